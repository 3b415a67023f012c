"""The CPU-offload child's worker side, answered in the release's own protocol.

The real worker needs CUDA (torch.cuda streams), so on CPU cells the suite tests
MultiConnector's side of that boundary: the scheduler-side metadata is real, and
the completions it implies are reported back as the release's worker would.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvcompat.testkit.adapter.capabilities import V1, _field_names
from kvcompat.testkit.adapter.engine import make_kv_connector_output


def offload_store_work(meta: Any) -> Any:
    """The store work carried by the CPU-offload child's metadata (empty if none).

    SimpleCPUOffloadMetadata: list of GPU block ids to store (store_gpu_blocks).
    OffloadingConnectorMetadata: reqs_to_store (<=0.20) or store_jobs (0.21+).
    """
    names = _field_names(type(meta)) if dataclasses.is_dataclass(meta) else set(vars(meta))
    for field in ("store_gpu_blocks", "store_jobs", "reqs_to_store"):
        if field in names:
            return getattr(meta, field)
    raise TypeError(f"no known store field on {type(meta).__name__}: {sorted(names)}")


def offload_load_work(meta: Any) -> Any:
    names = _field_names(type(meta)) if dataclasses.is_dataclass(meta) else set(vars(meta))
    for field in ("load_gpu_blocks", "load_jobs", "reqs_to_load"):
        if field in names:
            return getattr(meta, field)
    raise TypeError(f"no known load field on {type(meta).__name__}: {sorted(names)}")


class OffloadWorkerEmulator:
    """What the worker side of the CPU-offload child reports back, step by step,
    when every transfer issued in a step completes within that step.

    It reads only the real metadata the scheduler-side connector produced and
    answers in the release's worker->scheduler protocol, which differs per child:

    * SimpleCPUOffload: stores complete as
      ``SimpleCPUOffloadWorkerMetadata(completed_store_events={event: 1})``
      wrapped in ``MultiKVConnectorWorkerMetadata`` at the child's index; loads
      complete as ``finished_recving`` request ids (``load_event_to_reqs``).
    * OffloadingConnector up to 0.20 (``reqs_to_store``/``reqs_to_load``): loads
      complete as ``finished_recving``; a request's stores are reported in
      ``finished_sending`` once the request has finished (it is then in
      ``scheduler_output.finished_req_ids``), as ``OffloadingConnectorWorker.
      get_finished`` does.
    """

    def __init__(self, n_children: int, child_index: int):
        self.n_children = n_children
        self.child_index = child_index
        self._reqs_with_stores: set[str] = set()
        self.completed_store_events: list[int] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        # While deferring, completions are held back and reported together in the first
        # step after it ends: transfers that were still in flight when something happened.
        self.deferring = False
        self._held_store_events: list[int] = []
        self._held_sending: set[str] = set()

    def delivered_elsewhere(self, req_ids: set[str]) -> None:
        """These requests' sends were reported through a worker-side MultiConnector by the test
        itself: held back, they must not be reported a second time."""
        self._held_sending -= set(req_ids)

    def step(self, scheduler_output: Any) -> Any:
        """KVConnectorOutput for the step whose ``scheduler_output`` is given (or None)."""
        multi_meta = scheduler_output.kv_connector_metadata
        assert len(multi_meta.metadata) == self.n_children, (
            f"MultiKVConnectorMetadata has {len(multi_meta.metadata)} entries for {self.n_children} children"
        )
        meta = multi_meta.metadata[self.child_index]
        fields = _field_names(type(meta))
        sending: set[str] = set()
        recving: set[str] = set()
        worker_meta = None
        if "store_event" in fields:  # SimpleCPUOffload
            if meta.store_event >= 0 and meta.store_gpu_blocks:
                self._held_store_events.append(meta.store_event)
            if self._held_store_events and not self.deferring:
                done = {event: 1 for event in self._held_store_events}
                child = importlib.import_module("vllm.v1.simple_kv_offload.metadata").SimpleCPUOffloadWorkerMetadata(
                    completed_store_events=done
                )
                worker_meta = _wrap_multi_worker_meta(child, self.n_children, self.child_index)
                self.completed_store_events += self._held_store_events
                self._held_store_events = []
            if meta.load_event >= 0 and meta.load_gpu_blocks:
                recving |= set(meta.load_event_to_reqs.get(meta.load_event, []))
        elif "reqs_to_store" in fields:  # OffloadingConnector <= 0.20
            self._reqs_with_stores |= set(meta.reqs_to_store)
            recving |= set(meta.reqs_to_load)
            done = self._reqs_with_stores & set(scheduler_output.finished_req_ids)
            self._held_sending |= done
            self._reqs_with_stores -= done
            if not self.deferring:
                sending, self._held_sending = self._held_sending, set()
        else:
            raise TypeError(f"no worker-completion protocol known for {type(meta).__name__} ({sorted(fields)})")
        self.finished_sending |= sending
        self.finished_recving |= recving
        if not (sending or recving or worker_meta is not None):
            return None
        return make_kv_connector_output(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta,
        )


def _wrap_multi_worker_meta(child: Any, n_children: int, child_index: int) -> Any:
    mod = importlib.import_module(V1 + ".multi_connector")
    metas: list[Any] = [None] * n_children
    metas[child_index] = child
    return mod.MultiKVConnectorWorkerMetadata(metadata=tuple(metas))
