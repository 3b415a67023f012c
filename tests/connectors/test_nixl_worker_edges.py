"""NixlConnector at the edges of an engine's life and of a request: sleep mode (allowed, and sleeping and
waking in steps), shutdown (once by the engine, once more when the worker is collected), the transfer
stats on their way to the frontend, a prompt with a single token left to read, and a proxy that sends
incomplete remote-prefill params.

Engines are the release's Scheduler with MultiConnector(Nixl + CPU offload) and its worker half, moving real
bytes over the fake NIXL transport (kvcompat.testkit.fake_nixl).  Sleep and wake are driven as the release's
GPU worker drives them (v1/worker/gpu_worker.py sleep / wake_up / discard call the connector's
unregister_kv_caches / restore_kv_caches), since CpuPlatform has no sleep mode of its own.
"""

from __future__ import annotations

import copy
import importlib
import inspect

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by

from conftest import (
    BLOCK,
    NUM_GPU_BLOCKS,
    PREFILLED,
    assert_no_leak,
    leased_pd,
    nixl_counted,
    nixl_stats_count,
    read_received,
    step_until,
    stored_prefix,
    token_ids,
)

MARK = -7.0  # what a D block is filled with before a read that must overwrite it


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _worker(engine):
    """Rank 0's worker-role Nixl child's worker."""
    return engine.worker._connectors[engine.nixl_index].connector_worker


def _agent(engine):
    return _worker(engine).nixl_wrapper


def _count(engine, call: str) -> int:
    return len(_agent(engine).calls_named(call))


def _waiting(req) -> bool:
    from vllm.v1.request import RequestStatus

    return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def _read_token_for_token(p, d, rid: str, prompt: list[int]) -> None:
    """D reads ``rid`` from P over NIXL (P prefills it first), P and D of any block sizes: D waits for the
    remote KV and, in the step its workers report it received, every prompt token's K and V in D's blocks
    is exactly P's; the request then finishes and P frees its blocks."""
    with setup_owned_by(PREFILLED):
        params = p.prefill(rid, prompt)
    p_size, d_size = _block_size(p), _block_size(d)
    p_blocks = va.group_block_ids(params["remote_block_ids"])
    want = {
        layer: [row.clone() for b in p_blocks for row in va.token_rows(cache, b, p_size)][: len(prompt)]
        for layer, cache in p.ranks[0].kv_caches.items()
    }
    reads = _count(d, "make_prepped_xfer")
    req = va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    assert _waiting(req), f"D did not wait for {rid}'s KV from P: {req.status}"
    d_blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid))
    assert step_until([d, p], lambda: read_received(d, rid) or req.is_finished()), f"D's read of {rid} never finished"
    assert _count(d, "make_prepped_xfer") > reads, f"D did not read {rid} over NIXL"
    assert not req.is_finished() and req.num_computed_tokens >= len(prompt) - 1, (
        f"D's read of {rid} failed: {req.status}, {req.num_computed_tokens} of {len(prompt)} tokens loaded"
    )
    for layer, cache in d.ranks[0].kv_caches.items():
        got = [row for b in d_blocks for row in va.token_rows(cache, b, d_size)]
        for t in range(len(prompt)):
            assert va.same_bytes(got[t], want[layer][t]), (
                f"{layer}: token {t} of {rid} in D's block {d_blocks[t // d_size]} is not P's"
            )
    d.run([rid])
    assert step_until([d, p], lambda: rid not in p.scheduler.requests), f"P kept {rid}'s blocks after D's read"


def _block_size(engine) -> int:
    return engine.vllm_config.cache_config.block_size


def _nixl_source() -> str:
    """The source of the release's Nixl connector (its module, or every module of its package)."""
    import pkgutil

    package = importlib.import_module(va.nixl_module())
    names = [package.__name__] + [
        f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(getattr(package, "__path__", []))
    ]
    return "".join(inspect.getsource(importlib.import_module(n)) for n in names)


