"""Worker-role connectors driven the way the model runner drives them, one step at a time."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvcompat.testkit.adapter.capabilities import V1
from kvcompat.testkit.adapter.engine import make_kv_connector_output


@dataclasses.dataclass
class WorkerStepResult:
    """What one worker-side connector reported in one step."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    invalid_block_ids: set[int]
    worker_meta: Any = None
    stats: Any = None


def run_worker_step(connector: Any, metadata: Any, finished_req_ids: set[str]) -> WorkerStepResult:
    """One step of a worker-side connector in the order the model runner's KV
    connector mixin uses: bind, start_load_kv, wait_for_save, transfer results
    (``get_transfer_results`` from 0.30, else ``get_finished``), load errors,
    stats, worker metadata, clear."""
    connector.bind_connector_metadata(metadata)
    try:
        connector.start_load_kv(None)
        connector.wait_for_save()
        if hasattr(connector, "get_transfer_results"):
            r = connector.get_transfer_results(set(finished_req_ids))
            sending, recving = set(r.finished_sending), set(r.finished_recving)
            failed = set(getattr(r, "failed_recving", set()) or set())
        else:
            s, rv = connector.get_finished(set(finished_req_ids))
            sending, recving, failed = set(s or ()), set(rv or ()), set()
        invalid: set[int] = set()
        if hasattr(connector, "get_block_ids_with_load_errors"):
            invalid = set(connector.get_block_ids_with_load_errors() or ())
        stats = connector.get_kv_connector_stats() if hasattr(connector, "get_kv_connector_stats") else None
        worker_meta = None
        if hasattr(connector, "build_connector_worker_meta"):
            worker_meta = connector.build_connector_worker_meta()
    finally:
        connector.clear_connector_metadata()
    return WorkerStepResult(sending, recving, failed, invalid, worker_meta, stats)


def kv_connector_output_of(result: WorkerStepResult) -> Any:
    """The KVConnectorOutput a worker whose connector reported ``result`` sends
    to the scheduler (None when it reported nothing)."""
    r = result
    if not (
        r.finished_sending or r.finished_recving or r.failed_recving or r.invalid_block_ids or r.worker_meta is not None
    ):
        return None
    return make_kv_connector_output(
        finished_sending=r.finished_sending or None,
        finished_recving=r.finished_recving or None,
        kv_connector_worker_meta=r.worker_meta,
        failed_recving=r.failed_recving,
        invalid_block_ids=r.invalid_block_ids,
    )


def merge_child_worker_output(
    kv_connector_output: Any, child: WorkerStepResult, *, n_children: int, child_index: int
) -> Any:
    """Add one child's worker results to a step's KVConnectorOutput (or None), the
    way MultiConnector aggregates its children on the worker side: request-id sets
    are unioned, and worker metadata goes into ``MultiKVConnectorWorkerMetadata``
    at the child's index."""
    out = kv_connector_output
    sending = set(getattr(out, "finished_sending", None) or ()) | child.finished_sending
    recving = set(getattr(out, "finished_recving", None) or ()) | child.finished_recving
    failed = set(getattr(out, "failed_recving", None) or ()) | child.failed_recving
    invalid = set(getattr(out, "invalid_block_ids", None) or ()) | child.invalid_block_ids
    prev_meta = getattr(out, "kv_connector_worker_meta", None)
    worker_meta = prev_meta
    if child.worker_meta is not None:
        metas: list[Any] = list(prev_meta.metadata) if prev_meta is not None else [None] * n_children
        metas[child_index] = child.worker_meta
        mod = importlib.import_module(V1 + ".multi_connector")
        worker_meta = mod.MultiKVConnectorWorkerMetadata(metadata=tuple(metas))
    if not (sending or recving or failed or invalid or worker_meta is not None):
        return None
    return make_kv_connector_output(
        finished_sending=sending or None,
        finished_recving=recving or None,
        kv_connector_worker_meta=worker_meta,
        failed_recving=failed,
        invalid_block_ids=invalid,
    )
