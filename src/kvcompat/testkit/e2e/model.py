"""A tiny Llama made at test time, never fetched from a hub: 2 layers, random weights, a BPE tokenizer.

Weights are drawn with NumPy's generator from a fixed seed, not with torch's initialisers, so the
model is the same bytes under every torch a cell installs.  The tokenizer is trained on a corpus
generated from the same seed.  Built once per cell (a folder beside the venv's site-packages) and
reused: the folder is complete only when its ``ready`` marker exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
NUM_LAYERS = CONFIG["num_hidden_layers"]
NUM_KV_HEADS = CONFIG["num_key_value_heads"]
HEAD_DIM = CONFIG["head_dim"]
# Larger than the usual 0.02: the logits of a random model then differ enough that greedy tokens
# follow the context (and the KV a request was served) rather than ties.
WEIGHT_STD = 0.08
WORDS = (
    "cache block layer token prefill decode store load offload tier host device engine request "
    "prompt connector transfer nixl memory page slot queue step batch stream event copy bytes"
).split()


def kv_bytes_per_block(block_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    return 2 * NUM_KV_HEADS * HEAD_DIM * dtype_bytes * block_size * NUM_LAYERS


def corpus(n_lines: int = 400) -> list[str]:
    rng = random.Random(SEED)
    return [" ".join(rng.choices(WORDS, k=rng.randint(6, 19))) for _ in range(n_lines)]


def prompt(i: int, n_words: int) -> str:
    """A deterministic prompt ``i`` of ``n_words`` words (stdlib only: the harness's tests import it too)."""
    rng = random.Random(SEED + 1 + i)
    return " ".join(rng.choices(WORDS, k=n_words))


def build(directory: Path) -> Path:
    """Write the model and tokenizer into ``directory`` (atomically: a temporary folder renamed)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False
        )
        tok.train_from_iterator(corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
        )
        fast.save_pretrained(tmp)
        config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
        config.architectures = CONFIG["architectures"]
        with torch.device("meta"):
            shapes = {k: tuple(p.shape) for k, p in LlamaForCausalLM(config).state_dict().items()}
        rng = np.random.default_rng(SEED)
        tensors = {}
        for name in sorted(shapes):
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=torch.float32)
            else:
                a = rng.standard_normal(shapes[name], dtype=np.float32) * WEIGHT_STD
                tensors[name] = torch.from_numpy(a)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        (tmp / "ready").write_text(json.dumps({"made by": fingerprint()}))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def fingerprint() -> str:
    """This module's source: a model made by another version of it is made again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def cached(directory: Path) -> Path:
    """The model in ``directory``, built there first unless a complete one made by this code is present."""
    try:
        ready = json.loads((directory / "ready").read_text()).get("made by")
    except (OSError, ValueError):
        ready = None
    if ready != fingerprint():
        build(directory)
    return directory
