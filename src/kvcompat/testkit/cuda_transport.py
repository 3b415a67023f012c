"""A CPU stand-in for the CUDA transport of the CPU-offload child's worker, for cells without a GPU.

The sibling of :mod:`kvcompat.testkit.fake_nixl`: where fake NIXL stands in for the NIXL agent,
this stands in for the three CUDA things SimpleCPUOffload's worker moves KV blocks with, and for
nothing else:

* ``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)``: streams on which work happens in
  submission order (``priority_range``, ``wait_event`` and ``cuda_stream`` as the release uses them);
* ``torch.Event``: complete once every copy submitted before it was recorded has been done;
* the batch memcpy (``cuda_mem_ops._batch_memcpy`` from 0.29, ``_batch_memcpy_fn`` before): a
  ``ctypes.memmove`` over the same (dst, src, size) descriptor arrays the release builds.

Streams and events are replaced inside the worker modules only (their module-global ``torch`` is a
proxy that is real torch but for ``cuda`` and ``Event``), never in torch itself.  The worker, its
copy thread and queue, the address arithmetic and the scheduler-side manager run as shipped.

Copies are done at once (the stand-in is synchronous) unless the transport is *held*: a held
transport queues them, and events recorded after a queued copy stay incomplete until
:meth:`CudaTransport.release`, like a DMA still in flight.  Every copy is recorded in ``copies``.

Negative controls (``KVCOMPAT_CUDA_TRANSPORT_FAULT`` in the environment, or ``fault`` set on the
transport) prove the suite can see a broken transport: ``drop-loads`` (a load, i.e. a copy into a
GPU KV cache, copies nothing) and ``wrong-blocks`` (a load copies the neighbouring CPU block).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import os
import threading
import types
from collections.abc import Iterator
from typing import Any

FAULT_ENV = "KVCOMPAT_CUDA_TRANSPORT_FAULT"
# A folder where every process's stand-in keeps its tally (<pid>.json): a real engine may run its worker
# in a process of its own (vLLM's multiproc executor), where the copies happen (see tally()).
TALLY_ENV = "KVCOMPAT_CUDA_TRANSPORT_TALLY"
FAULTS = ("drop-loads", "wrong-blocks")
# The SimpleCPUOffload worker modules that use CUDA streams and events (disk_backend from 0.28).
WORKER_MODULES = (
    "vllm.v1.simple_kv_offload.worker",
    "vllm.v1.simple_kv_offload.copy_backend",
    "vllm.v1.simple_kv_offload.disk_backend",
)
MEM_OPS = "vllm.v1.simple_kv_offload.cuda_mem_ops"


@dataclasses.dataclass(frozen=True)
class Copy:
    """One descriptor of a batch copy: ``size`` bytes from ``src`` to ``dst`` (addresses)."""

    dst: int
    src: int
    size: int


class CudaTransport:
    """The stand-in's state: submitted and completed copies, the hold, the fault, the GPU regions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.submitted = 0  # copies submitted so far (an event records this count)
        self.completed = 0  # copies done so far, in submission order
        self._queued: list[Copy] = []
        self.held = False
        self.fault = _fault_from_environment()  # a negative control, kept across resets
        self.copies: list[Copy] = []  # every copy done, in order
        self.batches: list[int] = []  # descriptors per batch call
        # (start, end) address ranges of the GPU KV caches: a copy into one of them is a load
        self.gpu_regions: list[tuple[int, int]] = []
        # Without named GPU regions (a real engine's KV caches): the CPU tier is learnt from the
        # copies, as the destinations of stores, and a load is a copy out of it.  The first copy of
        # a run is a store (nothing is in the CPU tier yet), and a GPU address is never a store's
        # destination, so this tells them apart exactly.
        self._cpu_tier: list[tuple[int, int]] = []
        self._loads: list[Copy] = []

    # -- what the harness uses -------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.__init__()

    def add_gpu_region(self, tensor: Any) -> None:
        """Name a GPU KV cache (a tensor): copies into it are loads, copies out of it stores."""
        start = tensor.untyped_storage().data_ptr()
        self.gpu_regions.append((start, start + tensor.untyped_storage().nbytes()))

    def is_load(self, c: Copy) -> bool:
        if self.gpu_regions:
            return any(s <= c.dst < e for s, e in self.gpu_regions)
        return any(s <= c.src < e for s, e in self._cpu_tier)

    def _classify(self, c: Copy) -> bool:
        load = self.is_load(c)
        if load:
            self._loads.append(c)
        elif not self.gpu_regions:
            self._cpu_tier.append((c.dst, c.dst + c.size))
        return load

    def loads(self) -> list[Copy]:
        return list(self._loads)

    def stores(self) -> list[Copy]:
        loads = {id(c) for c in self._loads}
        return [c for c in self.copies if id(c) not in loads]

    def hold(self) -> None:
        """From now on copies stay in flight (queued, their events incomplete) until :meth:`release`."""
        with self._lock:
            self.held = True

    def release(self) -> None:
        """Do every queued copy, in order; later copies are done at once again."""
        with self._lock:
            self.held = False
            self._drain()

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[CudaTransport]:
        self.hold()
        try:
            yield self
        finally:
            self.release()

    @property
    def in_flight_count(self) -> int:
        return len(self._queued)

    def launched(self) -> int:
        """Batch copies handed to the transport so far (each worker's load or store of a step)."""
        return len(self.batches)

    # -- what the release's code calls -----------------------------------------------------
    def batch_memcpy(
        self, dsts: int, srcs: int, sizes: int, count: int, attrs: Any, attr_idxs: Any, num_attrs: int, *rest: Any
    ) -> int:
        """``cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, stream)``
        over the release's uint64 descriptor arrays; returns CUDA_SUCCESS (0)."""
        n = int(count)
        if n:
            d = (ctypes.c_uint64 * n).from_address(int(dsts))
            s = (ctypes.c_uint64 * n).from_address(int(srcs))
            z = (ctypes.c_uint64 * n).from_address(int(sizes))
            batch = [Copy(int(d[i]), int(s[i]), int(z[i])) for i in range(n)]
        else:
            batch = []
        with self._lock:
            self.batches.append(n)
            self._queued += batch
            self.submitted += len(batch)
            if not self.held:
                self._drain()
            self._write_tally()
        return 0

    def counts(self) -> dict[str, int]:
        return {"batches": len(self.batches), "stores": len(self.stores()), "loads": len(self.loads())}

    def _write_tally(self) -> None:
        folder = os.environ.get(TALLY_ENV)
        if folder:
            path = os.path.join(folder, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.counts(), f)
            os.replace(path + ".tmp", path)

    def _drain(self) -> None:
        for c in self._queued:
            self._do(c)
            self.completed += 1
        self._queued = []

    def _do(self, c: Copy) -> None:
        self.copies.append(c)
        if self._classify(c) and self.fault:
            if self.fault == "drop-loads":
                return
            if self.fault == "wrong-blocks":  # the next CPU block of the same tensor
                ctypes.memmove(c.dst, c.src + c.size, c.size)
                return
        ctypes.memmove(c.dst, c.src, c.size)

    def done_up_to(self, count: int) -> bool:
        with self._lock:
            return self.completed >= count


