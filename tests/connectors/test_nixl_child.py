"""NixlConnector's own halves under MultiConnector: what the decode side asks for and reads, when the
prefill side may free, what an abort does, what becomes of a request D cannot read and of an engine whose
handshake port is taken, and that nothing leaks.

These contracts are about Nixl's scheduler and worker code and the Scheduler's connector paths (the
MultiConnector contracts are in test_multi_*.py): a regression in ``nixl/`` (or ``nixl_connector.py``)
or in the Scheduler's remote-KV handling turns one of them red.  Two engines P and D, each the
release's Scheduler with MultiConnector(Nixl + CPU offload) and its worker half, move real bytes over
the fake NIXL transport (kvcompat.testkit.fake_nixl), whose transfers complete when polled.  Every
scenario ends with both engines back at their idle baseline (:func:`conftest.assert_no_leak`).
"""

from __future__ import annotations

import importlib
import inspect
import socket
import threading
import traceback
from pathlib import Path

import pytest

from kvcompat.outcomes import CHILD_ORDERS
from kvcompat.testkit import adapter as va
from kvcompat.testkit import nixl_clock, not_applicable, setup_owned_by, user_configuration
from kvcompat.testkit.adapter.idle import scheduler_object, worker_object

from conftest import (
    BLOCK,
    HYBRID,
    P_ENGINE,
    PD_READ,
    PREFILLED,
    TRANSFER_WAIT_S,
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    leased_pd,
    nixl_counted,
    nixl_lease,
    nixl_stats_count,
    nixl_values,
    pd_read_is_byte_exact,
    read_destination,
    read_received,
    require_hma_pair,
    step_until,
    stored_prefix,
    token_ids,
)

NEVER = 10**9  # polls before a fake NIXL read completes: it stays in flight until the test lowers it
MARK = -7.0  # what P's copy of a block is overwritten with when D must not read it


def _status(req):
    from vllm.v1.request import RequestStatus

    return req.status, RequestStatus


