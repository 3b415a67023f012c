"""The VllmConfig the suite builds: a tiny local model, and MultiConnector([Nixl, CPU offload]).

The tiny model has no weights and needs no hub.  Its head size 32 and block size
32 suit the CPU attention backend, which takes head sizes 32..512 and block sizes
that are a multiple of 32.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

from kvcompat.outcomes import CHILD_ORDER_ENV, CHILD_ORDERS
from kvcompat.testkit import probes
from kvcompat.testkit.adapter.capabilities import call_with_supported, has_simple_cpu_offload, offload_child_name

EOS_TOKEN_ID = 2
# What every tiny model of the suite (the dense Llama, the shapes' hybrid and MLA models) shares: the
# vocabulary and special tokens the suite's prompts and sampled tokens are drawn from, the dtype, the length.
TINY_MODEL_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
}
# Tiny local model (no weights, no hub).  head_size 32 and block_size 32 suit the
# CPU attention backend (head sizes 32..512, block size a multiple of 32).
TINY_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    **TINY_MODEL_COMMON,
}
NUM_KV_HEADS = 2
HEAD_SIZE = 32
LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
SAMPLED_TOKEN_ID = 100  # any non-EOS token


def write_tiny_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG, indent=1))
    return directory


OFFLOAD_CHILD_MODULE = "kvcompat.testkit.offload_child"
# The offload child's class under a name no registry has (for factories that read the registry first).
OFFLOAD_CHILD_ALIAS = "KvcompatCPUOffloadConnector"


def child_order() -> str:
    """The order of MultiConnector's children this cell deploys (its ``order``; nixl-first by default)."""
    order = os.environ.get(CHILD_ORDER_ENV, CHILD_ORDERS[0])
    if order not in CHILD_ORDERS:
        raise ValueError(f"{CHILD_ORDER_ENV}={order!r} is not a child order; use one of {CHILD_ORDERS}")
    return order


def child_index(kind: str, order: str | None = None) -> int:
    """Where MultiConnector holds the ``"nixl"`` or the ``"offload"`` child, under ``order``."""
    first = "nixl" if (order or child_order()) == "nixl-first" else "offload"
    return 0 if kind == first else 1


def offload_child_extra_config(
    block_size: int, num_gpu_blocks: int, world_size: int = 1, bytes_per_block: int | None = None
) -> dict[str, Any]:
    """Extra config of the CPU-offload child: room for ``num_gpu_blocks`` CPU blocks on every rank
    (``cpu_bytes_to_use`` is for the whole server).  ``bytes_per_block``: of the model's KV over all
    layers (the suite's tiny model by default)."""
    if bytes_per_block is None:
        bytes_per_block = 2 * NUM_KV_HEADS * HEAD_SIZE * 4 * block_size * len(LAYER_NAMES)  # fp32 K+V
    cpu_bytes = bytes_per_block * num_gpu_blocks * world_size
    if has_simple_cpu_offload():
        return {"cpu_bytes_to_use": cpu_bytes}
    # OffloadingConnector (CPUOffloadingSpec): num_cpu_blocks up to 0.13,
    # cpu_bytes_to_use from 0.14.1.  Probe the spec's source for the key it reads.
    spec_src = inspect.getsource(importlib.import_module(_cpu_offloading_spec_module()))
    if '"cpu_bytes_to_use"' in spec_src:
        return {"cpu_bytes_to_use": cpu_bytes}
    return {"num_cpu_blocks": num_gpu_blocks}


def _cpu_offloading_spec_module() -> str:
    if probes.has_module("vllm.v1.kv_offload.cpu.spec"):
        return "vllm.v1.kv_offload.cpu.spec"
    return "vllm.v1.kv_offload.cpu"


