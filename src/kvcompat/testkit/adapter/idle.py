"""What an idle engine holds: free device blocks, the CPU tier's pinned blocks and the children's
per-request bookkeeping, read from the release.

A leak is something that stays held once every request is done: a device block no request owns, a
CPU-tier block still pinned (a load or store whose completion never came, a cache hit reserved for a
request that went away), a block freed more often than it was taken (its reference count below 0: the
block pool hands it out again while something still uses it, or asserts), or an entry a child's scheduler side keeps per request or per transfer
event (a long-running server's memory grows with every such request, and a request id used
again meets the old entry).  :func:`idle_state` reads them all from the release's own structures, so a
test compares an engine after a scenario with the same engine before it (its baseline), never with a
number it assumed.  Reading only: nothing here frees, resets or nudges anything.

The CPU tier is the CPU-offload child's scheduler side: SimpleCPUOffloadConnector (0.19 on) keeps a
vLLM BlockPool of CPU blocks (``scheduler_manager.cpu_block_pool``), where a pin is a reference count;
OffloadingConnector (before 0.19) keeps an offloading manager whose blocks carry ``ref_cnt``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class IdleState:
    """The counts that must come back after a scenario: device blocks free, CPU-tier blocks pinned, blocks
    freed too often, and the size of each container the scheduler-role children hold
    (``("<child>: <attribute>", entries)`` pairs)."""

    free_device_blocks: int
    pinned_cpu_blocks: int
    tracked: tuple[tuple[str, int], ...] = ()
    overfreed_blocks: tuple[tuple[str, int], ...] = ()  # ("device" | "CPU-tier", blocks with ref_cnt < 0)

    def leaks_against(self, baseline: IdleState) -> list[str]:
        """What this state holds beyond ``baseline``, in words (empty when nothing leaked)."""
        out = []
        if self.free_device_blocks != baseline.free_device_blocks:
            out.append(
                f"{baseline.free_device_blocks - self.free_device_blocks} device blocks still held "
                f"({self.free_device_blocks} free, {baseline.free_device_blocks} at idle)"
            )
        if self.pinned_cpu_blocks != baseline.pinned_cpu_blocks:
            out.append(
                f"{self.pinned_cpu_blocks - baseline.pinned_cpu_blocks} CPU-tier blocks still pinned "
                f"({self.pinned_cpu_blocks} pinned, {baseline.pinned_cpu_blocks} at idle)"
            )
        for pool, n in self.overfreed_blocks:
            if n > dict(baseline.overfreed_blocks).get(pool, 0):
                out.append(f"{n} {pool} blocks freed more often than they were taken (reference count below 0)")
        at_idle = dict(baseline.tracked)
        for name, entries in self.tracked:
            idle = at_idle.get(name, 0)
            if entries > idle:
                child, _, attribute = name.partition(": ")
                out.append(f"{child} still holds {entries - idle} entries in {attribute} ({entries}, {idle} at idle)")
        return out


def _pinned_in_block_pool(pool: Any) -> int:
    """Blocks of a vLLM BlockPool that something references (its null block excluded: no ref count)."""
    null = getattr(pool, "null_block", None)
    return sum(1 for b in pool.blocks if b is not null and b.ref_cnt > 0)


def _overfreed_in_block_pool(pool: Any) -> int:
    null = getattr(pool, "null_block", None)
    return sum(1 for b in pool.blocks if b is not null and b.ref_cnt < 0)


def overfreed_blocks(scheduler: Any, offload_child: Any) -> tuple[tuple[str, int], ...]:
    """Device and CPU-tier blocks whose reference count is below 0: freed more often than taken (a double
    free the pool does not refuse; the block is handed out again while its other holder still uses it)."""
    out = [("device", _overfreed_in_block_pool(scheduler.kv_cache_manager.block_pool))]
    manager = getattr(offload_child, "scheduler_manager", None)
    if manager is not None and hasattr(manager, "cpu_block_pool"):
        out.append(("CPU-tier", _overfreed_in_block_pool(manager.cpu_block_pool)))
    blocks = getattr(getattr(getattr(offload_child, "connector_scheduler", None), "manager", None), "blocks", None)
    if isinstance(blocks, dict):  # OffloadingConnector
        out.append(("CPU-tier", sum(1 for b in blocks.values() if getattr(b, "ref_cnt", 0) < 0)))
    return tuple(out)


def pinned_cpu_blocks(offload_child: Any) -> int:
    """The CPU tier's pinned blocks, read from the scheduler-role CPU-offload child."""
    manager = getattr(offload_child, "scheduler_manager", None)  # SimpleCPUOffloadConnector
    if manager is not None and hasattr(manager, "cpu_block_pool"):
        return _pinned_in_block_pool(manager.cpu_block_pool)
    sched = getattr(offload_child, "connector_scheduler", None)  # OffloadingConnector
    blocks = getattr(getattr(sched, "manager", None), "blocks", None)
    if blocks is not None:
        return sum(1 for status in blocks.values() if getattr(status, "ref_cnt", 0) > 0)
    if manager is None and sched is None and hasattr(offload_child, "scheduler_manager"):
        return 0  # SimpleCPUOffload with prefix caching off builds no tier: nothing can be pinned
    raise AttributeError(
        f"kvcompat does not know where {type(offload_child).__name__} keeps its CPU blocks in this release; "
        "teach kvcompat.testkit.adapter.idle.pinned_cpu_blocks"
    )


