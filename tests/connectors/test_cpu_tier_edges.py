"""The CPU tier at its edges: an abort mid-load, a prompt of one block, shared prefixes, a reset mid-decode.

Like test_cpu_tier.py, these are contracts on SimpleCPUOffloadConnector's own code and the Scheduler's
paths for it, under MultiConnector, with the child's CUDA copies replaced by the CPU transport the test
can hold.  Each is what a user of a CPU tier expects at a boundary the plain scenarios do not reach, and
each ends with the engine back at its idle baseline.
"""

from __future__ import annotations

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import setup_owned_by

from conftest import (
    BLOCK,
    STORED,
    a_load_held_in_flight,
    assert_no_leak,
    can_reset_connectors,
    cpu_tier_hit,
    stored_prefix,
    token_ids,
    wait_until,
)

PREFILL_ONLY_STORED = "test_a_prefill_only_request_is_stored_in_the_cpu_tier_and_the_engine_goes_idle"


def test_a_request_aborted_while_its_cpu_tier_load_is_in_flight_keeps_its_blocks_until_the_copy_completes(
    engine, transport
):
    """A request aborted (the client went away) while its prompt is being copied out of the CPU tier
    cannot take its blocks back from the copy: the CPU blocks it reads stay pinned and the device blocks
    it writes stay allocated until the copy completes; then both are released and the engine is back at
    its idle baseline.  (Freeing either early lets the next request's data be overwritten, or read, by a
    copy still running.)"""
    from vllm.v1.request import RequestStatus

    prompt = token_ids(3 * BLOCK + 5, start=3100)
    a_load_held_in_flight(engine, transport, prompt, "abort-mid-load")
    engine.scheduler.finish_requests("abort-mid-load", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        engine.step()
        assert engine.idle_state().pinned_cpu_blocks > engine.baseline.pinned_cpu_blocks, (
            "the aborted request's CPU blocks were unpinned while its load was still copying them"
        )
        assert engine.free_blocks() < engine.baseline_free, (
            "the aborted request's device blocks were freed while its load was still writing them"
        )
    transport.release()
    engine.settle()
    assert_no_leak(engine)


def test_the_cpu_tier_serves_every_full_block_of_a_stored_prompt_down_to_one(engine, transport):
    """The CPU tier serves every full block of a stored prompt and leaves only the last token to
    compute: a prompt of three blocks and one token gets all three blocks, and a prompt of a single
    full block (and a few tokens) is loaded from the tier and runs to its end."""
    exact = token_ids(3 * BLOCK + 1, start=3300)
    stored_prefix(engine, exact, "k-plus-one-src")
    served = cpu_tier_hit(engine, exact, "k-plus-one")
    assert served == 3 * BLOCK, f"the CPU tier serves {served} tokens of a stored prompt of 3 blocks and 1 token"
    one = token_ids(BLOCK + 5, start=3400)
    stored_prefix(engine, one, "one-block-src")
    loads = len(transport.loads())
    req = va.make_request("one-block", one, max_tokens=2)
    engine.scheduler.add_request(req)
    engine.run(["one-block"])
    assert len(transport.loads()) > loads, "the stored single block was not loaded from the CPU tier"
    assert req.num_computed_tokens >= BLOCK, "the loaded block was not counted as computed"
    assert_no_leak(engine)


@pytest.mark.parametrize("max_tokens", [2, 1], ids=["decoding", "prefill-only"])
def test_each_block_is_copied_to_the_cpu_tier_once(engine, transport, max_tokens):
    """A block goes to the CPU tier once.  A second request sharing a prompt's full blocks, admitted while
    the first one's stores are still being copied (a request that decodes, or a prefill-only one whose
    blocks are stored when it finishes), copies none of them again; and a prompt served from the CPU tier
    that runs again is not copied back.  (Each duplicate costs a copy and a CPU-tier block, and evicts
    another prompt sooner.)"""
    owner = STORED if max_tokens == 2 else PREFILL_ONLY_STORED
    shared = token_ids(3 * BLOCK, start=3500)
    transport.hold()
    engine.scheduler.add_request(va.make_request("first", shared + token_ids(5, start=1), max_tokens=max_tokens))
    engine.run(["first"])
    engine.step()  # a prefill-only request's stores are sent the step after it finishes
    with setup_owned_by(owner):
        assert wait_until(lambda: transport.in_flight_count > 0), "the CPU-offload child stored nothing of it"
    queued = transport.in_flight_count
    engine.scheduler.add_request(va.make_request("second", shared + token_ids(5, start=9), max_tokens=max_tokens))
    engine.run(["second"])
    engine.step()
    assert transport.in_flight_count == queued, (
        f"the second request queued {transport.in_flight_count - queued} more copies of blocks the first "
        "request's stores were already copying to the CPU tier"
    )
    transport.release()
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    stores = len(transport.stores())
    engine.scheduler.add_request(va.make_request("again", shared + token_ids(5, start=1), max_tokens=2))
    engine.run(["again"])
    engine.settle()
    assert transport.loads(), "the stored prompt was not served from the CPU tier"
    assert len(transport.stores()) == stores, (
        f"a prompt served from the CPU tier was copied back to it ({len(transport.stores()) - stores} copies)"
    )
    assert_no_leak(engine)


def test_a_reset_while_a_request_decodes_raises_nothing_and_the_tier_keeps_serving(engine):
    """Resetting the caches with the connectors' while a request is decoding answers False (its blocks
    are in use) and raises nothing, then or at any later step: the request runs to its end, and the CPU
    tier keeps working afterwards (a new prompt is stored and served), with nothing leaked."""
    can_reset_connectors(engine)
    prompt = token_ids(3 * BLOCK + 5, start=3700)
    engine.scheduler.add_request(va.make_request("decoding", prompt, max_tokens=8))
    engine.step()
    engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False, (
        "the reset succeeded while a running request held its blocks"
    )
    engine.run(["decoding"])
    engine.settle()
    after = token_ids(3 * BLOCK + 5, start=3900)
    stored_prefix(engine, after, "after-reset-src")
    served = cpu_tier_hit(engine, after, "after-reset")
    assert served >= 3 * BLOCK, f"after a reset mid-decode the CPU tier serves {served} tokens of a new prompt"
    assert_no_leak(engine)


@pytest.mark.parametrize("ended_by", ["a reset", "an abort"])
def test_a_cpu_tier_hit_reserved_for_a_request_waiting_for_device_blocks_is_released_once(make_engine, ended_by):
    """A request whose prompt is in the CPU tier but which must wait for device blocks (the pool is busy)
    keeps its CPU-tier hit reserved while it waits.  A reset of the caches, or an abort of the request,
    releases that reservation exactly once: the request (when not aborted) and the busy one run to their
    end, the tier keeps storing and serving, and no block is left pinned or freed twice."""
    from vllm.v1.request import RequestStatus

    engine = make_engine(num_blocks=8)  # 7 usable device blocks (block 0 is the null block)
    if ended_by == "a reset":
        can_reset_connectors(engine)
    prompt = token_ids(3 * BLOCK + 5, start=4900)
    stored_prefix(engine, prompt, "reserved-src")
    engine.scheduler.add_request(va.make_request("busy", token_ids(4 * BLOCK + 20, start=5100), max_tokens=30))
    engine.step()
    engine.scheduler.add_request(va.make_request("reserved", prompt, max_tokens=2))
    engine.step()
    waiting = engine.scheduler.requests["reserved"]
    assert waiting.num_computed_tokens == 0, "scenario not built: the request got device blocks at once"
    assert engine.idle_state().pinned_cpu_blocks > engine.baseline.pinned_cpu_blocks, (
        "a request waiting for device blocks does not keep its CPU-tier hit reserved: the tier may evict it"
    )
    if ended_by == "a reset":
        engine.scheduler.reset_prefix_cache(reset_connector=True)  # refused (busy holds blocks); the tier resets
        engine.run(["busy", "reserved"])
    else:
        engine.scheduler.finish_requests("reserved", RequestStatus.FINISHED_ABORTED)
        engine.run(["busy"])
    engine.settle()
    after = token_ids(3 * BLOCK + 5, start=5300)
    stored_prefix(engine, after, "after-reserved-src")
    served = cpu_tier_hit(engine, after, "after-reserved")
    assert served >= 3 * BLOCK, f"after {ended_by} of a waiting request the CPU tier serves {served} tokens"
    assert_no_leak(engine)


def test_a_request_with_a_device_cache_hit_aborted_while_it_waits_for_device_blocks_leaves_no_record(make_engine):
    """A request whose prompt starts with a prefix still in the device cache, but which must wait for
    device blocks (the pool is busy), is aborted before it gets them (the client went away).  The
    CPU-offload child, told of the local hit when the scheduler looked the request up, forgets it with
    the request: nothing of it is left in the child's bookkeeping (a server that keeps every such request
    grows without end, and meets the stale entry again when a request id comes back), and the engine
    returns to its idle baseline."""
    from vllm.v1.request import RequestStatus

    engine = make_engine(num_blocks=10)  # 9 usable device blocks (block 0 is the null block)
    shared = token_ids(2 * BLOCK, start=6100)
    engine.scheduler.add_request(va.make_request("local-src", shared + token_ids(5, start=6300), max_tokens=2))
    engine.run(["local-src"])
    engine.settle()  # its two full blocks stay in the device cache: no reset
    engine.scheduler.add_request(va.make_request("busy", token_ids(4 * BLOCK + 20, start=6400), max_tokens=30))
    engine.step()
    engine.scheduler.add_request(va.make_request("local-hit", shared + token_ids(3 * BLOCK, start=6600), max_tokens=2))
    engine.step()
    waiting = engine.scheduler.requests["local-hit"]
    assert waiting.status == RequestStatus.WAITING and waiting.num_computed_tokens == 0, (
        f"scenario not built: the request did not wait for device blocks ({waiting.status})"
    )
    engine.scheduler.finish_requests("local-hit", RequestStatus.FINISHED_ABORTED)
    engine.run(["busy"])
    assert_no_leak(engine)
