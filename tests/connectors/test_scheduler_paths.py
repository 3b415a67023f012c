"""The Scheduler's connector paths, under MultiConnector(Nixl + CPU offload): how a failed load ends, what the
Scheduler keeps of a load once it is over, when it tells the engine it still has work, how a reset and a
shutdown reach the connectors, and when a load is admitted (a pool only just big enough, a full running
batch, a pause for new requests).

These are contracts on the release's Scheduler (vllm/v1/core/sched/scheduler.py) for what its connectors
report: a regression there turns one of them red.  Engines are the release's Scheduler with the
MultiConnector it builds and its worker half (see conftest); NIXL is the fake transport
(kvcompat.testkit.fake_nixl), the CPU tier's copies the CPU transport.  Where a scenario needs a child to
report what its real run does not give here (a block whose load failed), that one answer is scripted in the
release's own protocol (kvcompat.testkit.adapter.children), as in test_multi_lifecycle.py.  Every scenario
ends with its engines back at their idle baseline (:func:`conftest.assert_no_leak`).
"""

from __future__ import annotations

import threading

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by, user_configuration
from kvcompat.testkit.adapter import children as ch

from conftest import (
    BLOCK,
    HYBRID,
    PREFILLED,
    a_load_held_in_flight,
    assert_no_leak,
    can_reset_connectors,
    fail_a_loaded_block,
    nixl_lease,
    patient_steps,
    require_hma_pair,
    step_until,
    stored_prefix,
    token_ids,
    wait_until,
)

LEASE_S = 2  # P's lease on blocks nobody read (a failed read): short, so that the leak check's settle ends it