def scheduler_object(child: Any) -> Any:
    """Where a scheduler-role child keeps its state: SimpleCPUOffload's manager, OffloadingConnector's and
    NixlConnector's ``connector_scheduler``."""
    return getattr(child, "scheduler_manager", None) or getattr(child, "connector_scheduler", None)


def tracked_entries(children: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The size of every dict, set and list each scheduler-role child's state object holds directly,
    named ``"<child>: <attribute>"``.

    Per-request and per-event state lives in such containers under names that change between releases
    (``_reqs_to_load``, ``_store_event_to_reqs``, ``_pending_cpu_hits`` in 0.34.0's
    ``v1/simple_kv_offload/manager.py``; ``_reqs_need_send``, ``_reqs_need_recv`` in ``nixl/base_scheduler.py``),
    so every container is counted and compared with the same engine's baseline: configuration keeps its
    size, bookkeeping must return to its own."""
    out: list[tuple[str, int]] = []
    for label, child in children.items():
        state = scheduler_object(child)
        if state is None:
            continue
        out += [
            (f"{label}: {name}", len(value))
            for name, value in sorted(vars(state).items())
            if isinstance(value, (dict, set, list))
        ]
    return tuple(out)


def worker_object(child: Any) -> Any:
    """Where a worker-role child keeps its state: NixlConnector's ``connector_worker``, SimpleCPUOffload's
    ``worker_handler`` (OffloadingConnector's ``connector_worker`` too)."""
    return getattr(child, "connector_worker", None) or getattr(child, "worker_handler", None)


def _members(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.keys())
    if isinstance(value, (set, frozenset, list, tuple, collections.deque)):
        return list(value)
    return []


def requests_still_held(holders: dict[str, Any], request_ids: set[str]) -> list[str]:
    """Where the finished requests ``request_ids`` are still named by a connector's state, in words.

    Each holder's attributes are read: a dict's keys, a set's or list's members, and one level further
    (a dict of dicts keyed by request, a list of sets).  Names differ between releases and between the
    scheduler and worker halves, so no attribute is named here: a finished request must be gone from all
    of them, or a long-running server keeps it (and meets it again when a request id comes back)."""
    out = []
    for label, obj in holders.items():
        for name, value in sorted(vars(obj).items()) if obj is not None and hasattr(obj, "__dict__") else ():
            outer = _members(value)
            inner = [m for v in (value.values() if isinstance(value, dict) else outer) for m in _members(v)]
            held = sorted({m for m in outer + inner if isinstance(m, str) and m in request_ids})
            if held:
                out.append(f"{label} still holds finished request {', '.join(map(repr, held))} in {name}")
    return out


def idle_state(scheduler: Any, offload_child: Any, nixl_child: Any = None) -> IdleState:
    """The engine's counts now: the scheduler's free device blocks, the CPU tier's pinned blocks and the
    scheduler-role children's bookkeeping."""
    children = {"the CPU-offload child's scheduler": offload_child}
    if nixl_child is not None:
        children["the Nixl child's scheduler"] = nixl_child
    return IdleState(
        free_device_blocks=scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        pinned_cpu_blocks=pinned_cpu_blocks(offload_child),
        tracked=tracked_entries(children),
        overfreed_blocks=overfreed_blocks(scheduler, offload_child),
    )