def _answers(monkeypatch, obj, name: str) -> list:
    """Record what ``obj.name`` returns (the real method answers)."""
    real, seen = getattr(obj, name), []

    def recorded(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(obj, name, recorded)
    return seen


def _handshakes(nixl_agent) -> int:
    """Remote agents the fake NIXL agents were asked to add (D adds P's at each handshake)."""
    return sum(len(a.calls_named("add_remote_agent")) for a in nixl_agent.instances)


def _computed_after_the_read(d, rid: str) -> int:
    """Prompt tokens D schedules itself once its read has completed (stepping until it schedules some)."""
    scheduled = 0
    for _ in range(3):
        scheduled += d.step().num_scheduled_tokens.get(rid, 0)
        if scheduled:
            break
    return scheduled


def _reads(nixl_agent) -> int:
    """Transfers the fake NIXL agents were asked to make (in a P/D pair, only D reads)."""
    return sum(len(a.calls_named("make_prepped_xfer")) for a in nixl_agent.instances)


# ---------------------------------------------------------------------------
# 1. the decode side: an asynchronous load of exactly what P computed
# ---------------------------------------------------------------------------
def test_decode_waits_for_the_remote_kv_and_asks_for_exactly_the_prefilled_tokens(pd, nixl_agent, monkeypatch):
    """D's Nixl child asks for every prompt token P computed, as an asynchronous load: the request
    waits in WAITING_FOR_REMOTE_KVS, computing nothing, for as long as the NIXL read is in flight, and
    only when it completes does D schedule the request, computing at most the one token it needs for
    logits; P frees its blocks after D's read; neither engine leaks."""
    p, d = pd
    prompt = token_ids(3 * BLOCK + 5, start=200)
    with setup_owned_by(PREFILLED):
        params = p.prefill("async-0", prompt)
    nixl_answers = _answers(monkeypatch, d.nixl, "get_num_new_matched_tokens")
    nixl_agent.polls_until_done = NEVER
    req = va.make_request("async-0", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    waiting = None
    for _ in range(6):
        so = d.step()
        p.step()
        status, RequestStatus = _status(req)
        assert status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D's request is {status} while its read is in flight"
        assert so.num_scheduled_tokens.get("async-0", 0) == 0, "D computed prompt tokens while the read was in flight"
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    assert nixl_answers and nixl_answers[0] == (len(prompt), True), (
        f"D's Nixl child answered {nixl_answers[:1]} for a {len(prompt)}-token prompt P computed; "
        f"want ({len(prompt)}, True): every prompt token, loaded asynchronously"
    )
    nixl_agent.polls_until_done = 1
    assert step_until([d, p], lambda: req.status != waiting), "D's read never completed"
    scheduled = _computed_after_the_read(d, "async-0")
    assert scheduled <= 1, f"D computed {scheduled} prompt tokens itself after loading all {len(prompt)} over NIXL"
    d.run(["async-0"])
    assert step_until([d, p], lambda: "async-0" not in p.scheduler.requests), "P kept the blocks after D had read them"
    assert_no_leak(p, d)


@pytest.mark.parametrize(
    "prompt_len",
    [4 * BLOCK + BLOCK // 2, 4 * BLOCK, BLOCK + BLOCK // 2],
    ids=["d-last-block-half-read", "d-blocks-filled", "one-d-block"],
)
def test_a_decode_with_blocks_twice_the_prefills_reads_the_prompt_token_for_token(make_pd, prompt_len):
    """P/D with different block sizes, the direction vLLM supports (D's block a multiple of P's): P at 32
    tokens a block, D at 64.  D accepts P's handshake and reads the prompt over NIXL; then every prompt
    token's K and V in D's blocks are exactly P's (two of P's blocks laid out as one of D's), what the
    read did not cover of D's last block is zeroed (never stale bytes), D computes at most the one token
    it needs for logits, P frees its blocks after the read, and neither engine leaks."""
    big = 2 * BLOCK
    p, d = make_pd(decode={"block_size": big})
    prompt = token_ids(prompt_len, start=900)
    with setup_owned_by(PREFILLED):
        params = p.prefill("hetero-0", prompt)
    p_blocks = va.group_block_ids(params["remote_block_ids"])
    want = {}  # P's K and V of every prompt token, before anything else can touch P's blocks
    for layer, cache in p.ranks[0].kv_caches.items():
        rows = [row.clone() for b in p_blocks for row in va.token_rows(cache, b, BLOCK)]
        want[layer] = rows[:prompt_len]
    req = va.make_request("hetero-0", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    status, RequestStatus = _status(req)
    assert status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D did not wait for P's KV (block 32 -> 64): {status}"
    d_blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids("hetero-0"))

    # Checked in the step D's worker reports the read done, before D's next step computes the last token
    # (whose block the suite's forward pass fills whole, as no real attention layer would).
    assert step_until([d, p], lambda: read_received(d, "hetero-0")), "D's read never finished"
    read_end = -(-prompt_len // BLOCK) * BLOCK  # the read moves whole P blocks
    last = (prompt_len - 1) // big
    for layer, cache in d.ranks[0].kv_caches.items():
        got_rows = [row for b in d_blocks for row in va.token_rows(cache, b, big)]
        for t in range(prompt_len):
            assert va.same_bytes(got_rows[t], want[layer][t]), (
                f"{layer}: token {t} in D's block {d_blocks[t // big]} (64 tokens) is not P's token {t} "
                f"(P's block {p_blocks[t // BLOCK]}, 32 tokens)"
            )
        stale = [t for t in range(read_end, (last + 1) * big) if got_rows[t].abs().sum().item() != 0]
        assert not stale, f"{layer}: D's block {d_blocks[last]} keeps stale bytes where the read wrote nothing: {stale}"
    scheduled = _computed_after_the_read(d, "hetero-0")
    assert scheduled <= 1, f"D computed {scheduled} prompt tokens itself after loading all {prompt_len} over NIXL"
    d.run(["hetero-0"])
    assert step_until([d, p], lambda: "hetero-0" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


def test_a_hybrid_models_read_fills_each_groups_blocks_in_its_own_layers_and_moves_nothing_more(make_pd):
    """A hybrid model (a full-attention layer and a sliding-window layer, each its own KV-cache group, HMA
    on) served P/D: D reads the prompt over NIXL.  Each group's blocks in D then hold, in that group's
    layers, exactly the KV P's forward pass wrote, and the read moves those blocks and nothing more:
    Nixl's transfer stats (what vllm:nixl_num_descriptors and vllm:nixl_bytes_transferred report) count
    one descriptor per block P sent for each group in each of its layers, and those bytes.  P frees its
    blocks after the read, and neither engine leaks."""
    with user_configuration("P/D of a hybrid model (sliding window) with MultiConnector(Nixl, CPU offload), HMA on"):
        p, d = make_pd(**HYBRID)
    require_hma_pair(d)
    groups = d.kv_cache_config.kv_cache_groups
    assert va.hma_enabled(d.vllm_config) and len(groups) == 2, (
        "scenario not built: the hybrid model did not get two KV-cache groups with HMA on"
    )
    prompt = token_ids(4 * BLOCK, start=1900)  # inside the sliding window: every block of both groups is read
    with setup_owned_by(PREFILLED):
        params = p.prefill("hybrid-read", prompt)
    req = va.make_request("hybrid-read", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    status, RequestStatus = _status(req)
    assert status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D did not wait for P's KV: {status}"
    d_blocks = d.scheduler.kv_cache_manager.get_block_ids("hybrid-read")

    # Checked in the step D's worker reports the read done, before D's next step computes the last token.
    assert step_until([d, p], lambda: read_received(d, "hybrid-read")), "D's read never finished"
    assert_blocks_hold_the_prompt(d, d_blocks, prompt, len(prompt) // BLOCK)
    # The count is checked where the release maps each KV region to the groups that use it (0.32 on:
    # ``region_group_ids``); before, Nixl reads every group's blocks in every region by design ("layers
    # from different groups share the same kv tensor"), the layout vLLM's own allocator gives such a model.
    d_nixl = worker_object(d.worker._connectors[d.nixl_index])
    if nixl_stats_count("bytes_transferred") and hasattr(d_nixl, "region_group_ids"):
        caches = d.ranks[0].kv_caches
        sent = sent_bytes = 0
        for g, group in enumerate(groups):
            blocks = len(va.group_block_ids(params["remote_block_ids"], g))
            sent += blocks * len(group.layer_names)
            sent_bytes += blocks * sum(va.kv_cache_block(caches[layer], 1).nbytes for layer in group.layer_names)
        descriptors = sum(nixl_values(d.kv_outputs, "num_descriptors"))
        moved = sum(nixl_values(d.kv_outputs, "bytes_transferred"))
        assert (descriptors, moved) == (sent, sent_bytes), (
            f"the read moved {descriptors} block descriptors ({moved} bytes) for the {sent} blocks P sent, one per "
            f"layer of their group ({sent_bytes} bytes)"
        )
    d.run(["hybrid-read"])
    assert step_until([d, p], lambda: "hybrid-read" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


def test_decode_with_a_local_prefix_hit_reads_only_the_uncached_suffix(pd, nixl_agent, monkeypatch):
    """When D already holds the first blocks of the prompt in its own prefix cache, its Nixl child asks
    only for the rest (prompt length minus the local hit) and reads P's blocks for the suffix into D's
    new blocks: checked by content, with P's copy of the prefix overwritten, so D's prefix blocks must
    stay D's own and D's suffix blocks must hold exactly P's suffix KV."""
    p, d = pd
    prompt = token_ids(4 * BLOCK + 5, start=60)
    local = 2 * BLOCK
    d.scheduler.add_request(va.make_request("local-prefix", prompt[: local + 3], max_tokens=1))
    d.run(["local-prefix"])
    d.settle()
    with setup_owned_by(PREFILLED):
        params = p.prefill("suffix-0", prompt)
    p_blocks = va.group_block_ids(params["remote_block_ids"])
    for rank in p.ranks:  # P's copy of the prefix: a read of it would bring MARK into D
        for cache in rank.kv_caches.values():
            for b in p_blocks[: local // BLOCK]:
                va.kv_cache_block(cache, b).fill_(MARK)
    nixl_answers = _answers(monkeypatch, d.nixl, "get_num_new_matched_tokens")
    req = va.make_request("suffix-0", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    _, RequestStatus = _status(req)
    assert step_until([d, p], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS), "D's read never completed"
    assert (len(prompt) - local, True) in nixl_answers, (
        f"D's Nixl child answered {nixl_answers} with {local} prompt tokens cached locally; "
        f"want ({len(prompt) - local}, True): only the uncached suffix"
    )
    d_blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids("suffix-0"))
    for rank in d.ranks:
        for layer, cache in rank.kv_caches.items():
            for j in range(len(prompt) // BLOCK):
                want = va.expected_block(cache, layer, prompt[: (j + 1) * BLOCK])
                where = "D's own cached prefix" if j < local // BLOCK else f"P's block {p_blocks[j]}"
                assert va.same_bytes(va.kv_cache_block(cache, d_blocks[j]), want), (
                    f"D's block {d_blocks[j]} (prompt block {j}, {layer}) does not hold the KV of {where}"
                )
    d.run(["suffix-0"])
    assert step_until([d, p], lambda: "suffix-0" not in p.scheduler.requests), "P kept the blocks after D had read them"
    assert_no_leak(p, d)


def test_blocks_received_over_nixl_are_cached_on_the_decode_side(pd):
    """Once D has read a prompt's blocks over NIXL, the Scheduler caches them in D's own prefix cache:
    the same prompt sent to D again (a retry, the next turn) finds every full block of it locally."""
    p, d = pd
    prompt = token_ids(3 * BLOCK + 5, start=240)
    with setup_owned_by(PD_READ):
        print(pd_read_is_byte_exact(p, d, "cached-0", prompt))
    again = va.make_request("cached-1", prompt, max_tokens=1)
    hit = d.scheduler.kv_cache_manager.get_computed_blocks(again)[1]
    assert hit == 3 * BLOCK, (
        f"D's prefix cache holds {hit} tokens of a prompt it received over NIXL, not its {3 * BLOCK} full-block tokens"
    )
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 2. the prefill side: hold until read, or until the lease expires
# ---------------------------------------------------------------------------
def _nixl_source() -> str:
    """The release's Nixl connector and worker modules' source (for explicit probes)."""
    return "".join(
        inspect.getsource(importlib.import_module(m))
        for m in (va.nixl_module(), va.nixl_wrapper_target()[0])
        if importlib.util.find_spec(m) is not None
    )


def _lease_knob() -> str | None:
    """How this release bounds the time P holds blocks nobody reads: the Nixl child's
    ``kv_lease_duration`` (extra config) or the VLLM_NIXL_ABORT_REQUEST_TIMEOUT variable; None when
    its Nixl code has neither (explicit probe of the release's source)."""
    source = _nixl_source()
    for knob in ("kv_lease_duration", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"):
        if knob in source:
            return knob
    return None


def _a_read_held_in_flight(p, d, nixl_agent, req_id: str, prompt: list[int]):
    """P prefills ``prompt`` and D, given P's kv_transfer_params, starts reading it over NIXL; the fake
    transport holds the read in flight (the test lowers ``polls_until_done`` to let it complete).  Returns
    D's request."""
    with setup_owned_by(PREFILLED):
        params = p.prefill(req_id, prompt)
    nixl_agent.polls_until_done = NEVER
    req = va.make_request(req_id, prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: _reads(nixl_agent) > 0, max_steps=50), "D's Nixl worker never started the read"
    return req


def _heartbeats(nixl_agent) -> int:
    """Lease-renewal heartbeats ("HB:<request ids>" notifications) the fake NIXL agents were asked to send."""
    return sum(
        1
        for a in nixl_agent.instances
        for c in a.calls_named("send_notif")
        if len(c.args) > 1 and bytes(c.args[1]).startswith(b"HB:")
    )


def test_prefill_frees_the_blocks_when_the_lease_expires(make_engine, monkeypatch):
    """A prefill-side request whose decode side never reads keeps its blocks for the lease the user
    configured, then the Nixl child's worker releases them: the request is freed and the engine is
    back at its idle baseline, without any notification from a decode side."""
    knob = _lease_knob()
    if knob is None:
        not_applicable("this release's Nixl code has no lease or abort timeout for unread blocks")
    # Long enough that the real seconds a loaded machine spends between the lease's start and the checks (the
    # clock is real time plus what the test advances) stay well inside its margins; none of it is waited out.
    lease_s = 30
    engine = make_engine(nixl_extra_config=nixl_lease(monkeypatch, lease_s))
    prompt = token_ids(2 * BLOCK + 3)
    engine.scheduler.add_request(
        va.make_request("lease-0", prompt, max_tokens=1, kv_transfer_params=va.remote_decode_params())
    )
    engine.run(["lease-0"])
    clock = nixl_clock.install(monkeypatch)  # the lease's time passes on the release's clock, not waited out
    clock.advance(0.8 * lease_s)
    for _ in range(3):
        engine.step()
    assert "lease-0" in engine.scheduler.requests, (
        f"P freed the blocks {0.8 * lease_s:.1f}s into a {lease_s}s lease, before any decode side could read"
    )
    clock.advance(0.2 * lease_s + 1)
    assert step_until([engine], lambda: "lease-0" not in engine.scheduler.requests, max_steps=50), (
        f"P still holds the unread blocks {lease_s + 1}s into a {lease_s}s lease ({knob})"
    )
    assert_no_leak(engine)


def test_decode_heartbeats_keep_the_prefill_blocks_past_the_lease_while_its_read_is_in_flight(
    make_pd, nixl_agent, monkeypatch
):
    """A read that outlasts the lease (a slow link, a busy decode) does not lose the prefill's blocks:
    while D waits for it, D's Nixl child renews the lease with heartbeats, so P still holds the blocks
    well past the lease; once the read completes P frees them on D's notification, D stops
    heartbeating, and neither engine leaks."""
    if "HB:" not in _nixl_source():
        not_applicable("this release's Nixl code renews no lease with heartbeats")
    lease_s = 2  # the heartbeat interval is lease // 6 = 0: D heartbeats on every step
    p, d = make_pd(nixl_extra_config={"kv_lease_duration": lease_s})
    prompt = token_ids(3 * BLOCK + 5, start=360)
    _a_read_held_in_flight(p, d, nixl_agent, "hb-read", prompt)
    clock = nixl_clock.install(monkeypatch)  # 1.5 leases pass on the release's clock, a step at a time
    for _ in range(12):  # P's own lease ran out a third of the way into this window
        clock.advance(1.5 * lease_s / 12)
        d.step()
        p.step()
    assert "hb-read" in p.scheduler.requests, (
        f"P freed the blocks of a read still in flight {1.5 * lease_s:.0f}s into a {lease_s}s lease, "
        f"though D sent {_heartbeats(nixl_agent)} heartbeats"
    )
    nixl_agent.polls_until_done = 1
    assert step_until([d, p], lambda: "hb-read" not in p.scheduler.requests), "P never freed the blocks D read"
    assert step_until([d, p], lambda: "hb-read" not in d.scheduler.requests), "D never finished the request it read"
    sent = _heartbeats(nixl_agent)
    for _ in range(5):
        d.step()
        p.step()
    assert _heartbeats(nixl_agent) == sent, "D kept heartbeating for a read that is over"
    assert_no_leak(p, d)


@pytest.mark.parametrize("order", CHILD_ORDERS)
def test_a_decode_served_from_its_own_cpu_tier_still_releases_the_prefill_blocks(make_pd, nixl_agent, order):
    """D already keeps the prompt in its CPU tier (a repeated prompt, evicted from its device cache) when
    a P/D request for it arrives.  Whichever child MultiConnector lets load it (the first in config
    order that has the tokens), D loads the prompt once, over NIXL or from its CPU tier, finishes the
    request, and P's blocks are released by D's notification, not stranded until the lease ends;
    neither engine leaks."""
    p, d = make_pd(order=order)
    prompt = token_ids(3 * BLOCK + 5, start=600)
    stored_prefix(d, prompt, "own-tier-src")
    cpu_loads_before = len(d.transfers.loads())
    with setup_owned_by(PREFILLED):
        params = p.prefill("own-tier", prompt)
    req = va.make_request("own-tier", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: "own-tier" not in p.scheduler.requests), (
        "P still holds the blocks of a request D served: stranded until the lease ends"
    )
    assert step_until([d, p], lambda: req.is_finished()), f"D never finished the request ({req.status})"
    over_nixl, from_tier = _reads(nixl_agent) > 0, len(d.transfers.loads()) > cpu_loads_before
    assert over_nixl != from_tier, f"D loaded the prompt {'twice' if over_nixl else 'from nowhere'}"
    assert_no_leak(p, d)


def test_a_decode_read_over_nixl_waits_for_the_read_though_its_cpu_tier_holds_the_prompt(make_pd, nixl_agent):
    """With Nixl first in config order, a P/D request whose prompt D also keeps in its CPU tier is D's
    Nixl child's to load; the CPU-offload child, which found the prompt too, loads nothing.  So D runs
    the request only when the NIXL read is done: while the read is in flight the request waits for
    its remote KV, and no other child's (empty) completion may let it run on blocks nobody wrote."""
    from vllm.v1.request import RequestStatus

    p, d = make_pd(order="nixl-first")
    prompt = token_ids(3 * BLOCK + 5, start=820)
    stored_prefix(d, prompt, "tier-and-nixl-src")
    cpu_loads_before = len(d.transfers.loads())
    req = _a_read_held_in_flight(p, d, nixl_agent, "tier-and-nixl", prompt)
    for _ in range(5):
        d.step()
        p.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not req.output_token_ids, (
        f"D ran the request before its NIXL read completed ({req.status}, {len(req.output_token_ids)} tokens out)"
    )
    nixl_agent.polls_until_done = 1
    assert step_until([d, p], lambda: req.is_finished()), f"D never finished the request it read ({req.status})"
    assert len(d.transfers.loads()) == cpu_loads_before, "D's CPU tier loaded a prompt its Nixl child was reading"
    assert_no_leak(p, d)


def test_a_failed_nixl_read_is_not_used_and_releases_both_sides(make_pd, nixl_agent, monkeypatch):
    """A NIXL read that breaks (the transport reports an error state, no bytes moved) does not hang D:
    its request finishes (recomputed, or ended as the release's load-failure policy says), D leaks
    nothing, and P frees its blocks, on D's word or when its lease ends.  What D reports says so: the
    request's blocks among the step's invalid blocks (where the release reports any), one failed transfer
    in Nixl's stats (where they count them), no transfer handle left open; and P, which is healthy, stays
    connected: the next request reads from it without a second handshake."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    p, d, lease = leased_pd(make_pd, monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=700)
    with setup_owned_by(PREFILLED):
        params = p.prefill("failed-read", prompt)
    nixl_agent.failing_transfers = 1
    req = va.make_request("failed-read", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)

    def allocated() -> set[int]:
        return set(va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids("failed-read")))

    # The blocks D gives the read: taken when they are allocated, which a loaded machine may delay a step or two
    assert step_until([d, p], lambda: bool(allocated()) or nixl_agent.failed > 0), "D never allocated the request"
    d_blocks = allocated()
    assert step_until([d, p], lambda: nixl_agent.failed == 1), "the fake transport failed no read: no scenario"
    # on a loaded machine the read can fail, and the request end, in the step that allocated its blocks
    d_blocks |= read_destination(d, "failed-read")
    for _ in range(3):
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        d.step()
    assert req.num_computed_tokens <= BLOCK or req.status == RequestStatus.FINISHED_ERROR, (
        f"{req.num_computed_tokens} prompt tokens counted as computed from a read that failed"
    )
    assert step_until([d, p], lambda: req.is_finished()), f"D's request whose read failed never finished ({req.status})"
    assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR), req.status
    lease.run_out(p, d, "failed-read", holding="the blocks of a read that failed,")
    if "invalid_block_ids" in va.capabilities._field_names(KVConnectorOutput):
        invalid = set().union(*(o.invalid_block_ids or set() for o in d.kv_outputs if o))
        assert invalid and invalid <= d_blocks, (
            f"D reported {sorted(invalid)} as blocks whose load failed; want some of the request's {sorted(d_blocks)}"
        )
    if nixl_stats_count("num_failed_transfers"):
        counted = nixl_counted(d.kv_outputs, "num_failed_transfers")
        assert counted == 1, f"D's Nixl stats count {counted} failed transfers for the one read that failed"
    open_handles = sum(len(agent._xfers) for agent in nixl_agent.instances)
    assert open_handles == 0, f"{open_handles} NIXL transfer handles still open after the failed read was handled"
    handshakes = _handshakes(nixl_agent)
    with setup_owned_by(PREFILLED):
        params = p.prefill("after-failed-read", token_ids(2 * BLOCK + 3, start=760))
    d.scheduler.add_request(
        va.make_request(
            "after-failed-read", token_ids(2 * BLOCK + 3, start=760), max_tokens=2, kv_transfer_params=params
        )
    )
    reads = _reads(nixl_agent)
    d.run(["after-failed-read"])
    assert _reads(nixl_agent) > reads, "D did not read the next request over NIXL from the P whose read had failed"
    assert _handshakes(nixl_agent) == handshakes, (
        "D handshook again with a healthy P after one failed read (it dropped the connection)"
    )
    assert step_until([d, p], lambda: "after-failed-read" not in p.scheduler.requests), (
        "P kept the next request's blocks"
    )
    assert_no_leak(p, d)


def test_a_failed_handshake_does_not_hang_the_decode_and_the_next_request_reads(make_pd, nixl_agent, monkeypatch):
    """D is sent to P under an engine id P does not answer to (a proxy holding a stale id, a P restarted
    under another): D's handshake fails.  D's request does not wait for its KV forever: it finishes
    (recomputed, or ended as the release's load-failure policy says), Nixl's stats count a failed
    handshake and no failed transfer (where they count them), and P frees the blocks nobody read when its
    lease ends.  The next request, sent under P's right id, handshakes and is read; nothing leaks."""
    from vllm.v1.request import RequestStatus

    p, d, lease = leased_pd(make_pd, monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=1500)
    with setup_owned_by(PREFILLED):
        params = p.prefill("bad-handshake", prompt)
    stale = {**params, "remote_engine_id": params["remote_engine_id"] + "-restarted"}
    req = va.make_request("bad-handshake", prompt, max_tokens=2, kv_transfer_params=stale)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: req.is_finished()), f"D's request stayed {req.status} after its handshake failed"
    assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR), req.status
    if nixl_stats_count("num_failed_handshakes"):  # counted per handshake tried (0.34.0 tries twice here)
        counted = nixl_counted(d.kv_outputs, "num_failed_handshakes")
        assert counted >= 1, "D's Nixl stats count no failed handshake"
    if nixl_stats_count("num_failed_transfers"):
        counted = nixl_counted(d.kv_outputs, "num_failed_transfers")
        assert counted == 0, f"D's Nixl stats count {counted} failed transfers where no transfer was made"
    lease.run_out(p, d, "bad-handshake")
    prompt = token_ids(2 * BLOCK + 3, start=1600)
    with setup_owned_by(PREFILLED):
        params = p.prefill("after-bad-handshake", prompt)
    d.scheduler.add_request(va.make_request("after-bad-handshake", prompt, max_tokens=2, kv_transfer_params=params))
    reads = _reads(nixl_agent)
    d.run(["after-bad-handshake"])
    assert _reads(nixl_agent) > reads, "D did not read the next request from P over NIXL after one failed handshake"
    assert step_until([d, p], lambda: "after-bad-handshake" not in p.scheduler.requests), "P kept the next request"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 3. aborts on the decode side release both sides
# ---------------------------------------------------------------------------
def test_decode_abort_before_scheduling_releases_the_prefill_blocks(pd):
    """A request aborted on D before D ever scheduled it (a client gone, the serving layer rejecting
    it) still tells P, through D's Nixl child, that nobody will read its blocks: P frees them, D
    holds nothing, and neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d = pd
    prompt = token_ids(3 * BLOCK + 5, start=300)
    with setup_owned_by(PREFILLED):
        params = p.prefill("abort-early", prompt)
    d.scheduler.add_request(va.make_request("abort-early", prompt, max_tokens=2, kv_transfer_params=params))
    d.scheduler.finish_requests("abort-early", RequestStatus.FINISHED_ABORTED)
    assert step_until([d, p], lambda: "abort-early" not in p.scheduler.requests), (
        "P still holds the blocks of a request D aborted before scheduling it: stranded until the lease ends"
    )
    assert "abort-early" not in d.scheduler.requests, "D kept the aborted request"
    assert_no_leak(p, d)


def test_decode_abort_while_waiting_for_remote_kv_releases_both_sides(pd, nixl_agent):
    """A request aborted on D while its NIXL read is in flight (WAITING_FOR_REMOTE_KVS) finishes
    without a hang: once the read is over, D returns the request's blocks, P frees its own, and
    neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d = pd
    prompt = token_ids(3 * BLOCK + 5, start=340)
    req = _a_read_held_in_flight(p, d, nixl_agent, "abort-waiting", prompt)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req.status
    d.scheduler.finish_requests("abort-waiting", RequestStatus.FINISHED_ABORTED)
    nixl_agent.polls_until_done = 1
    assert step_until([d, p], lambda: "abort-waiting" not in p.scheduler.requests), (
        "P still holds the blocks of a request D aborted while reading them"
    )
    assert step_until([d, p], lambda: "abort-waiting" not in d.scheduler.requests), (
        "D never let go of the aborted request"
    )
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 4. no leak after a P/D round trip, in both child orders
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("order", CHILD_ORDERS)
def test_pd_round_trip_leaves_both_engines_at_their_idle_baseline(make_pd, order):
    """After a P/D round trip (P prefills and stores its blocks in its CPU tier, D reads them over
    NIXL and stores its own), both engines settle back to their idle baseline: every device block
    free and no CPU-tier block pinned, whichever child comes first."""
    p, d = make_pd(order=order)
    with setup_owned_by(PD_READ):  # the read is that contract's; this one is what is left after it
        print(pd_read_is_byte_exact(p, d, f"leak-{order}", token_ids(3 * BLOCK + 5, start=400)))
    assert_no_leak(p, d)


def test_no_leak_check_sees_a_pinned_cpu_block(engine):
    """The leak check itself: a CPU-tier block pinned behind the engine's back is reported."""
    pool = getattr(getattr(engine.offload, "scheduler_manager", None), "cpu_block_pool", None)
    if pool is None:
        not_applicable("the CPU-offload child of this release keeps no BlockPool of CPU blocks")
    (block,) = pool.get_new_blocks(1)
    try:
        leaks = engine.leaks()
        assert leaks and "CPU-tier" in leaks[0], f"a pinned CPU block went unnoticed: {leaks}"
    finally:
        pool.free_blocks([block])
    assert not engine.leaks()


def test_no_leak_check_sees_a_request_left_in_the_cpu_offload_childs_bookkeeping(engine):
    """The leak check itself: an entry the CPU-offload child's scheduler keeps per request, left behind
    once the engine is idle, is reported with the container's name."""
    manager = scheduler_object(engine.offload)
    empty = sorted(n for n, v in vars(manager or object()).items() if isinstance(v, dict) and not v)
    if not empty:
        not_applicable("the CPU-offload child of this release keeps no per-request dict on its scheduler")
    held = getattr(manager, empty[0])
    held["kvcompat-ghost"] = None
    try:
        leaks = engine.leaks()
        assert any(empty[0] in leak for leak in leaks), f"an entry left in {empty[0]} went unnoticed: {leaks}"
    finally:
        del held["kvcompat-ghost"]
    assert not engine.leaks()


def test_no_leak_check_sees_a_cpu_block_freed_twice(engine):
    """The leak check itself: a CPU-tier block freed once more than it was taken (its reference count
    below 0, which the block pool does not refuse) is reported."""
    pool = getattr(getattr(engine.offload, "scheduler_manager", None), "cpu_block_pool", None)
    if pool is None:
        not_applicable("the CPU-offload child of this release keeps no BlockPool of CPU blocks")
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    block.ref_cnt -= 1  # the second free, as a double-freeing release would do it
    try:
        leaks = engine.leaks()
        assert any("freed more often" in leak for leak in leaks), f"a CPU block freed twice went unnoticed: {leaks}"
    finally:
        block.ref_cnt += 1
    assert not engine.leaks()


def test_no_leak_check_sees_a_finished_request_still_named_by_a_nixl_worker(engine):
    """The leak check itself: a request the engine finished, still named in the Nixl child's worker half
    (a per-request dict no baseline sizes), is reported with the holder and the container."""
    worker = worker_object(engine.worker._connectors[engine.nixl_index])
    empty = sorted(n for n, v in vars(worker or object()).items() if isinstance(v, dict) and not v)
    if not empty:
        not_applicable("the Nixl child's worker of this release keeps no per-request dict")
    engine.scheduler.add_request(va.make_request("ghost", token_ids(BLOCK + 3), max_tokens=1))
    engine.run(["ghost"])
    held = getattr(worker, empty[0])
    held["ghost"] = None
    try:
        leaks = engine.leaks()
        assert any("'ghost'" in leak and empty[0] in leak for leak in leaks), (
            f"'ghost' in {empty[0]} unnoticed: {leaks}"
        )
    finally:
        del held["ghost"]
    assert not engine.leaks()


# ---------------------------------------------------------------------------
# 5. a decode request whose kv_transfer_params are incomplete
# ---------------------------------------------------------------------------
# What D needs to read a remote prefill (vLLM's proxy passes P's answer on): a request that names no peer to
# read from, or no blocks, cannot be read.
PEER_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
INCOMPLETE_STEPS = 60  # steps (and TRANSFER_WAIT_S) within which D must be done with such a request


def _serve_incomplete(p, d, lacking: tuple[str, ...], start: int) -> tuple[list[str], bool]:
    """For each field in ``lacking``: P prefills two prompts and D is sent both with P's kv_transfer_params less
    that field (do_remote_prefill still set); D steps once, the second is aborted, then D and P step until the
    first has ended and the aborted one is gone (a bounded number of steps).  What went wrong (fields that went
    wrong alike in one phrase), and whether a step of D raised (D's engine core dies with it: the scenario ends)."""
    from vllm.v1.request import RequestStatus

    left, aborted = {}, {}
    for n, field in enumerate(lacking):
        for m, (kind, into) in enumerate((("left", left), ("aborted", aborted))):
            rid, prompt = f"lacking-{field}-{kind}", token_ids(2 * BLOCK + 3, start=start + 80 * n + 40 * m)
            with setup_owned_by(PREFILLED):
                params = p.prefill(rid, prompt)
            req = va.make_request(
                rid, prompt, max_tokens=2, kv_transfer_params={k: v for k, v in params.items() if k != field}
            )
            d.scheduler.add_request(req)
            into[field] = req

    def over() -> bool:
        return all(r.is_finished() for r in left.values()) and not any(
            r.request_id in d.scheduler.requests for r in aborted.values()
        )

    try:
        d.step()
        d.scheduler.finish_requests([r.request_id for r in aborted.values()], RequestStatus.FINISHED_ABORTED)
        step_until([d, p], over, max_steps=INCOMPLETE_STEPS)
    except Exception as exc:  # a step that raises is the finding: D's engine core dies with it
        at = traceback.extract_tb(exc.__traceback__)[-1]
        message = str(exc).splitlines()[0] if str(exc) else ""
        raised = f"{type(exc).__name__}({message!r}) at {Path(at.filename).name}:{at.lineno}"
        return [f"lacking {', '.join(lacking)}: D's engine step raised {raised}"], True
    wrong: dict[str, list[str]] = {}  # what went wrong -> the fields it went wrong for
    for field in lacking:
        what = []
        if not left[field].is_finished():
            what.append(
                f"left alone, still {left[field].status.name} after {INCOMPLETE_STEPS} steps (it waits forever)"
            )
        rid = aborted[field].request_id
        if rid in d.scheduler.requests:
            held = len(va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid)))
            what.append(f"aborted, still held by D's scheduler with its {held} blocks")
        if what:
            wrong.setdefault("; ".join(what), []).append(field)
    return [f"lacking {', '.join(fields)}: {what}" for what, fields in wrong.items()], False


def test_a_remote_prefill_with_incomplete_kv_transfer_params_fails_and_its_abort_releases_everything(
    make_pd, nixl_agent, monkeypatch
):
    """D is sent a remote prefill (do_remote_prefill) whose kv_transfer_params lack a field D needs to read it
    (P's engine id, its request id, its host or port; or the blocks): a proxy that lost a field, a client that
    sent its own.  D cannot read such a request, so the user expects it refused, failed with a clear error or
    computed locally, never left waiting for KV that no read will bring: left alone, it ends within a bounded
    number of steps; aborted while D holds it, D lets go of it and of its blocks.  Nothing leaks on either
    engine once P's lease on the blocks nobody read has run out (on the release's clock)."""
    p, d, lease = leased_pd(make_pd, monkeypatch)
    found, crashed = _serve_incomplete(p, d, PEER_FIELDS, start=4000)
    if not crashed:
        found += _serve_incomplete(p, d, ("remote_block_ids",), start=4400)[0]
    assert not found, "D's remote prefills with incomplete kv_transfer_params: " + " | ".join(found)
    lease.run_out(p, d, *p.scheduler.requests, holding=f"{sorted(p.scheduler.requests)}")
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 6. a prefill engine whose NIXL side-channel port is taken
# ---------------------------------------------------------------------------
def test_an_engine_whose_nixl_side_channel_port_is_taken_fails_at_start_naming_the_port(make_engine, nixl_agent):
    """The port a prefill engine's Nixl child serves its handshake on (VLLM_NIXL_SIDE_CHANNEL_PORT) is already
    taken, by another engine or a process left over.  The user expects the engine's start (EngineCore handing the
    workers' handshake metadata to the scheduler's connector, which starts Nixl's listener there) to fail with an
    error that names the port, never to hang.  The start runs in a thread joined after TRANSFER_WAIT_S (a start
    that hangs stays blocked in that daemon thread).  No engine comes up, so there is no idle baseline to settle to."""
    p = make_engine(engine_id=P_ENGINE, side="prefill")
    if not any(hasattr(p.multi, m) for m in ("set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware")):
        not_applicable("in this release the Nixl worker serves the handshake itself, not the scheduler's connector")
    nixl = scheduler_object(p.nixl)
    host, port = nixl.side_channel_host, nixl.side_channel_port
    started: dict[str, BaseException | None] = {}

    def start() -> None:
        try:
            va.serve_nixl_handshake(p.multi, *(r.connector for r in p.ranks))
        except BaseException as exc:  # what the start raised is the verdict
            started["error"] = exc
        else:
            started["error"] = None

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((host, port))
        taken.listen()
        starting = threading.Thread(target=start, name="kvcompat-engine-start", daemon=True)
        starting.start()
        starting.join(TRANSFER_WAIT_S)
    assert not starting.is_alive(), (
        f"the engine's start hung on its taken NIXL side-channel port {port}: no error after {TRANSFER_WAIT_S:.0f}s"
    )
    error = started["error"]
    assert error is not None, f"the engine started though its NIXL side-channel port {port} was taken"
    told = []  # what the user reads: the error and the ones it was raised from
    while error is not None and len(told) < 5:
        told.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    assert any(str(port) in t for t in told), (
        f"the engine failed to start on its taken port {port} with no word of it: {' <- '.join(told)}"
    )