def tally(folder: str) -> dict[str, int]:
    """The copies of every process whose stand-in kept its tally in ``folder`` (TALLY_ENV), added up."""
    total = {"batches": 0, "stores": 0, "loads": 0}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                for k, v in json.load(f).items():
                    total[k] = total.get(k, 0) + v
    return total


def _fault_from_environment() -> str | None:
    fault = os.environ.get(FAULT_ENV) or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r} is not a transport fault; use one of {FAULTS}")
    return fault


TRANSPORT = CudaTransport()


class Event:
    """``torch.Event``: complete once every copy submitted before :meth:`record` was done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._after = 0

    def record(self, stream: Any = None) -> None:
        self._after = TRANSPORT.submitted

    def query(self) -> bool:
        return TRANSPORT.done_up_to(self._after)

    def synchronize(self) -> None:
        # Waiting on a copy in flight: the DMA finishes (a held transport is released).
        if not self.query():
            TRANSPORT.release()

    def wait(self, stream: Any = None) -> None:
        return None


class Stream:
    """``torch.cuda.Stream``: work on it happens in submission order (the transport's)."""

    cuda_stream = 0  # the release puts it in BatchMemcpyParams; the stand-in memcpy ignores it

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return TRANSPORT.done_up_to(TRANSPORT.submitted)

    def synchronize(self) -> None:
        if TRANSPORT.in_flight_count:  # waiting on the stream: the DMA in flight finishes
            TRANSPORT.release()


_CURRENT = Stream()


class _Cuda(types.ModuleType):
    """``torch.cuda`` as the worker modules see it: the stand-ins, and real torch.cuda for the rest."""

    Stream = Stream
    Event = Event

    def __init__(self, real: Any) -> None:
        super().__init__("torch.cuda[kvcompat cuda_transport]")
        self._real = real

    @staticmethod
    def current_stream(device: Any = None) -> Stream:
        return _CURRENT

    @staticmethod
    def default_stream(device: Any = None) -> Stream:
        return _CURRENT

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Any = None) -> Iterator[Any]:
        yield stream

    @staticmethod
    def synchronize(device: Any = None) -> None:
        _CURRENT.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Torch(types.ModuleType):
    """A worker module's global ``torch``: real torch but for ``cuda`` and ``Event``."""

    def __init__(self, real: Any) -> None:
        super().__init__("torch[kvcompat cuda_transport]")
        self._real = real
        self.cuda = _Cuda(real.cuda)
        self.Event = Event

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


INSTALLED: list[str] = []


def install() -> list[str]:
    """Replace the CUDA transport inside the release's SimpleCPUOffload worker modules (idempotent).

    Which globals exist is probed on the modules, never read from a version.  Returns what was
    replaced.  The fault comes from ``KVCOMPAT_CUDA_TRANSPORT_FAULT`` (a negative control).
    """
    import torch

    if INSTALLED:
        return INSTALLED
    proxy = _Torch(torch)
    from kvcompat.testkit import probes

    for name in WORKER_MODULES:
        if not probes.has_module(name):
            continue
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
            INSTALLED.append(f"{name}.torch")
    mem = importlib.import_module(MEM_OPS)
    if hasattr(mem, "_batch_memcpy"):  # 0.29+: (entry point, numAttrs), resolved lazily
        mem._batch_memcpy = (TRANSPORT.batch_memcpy, 1)
        INSTALLED.append(f"{MEM_OPS}._batch_memcpy")
    elif hasattr(mem, "_batch_memcpy_fn"):  # 0.19-0.28: the entry point, resolved lazily
        mem._batch_memcpy_fn = TRANSPORT.batch_memcpy
        INSTALLED.append(f"{MEM_OPS}._batch_memcpy_fn")
    else:
        raise TypeError(f"{MEM_OPS} has no batch-memcpy entry point (_batch_memcpy / _batch_memcpy_fn) to replace")
    return INSTALLED
