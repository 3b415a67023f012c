"""NixlConnector specifics: P/D transfer params, the device table, the handshake."""

from __future__ import annotations

import importlib
from typing import Any

from kvcompat.testkit import probes
from kvcompat.testkit.adapter.capabilities import V1


def remote_prefill_params(
    *, remote_engine_id: str, remote_request_id: str, remote_block_ids: list[int]
) -> dict[str, Any]:
    """D-side (decode) params of a request whose prefill ran remotely.

    ``remote_request_id`` is sent always: the Nixl scheduler needs it from 0.13 and
    earlier releases ignore it.
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": remote_engine_id,
        "remote_request_id": remote_request_id,
        "remote_block_ids": remote_block_ids,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def remote_decode_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False}


def nixl_supported_device_table() -> dict[str, tuple[str, ...]]:
    """The release's NixlConnectorWorker device table (device type -> kv buffer
    devices): ``_NIXL_SUPPORTED_DEVICE`` (``_NIXL_SUPPORTED_XPUS`` in 0.10.2) in
    ``v1/nixl/utils.py`` (0.20.2+) or in ``v1/nixl_connector.py`` (N1)."""
    if probes.has_module(V1 + ".nixl.utils"):
        mod = importlib.import_module(V1 + ".nixl.utils")
    else:
        mod = importlib.import_module(V1 + ".nixl_connector")
    for name in ("_NIXL_SUPPORTED_DEVICE", "_NIXL_SUPPORTED_XPUS"):
        if hasattr(mod, name):
            return dict(getattr(mod, name))
    raise TypeError(f"{mod.__name__} has no NIXL supported-device table")


def serve_nixl_handshake(scheduler_connector: Any, *worker_connectors: Any) -> str:
    """Hand the workers' handshake metadata to the scheduler-side connector, as
    EngineCore does after KV-cache registration (this starts the Nixl side-channel
    listener on VLLM_NIXL_SIDE_CHANNEL_HOST/PORT): worker ``i`` of ``worker_connectors``
    is TP rank ``i``, each reporting ``{(pp_rank, tp_rank): metadata}`` as the release's
    GPU worker does (``v1/worker/gpu_worker.py`` ``get_kv_connector_handshake_metadata``),
    merged by EngineCore (``v1/engine/core.py`` ``_set_kv_connector_handshake_metadata``).
    PP=1.  Returns which entry point the release has; on releases with neither, the
    worker serves the handshake itself and nothing is done here."""
    metadata = {}
    for rank, worker_connector in enumerate(worker_connectors):
        metadata[rank] = worker_connector.get_handshake_metadata()
        if metadata[rank] is None:
            raise RuntimeError(f"{type(worker_connector).__name__} worker produced no handshake metadata")
    if hasattr(scheduler_connector, "set_xfer_handshake_metadata_pp_aware"):
        scheduler_connector.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})
        return "set_xfer_handshake_metadata_pp_aware"
    if hasattr(scheduler_connector, "set_xfer_handshake_metadata"):
        scheduler_connector.set_xfer_handshake_metadata(metadata)
        return "set_xfer_handshake_metadata"
    return "worker-served"
