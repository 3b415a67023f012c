"""The CPU-offload child's own code under MultiConnector: its CPU tier loads, stores and resets.

These contracts are about SimpleCPUOffloadConnector's manager and worker (OffloadingConnector's before
0.19) and the Scheduler's paths for asynchronous loads: a regression in ``simple_kv_offload/`` or in
``simple_cpu_offload_connector.py`` turns one of them red.  The child's blocks move through the CPU
stand-in of its CUDA transport (kvcompat.testkit.cuda_transport), which the test can hold so that a
transfer stays in flight.  Every scenario ends with the engine back at its idle baseline.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import time

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by
from kvcompat.testkit.adapter import children as ch

from conftest import (
    BLOCK,
    NUM_GPU_BLOCKS,
    STORED,
    a_load_held_in_flight,
    assert_no_leak,
    can_reset_connectors,
    cpu_tier_hit,
    offload_metric_names,
    stored_prefix,
    token_ids,
    wait_until,
)


# ---------------------------------------------------------------------------
# 1. loads
# ---------------------------------------------------------------------------
def test_cpu_tier_load_is_asynchronous_and_unpins_when_it_completes(engine, transport):
    """A prompt served from the CPU tier is loaded asynchronously: the request waits in
    WAITING_FOR_REMOTE_KVS, computing nothing, with the CPU blocks it reads pinned, while the copy is
    in flight; when the copy completes the request runs with the loaded tokens counted as computed,
    finishes, and the CPU blocks are unpinned (the engine is back at its idle baseline)."""
    from vllm.v1.request import RequestStatus

    prompt = token_ids(3 * BLOCK + 5, start=70)
    req, so = a_load_held_in_flight(engine, transport, prompt, "tier-load")
    for _ in range(3):
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"{req.status} while its CPU load is in flight"
        assert so.num_scheduled_tokens.get("tier-load", 0) == 0, "the request computed tokens during its load"
        assert engine.idle_state().pinned_cpu_blocks > engine.baseline.pinned_cpu_blocks, (
            "the CPU blocks being read are not pinned while the load is in flight"
        )
        so = engine.step()
    transport.release()
    engine.run(["tier-load"])
    assert req.num_computed_tokens >= 3 * BLOCK, "the loaded tokens were not counted as computed"
    assert_no_leak(engine)


def test_cpu_tier_metrics_count_the_blocks_it_loaded(engine, transport, monkeypatch):
    """What the CPU tier reports to the engine's stats (the counter a user reads in the logs and on
    Prometheus) matches what it did: serving a prompt of three full blocks from the tier counts three
    blocks loaded, counted over every report the Scheduler takes from the child (it drains them each
    step).  (The store counters are for boundary hand-offs of hybrid models only,
    ``BoundaryStoreStats`` in ``v1/simple_kv_offload/manager.py`` 0.34.0 L121, which this pair never makes.)"""
    names = offload_metric_names()
    if names is None:
        not_applicable("this release's CPU-offload child reports no load counter")
    prompt = token_ids(3 * BLOCK + 5, start=2900)
    stored_prefix(engine, prompt, "metrics-src")
    reports = ch.spy(monkeypatch, engine.offload, "get_kv_connector_stats").returned
    engine.scheduler.add_request(va.make_request("metrics-load", prompt, max_tokens=2))
    engine.run(["metrics-load"])
    engine.settle()
    assert reports, "the Scheduler never asked the CPU-offload child for its stats"
    loaded = sum((r.data.get("data", {}).get(names.LOAD_BLOCKS, {}).get((), 0) if r else 0) for r in reports)
    assert loaded == 3, f"the CPU tier served the prompt's 3 full blocks and its stats count {loaded} loaded"
    # What reaches the stats logger in another process: the stats as plain data under the child's name,
    # rebuilt by the release's MultiConnector.build_kv_connector_stats (0.34.0 multi_connector.py L715-736).
    MultiConnector, _ = va.multi_classes()
    name = type(engine.offload).__name__
    rebuilt = [MultiConnector.build_kv_connector_stats(data={name: copy.deepcopy(r.data)}) for r in reports if r]
    reloaded = sum(s.data[name].data.get("data", {}).get(names.LOAD_BLOCKS, {}).get((), 0) for s in rebuilt)
    assert reloaded == 3, f"the stats logger, rebuilding what the engine sent, counts {reloaded} of 3 blocks loaded"
    info = {labels for r in reports if r for labels in r.data.get("data", {}).get(getattr(names, "INFO", ""), {})}
    tier = str(len(engine.offload.scheduler_manager.cpu_block_pool.blocks))
    assert info or not hasattr(names, "INFO"), "the CPU tier never described itself to the metrics (info gauge)"
    assert all(labels[0] == "cpu" and labels[-1] == tier for labels in info), (
        f"the CPU tier of {tier} blocks describes itself to the metrics as {sorted(info)} (backend, ..., capacity)"
    )
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 2. stores: what a request filled, prompt and decode alike
# ---------------------------------------------------------------------------
def test_a_prefill_only_request_is_stored_in_the_cpu_tier_and_the_engine_goes_idle(engine):
    """A request that ends with its prefill (``max_tokens=1``, as the prefill side of P/D runs every
    request) has its prompt's full blocks stored in the CPU tier: the blocks computed in a request's last
    step can only be stored when it finishes, and an engine that steps only while its scheduler says it
    has work (EngineCore's loop) finishes that store and goes idle; the tier then serves the prompt and
    nothing leaks.  (A release that stores nothing at all is the store contract's finding: a request that
    decodes a token first must be stored, or this test is blocked by that contract.)"""
    stored_prefix(engine, token_ids(2 * BLOCK + 3, start=1900), "decodes-then-finishes")
    prompt = token_ids(3 * BLOCK + 5, start=1300)
    engine.scheduler.add_request(va.make_request("prefill-only", prompt, max_tokens=1))
    engine.run(["prefill-only"])
    engine.run_until_idle()  # fails when the engine still says it has work after MAX_IDLE_STEPS steps
    served = cpu_tier_hit(engine, prompt, "prefill-only-again")
    assert served >= 3 * BLOCK, f"the CPU tier serves {served} tokens of a prefill-only prompt of {len(prompt)}"
    assert_no_leak(engine)


QUIET_S = 1.0  # an engine left alone this long (no traffic, no steps) still serves what it stored


def test_the_engine_keeps_stepping_while_a_finished_requests_store_is_queued_and_serves_it_after_a_quiet_period(
    engine, transport
):
    """When a request's last step completes blocks, their store is queued when the request finishes and
    issued at the next step: until it is, the scheduler says it has work (not only while a store is in
    flight), so an engine that steps only while it has work (EngineCore's loop) issues and completes it and
    then goes idle; left alone for a while, the engine then serves the whole prompt from the CPU tier, and
    nothing leaks.  An engine that goes idle with the store still queued never issues it: the prompt's
    blocks stay pinned and the next request for it recomputes."""
    prompt = token_ids(3 * BLOCK + 5, start=2300)
    launched = transport.launched()
    engine.scheduler.add_request(va.make_request("queued-store", prompt, max_tokens=1))
    engine.run(["queued-store"])
    queued = transport.launched() == launched
    assert engine.scheduler.has_requests(), (
        "the engine says it has no work right after a request finished, with its store "
        + ("queued but not issued" if queued else "in flight")
    )
    steps = engine.run_until_idle()
    with setup_owned_by(STORED):
        assert transport.stores(), "the CPU-offload child stored nothing of the finished request"
    assert steps > 0, "the engine took no step after the request finished: its store was never issued"
    time.sleep(QUIET_S)
    served = cpu_tier_hit(engine, prompt, "queued-store-again")
    assert served >= 3 * BLOCK, (
        f"after {steps} steps and a quiet {QUIET_S:.0f} s the CPU tier serves {served} tokens of the "
        f"{len(prompt)}-token prompt (its 3 full blocks: {3 * BLOCK})"
    )
    assert_no_leak(engine)


def test_blocks_filled_during_decode_are_stored_too(engine, transport):
    """A request whose generated tokens complete another block has that block stored in the CPU tier
    too: a follow-up request whose prompt is the first request's prompt and output (a chat's next
    turn) is served from the CPU tier past the prompt's own full blocks."""
    prompt = token_ids(2 * BLOCK + BLOCK - 4, start=90)
    engine.scheduler.add_request(va.make_request("turn-1", prompt, max_tokens=8))
    engine.run(["turn-1"])
    engine.settle()
    with setup_owned_by(STORED):
        assert transport.stores(), "the CPU-offload child stored nothing of the finished request"
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    output = [t for o in engine.outputs["turn-1"] for t in o.new_token_ids]
    turn_2 = prompt + output
    assert len(turn_2) >= 3 * BLOCK, f"the first request produced {len(output)} tokens"
    served = cpu_tier_hit(engine, turn_2 + token_ids(5, start=7), "turn-2")
    assert served >= 3 * BLOCK, (
        f"the CPU tier serves {served} tokens of the next turn: the block completed during decode "
        f"(tokens {2 * BLOCK}..{3 * BLOCK - 1}) was not stored"
    )
    assert_no_leak(engine)


def test_a_prompt_that_extends_a_stored_one_has_its_new_blocks_stored_too(engine):
    """A prompt that starts with one already in the CPU tier (a conversation's next turn, a shared system
    prompt) and adds blocks of its own has those new blocks stored as well: afterwards the CPU tier serves
    the whole longer prompt, not only the part it had."""
    first = token_ids(3 * BLOCK, start=5500)
    stored_prefix(engine, first + token_ids(5, start=3), "extends-first")
    longer = first + token_ids(3 * BLOCK + 5, start=5700)
    engine.scheduler.add_request(va.make_request("extends-longer", longer, max_tokens=2))
    engine.run(["extends-longer"])
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    served = cpu_tier_hit(engine, longer, "extends-again")
    assert served >= 6 * BLOCK, (
        f"the CPU tier serves {served} tokens of a 6-block prompt that extends a stored 3-block one: "
        "the new blocks were not stored"
    )
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 3. reset_cache
# ---------------------------------------------------------------------------
def test_reset_cache_on_an_idle_engine_answers_and_reaches_both_children(engine, monkeypatch):
    """Resetting the prefix cache together with the connectors' caches on an idle engine (nothing
    stored, nothing in flight) does not raise, reaches both children once, and succeeds.  (Needs no
    stored prefix: a release whose reset raises is red here even if its stores are broken.)"""
    can_reset_connectors(engine)
    calls = [ch.spy(monkeypatch, c, "reset_cache") for c in engine.multi._connectors]
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert [len(c) for c in calls] == [1, 1], f"reset_cache calls per child: {[len(c) for c in calls]}"
    assert_no_leak(engine)


def test_reset_cache_refuses_while_a_store_is_in_flight_then_clears_the_cpu_tier(engine, transport):
    """While a store to the CPU tier is in flight, resetting with the connectors' caches answers False
    (the child cannot drop blocks a copy is writing) and raises nothing; once the copy has completed
    and the engine settled, the reset succeeds, the CPU tier serves nothing of the old prompt, and no
    block stays pinned."""
    can_reset_connectors(engine)
    prompt = token_ids(3 * BLOCK + 5, start=110)
    transport.hold()
    engine.scheduler.add_request(va.make_request("reset-flight", prompt, max_tokens=2))
    engine.run(["reset-flight"])
    engine.step()
    with setup_owned_by(STORED):
        assert wait_until(lambda: transport.launched() > 0), "the CPU-offload child never started a store"
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False, (
        "reset_cache succeeded while a store into the CPU tier was in flight"
    )
    transport.release()
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True, "reset failed on a settled engine"
    served = cpu_tier_hit(engine, prompt, "reset-after")
    assert served == 0, f"the CPU tier still serves {served} tokens of the prompt after a successful reset"
    assert_no_leak(engine)


def test_reset_cache_refuses_while_a_cpu_tier_load_is_in_flight_and_keeps_its_blocks_pinned(
    engine, transport, monkeypatch
):
    """A reset asked while a copy out of the CPU tier is in flight cannot drop the blocks the copy reads:
    the CPU-offload child answers False and keeps them pinned until the copy completes; the request then
    runs with the loaded tokens, and on the settled engine a reset succeeds and nothing leaks.  (The
    device cache cannot reset while the loading request holds blocks, so the child's own answer is
    checked, not only the scheduler's.)"""
    can_reset_connectors(engine)
    from vllm.v1.request import RequestStatus

    prompt = token_ids(3 * BLOCK + 5, start=170)
    req, _ = a_load_held_in_flight(engine, transport, prompt, "reset-load")
    resets = ch.spy(monkeypatch, engine.offload, "reset_cache")
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False, "the reset succeeded mid-load"
    assert resets.returned == [False], (
        f"the CPU-offload child answered {resets.returned} to a reset while its load was in flight"
    )
    for _ in range(3):
        engine.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"{req.status} while its CPU load is in flight"
        assert engine.idle_state().pinned_cpu_blocks > engine.baseline.pinned_cpu_blocks, (
            "the reset unpinned the CPU blocks a load in flight is still reading"
        )
    transport.release()
    engine.run(["reset-load"])
    assert req.num_computed_tokens >= 3 * BLOCK, "the loaded tokens were not counted as computed after the reset"
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True, "reset failed on a settled engine"
    assert_no_leak(engine)


def test_reset_cache_right_after_a_prefill_only_request_drops_its_queued_store(engine, monkeypatch):
    """A reset asked the moment a prefill-only request finishes, before its finish-time store has gone to
    the workers, drops that store: the CPU-offload child's reset succeeds (nothing of it is being copied;
    the device cache may still refuse while the store's references hold its blocks), the CPU tier then
    serves nothing of the prompt, the engine settles with nothing leaked, a second reset succeeds, and the
    tier keeps working (the next prompt is stored and served)."""
    can_reset_connectors(engine)
    stored_prefix(engine, token_ids(2 * BLOCK + 3, start=2300), "decodes-before-reset")
    prompt = token_ids(3 * BLOCK + 5, start=2500)
    engine.scheduler.add_request(va.make_request("queued-store", prompt, max_tokens=1))
    engine.run(["queued-store"])
    resets = ch.spy(monkeypatch, engine.offload, "reset_cache")
    engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert resets.returned == [True], (
        f"the CPU-offload child answered {resets.returned} although the finished request's store had not started"
    )
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True, "reset failed on a settled engine"
    served = cpu_tier_hit(engine, prompt, "queued-store-again")
    assert served == 0, f"the CPU tier serves {served} tokens of a prompt whose store the reset dropped"
    assert_no_leak(engine)
    after = token_ids(3 * BLOCK + 5, start=2700)
    engine.scheduler.add_request(va.make_request("after-reset", after, max_tokens=1))
    engine.run(["after-reset"])
    engine.run_until_idle()
    served = cpu_tier_hit(engine, after, "after-reset-again")
    assert served >= 3 * BLOCK, f"after the reset the CPU tier serves {served} tokens of a new prompt"
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 4. the tier the user configured
# ---------------------------------------------------------------------------
def _takes_num_cpu_blocks() -> None:
    """Explicit probe: the release's CPU-offload child reads ``num_cpu_blocks`` from its extra config."""
    if not va.has_simple_cpu_offload():
        not_applicable("this release's CPU-offload child is OffloadingConnector, whose tier kvcompat sizes by bytes")
    if '"num_cpu_blocks"' not in inspect.getsource(importlib.import_module(va.V1 + ".simple_cpu_offload_connector")):
        not_applicable("this release's SimpleCPUOffloadConnector takes no num_cpu_blocks")


@pytest.mark.parametrize(
    ("asked", "prompt_blocks"), [(1, 0), (24, 3), (NUM_GPU_BLOCKS, 3)], ids=["one", "some", "the-whole-budget"]
)
def test_cpu_tier_has_the_blocks_the_user_asked_for(make_engine, asked, prompt_blocks):
    """``num_cpu_blocks`` in the CPU-offload child's config, anywhere from 1 to what its byte budget allows
    (the suite's budget is ``NUM_GPU_BLOCKS`` blocks a rank), gives a CPU tier of exactly that many blocks
    on the scheduler side and on the worker, and the tier works: a prompt stored there is served from it.
    (A tier of 1 is only sized: its BlockPool keeps block 0 as the null block, v1/core/block_pool.py 0.34.0
    L164, so it can hold nothing; a tier of N holds N - 1.)"""
    _takes_num_cpu_blocks()
    engine = make_engine(offload_extra_config={"num_cpu_blocks": asked})
    pool = engine.offload.scheduler_manager.cpu_block_pool
    assert len(pool.blocks) == asked, f"the scheduler's CPU tier has {len(pool.blocks)} blocks, {asked} asked for"
    worker = engine.ranks[0].connector._connectors[engine.offload_index].worker_handler
    assert worker.num_cpu_blocks == asked, f"the worker's CPU tier has {worker.num_cpu_blocks} blocks, {asked} asked"
    if prompt_blocks:
        prompt = token_ids(prompt_blocks * BLOCK + 5, start=520)
        stored_prefix(engine, prompt, "sized-src")  # owned by the store contract (STORED) inside
        assert cpu_tier_hit(engine, prompt, "sized") >= prompt_blocks * BLOCK, (
            "the sized CPU tier served no stored prompt"
        )
    assert_no_leak(engine)


def test_a_cpu_tier_smaller_than_a_prompt_stores_and_serves_what_fits(make_engine):
    """A CPU tier with room for fewer blocks than a prompt fills (two, for a prompt of three full blocks)
    still works: the request finishes, nothing raises, the tier serves the head of the prompt that fits
    in it, and nothing leaks."""
    _takes_num_cpu_blocks()
    engine = make_engine(offload_extra_config={"num_cpu_blocks": 3})  # block 0 is the pool's null block
    prompt = token_ids(3 * BLOCK + 5, start=4100)
    engine.scheduler.add_request(va.make_request("small-tier-src", prompt, max_tokens=2))
    engine.run(["small-tier-src"])  # a store that does not fit must not break the request: this contract's
    engine.settle()
    assert engine.transfers.stores(), "a CPU tier smaller than the prompt stored none of it"
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    served = cpu_tier_hit(engine, prompt, "small-tier")
    assert served == 2 * BLOCK, f"a CPU tier of 2 usable blocks serves {served} tokens of a 3-block prompt"
    assert_no_leak(engine)


def test_a_prompt_in_use_from_the_device_cache_is_evicted_from_the_cpu_tier_after_an_unused_one(make_engine):
    """The CPU tier evicts the prompt used longest ago, and a prompt served from the device's own prefix
    cache counts as used: in a tier with room for two prompts, after A and B are stored and A runs again
    (from the device cache), storing a third prompt evicts B, not A, and the tier still serves all of A."""
    _takes_num_cpu_blocks()
    engine = make_engine(offload_extra_config={"num_cpu_blocks": 7})  # 6 usable: two prompts of 3 blocks
    a, b, c = (token_ids(3 * BLOCK + 5, start=s) for s in (4300, 4500, 4700))
    for rid, prompt in (("lru-a", a), ("lru-b", b), ("lru-a-again", a), ("lru-c", c)):
        engine.scheduler.add_request(va.make_request(rid, prompt, max_tokens=2))
        engine.run([rid])
        engine.settle()
    with setup_owned_by(STORED):
        assert engine.transfers.stores(), "the CPU-offload child stored nothing of the finished requests"
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"
    served_a, served_b = cpu_tier_hit(engine, a, "lru-a-tier"), cpu_tier_hit(engine, b, "lru-b-tier")
    assert served_a >= 3 * BLOCK, (
        f"the CPU tier serves {served_a} tokens of A, which ran again after B, and {served_b} of B: "
        "it evicted the prompt in use instead of the one used longest ago"
    )
    assert_no_leak(engine)


def test_a_cpu_tier_of_no_blocks_is_refused_at_start(tiny_model_dir, single_rank_distributed, nixl_agent):
    """``num_cpu_blocks`` of 0 (or not a whole number) is refused when the engine is built, on the
    scheduler side and on the worker, with an error that names the setting: never a tier that
    silently holds nothing.  One block more than the byte budget holds is refused too, by the scheduler
    and by the worker when it sizes its tier (never a tier larger than the memory it may take)."""
    _takes_num_cpu_blocks()
    over = NUM_GPU_BLOCKS + 1  # offload_child_extra_config's budget is NUM_GPU_BLOCKS blocks a rank
    kvt = va.multi_kv_transfer_config(BLOCK, NUM_GPU_BLOCKS, offload_extra_config={"num_cpu_blocks": over})
    cfg = va.make_vllm_config(tiny_model_dir, block_size=BLOCK, num_gpu_blocks=NUM_GPU_BLOCKS, kv_transfer_config=kvt)
    kvc = va.make_kv_cache_config(NUM_GPU_BLOCKS, block_size=BLOCK)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        va.make_scheduler(cfg, kvc)
    rank = va.build_rank(cfg, kvc, 0)
    try:
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            rank.register()
    finally:
        rank.shutdown()
    for bad in (0, "8"):
        kvt = va.multi_kv_transfer_config(BLOCK, NUM_GPU_BLOCKS, offload_extra_config={"num_cpu_blocks": bad})
        cfg = va.make_vllm_config(
            tiny_model_dir, block_size=BLOCK, num_gpu_blocks=NUM_GPU_BLOCKS, kv_transfer_config=kvt
        )
        kvc = va.make_kv_cache_config(NUM_GPU_BLOCKS, block_size=BLOCK)
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            va.make_scheduler(cfg, kvc)
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            va.build_rank(cfg, kvc, 0)