def _has_sleep_mode_remap() -> None:
    base = importlib.import_module(va.KV_BASE + ".v1.base").KVConnectorBase_V1
    if not hasattr(base, "unregister_kv_caches"):
        not_applicable("the release's connector API has no unregister_kv_caches (no sleep-mode remap)")


# ---------------------------------------------------------------------------
# 1. sleep mode
# ---------------------------------------------------------------------------
def test_sleep_mode_is_allowed_with_nixl_on_ucx_and_refused_on_other_backends():
    """vLLM refuses enable_sleep_mode when the connector says it does not support it (config/vllm.py asks
    the connector class).  For the deployed pair a user expects: Nixl on its default UCX backend (or UCX
    named explicitly) next to the CPU-offload child: sleep mode allowed; Nixl on UCX and GDS (a backend
    sleep mode is not validated with): refused."""
    MultiConnector, _ = va.multi_classes()
    base = importlib.import_module(va.KV_BASE + ".v1.base").KVConnectorBase_V1
    if not hasattr(base, "supports_sleep_mode"):
        not_applicable("the release's connector API has no supports_sleep_mode")
    cases = [(None, True), (["UCX"], True), (["UCX", "GDS"], False)]
    for backends, allowed in cases:
        extra = None if backends is None else {"backends": backends}
        ktc = va.multi_kv_transfer_config(BLOCK, NUM_GPU_BLOCKS, "kvcompat-sleepy", nixl_extra_config=extra)
        got = MultiConnector.supports_sleep_mode(ktc)
        assert got is allowed, (
            f"Nixl on {backends or 'its default backend'} with the CPU tier: sleep mode "
            f"{'refused' if allowed else 'allowed'}; want {'allowed' if allowed else 'refused'}"
        )


