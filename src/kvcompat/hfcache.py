"""An offline Hugging Face hub cache for vLLM's own connector tests (the upstream suite): real hub layout,
config files written here, no weights, no download.

The model ids the tests pass to ``VllmConfig``/``ModelConfig`` (kvcompat.upstream finds them in the sdist) are
served from the folder :func:`hf_offline_cache` writes; ``MODEL_CONFIGS`` holds the architecture configs it knows.
Harness code: it runs in the nox process and never imports vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcompat.atomic import write_atomic

# Architecture configs for the hub ids the connector tests use.  Values follow
# the public config.json of each model (layers, heads, sizes matter: tests size
# KV caches from them); no weights are ever written.
_LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "torch_dtype": "float16",
    "prefix": "</s>",
    "init_std": 0.02,
    "layerdrop": 0.0,
    "use_cache": True,
}
_LLAMA_3_1_8B = {
    **_LLAMA_3_2_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "rope_scaling": {**_LLAMA_3_2_1B["rope_scaling"], "factor": 8.0},
    "tie_word_embeddings": False,
}
MODEL_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {
        **_OPT,
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT,
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": True,
    },
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-1B": {**_LLAMA_3_2_1B, "eos_token_id": 128001},
    "meta-llama/Llama-3.1-8B": {**_LLAMA_3_1_8B, "eos_token_id": 128001},
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA_3_1_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": {
        **_LLAMA_3_2_1B,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "eos_token_id": 128009,
    },
}
# A fixed, fake commit hash: refs/main points at it, the snapshot folder is named after it.
SNAPSHOT_REVISION = "6b76636f6d706174000000000000000000000001"


def _repo_folder(model_id: str) -> str:
    return "models--" + model_id.replace("/", "--")


def _generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config} | {
        "_from_model_config": True
    }


def _byte_level_gpt2_tokenizer() -> dict[str, str]:
    """vocab.json and merges.txt of a GPT-2 style tokenizer: the 256 byte symbols, OPT's two specials, no merges.

    Enough for a tokenizer to load and to encode any text (a token per byte); not OPT's vocabulary.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = [chr(b) for b in printable] + [chr(256 + n) for n in range(256 - len(printable))]
    vocab = {s: i for i, s in enumerate(symbols)} | {"</s>": 256, "<pad>": 257}
    return {"vocab.json": json.dumps(vocab) + "\n", "merges.txt": "#version: 0.2\n"}


def hf_offline_cache(dest: Path, model_ids: list[str]) -> dict[str, str]:
    """Write an offline hub cache under ``dest`` for ``model_ids``; return the env vars that select it.

    Layout (huggingface_hub's own): ``dest/hub/models--org--name/{refs/main,
    snapshots/<rev>/config.json, generation_config.json}``.  No weights: the
    connector tests build configs, never an engine that serves text.  OPT ids (the
    default model of vLLM's ``create_vllm_config``) also get a byte-level GPT-2
    tokenizer with no merges (:func:`_byte_level_gpt2_tokenizer`): a scheduler
    builds a StructuredOutputManager, which loads the model's tokenizer (0.22.1's
    ``test_multi_connector_handle_preemptions_integration`` failed without one, on
    ``open(vocab_file)`` of None).  Raises KeyError for an id with no config in MODEL_CONFIGS.
    Idempotent; files are written atomically.
    """
    dest = Path(dest)
    hub = dest / "hub"
    for model_id in model_ids:
        config = MODEL_CONFIGS[model_id]
        repo = hub / _repo_folder(model_id)
        snap = repo / "snapshots" / SNAPSHOT_REVISION
        files = {
            "config.json": json.dumps({**config, "_name_or_path": model_id}, indent=1) + "\n",
            "generation_config.json": json.dumps(_generation_config(config), indent=1) + "\n",
        }
        if config["model_type"] == "opt":
            files.update(_byte_level_gpt2_tokenizer())
        for name, text in files.items():
            _write_if_changed(snap / name, text)
        _write_if_changed(repo / "refs" / "main", SNAPSHOT_REVISION)
    return {
        "HF_HOME": str(dest),
        "HF_HUB_CACHE": str(hub),
        "HUGGINGFACE_HUB_CACHE": str(hub),  # older huggingface_hub / transformers spellings
        "TRANSFORMERS_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass

    write_atomic(path, text)