def _policy(engine) -> str:
    """The release's kv_load_failure_policy for this engine ("recompute" where the release has no such knob)."""
    return getattr(engine.vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")


def _has_output_field(name: str) -> bool:
    """Explicit probe: the release's KVConnectorOutput carries ``name``."""
    from vllm.v1.outputs import KVConnectorOutput

    return name in va.capabilities._field_names(KVConnectorOutput)


# ---------------------------------------------------------------------------
# 1. a failed NIXL read of a hybrid model ends the request (failed_recving is its only report)
# ---------------------------------------------------------------------------
def test_a_failed_load_under_hma_ends_the_request_in_error(make_pd, nixl_agent, monkeypatch):
    """A hybrid model (full attention + sliding window) served P/D: D's NIXL read of P's blocks fails.  For
    such a model Nixl reports the request only as a failed receive (no block ids: they are not unique across
    KV-cache groups), and that alone must end it as the release's load-failure policy says: in error under
    "fail" (the release's default), recomputed from scratch under "recompute".  It is never run on the KV
    the failed read left behind, nor left waiting for it; neither engine leaks."""
    from vllm.v1.request import RequestStatus

    if not _has_output_field("failed_recving"):
        not_applicable("this release's KVConnectorOutput has no failed_recving (no failed-receive reporting)")
    with user_configuration("P/D of a hybrid model (sliding window) with MultiConnector(Nixl, CPU offload), HMA on"):
        p, d = make_pd(nixl_extra_config=nixl_lease(monkeypatch, LEASE_S), **HYBRID)
    require_hma_pair(d)
    assert va.hma_enabled(d.vllm_config) and len(d.kv_cache_config.kv_cache_groups) == 2, (
        "scenario not built: the hybrid model did not get two KV-cache groups with HMA on"
    )
    prompt = token_ids(4 * BLOCK, start=1900)
    with setup_owned_by(PREFILLED):
        params = p.prefill("hma-failed-read", prompt)
    nixl_agent.failing_transfers = 1
    req = va.make_request("hma-failed-read", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: nixl_agent.failed > 0 or req.is_finished()), "the fake transport failed no read"
    assert step_until([d, p], lambda: req.is_finished()), (
        f"D's request whose read failed never finished: it is {req.status} (waiting on a load reported failed)"
    )
    reported = any("hma-failed-read" in (getattr(o, "failed_recving", None) or ()) for o in d.kv_outputs if o)
    assert reported, "scenario not built: D's Nixl worker never reported the read as a failed receive"
    if _policy(d) == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR, (
            f"policy 'fail': the request whose read failed ended {req.status}, run on KV that never arrived"
        )
        out = d.finished_output("hma-failed-read")
        assert out is not None and str(out.finish_reason).lower().endswith("error"), (
            f"the client was not told the request failed: finish reason {getattr(out, 'finish_reason', None)}"
        )
    else:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, req.status
        assert req.num_computed_tokens >= len(prompt), "the prompt whose read failed was never recomputed"
    assert "hma-failed-read" not in d.scheduler.requests, "D still holds the request whose read failed"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 2. the Scheduler keeps no record of a load once it is over
# ---------------------------------------------------------------------------
def test_the_scheduler_keeps_no_record_of_a_finished_or_aborted_load(engine, transport):
    """A load from the CPU tier that completed leaves nothing behind in the Scheduler once its request has
    run, and neither does one whose request is aborted after the load completed but before the request ran
    again (the client went away at that moment): the aborted request's blocks come back at once (no
    transfer is left to report them), the request is gone, and the engine is at its idle baseline."""
    from vllm.v1.request import RequestStatus

    done = token_ids(3 * BLOCK + 5, start=2100)
    stored_prefix(engine, done, "record-done-src")
    loads = len(transport.loads())
    engine.scheduler.add_request(va.make_request("record-done", done, max_tokens=2))
    engine.run(["record-done"])
    assert len(transport.loads()) > loads, "scenario not built: the prompt was not loaded from the CPU tier"
    left = set(engine.scheduler.finished_recving_kv_req_ids)
    assert not left, f"the Scheduler still lists {sorted(left)} as loads to collect after the request ran"

    aborted = token_ids(3 * BLOCK + 5, start=2300)
    stored_prefix(engine, aborted, "record-aborted-src")
    req = va.make_request("record-aborted", aborted, max_tokens=2)
    engine.scheduler.add_request(req)

    def reported() -> bool:
        return "record-aborted" in (getattr(engine.kv_outputs[-1], "finished_recving", None) or ())

    for _ in patient_steps(20):  # the copy thread completes the load
        engine.step()
        if reported():
            break
    assert reported(), "scenario not built: the CPU-offload child's load never completed"
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, (
        f"scenario not built: the loaded request is {req.status} before the next schedule()"
    )
    engine.scheduler.finish_requests("record-aborted", RequestStatus.FINISHED_ABORTED)
    for _ in range(2):
        engine.step()
    assert "record-aborted" not in engine.scheduler.requests, (
        "the request aborted after its load completed is still held, its blocks waiting for a transfer report "
        "that will never come"
    )
    left = set(engine.scheduler.finished_recving_kv_req_ids)
    assert not left, f"the Scheduler still lists {sorted(left)} as loads to collect after the request was aborted"
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 3. a failed block fails the request that loaded it, and no other
# ---------------------------------------------------------------------------
def test_a_block_failure_of_one_load_spares_the_other_requests(engine, monkeypatch):
    """One block of a CPU-tier load fails (the child names it when the load completes) while another
    request is decoding: the loading request ends as the load-failure policy says, and the decoding
    request, whose blocks are all good, runs to its end untouched; nothing leaks."""
    from vllm.v1.request import RequestStatus

    if not _has_output_field("invalid_block_ids"):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    prompt = token_ids(3 * BLOCK + 5, start=2500)
    stored_prefix(engine, prompt, "spared-src")
    bystander = va.make_request("bystander", token_ids(2 * BLOCK + 7, start=2700), max_tokens=24)
    engine.scheduler.add_request(bystander)
    engine.step()
    engine.step()
    assert bystander.status == RequestStatus.RUNNING and bystander.num_computed_tokens > 0, bystander.status
    failed = fail_a_loaded_block(monkeypatch, engine, engine.worker._connectors[engine.offload_index], "loser")
    loser = va.make_request("loser", prompt, max_tokens=2)
    engine.scheduler.add_request(loser)
    for _ in patient_steps(20):
        if failed:
            break
        engine.step()
    assert failed, "scenario not built: the CPU-offload child's load never completed"
    assert not bystander.is_finished(), "scenario not built: the decoding request ended before the failure"
    engine.run(["loser", "bystander"])
    if _policy(engine) == "fail":
        assert loser.status == RequestStatus.FINISHED_ERROR, f"policy 'fail': the failed load ended {loser.status}"
    else:
        assert loser.status == RequestStatus.FINISHED_LENGTH_CAPPED, loser.status
    assert bystander.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"a request with no failed block ended {bystander.status} because another request's load failed"
    )
    assert len(bystander.output_token_ids) == 24, (
        f"the decoding request produced {len(bystander.output_token_ids)} of its 24 tokens"
    )
    assert_no_leak(engine)