def test_sleeping_and_waking_in_steps_registers_each_kv_cache_once_and_reads_go_on(make_pd, nixl_agent):
    """An engine may fall asleep in two steps (executor.discard(("kv_cache",)), then sleep(): the worker
    unregisters its KV caches twice) and wake in two (wake_up(["kv_cache"]), then wake_up(): restores
    twice); the connector API says both are idempotent.  D (64-token blocks) has read from P (32-token
    blocks).  The user expects D's NIXL agent to deregister each registered region exactly once while
    asleep and register it exactly once on waking (no region pinned twice, none left out), and D to read
    from P afterwards token for token, twice, across a second sleep; nothing leaks."""
    _has_sleep_mode_remap()
    p, d = make_pd(decode={"block_size": 2 * BLOCK})
    _read_token_for_token(p, d, "before-sleep", token_ids(4 * BLOCK + BLOCK // 2, start=4000))
    agent = _agent(d)
    regions = len(agent.registered)
    assert regions, "D's Nixl worker registered no KV memory with NIXL"
    deregistered, registered = _count(d, "deregister_memory"), _count(d, "register_memory")
    d.worker.unregister_kv_caches()  # executor.discard(("kv_cache",)) -> gpu_worker.discard
    d.worker.unregister_kv_caches()  # executor.sleep() -> gpu_worker.sleep
    assert _count(d, "deregister_memory") - deregistered == regions, (
        f"D deregistered {_count(d, 'deregister_memory') - deregistered} regions for its {regions} "
        "over a discard and a sleep; want each once"
    )
    assert not agent.registered, "D still has KV memory registered with NIXL while asleep"
    d.worker.restore_kv_caches()  # executor.wake_up(["kv_cache"])
    d.worker.restore_kv_caches()  # executor.wake_up() (the weights, still asleep)
    assert _count(d, "register_memory") - registered == regions, (
        f"D registered {_count(d, 'register_memory') - registered} regions for its {regions} over two "
        "wake-ups; want each once"
    )
    assert len(agent.registered) == regions, f"D has {len(agent.registered)} regions registered for {regions}"
    _read_token_for_token(p, d, "after-sleep", token_ids(4 * BLOCK + BLOCK // 2, start=4100))
    d.worker.unregister_kv_caches()
    d.worker.restore_kv_caches()
    _read_token_for_token(p, d, "after-second-sleep", token_ids(3 * BLOCK + 5, start=4200))
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 2. shutdown
# ---------------------------------------------------------------------------
def test_shutting_a_worker_down_and_collecting_it_releases_its_nixl_resources_exactly_once(make_pd, nixl_agent):
    """EngineCore shuts the workers' connectors down, and the Nixl worker shuts itself down again when
    it is garbage-collected (its __del__).  D has read from P; P is asleep (its KV memory already
    deregistered), D awake.  The user expects, over both shutdowns, each engine's KV memory to be
    deregistered from NIXL exactly once in its life (D's at shutdown, P's at its sleep only), no NIXL
    descriptor-list handle released twice and none left open, and D to drop P's agent once."""
    _has_sleep_mode_remap()
    p, d = make_pd()
    regions = {"P": len(_agent(p).registered), "D": len(_agent(d).registered)}
    assert all(regions.values()), f"an engine registered no KV memory with NIXL: {regions}"
    _read_token_for_token(p, d, "before-shutdown", token_ids(3 * BLOCK + 5, start=4300))
    assert_no_leak(p, d)
    p.worker.unregister_kv_caches()  # P goes to sleep
    engines = {"P": p, "D": d}
    for e in engines.values():
        worker = _worker(e)
        e.shutdown_workers()  # EngineCore's shutdown
        worker.__del__()  # the garbage collector's
    for name, e in engines.items():
        agent = _agent(e)
        assert _count(e, "deregister_memory") == regions[name], (
            f"{name} deregistered {_count(e, 'deregister_memory')} regions of KV memory for its "
            f"{regions[name]} over a {'sleep and ' if name == 'P' else ''}shutdown and its collection; want each once"
        )
        released = [c.args[0] for c in agent.calls_named("release_dlist_handle")]
        twice = sorted({h for h in released if released.count(h) > 1})
        assert not twice, f"{name} released NIXL descriptor-list handles {twice} more than once"
        assert not agent._dlists, f"{name} left NIXL descriptor-list handles {sorted(agent._dlists)} open"
    p_name = _agent(p).name
    dropped = [c for c in _agent(d).calls_named("remove_remote_agent") if p_name in str(c.args[0])]
    assert len(dropped) == 1, f"D dropped P's NIXL agent {len(dropped)} times over its shutdowns; want once"


# ---------------------------------------------------------------------------
# 3. stats
# ---------------------------------------------------------------------------
def test_nixl_transfer_stats_reach_the_frontend_logger_as_the_workers_measured_them(make_pd, nixl_agent):
    """The Nixl transfer stats a user sees in the frontend's log come from the engine core as the
    serialised payload (Scheduler.make_stats sends kv_connector_stats.to_dict()), which the frontend's
    KVConnectorLogging rebuilds through the connector class (MultiConnector.build_kv_connector_stats,
    then each child's).  After D reads from P, the user expects the frontend's accumulated stats to
    report the same as D's workers measured (one transfer and its figures), not empty stats."""
    p, d = make_pd()
    metrics = importlib.import_module(va.KV_BASE + ".v1.metrics")
    if not hasattr(metrics, "KVConnectorLogging"):
        not_applicable("the release's frontend has no KVConnectorLogging")
    steps = len(d.kv_outputs)
    _read_token_for_token(p, d, "measured", token_ids(3 * BLOCK + 5, start=4400))
    per_step = [o.kv_connector_stats for o in d.kv_outputs[steps:] if o is not None and o.kv_connector_stats]
    assert per_step, "D's workers reported no connector stats for the read"
    measured = None
    for s in copy.deepcopy(per_step):
        measured = s if measured is None else measured.aggregate(s)
    nixl_name = type(d.nixl).__name__
    assert nixl_name in measured.data, f"D's stats have no {nixl_name} entry: {sorted(measured.data)}"
    want = measured.data[nixl_name].reduce()
    assert want.get("Num successful transfers", 1) >= 1, f"D's workers measured no transfer: {want}"
    logging = metrics.KVConnectorLogging(d.vllm_config.kv_transfer_config)
    for s in per_step:
        payload = s.to_dict() if hasattr(s, "to_dict") else s.data
        logging.observe(copy.deepcopy(payload))
    got = logging.transfer_stats_accumulator
    assert got is not None and nixl_name in got.data, f"the frontend rebuilt no {nixl_name} stats"
    assert got.data[nixl_name].reduce() == want, (
        f"the frontend's {nixl_name} stats {got.data[nixl_name].reduce()} are not what D measured: {want}"
    )
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 4. a single prompt token left to read
# ---------------------------------------------------------------------------
def test_a_decode_holding_all_but_the_last_prompt_token_reads_that_token_from_the_prefill(make_pd, nixl_agent):
    """D holds the first two blocks of a prompt of two blocks and one token in its own prefix cache, so
    one prompt token is left that P computed.  The user expects D to wait for it and read it over NIXL:
    in the step the read completes, D's block for that token holds exactly P's K and V for it (D counts
    the token as loaded, so a block the read skipped would be decoded from whatever it held); the request
    finishes, P frees its blocks and nothing leaks."""
    p, d = make_pd()
    prompt = token_ids(2 * BLOCK + 1, start=4500)
    d.scheduler.add_request(va.make_request("d-holds-the-head", prompt[: 2 * BLOCK], max_tokens=1))
    (new,) = d.step().scheduled_new_reqs
    head = va.group_block_ids(new.block_ids)[:2]
    d.run(["d-holds-the-head"])
    d.settle()
    # Every block D may allocate for the last token holds MARK before the read can start (it may start, and
    # complete, within the step that allocates the block).
    for cache in d.ranks[0].kv_caches.values():
        for b in range(1, NUM_GPU_BLOCKS):
            if b not in head:
                va.kv_cache_block(cache, b).fill_(MARK)
    with setup_owned_by(PREFILLED):
        params = p.prefill("last-token", prompt)
    p_last = va.group_block_ids(params["remote_block_ids"])[-1]
    want = {layer: va.token_rows(cache, p_last, BLOCK)[0].clone() for layer, cache in p.ranks[0].kv_caches.items()}
    reads = _count(d, "make_prepped_xfer")
    req = va.make_request("last-token", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    assert _waiting(req), (
        f"D did not wait for the one prompt token P computed ({req.status}, {req.num_computed_tokens} computed)"
    )
    d_blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids("last-token"))
    assert len(d_blocks) == 3 and d_blocks[:2] == head, (
        f"D holds blocks {d_blocks} for a prompt of two blocks and one token whose first two it cached in {head}"
    )
    assert step_until([d, p], lambda: read_received(d, "last-token") or req.is_finished()), "D's read never finished"
    assert _count(d, "make_prepped_xfer") > reads, "D did not read the last prompt token over NIXL"
    for layer, cache in d.ranks[0].kv_caches.items():
        got = va.token_rows(cache, d_blocks[2], BLOCK)[0]
        assert va.same_bytes(got, want[layer]), (
            f"{layer}: D's block {d_blocks[2]} does not hold P's K and V of the last prompt token after the read"
        )
    d.run(["last-token"])
    assert step_until([d, p], lambda: "last-token" not in p.scheduler.requests), "P kept its blocks after the read"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 5. a remote prefill whose params name no request
# ---------------------------------------------------------------------------
def test_a_remote_prefill_without_a_remote_request_id_neither_breaks_the_decode_nor_holds_the_prefill(
    make_pd, nixl_agent, monkeypatch
):
    """A proxy written for an older vLLM forwards P's kv_transfer_params without ``remote_request_id``:
    D cannot name the request to P, so it reads nothing for it (the release logs "will not utilize
    KVTransfer" and leaves it waiting until the client gives up on it).  The user expects D to go on
    serving meanwhile: its steps do not fail and a complete request sent after it is read over NIXL token
    for token; D's heartbeats to P name no request but the complete one, so P frees the incomplete
    request's blocks when their lease runs out and P leaks nothing.  (What D does with the incomplete
    request itself is not held here: in 0.34.0 it stays waiting for remote KV, and an abort of it leaves
    its blocks held on D, as no load was ever started that could report them free.)"""
    p, d, lease = leased_pd(make_pd, monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=4600)
    with setup_owned_by(PREFILLED):
        params = p.prefill("no-remote-id", prompt)
    del params["remote_request_id"]
    d.scheduler.add_request(va.make_request("no-remote-id", prompt, max_tokens=2, kv_transfer_params=params))
    for _ in range(5):
        d.step()
        p.step()
    _read_token_for_token(p, d, "complete-after", token_ids(2 * BLOCK + 3, start=4700))
    heartbeats = [bytes(c.args[1]) for c in _agent(d).calls_named("send_notif") if bytes(c.args[1]).startswith(b"HB:")]
    named = {rid for hb in heartbeats for rid in hb[3:].split(b",") if rid}
    assert named <= {b"complete-after"}, f"D's heartbeats to P named {sorted(named)}"
    lease.run_out(p, d, "no-remote-id", holding="the blocks of the request D could not name")
    assert_no_leak(p)


# ---------------------------------------------------------------------------
# 6. a read after the prefill's lease ran out
# ---------------------------------------------------------------------------
def test_a_decode_that_reads_after_the_prefills_lease_ran_out_does_not_break_the_prefill(
    make_pd, nixl_agent, monkeypatch
):
    """P holds a prefilled request's blocks for kv_lease_duration (2 s here) and frees them when no decode
    has read them by then.  A decode that reads them later anyway (a slow router, a long queue on D) sends
    P a notification for a request P no longer knows.  The user expects P to go on serving: its steps do
    not fail, its Nixl stats count one notification after expiry (where the release has that count), and
    its next request is read by D token for token; D's late request finishes, and nothing leaks."""
    p, d, lease = leased_pd(make_pd, monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=4800)
    with setup_owned_by(PREFILLED):
        params = p.prefill("late", prompt)
    lease.run_out(p, None, "late", holding="the blocks")
    reads = _count(d, "make_prepped_xfer")
    req = va.make_request("late", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: req.is_finished()), f"D's late request never finished ({req.status})"
    assert _count(d, "make_prepped_xfer") > reads, "D did not read the late request over NIXL: no scenario"
    for _ in range(3):
        p.step()
    if nixl_stats_count("num_notifications_after_expiry"):
        counted = nixl_counted(p.kv_outputs, "num_notifications_after_expiry")
        assert counted == 1, f"P's Nixl stats count {counted} notifications after expiry for one late read"
    _read_token_for_token(p, d, "after-late", token_ids(2 * BLOCK + 3, start=4900))
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 7. a decode served from its CPU tier whose prefill cannot be reached
# ---------------------------------------------------------------------------
def test_a_decode_served_from_its_cpu_tier_keeps_no_trace_of_a_prefill_it_cannot_reach(
    make_pd, nixl_agent, monkeypatch
):
    """D keeps the prompt in its CPU tier and MultiConnector lets the CPU-offload child load it (it comes
    first), so Nixl has only to tell P to free its blocks; but D is sent to P under an engine id P does
    not answer to (a proxy holding a stale id), so that handshake fails.  The user expects D to serve the
    request from its CPU tier all the same, P to free the blocks nobody read when their lease ends, and
    neither engine to keep any trace of the request (its Nixl worker included)."""
    p, d, lease = leased_pd(make_pd, monkeypatch, order="offload-first")
    prompt = token_ids(3 * BLOCK + 5, start=5000)
    stored_prefix(d, prompt, "tier-src")
    loads = len(d.transfers.loads())
    with setup_owned_by(PREFILLED):
        params = p.prefill("tier-stale-p", prompt)
    stale = {**params, "remote_engine_id": params["remote_engine_id"] + "-restarted"}
    req = va.make_request("tier-stale-p", prompt, max_tokens=2, kv_transfer_params=stale)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: req.is_finished()), f"D never finished the request ({req.status})"
    assert len(d.transfers.loads()) > loads, "D did not load the prompt from its CPU tier: no scenario"
    assert req.num_output_tokens == 2, f"D's request served from its CPU tier ended {req.status}"
    lease.run_out(p, d, "tier-stale-p")
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 8. CPU core reserved for KV transfer
# ---------------------------------------------------------------------------
def test_a_cpu_nixl_worker_reserves_the_last_core_of_each_numa_node_for_kv_transfer(make_engine, monkeypatch):
    """On CPU, the Nixl worker reserves cores for KV transfer apart from the model's forward pass: it pins
    the thread that builds it (the one that then drives start_load_kv) to the last core of each NUMA node
    the platform reports.  A CPU deployment expects that placement.  (The harness gives the test process
    its cores back right after building a worker, kvcompat.testkit.adapter.worker._affinity_kept, so the
    pinning is seen as the worker's request to the OS, passed through unchanged.)"""
    import os

    from vllm.platforms import current_platform

    if not hasattr(os, "sched_setaffinity") or current_platform.device_type != "cpu":
        not_applicable("no CPU platform with thread affinity here")
    if "sched_setaffinity" not in inspect.getsource(importlib.import_module(va.nixl_wrapper_target()[0])):
        not_applicable("this release's Nixl worker reserves no CPU core")
    want = {max(node) for node in current_platform.discover_numa_topology() if node}
    if not want:
        not_applicable("the platform reports no NUMA node")
    real, asked = os.sched_setaffinity, []

    def sched_setaffinity(pid, cores):
        asked.append((pid, set(cores)))
        return real(pid, cores)

    monkeypatch.setattr(os, "sched_setaffinity", sched_setaffinity)
    make_engine(engine_id="kvcompat-cpu-cores")
    assert asked and asked[0] == (0, want), (
        f"building the Nixl worker asked the OS for {asked[:1] or 'no pinning'}; want the calling thread (0) "
        f"on cores {sorted(want)}"
    )


# ---------------------------------------------------------------------------
# 9. a decode with bigger blocks, and params without remote_num_tokens
# ---------------------------------------------------------------------------
def test_a_decode_with_bigger_blocks_declines_a_read_without_remote_num_tokens(make_pd, nixl_agent, monkeypatch):
    """D's blocks are twice P's, and the proxy does not forward ``remote_num_tokens`` (which D needs to pair
    P's blocks with its own from the last token).  The user expects D to decline that read rather than
    guess: no NIXL read, the request finishes (recomputed, or ended as the release's load-failure policy
    says) and D keeps serving: a complete request sent next is read token for token; P frees the unread
    blocks when their lease ends, and nothing leaks."""
    from vllm.v1.request import RequestStatus

    if "Declining remote reads" not in _nixl_source():
        not_applicable("this release's Nixl worker does not decline reads it cannot pair without remote_num_tokens")
    p, d, lease = leased_pd(make_pd, monkeypatch, decode={"block_size": 2 * BLOCK})
    prompt = token_ids(4 * BLOCK + BLOCK // 2, start=5200)
    with setup_owned_by(PREFILLED):
        params = p.prefill("no-num-tokens", prompt)
    if "remote_num_tokens" not in params:
        not_applicable("this release's prefill sends no remote_num_tokens")
    del params["remote_num_tokens"]
    reads = _count(d, "make_prepped_xfer")
    req = va.make_request("no-num-tokens", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: req.is_finished()), f"D's request stayed {req.status}"
    assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR), req.status
    assert _count(d, "make_prepped_xfer") == reads, "D read P's blocks without remote_num_tokens to pair them"
    lease.run_out(p, d, "no-num-tokens", holding="the unread blocks")
    _read_token_for_token(p, d, "with-num-tokens", token_ids(4 * BLOCK + BLOCK // 2, start=5300))
    assert_no_leak(p, d)
