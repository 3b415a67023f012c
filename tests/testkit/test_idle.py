"""The leak check's readers (kvcompat.testkit.adapter.idle) on plain objects: no vLLM needed."""

from __future__ import annotations

import collections
from types import SimpleNamespace

from kvcompat.testkit.adapter.idle import IdleState, overfreed_blocks, requests_still_held


def _pool(*ref_cnts: int) -> SimpleNamespace:
    null = SimpleNamespace(ref_cnt=-7)  # the null block has no meaningful count: never reported
    return SimpleNamespace(null_block=null, blocks=[null, *(SimpleNamespace(ref_cnt=r) for r in ref_cnts)])


def test_a_finished_request_is_found_in_keys_members_and_one_level_down():
    worker = SimpleNamespace(
        _recving_metadata={"req-a": object()},
        _reqs_to_process={"req-b"},
        per_engine={"engine-1": {"req-c": 1}},
        queue=collections.deque(["req-d"]),
        layers={"model.layers.0": 1},  # configuration: no request id in it
        count=3,
    )
    found = requests_still_held({"rank 0's Nixl worker": worker}, {"req-a", "req-b", "req-c", "req-d", "req-z"})
    assert found == [
        "rank 0's Nixl worker still holds finished request 'req-a' in _recving_metadata",
        "rank 0's Nixl worker still holds finished request 'req-b' in _reqs_to_process",
        "rank 0's Nixl worker still holds finished request 'req-c' in per_engine",
        "rank 0's Nixl worker still holds finished request 'req-d' in queue",
    ]


def test_nothing_is_held_by_a_missing_holder_or_one_without_request_ids():
    assert requests_still_held({"absent": None, "clean": SimpleNamespace(m={"x": 1})}, {"req-a"}) == []


def test_a_block_freed_twice_is_a_leak_and_the_null_block_is_not():
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=_pool(0, 1)))
    child = SimpleNamespace(scheduler_manager=SimpleNamespace(cpu_block_pool=_pool(0, -1, -1)))
    assert overfreed_blocks(scheduler, child) == (("device", 0), ("CPU-tier", 2))
    now = IdleState(10, 0, overfreed_blocks=(("device", 0), ("CPU-tier", 2)))
    baseline = IdleState(10, 0, overfreed_blocks=(("device", 0), ("CPU-tier", 0)))
    assert now.leaks_against(baseline) == [
        "2 CPU-tier blocks freed more often than they were taken (reference count below 0)"
    ]
    assert baseline.leaks_against(baseline) == []