def test_a_failed_last_block_holding_one_token_fails_the_load(pd, monkeypatch):
    """A P/D read of a prompt of two blocks and one token, whose last block (that one token) the Nixl child
    names as failed when the read completes: that token's KV is not there, so the request ends as the
    load-failure policy says (in error under "fail"), never run on the block the read did not write; P frees
    its blocks and neither engine leaks."""
    from vllm.v1.request import RequestStatus

    if not _has_output_field("invalid_block_ids"):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    p, d = pd
    prompt = token_ids(2 * BLOCK + 1, start=2900)
    with setup_owned_by(PREFILLED):
        params = p.prefill("one-token-tail", prompt)
    failed = fail_a_loaded_block(monkeypatch, d, d.worker._connectors[d.nixl_index], "one-token-tail", 2)
    req = va.make_request("one-token-tail", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: bool(failed)), "scenario not built: D's read never completed"
    assert step_until([d, p], lambda: req.is_finished()), f"D's request never finished ({req.status})"
    if _policy(d) == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR, (
            f"policy 'fail': the request whose last block (1 token) failed to load ended {req.status}"
        )
    else:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, req.status
        assert req.num_computed_tokens >= len(prompt), "the failed token was never recomputed"
    assert step_until([d, p], lambda: "one-token-tail" not in p.scheduler.requests), "P kept the blocks D read"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 4. shutdown
# ---------------------------------------------------------------------------
def test_scheduler_shutdown_stops_the_connector(make_pd, monkeypatch):
    """Shutting the Scheduler down (EngineCore's shutdown, after the workers') shuts its connector down
    once: the Nixl handshake listener P's MultiConnector started for its decode peers stops, its thread
    ends, and the engine leaks nothing."""
    before = set(threading.enumerate())
    p, _ = make_pd()
    listeners = [t for t in set(threading.enumerate()) - before if t.name == "nixl_handshake_listener"]
    assert listeners, "scenario not built: P serves its Nixl handshake on no listener thread of that name"
    assert_no_leak(p)
    calls = ch.spy(monkeypatch, p.multi, "shutdown")
    p.scheduler.shutdown()
    assert len(calls) == 1, f"Scheduler.shutdown() called its connector's shutdown {len(calls)} times, want once"
    running = [t.name for t in listeners if wait_until(lambda t=t: not t.is_alive(), timeout=5) is False]
    assert not running, f"{running} still running after the Scheduler's shutdown: the handshake port stays bound"


