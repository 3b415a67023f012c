"""The CPU tier around a preemption: copies in flight when a request is preempted, and what it stores once resumed.

Like test_cpu_tier.py, these are contracts on SimpleCPUOffloadConnector's own code (its manager's store
bookkeeping, its worker's flush) and the Scheduler's preemption path, under MultiConnector, with the
child's CUDA copies replaced by the CPU transport the test can hold.  A small device pool makes the
Scheduler preempt: with FCFS the later of two growing requests is the one preempted.  What the CPU tier
holds is checked by serving it back and comparing the bytes the load wrote with the KV the prompt's
forward pass wrote.  Each scenario ends with the engine back at its idle baseline.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by

from conftest import BLOCK, STORED, assert_no_leak, cpu_tier_hit, token_ids

# A device pool of 7 usable blocks (block 0 is the null block): the first request's prompt takes 3, the
# second's 4, and both decode until one needs a block that is not there; the second is then preempted,
# and resumes once the first has finished.
GPU_BLOCKS = 8
FIRST_PROMPT = 2 * BLOCK + 5
SECOND_PROMPT = 3 * BLOCK + 5
SECOND_FULL = SECOND_PROMPT // BLOCK


def _simple_cpu_offload(engine) -> Any:
    """Explicit probe: the CPU-offload child is SimpleCPUOffloadConnector (0.19+), with a scheduler-side
    manager whose CPU tier can be looked up without pinning it; its manager."""
    if not va.has_simple_cpu_offload():
        not_applicable("this release's CPU-offload child is OffloadingConnector, not SimpleCPUOffloadConnector")
    mgr = getattr(engine.offload, "scheduler_manager", None)
    if mgr is None or not hasattr(getattr(mgr, "cpu_coordinator", None), "find_longest_cache_hit"):
        not_applicable("this release's SimpleCPUOffload manager has no CPU-tier coordinator to look up")
    return mgr


def _takes_num_cpu_blocks() -> None:
    """Explicit probe: the release's SimpleCPUOffloadConnector reads ``num_cpu_blocks`` from its extra config."""
    if not va.has_simple_cpu_offload():
        not_applicable("this release's CPU-offload child is OffloadingConnector, not SimpleCPUOffloadConnector")
    if '"num_cpu_blocks"' not in inspect.getsource(importlib.import_module(va.V1 + ".simple_cpu_offload_connector")):
        not_applicable("this release's SimpleCPUOffloadConnector takes no num_cpu_blocks")


def _cpu_tier_blocks(mgr: Any, req: Any, n_blocks: int) -> int:
    """How many of the first ``n_blocks`` blocks of ``req`` the CPU tier holds now, looked up as the child
    looks them up, without pinning anything (a lookup through the scheduler would pin, and move them in
    the tier's eviction order)."""
    return mgr.cpu_coordinator.find_longest_cache_hit(req.block_hashes[:n_blocks], n_blocks * BLOCK)[1] // BLOCK


def _two_growing_requests(engine) -> tuple[Any, Any]:
    """A first request that decodes long and a second, larger one admitted a step later: the small device
    pool makes the Scheduler preempt the second while both decode."""
    first = va.make_request("grows", token_ids(FIRST_PROMPT, start=500), max_tokens=120)
    second = va.make_request("preempted", token_ids(SECOND_PROMPT, start=700), max_tokens=40)
    engine.scheduler.add_request(first)
    engine.step()
    engine.scheduler.add_request(second)
    return first, second


def _steps_until_both_finish(engine, on_step=None, max_steps: int = 300) -> bool:
    """Step until both requests finish; ``on_step(so)`` after each step.  Whether the second was preempted."""
    preempted = False
    for _ in range(max_steps):
        so = engine.step()
        preempted |= "preempted" in (so.preempted_req_ids or ())
        if on_step is not None:
            on_step(so)
        if engine.finished_output("grows") and engine.finished_output("preempted"):
            return preempted
    raise AssertionError(f"the two requests did not finish in {max_steps} steps")


