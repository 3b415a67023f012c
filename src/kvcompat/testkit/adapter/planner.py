"""KV-cache configs from the release's own planner, and KV caches from its own allocator.

What EngineCore does once the workers report their layers' KV-cache specs
(``v1/engine/core.py`` ``_initialize_kv_caches``): group the layers of the whole model
(``get_global_kv_cache_groups``, from 0.33 in ``v1/core/kv_cache_planning.py``), give every worker a
KVCacheConfig (``get_kv_cache_configs``, one per worker, each with its own layers' specs: a TP rank's
heads) and the scheduler one (``generate_scheduler_kv_cache_config``).  The block count is the one a
user sets with ``num_gpu_blocks_override``, which the planner honours.  A worker then allocates its
caches the way the release's model runner does (``allocate_kv_cache``, ``v1/worker/utils.py`` 0.33+),
or on releases without it as :func:`kvcompat.testkit.adapter.kv_cache.make_kv_caches` places them.

Only the call differs between releases (module, signature); what the planner decides is the release's.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

from kvcompat.testkit import probes
from kvcompat.testkit.adapter.kv_cache import make_kv_caches, resolve_kv_cache_layout

PLANNING = "vllm.v1.core.kv_cache_planning"
UTILS = "vllm.v1.core.kv_cache_utils"
WORKER_UTILS = "vllm.v1.worker.utils"
HEADROOM_BLOCKS = 4  # memory for a few blocks more than the override: the planner reserves the null block


@dataclasses.dataclass
class Plan:
    """What the planner gave: one KVCacheConfig per worker rank, and the scheduler's."""

    workers: list[Any]
    scheduler: Any


def _planning_module() -> Any:
    return importlib.import_module(PLANNING if probes.has_module(PLANNING) else UTILS)


def plan(vllm_config: Any, worker_specs: list[dict[str, Any]], num_blocks: int) -> Plan:
    """The release's KV-cache plan for workers whose layers have ``worker_specs`` (one dict a rank), with
    ``num_blocks`` blocks (``cache_config.num_gpu_blocks_override``, as a user sets it)."""
    planning = _planning_module()
    utils = importlib.import_module(UTILS)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    registry = importlib.import_module("vllm.v1.kv_cache_spec_registry") if _has_spec_registry() else None
    if registry is not None and hasattr(registry, "register_all_kvcache_specs"):
        registry.register_all_kvcache_specs(vllm_config)  # EngineCore does it first (0.34)
    # EngineCore resolves the KV-cache layout from the layers' specs before it plans
    resolve_kv_cache_layout(vllm_config, [s for specs in worker_specs for s in specs.values()])
    per_block = [sum(s.page_size_bytes for s in specs.values()) for specs in worker_specs]
    memory = [b * (num_blocks + HEADROOM_BLOCKS) for b in per_block]
    fn = planning.get_kv_cache_configs
    params = inspect.signature(fn).parameters
    if "global_kv_cache_groups" in params:
        groups = planning.get_global_kv_cache_groups(vllm_config, worker_specs)
        configs = fn(vllm_config, worker_specs, memory, groups)
    else:
        configs = fn(vllm_config, worker_specs, memory)
    scheduler = utils.generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler.num_blocks
    _resolve_block_sizes(vllm_config, [*configs, scheduler])
    return Plan(list(configs), scheduler)


def _resolve_block_sizes(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """What EngineCore does next, where the release does it (``v1/engine/core.py`` 0.34.0 L388-402): resolve the
    hash block size and the cache-hit alignment from the scheduler's config and set them on every config, the
    workers' and the scheduler's (the connectors' scheduler sides read them, e.g. Nixl truncating a hybrid
    prefill, ``nixl/base_scheduler.py`` 0.34.0 L441-442)."""
    utils = importlib.import_module(UTILS)
    scheduler = kv_cache_configs[-1]
    if not hasattr(utils, "resolve_kv_cache_block_sizes") or not hasattr(scheduler, "hash_block_size"):
        return
    hash_block, alignment = resolved_block_sizes(vllm_config, scheduler)
    aligned = hasattr(utils, "resolve_cache_hit_alignment_tokens") and hasattr(scheduler, "cache_hit_alignment_tokens")
    for config in kv_cache_configs:
        config.hash_block_size = hash_block
        if aligned:
            config.cache_hit_alignment_tokens = alignment


def resolved_block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """(hash block size, cache-hit alignment in tokens) of ``kv_cache_config`` as EngineCore resolves them
    (``v1/engine/core.py`` 0.34.0 L388-402); the block size for both where the release resolves neither."""
    utils = importlib.import_module(UTILS)
    block = vllm_config.cache_config.block_size
    hash_block = block
    if hasattr(utils, "resolve_kv_cache_block_sizes"):
        block, hash_block = utils.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    alignment = block
    if hasattr(utils, "resolve_cache_hit_alignment_tokens"):
        alignment = utils.resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, block, hash_block)
    return hash_block, alignment


def _has_spec_registry() -> bool:
    return probes.has_module("vllm.v1.kv_cache_spec_registry")


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A worker's CPU KV caches for ``kv_cache_config``, as the release's model runner allocates them."""
    worker_utils = importlib.import_module(WORKER_UTILS)
    if not hasattr(worker_utils, "allocate_kv_cache"):
        return make_kv_caches(kv_cache_config)
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[vllm_config.cache_config.kv_cache_layout]
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    return worker_utils.allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, sizes)


def attention_layer_specs(vllm_config: Any, block_size: int, tp_size: int) -> list[dict[str, Any]]:
    """Each rank's layer specs for the tiny dense model, as its attention layers report them
    (``Attention.get_kv_cache_spec``): full attention, the rank's share of the KV heads as the release
    computes it (``ModelConfig.get_num_kv_heads``), the model's head size and dtype."""
    from kvcompat.testkit.adapter.config import LAYER_NAMES
    from kvcompat.testkit.adapter.kv_cache import attention_spec

    heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    return [{name: attention_spec(block_size, None, heads) for name in LAYER_NAMES} for _ in range(tp_size)]


def first_kv_head(vllm_config: Any, rank: int) -> int:
    """The model's global index of the first KV head TP rank ``rank`` holds (see
    :func:`kvcompat.testkit.adapter.parallel.kv_heads_of_rank`)."""
    from kvcompat.testkit.adapter.parallel import kv_heads_of_rank

    total = vllm_config.model_config.get_total_num_kv_heads()
    return kv_heads_of_rank(total, vllm_config.parallel_config.tensor_parallel_size, rank)[0]