def factory_reads_registry_first() -> bool:
    """Probe the release's factory source: does it look a name up in its registry before it imports
    ``kv_connector_module_path`` (0.19-0.22)?  Then a registered name never reaches our module."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    fn = getattr(KVConnectorFactory, "_get_connector_class_with_compat", KVConnectorFactory.get_connector_class)
    src = inspect.getsource(fn)
    registry, module_path = src.find("in cls._registry"), src.find("kv_connector_module_path")
    return 0 <= registry < module_path


def offload_child_config(
    block_size: int, num_gpu_blocks: int, world_size: int = 1, bytes_per_block: int | None = None
) -> dict[str, Any]:
    """The CPU-offload child's entry: the release's class, reached through ``kv_connector_module_path``
    (:mod:`kvcompat.testkit.offload_child`, which brings the CPU stand-in of its CUDA transport along)."""
    name = OFFLOAD_CHILD_ALIAS if factory_reads_registry_first() else offload_child_name()
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_module_path": OFFLOAD_CHILD_MODULE,
        "kv_connector_extra_config": offload_child_extra_config(
            block_size, num_gpu_blocks, world_size, bytes_per_block
        ),
    }


def multi_kv_transfer_config(
    block_size: int, num_gpu_blocks: int, engine_id: str = "kvcompat-engine", **options
) -> Any:
    """KVTransferConfig for MultiConnector with a Nixl and a CPU-offload child in ``order`` (the
    cell's by default); children without engine_id.  ``options`` are :func:`multi_kv_transfer_dict`'s:
    ``order``, ``world_size``, ``bytes_per_block``, and ``nixl_extra_config`` / ``offload_extra_config``, a
    child's own extra config, as a user writes it (e.g. Nixl's ``kv_lease_duration``, the CPU tier's
    ``num_cpu_blocks``), over the suite's."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**multi_kv_transfer_dict(block_size, num_gpu_blocks, engine_id, **options))


def multi_kv_transfer_dict(
    block_size: int,
    num_gpu_blocks: int,
    engine_id: str = "kvcompat-engine",
    *,
    order: str | None = None,
    world_size: int = 1,
    bytes_per_block: int | None = None,
    nixl_extra_config: dict[str, Any] | None = None,
    offload_extra_config: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
) -> dict[str, Any]:
    """:func:`multi_kv_transfer_config`'s arguments as a dict: what a user passes to ``vllm serve
    --kv-transfer-config`` as JSON.  ``kv_role`` is MultiConnector's and its Nixl child's (a P/D
    deployment's ``kv_producer`` / ``kv_consumer``); the CPU tier's child stays ``kv_both``."""
    nixl: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    if nixl_extra_config:
        nixl["kv_connector_extra_config"] = dict(nixl_extra_config)
    offload = offload_child_config(block_size, num_gpu_blocks, world_size, bytes_per_block)
    offload["kv_connector_extra_config"].update(offload_extra_config or {})
    children = [nixl, offload]
    if child_index("nixl", order) == 1:
        children.reverse()
    return {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"connectors": children},
    }


def make_vllm_config(
    model_dir: Path,
    *,
    block_size: int = BLOCK_SIZE,
    num_gpu_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 1024,
    kv_transfer_config: Any = None,
    disable_hybrid_kv_cache_manager: bool | None = None,
    tensor_parallel_size: int = 1,
    model_extra: dict[str, Any] | None = None,
    cache_extra: dict[str, Any] | None = None,
    scheduler_extra: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
) -> Any:
    """VllmConfig with the tiny local model on DeviceConfig("cpu"), ``tensor_parallel_size`` ranks.

    ``disable_hybrid_kv_cache_manager=None`` leaves the release's own default, so
    the release decides whether HMA is on (its ``SchedulerConfig`` default became
    ``None``, resolved by the release itself, in 0.17).  ``model_extra``, ``cache_extra`` and
    ``scheduler_extra``: more of a user's settings for ModelConfig, CacheConfig and SchedulerConfig
    (a deployment shape's, kvcompat.testkit.deploy), passed only where the release's class takes them;
    ``speculative``: a user's ``--speculative-config`` (SpeculativeConfig's arguments).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
    )
    model_config = call_with_supported(ModelConfig, **{**model_kwargs, **(model_extra or {})})
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    if disable_hybrid_kv_cache_manager is not None:
        sched_kwargs["disable_hybrid_kv_cache_manager"] = disable_hybrid_kv_cache_manager
    sched_kwargs.update(scheduler_extra or {})
    scheduler_config = call_with_supported(SchedulerConfig, **sched_kwargs)
    cache_config = call_with_supported(
        CacheConfig,
        block_size=block_size,
        enable_prefix_caching=True,
        cache_dtype="auto",
        **(cache_extra or {}),
    )
    if kv_transfer_config is None:
        kv_transfer_config = multi_kv_transfer_config(block_size, num_gpu_blocks, world_size=tensor_parallel_size)
    parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    parts: dict[str, Any] = {}
    if speculative is not None:
        from vllm.config import SpeculativeConfig

        parts["speculative_config"] = call_with_supported(
            SpeculativeConfig,
            **speculative,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
        **parts,
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return vllm_config


def hma_enabled(vllm_config: Any) -> bool:
    """Whether the release left the hybrid KV cache manager on for this config."""
    return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