def _served_back_byte_exact(engine, prompt: list[int], req_id: str) -> None:
    """A request for ``prompt`` on a device cache emptied of it is served from the CPU tier: every full block
    of the prompt is loaded, and the device blocks it was loaded into hold exactly the KV the prompt's
    forward pass wrote (not another request's, not a block not yet written)."""
    from vllm.v1.request import RequestStatus

    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    full = len(prompt) // BLOCK
    req = va.make_request(req_id, prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    for _ in range(60):
        engine.step()
        if req.status == RequestStatus.RUNNING:
            break
    assert req.num_computed_tokens >= full * BLOCK, (
        f"the CPU tier served {req.num_computed_tokens} tokens of the prompt's {full * BLOCK} in full blocks"
    )
    blocks = va.group_block_ids(engine.scheduler.kv_cache_manager.get_block_ids(req_id))
    for rank in engine.ranks:
        for layer, cache in rank.kv_caches.items():
            for j, block_id in enumerate(blocks[:full]):
                want = va.expected_block(cache, layer, prompt[: (j + 1) * BLOCK])
                assert va.same_bytes(va.kv_cache_block(cache, block_id), want), (
                    f"block {j} of the prompt ({layer}), served from the CPU tier, does not hold the KV its "
                    "forward pass wrote"
                )
    engine.run([req_id])


# ---------------------------------------------------------------------------
# 1. a preemption with copies in flight
# ---------------------------------------------------------------------------
def test_a_preemption_waits_for_the_cpu_tier_copies_in_flight_before_the_step_runs(make_engine, transport, monkeypatch):
    """When the Scheduler preempts a request while the CPU-offload child's copies of its blocks are still
    in flight, the workers finish those copies before the step's forward pass runs (the child's
    handle_preemptions: the preempted request's blocks may be handed out in that very step, and a copy
    still reading or writing them would move another request's KV).  The preempted request then resumes
    and finishes, the CPU tier serves its prompt with exactly the KV its forward pass wrote, and nothing
    leaks."""
    engine = make_engine(num_blocks=GPU_BLOCKS)
    _simple_cpu_offload(engine)
    if "handle_preemptions" not in vars(type(engine.offload)):
        not_applicable("this release's SimpleCPUOffloadConnector does not handle preemptions")
    in_flight_at_forward: list[tuple[Any, int]] = []
    real_forward = va.forward_layers

    def forward_layers(rank, write_kv):
        in_flight_at_forward.append((engine.sched_outputs[-1], transport.in_flight_count))
        real_forward(rank, write_kv)

    monkeypatch.setattr(va, "forward_layers", forward_layers)
    transport.hold()  # every copy stays in flight until the workers wait for it
    _, second = _two_growing_requests(engine)
    at_preemption: list[int] = []
    before = [0]  # copies in flight when the step began
    queued_at_preemption: list[int] = []

    def check(so):
        if "preempted" in (so.preempted_req_ids or ()):
            at_preemption.extend(n for s, n in in_flight_at_forward if s is so)
            queued_at_preemption.append(before[0])
            transport.release()  # a copy in flight completes on its own, later, as a DMA does
        before[0] = transport.in_flight_count

    preempted = _steps_until_both_finish(engine, check)
    if not preempted:
        pytest.fail("the scheduler never preempted the second request: the scenario was not built")
    with setup_owned_by(STORED):
        assert transport.stores(), "the CPU-offload child stored nothing of the two requests"
    assert queued_at_preemption[0] > 0, (
        "no copy was in flight when the request was preempted: the scenario was not built"
    )
    assert at_preemption, "the step that preempted the request ran no forward pass: the scenario was not built"
    assert all(n == 0 for n in at_preemption), (
        f"{max(at_preemption)} copies to or from the CPU tier were still in flight when the forward pass of the "
        "step that preempted a request ran"
    )
    engine.settle()
    _served_back_byte_exact(engine, second.prompt_token_ids, "preempted-again")
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 2. what a resumed request stores
# ---------------------------------------------------------------------------
def test_a_resumed_request_stores_again_the_blocks_the_cpu_tier_evicted_while_it_was_preempted(make_engine):
    """A preempted request starts over when it resumes, for the CPU tier too: its blocks are looked at
    again from the first, so a block of its prompt that the tier evicted while the request waited (other
    requests' stores filled the tier) is stored again from its new block table, and once it has finished
    the tier serves its whole prompt, byte for byte as its forward pass wrote it; nothing leaks."""
    _takes_num_cpu_blocks()
    # a tier of 5 usable blocks: the first request's decode blocks evict the second's prompt while it waits
    engine = make_engine(num_blocks=GPU_BLOCKS, offload_extra_config={"num_cpu_blocks": 6})
    mgr = _simple_cpu_offload(engine)
    _, second = _two_growing_requests(engine)
    held: list[int] = []

    def record(so):
        if "preempted" in (so.preempted_req_ids or ()) or held:
            held.append(_cpu_tier_blocks(mgr, second, SECOND_FULL))

    preempted = _steps_until_both_finish(engine, record)
    if not preempted:
        pytest.fail("the scheduler never preempted the second request: the scenario was not built")
    with setup_owned_by(STORED):
        assert held and held[0] == SECOND_FULL, (
            f"the CPU tier held {held[:1]} of the preempted request's {SECOND_FULL} prompt blocks when it was preempted"
        )
    if min(held) == SECOND_FULL:
        pytest.fail("the CPU tier never evicted the preempted request's first block: the scenario was not built")
    engine.settle()
    served = cpu_tier_hit(engine, second.prompt_token_ids, "evicted-hit")
    assert served == SECOND_FULL * BLOCK, (
        f"the CPU tier serves {served} tokens of the resumed request's prompt ({SECOND_FULL * BLOCK} in full "
        "blocks): the blocks it evicted while the request was preempted were not stored again after it resumed"
    )
    _served_back_byte_exact(engine, second.prompt_token_ids, "evicted-again")
    assert_no_leak(engine)