# ---------------------------------------------------------------------------
# 5. finished requests whose sends are pending keep the engine stepping
# ---------------------------------------------------------------------------
def test_finished_requests_with_pending_sends_keep_the_engine_busy(pd):
    """P has finished a prefill whose blocks D has not read yet: P's Scheduler says it still has work (as
    EngineCore asks it, has_requests), so an engine core that steps only while there is work keeps stepping,
    learns that D read the blocks, and frees them; then it says it has none."""
    p, d = pd
    prompt = token_ids(3 * BLOCK + 5, start=3100)
    with setup_owned_by(PREFILLED):
        params = p.prefill("busy-send", prompt)
    assert "busy-send" in p.scheduler.requests, "scenario not built: P freed the blocks before D's read"
    p.step()  # the step after the finish: P's finished ids are handed out, only the held blocks remain
    assert p.scheduler.has_requests(), (
        "P says it has no work while it holds a finished request's blocks for D: its engine core stops stepping"
    )
    d.scheduler.add_request(va.make_request("busy-send", prompt, max_tokens=2, kv_transfer_params=params))
    for _ in patient_steps(400):  # P steps only while its Scheduler says it has work, as EngineCore's loop does
        if "busy-send" not in p.scheduler.requests and d.finished_output("busy-send") is not None:
            break
        d.step()
        if p.scheduler.has_requests():
            p.step()
    assert d.finished_output("busy-send") is not None, "D never finished the request"
    assert "busy-send" not in p.scheduler.requests, (
        "P, stepping only while its Scheduler said it had work, never freed the blocks D read"
    )
    assert not p.scheduler.has_finished_requests(), "P says it still holds finished requests after D's read"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 6. a reset the connectors or the local cache refuse is reported as refused
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("refused_by", ["a child", "the local cache"])
def test_a_refused_reset_is_reported(engine, monkeypatch, refused_by):
    """Resetting the prefix cache with the connectors' answers True only if every part reset: when one
    child refuses (the others reset), or when the local prefix cache cannot be reset because a request is
    running (the connectors reset), the Scheduler answers False, so the caller knows stale KV may still be
    served.  The request runs to its end and nothing leaks."""
    can_reset_connectors(engine)
    if refused_by == "a child":
        for i, child in enumerate(engine.multi._connectors):
            ch.spy(monkeypatch, child, "reset_cache", lambda _ok=(i != engine.offload_index): _ok)
        assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False, (
            "the reset was reported done although the CPU-offload child refused it"
        )
        assert_no_leak(engine)
        return
    # Under one block of prompt and output: nothing is stored to the CPU tier, so the connectors can reset.
    engine.scheduler.add_request(va.make_request("running", token_ids(BLOCK // 2, start=3300), max_tokens=6))
    engine.step()
    engine.step()
    assert engine.multi.reset_cache() is not False, "scenario not built: the connectors refused to reset"
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False, (
        "the reset was reported done although a running request kept the local prefix cache from resetting"
    )
    engine.run(["running"])
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 7. block-level load failures on a multi-group model are refused loudly
# ---------------------------------------------------------------------------
def test_a_block_level_load_failure_on_a_multi_group_model_is_refused_or_recomputed_never_decoded_over(
    make_engine, monkeypatch
):
    """A hybrid model (two KV-cache groups, HMA on) whose CPU-tier load reports one failed block by block id
    (get_block_ids_with_load_errors).  Block ids are only unique within a group, so the Scheduler cannot map the id
    back to one group's blocks.  The user expects either a refusal by the Scheduler with its own error naming the
    cause (0.31.0 on: EngineCore then stops, with no engine left to check for leaks), or the request recomputed in
    full or ended as the load-failure policy says (0.30.0: "no single truncation point exists across groups",
    ``v1/core/sched/scheduler.py`` 0.30.0 L3087-3106), never a crash of another kind and never a decode over the
    failed block."""
    from vllm.v1.request import RequestStatus

    if not _has_output_field("invalid_block_ids"):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    with user_configuration("a hybrid model (sliding window) with MultiConnector(Nixl, CPU offload), HMA on"):
        engine = make_engine(**HYBRID)
    require_hma_pair(engine)
    assert va.hma_enabled(engine.vllm_config) and len(engine.kv_cache_config.kv_cache_groups) == 2, (
        "scenario not built: the hybrid model did not get two KV-cache groups with HMA on"
    )
    prompt = token_ids(3 * BLOCK + 5, start=3500)
    stored_prefix(engine, prompt, "groups-src")
    failed = fail_a_loaded_block(monkeypatch, engine, engine.worker._connectors[engine.offload_index], "groups")
    req = va.make_request("groups", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    try:
        for _ in patient_steps(20):
            engine.step()
            if failed:
                engine.step()  # the step whose output reports the failed block, if not this one
                break
    except RuntimeError as exc:
        assert "multiple KV cache groups" in str(exc), (
            f"the Scheduler stopped with an error not naming the cause: {exc}"
        )
        assert failed, "scenario not built: the CPU-offload child's load never completed"
        return
    assert failed, "scenario not built: the CPU-offload child's load never completed"
    assert req.num_computed_tokens == 0 or req.is_finished(), (
        f"{req.num_computed_tokens} tokens counted as computed after block {sorted(failed)} of a multi-group load failed"
    )
    for _ in range(8):
        if req.is_finished():
            break
        engine.step()
    policy = getattr(engine.vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR, f"policy 'fail', request ended {req.status}"
    else:
        assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED), req.status
        assert req.num_computed_tokens >= len(prompt), "the failed load's tokens were never recomputed"
    assert "groups" not in engine.scheduler.requests, "blocks of the failed request still held"


# ---------------------------------------------------------------------------
# 8. loads that fill the pool still finish, one after the other
# ---------------------------------------------------------------------------
# Each layout: the two prompts, as (tokens whose prefix is in the CPU tier, tokens past it), and the pool.
TIGHT_POOLS = {
    # 7 usable blocks.  Each load takes its prompt's 3 stored blocks and needs a 4th for the prompt's last 5
    # tokens: 3 + 3 + the first's 1 fit, 4 + 4 do not.
    "each-load-needs-one-block-more": ([(3 * BLOCK, 5), (3 * BLOCK, 5)], 8),
    # 6 usable blocks.  The first load takes 2 stored blocks and needs 3 more for the rest of its prompt;
    # the second takes 3 stored blocks and needs 1 more.  Both loads fit at once (2 + 3), but then neither
    # can finish its prompt: the second may start only once the first has finished.  (vLLM #44560: two
    # async loads admitted into such a pool waited for each other forever.)
    "the-first-load-needs-three-blocks-more": ([(2 * BLOCK, 3 * BLOCK - 8), (3 * BLOCK, 5)], 7),
}


@pytest.mark.parametrize("layout", list(TIGHT_POOLS))
def test_two_cpu_tier_loads_in_a_pool_that_finishes_one_at_a_time_both_finish(make_engine, transport, layout):
    """Two requests whose prefixes are in the CPU tier arrive together on an engine whose KV pool holds
    both loads and the blocks the first still needs to finish its prompt, but not both whole prompts.
    A load holds its blocks, with no forward progress, until it can finish its prompt: the blocks kept for
    the first load go to it once its KV is in, it runs and frees its blocks, and then the second runs.
    Both requests finish (neither waits forever for a block the other holds), in arrival order, and the
    engine is back at its idle baseline."""
    from vllm.v1.request import RequestStatus

    parts, num_blocks = TIGHT_POOLS[layout]
    prompts = [
        token_ids(stored, start=3700 + 200 * i) + token_ids(rest, start=100 + 20 * i)
        for i, (stored, rest) in enumerate(parts)
    ]
    with user_configuration(f"MultiConnector(Nixl, CPU offload) on a KV pool of {num_blocks} blocks"):
        engine = make_engine(num_blocks=num_blocks)
    usable = num_blocks - 1  # block 0 is the pool's null block
    assert engine.baseline_free == usable, f"scenario not built: {engine.baseline_free} free blocks, want {usable}"
    for i, ((stored, _), prompt) in enumerate(zip(parts, prompts, strict=True)):
        # the stored request goes a few tokens past the prefix, so that all of the prefix's blocks are full
        stored_prefix(engine, prompt[:stored] + token_ids(3, start=90), f"tight-src-{i}")
    loads = len(transport.loads())
    reqs = [va.make_request(f"tight-{i}", prompt, max_tokens=2) for i, prompt in enumerate(prompts)]
    for req in reqs:
        engine.scheduler.add_request(req)
    engine.step()
    assert reqs[0].status == RequestStatus.WAITING_FOR_REMOTE_KVS, (
        f"scenario not built: the first request did not start loading from the CPU tier ({reqs[0].status})"
    )
    engine.run(["tight-0", "tight-1"])
    assert len(transport.loads()) > loads, "scenario not built: nothing was loaded from the CPU tier"
    for req in reqs:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, f"{req.request_id} ended {req.status}"
        assert len(req.output_token_ids) == 2, f"{req.request_id} produced {len(req.output_token_ids)} of 2 tokens"
    first = [
        min(i for i, so in enumerate(engine.sched_outputs) if r.request_id in so.num_scheduled_tokens) for r in reqs
    ]
    assert first[0] <= first[1], f"the later request ran first (steps {first})"
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 9. without max_num_inflight_kv_loads, a load waits for a running slot
# ---------------------------------------------------------------------------
def test_without_an_inflight_load_cap_a_load_waits_for_a_free_running_slot(engine, transport):
    """The running batch is full (max_num_seqs requests decoding) when a request whose prefix is in the
    CPU tier arrives.  Only --max-num-inflight-kv-loads lets such a request start loading while the
    batch is full (the connector API's may_load_async says so); without it (the suite's SchedulerConfig
    default) its load waits for a running slot, so it holds no blocks no slot can use yet.  Once a slot
    is free it loads and runs to its end; nothing leaks."""
    from vllm.v1.request import RequestStatus

    cap = getattr(engine.scheduler.scheduler_config, "max_num_inflight_kv_loads", None)  # no such knob before 0.34
    assert cap is None, f"scenario not built: the engine caps in-flight KV loads at {cap}"
    hit = token_ids(3 * BLOCK + 5, start=4100)
    stored_prefix(engine, hit, "slot-src")
    slots = engine.scheduler.scheduler_config.max_num_seqs
    decoding = [f"slot-busy-{i}" for i in range(slots)]
    for i, rid in enumerate(decoding):  # under one block each, prompt and output: nothing to store
        engine.scheduler.add_request(va.make_request(rid, token_ids(8, start=4300 + 10 * i), max_tokens=12))
    engine.step()
    assert len(engine.scheduler.running) == slots, "scenario not built: the batch is not full"
    loads = len(transport.loads())
    req = va.make_request("slot-load", hit, max_tokens=2)
    engine.scheduler.add_request(req)
    while len(engine.scheduler.running) >= slots:
        engine.step()
        assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0, (
            f"the request started its KV load while every running slot was taken ({req.status}), "
            "without --max-num-inflight-kv-loads"
        )
    engine.run(["slot-load", *decoding])
    assert len(transport.loads()) > loads, "scenario not built: the request's prefix was not loaded from the CPU tier"
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, req.status
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 10. pausing new requests lets a load finish and keeps new requests queued
# ---------------------------------------------------------------------------
def test_a_pause_for_new_requests_lets_a_load_finish_and_queues_new_ones(engine, transport):
    """The engine is paused for new requests (EngineCore's pause in "wait" mode: PAUSED_NEW) while a
    request's KV load from the CPU tier is in flight.  The request holding loaded blocks still finishes;
    a request that arrives during the pause is not started, and the engine says it has no more work
    (so the pause's wait for the drain ends).  After the pause the queued request runs; nothing leaks."""
    from vllm.v1.core.sched import interface
    from vllm.v1.request import RequestStatus

    PauseState = getattr(interface, "PauseState", None)
    if PauseState is None or not hasattr(engine.scheduler, "set_pause_state"):
        not_applicable("this release's Scheduler has no pause state (PauseState, set_pause_state)")
    if not hasattr(engine.scheduler, "kv_holding_waiting"):  # explicit probe: the queue PAUSED_NEW still drains
        not_applicable("in this release a pause for new requests schedules only running requests (PauseState)")
    loading, _ = a_load_held_in_flight(engine, transport, token_ids(3 * BLOCK + 5, start=4700), "pause-load")
    assert loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"scenario not built: {loading.status}"
    engine.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    queued = va.make_request("pause-new", token_ids(BLOCK + 3, start=4900), max_tokens=2)
    engine.scheduler.add_request(queued)
    transport.release()
    for _ in patient_steps(40):
        if loading.is_finished():
            break
        engine.step()
    assert loading.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"the request whose KV was loading did not finish during the pause: {loading.status}"
    )
    scheduled = [i for i, so in enumerate(engine.sched_outputs) if "pause-new" in so.num_scheduled_tokens]
    assert not scheduled and queued.status == RequestStatus.WAITING and queued.num_computed_tokens == 0, (
        f"a request that arrived while new requests were paused was started (steps {scheduled}, {queued.status})"
    )
    assert engine.scheduler.get_num_unfinished_requests() == 0, (
        "paused for new requests, the engine still reports work once the loading request finished: "
        "the pause's wait for the drain never ends"
    )
    engine.scheduler.set_pause_state(PauseState.UNPAUSED)
    engine.run(["pause-new"])
    assert queued.status == RequestStatus.FINISHED_LENGTH_CAPPED, queued.status
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 11. the pair's loads are asynchronous: the worker starts them after the forward
# ---------------------------------------------------------------------------
def test_the_pairs_loads_start_after_the_forward_not_ahead_of_it(engine, transport, monkeypatch):
    """Both children load asynchronously (a NIXL read, a CPU-tier copy), so no step has a load the forward
    must wait for: the model runner starts the connectors' loads after it has launched the forward, which
    keeps their submission (the CPU tier's block copies, ~5 ms) off the forward's critical path (the
    release's ActiveKVConnector.pre_forward / post_forward; SimpleCPUOffloadWorker.start_load_kv).  On
    every step, with requests admitted fresh, loaded from the CPU tier and decoding, the worker's
    MultiConnector starts its loads only once the forward's layers have run; both requests finish and
    nothing leaks."""
    from vllm.v1.core.sched.output import SchedulerOutput

    if "has_sync_kv_loads" not in va.capabilities._field_names(SchedulerOutput):
        not_applicable("this release's model runner starts the connectors' loads before every forward")
    hit = token_ids(3 * BLOCK + 5, start=5100)
    stored_prefix(engine, hit, "after-fwd-src")
    calls: dict[int, list[str]] = {}  # step (its SchedulerOutput's index) -> worker calls, in order

    def record(name: str) -> None:
        real = getattr(engine.worker, name)

        def call(*args, **kwargs):
            calls.setdefault(len(engine.sched_outputs), []).append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.worker, name, call)

    record("start_load_kv")
    record("wait_for_layer_load")
    loads = len(transport.loads())
    engine.scheduler.add_request(va.make_request("after-fwd-load", hit, max_tokens=3))
    engine.scheduler.add_request(va.make_request("after-fwd-fresh", token_ids(BLOCK + 3, start=5300), max_tokens=3))
    engine.run(["after-fwd-load", "after-fwd-fresh"])
    assert len(transport.loads()) > loads, "scenario not built: nothing was loaded from the CPU tier"
    forwards = {step: seq for step, seq in calls.items() if "wait_for_layer_load" in seq and "start_load_kv" in seq}
    assert forwards, f"scenario not built: no step ran both a forward and the connectors' loads ({calls})"
    early = sorted(s for s, seq in forwards.items() if seq.index("start_load_kv") < seq.index("wait_for_layer_load"))
    assert not early, (
        f"steps {early} started the connectors' (asynchronous) loads ahead of the forward, as if a synchronous "
        "load had to land first"
    )
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 12. a request whose KV was loaded goes to the workers as a new request
# ---------------------------------------------------------------------------
def test_a_request_whose_kv_was_loaded_goes_to_the_workers_as_a_new_request(engine, transport):
    """A request that waited for its KV (here from the CPU tier) has never run, so when its load is done the
    Scheduler hands it to the workers as a new request, with its prompt and its block table: the model
    runner holds no state for it that a resumed request would continue from (a runner given an unknown
    request to resume fails).  It then runs to its end and nothing leaks."""
    req, _ = a_load_held_in_flight(engine, transport, token_ids(3 * BLOCK + 5, start=5100), "new-after-load")
    loading_steps = len(engine.sched_outputs)
    transport.release()
    assert step_until(
        [engine],
        lambda: any("new-after-load" in so.num_scheduled_tokens for so in engine.sched_outputs[loading_steps:]),
        max_steps=40,
    ), f"the request whose load completed was never scheduled ({req.status})"
    so = next(so for so in engine.sched_outputs[loading_steps:] if "new-after-load" in so.num_scheduled_tokens)
    new = {r.req_id for r in so.scheduled_new_reqs}
    resumed = set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    assert "new-after-load" in new and "new-after-load" not in resumed, (
        f"the request, never run before its load, went to the workers as {'resumed' if 'new-after-load' in resumed else 'neither new nor resumed'}"
    )
    engine.run(["new-after-load"])
    assert_no_leak(engine)
