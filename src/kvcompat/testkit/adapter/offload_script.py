"""OffloadingConnector's transfers, scripted: the CPU-offload child up to 0.18 on a CPU.

OffloadingConnector's CPU worker cannot run on a CPU with only its transport replaced: building its
GPU<->CPU handlers stops at the spec's platform gate ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs", v1/kv_offload/cpu.py), and from 0.16 its registration needs the model's
attention layers.  So for these releases only, the child's KV-cache registration registers a
scripted handler, in vLLM's own ``OffloadingHandler`` protocol, for the two directions the spec
would (GPU->CPU stores, CPU->GPU loads).  A scripted job completes when it is next polled (or, while
:data:`SCRIPT` is held, when released) and moves no bytes.  Everything else runs as shipped:
MultiConnector, the child's OffloadingConnectorWorker (job ids, stores deferred to the next step,
finished_sending once the request is done), its OffloadingWorker and the scheduler side.  The report
says which releases ran this way.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

from kvcompat.testkit.adapter.capabilities import V1


@dataclasses.dataclass
class ScriptedTransfers:
    """Jobs submitted to the scripted handlers, and whether their completion is held back."""

    submitted: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (job id, "store" | "load")
    held: bool = False
    _done: list[int] = dataclasses.field(default_factory=list)
    _pending: list[int] = dataclasses.field(default_factory=list)

    def reset(self) -> None:
        self.__init__()

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        self._done += self._pending
        self._pending = []

    def launched(self) -> int:
        """Jobs handed to the scripted handlers so far."""
        return len(self.submitted)

    def stores(self) -> list[int]:
        return [j for j, kind in self.submitted if kind == "store"]

    def loads(self) -> list[int]:
        return [j for j, kind in self.submitted if kind == "load"]


SCRIPT = ScriptedTransfers()


def _result(job_id: int) -> Any:
    """A finished job in the release's form: ``TransferResult(job_id, success)`` or a ``(job_id, True)`` tuple."""
    worker = importlib.import_module("vllm.v1.kv_offload.worker.worker")
    result = worker.TransferResult
    return result(job_id=job_id, success=True) if dataclasses.is_dataclass(result) else (job_id, True)


class ScriptedHandler:
    """An ``OffloadingHandler`` (vllm/v1/kv_offload/worker/worker.py) whose jobs finish when polled."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        SCRIPT.submitted.append((job_id, self.kind))
        (SCRIPT._pending if SCRIPT.held else SCRIPT._done).append(job_id)
        return True

    def get_finished(self) -> list[Any]:
        mine = {j for j, kind in SCRIPT.submitted if kind == self.kind}
        done = [j for j in SCRIPT._done if j in mine]
        SCRIPT._done = [j for j in SCRIPT._done if j not in mine]
        return [_result(j) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        if any(j in SCRIPT._pending for j in job_ids):
            SCRIPT.release()


def install(rank: Any) -> None:
    """Script the transfers of the OffloadingConnector child in ``rank``'s worker-role connector."""
    offloading = importlib.import_module(V1 + ".offloading_connector").OffloadingConnector
    mediums = importlib.import_module("vllm.v1.kv_offload.mediums")
    children = [c for c in rank.connector._connectors if isinstance(c, offloading)]
    assert len(children) == 1, f"expected one OffloadingConnector child, found {len(children)}"
    worker = children[0].connector_worker

    def register_kv_caches(kv_caches: dict[str, Any], *_: Any) -> None:
        # What the release's registration ends with: a handler per direction the spec serves.
        worker.worker.register_handler(mediums.GPULoadStoreSpec, mediums.CPULoadStoreSpec, ScriptedHandler("store"))
        worker.worker.register_handler(mediums.CPULoadStoreSpec, mediums.GPULoadStoreSpec, ScriptedHandler("load"))

    assert list(inspect.signature(worker.register_kv_caches).parameters)[:1] == ["kv_caches"]
    worker.register_kv_caches = register_kv_caches
