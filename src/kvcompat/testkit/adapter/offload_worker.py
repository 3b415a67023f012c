"""The CPU-offload child's worker on a CPU, and what EngineCore asks of it at startup.

From 0.19 the child is SimpleCPUOffloadConnector, whose worker runs as shipped with only its CUDA
transport replaced (:mod:`kvcompat.testkit.cuda_transport`, installed by the child's module path).
Up to 0.18 the child is OffloadingConnector: see :mod:`kvcompat.testkit.adapter.offload_script`.
Also here: reading the offload child's scheduler-side metadata (the store and load work it carries).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcompat.testkit.adapter.capabilities import _field_names, has_simple_cpu_offload
from kvcompat.testkit.adapter.kv_cache import layer_tensors

REAL = "real worker (CUDA transport on CPU)"
SCRIPTED = "scripted transfers"


def offload_worker_kind() -> str:
    """Which worker the CPU-offload child runs in this release (the report says it per cell)."""
    return REAL if has_simple_cpu_offload() else SCRIPTED


def offload_transfers() -> Any:
    """What moves the CPU-offload child's blocks in this release, fresh: the CUDA-transport stand-in
    (its copies, hold and release) or, up to 0.18, the scripted transfers (jobs, hold and release)."""
    if has_simple_cpu_offload():
        from kvcompat.testkit.cuda_transport import TRANSPORT

        TRANSPORT.reset()
        return TRANSPORT
    from kvcompat.testkit.adapter.offload_script import SCRIPT

    SCRIPT.reset()
    return SCRIPT


def prepare_offload_worker(rank: Any, transport: Any) -> None:
    """Before registration: name the rank's KV caches to the transport (copies into them are loads),
    or script OffloadingConnector's transfers where that is the child."""
    if has_simple_cpu_offload():
        for cache in rank.kv_caches.values():
            for tensor in layer_tensors(cache):  # a Mamba layer's states, or the one tensor
                transport.add_gpu_region(tensor)
    else:
        from kvcompat.testkit.adapter import offload_script

        offload_script.install(rank)


def report_offload_blocks(vllm_config: Any, ranks: list[Any]) -> int | None:
    """What EngineCore does after the workers registered their KV caches, where the release does it
    (0.34: ``cache_config.simple_cpu_offload_num_blocks``): ask the workers for SimpleCPUOffload's
    aligned CPU block count and give it to the scheduler's config.  As the release, refuse to go on
    when no worker reports one ("SimpleCPUOffloadConnector workers must report their block count")."""
    if not has_simple_cpu_offload() or not hasattr(vllm_config.cache_config, "simple_cpu_offload_num_blocks"):
        return None
    if not vllm_config.kv_transfer_config.has_connector("SimpleCPUOffloadConnector"):
        return None  # EngineCore asks only when the configuration has the connector
    from kvcompat.testkit.adapter.worker import simple_cpu_offload_blocks

    blocks = simple_cpu_offload_blocks(ranks)
    if blocks is None:
        raise AssertionError("SimpleCPUOffloadConnector workers must report their block count (EngineCore)")
    vllm_config.cache_config.simple_cpu_offload_num_blocks = blocks
    return blocks


def _fields(meta: Any) -> set[str]:
    return _field_names(type(meta)) if dataclasses.is_dataclass(meta) else set(vars(meta))


def offload_store_work(meta: Any) -> Any:
    """The store work carried by the CPU-offload child's metadata (empty if none).

    SimpleCPUOffloadMetadata: list of GPU block ids to store (store_gpu_blocks).
    OffloadingConnectorMetadata: reqs_to_store (<=0.20) or store_jobs (0.21+).
    """
    names = _fields(meta)
    for name in ("store_gpu_blocks", "store_jobs", "reqs_to_store"):
        if name in names:
            return getattr(meta, name)
    raise TypeError(f"no known store field on {type(meta).__name__}: {sorted(names)}")


def offload_load_work(meta: Any) -> Any:
    names = _fields(meta)
    for name in ("load_gpu_blocks", "load_jobs", "reqs_to_load"):
        if name in names:
            return getattr(meta, name)
    raise TypeError(f"no known load field on {type(meta).__name__}: {sorted(names)}")


def offload_worker_handler(connector: Any) -> Any:
    """The worker-side handler inside a worker-role CPU-offload child (SimpleCPUOffloadWorker or
    OffloadingConnectorWorker)."""
    return getattr(connector, "worker_handler", None) or getattr(connector, "connector_worker", None)
