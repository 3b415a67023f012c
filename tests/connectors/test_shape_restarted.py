"""The restarted-prefill shape's own contracts: D's prefill peer is replaced at the same address.

A fleet replaces prefill pods all the time (a crash, a rollout, an autoscaler).  D has read from P1 and
holds P1's NIXL agent, its KV base addresses and the descriptor lists prepared for it; P1 shuts down
and P2 comes up at P1's address (kvcompat.testkit.deploy.restarted_prefill builds that history through
``make_pd``).  The user expects D to handshake with P2 before reading from it and to let go of P1
(vllm#58063: a replaced prefill that D still maps cannot start), reads left in flight from P1 to end
cleanly, never as tokens decoded over blocks nobody wrote (vllm#49238, #55471, #41863), a prefill that
came back with the same engine id never to be read with the old one's addresses, and a prefill that
slept and woke (its KV memory registered again) to be read with its new registration.

Engines are the release's Scheduler with MultiConnector(Nixl + CPU offload) and its worker half, moving
real bytes over the fake NIXL transport (kvcompat.testkit.fake_nixl).  What the fake leaves out is
modelled on the fake's own state (:class:`kvcompat.testkit.fake_nixl.Peers`), as NIXL behaves: a peer whose process is gone fails
the transfers towards it as a remote disconnect (and NIXL drops its metadata), and a read made with a
peer's memory registration from before that peer registered its memory again fails (its remote keys are
stale).  The release's timers run on kvcompat.testkit.nixl_clock, not waited out.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import nixl_clock, not_applicable, setup_owned_by
from kvcompat.testkit.deploy.restarted_prefill import NEW_ENGINE, Restart
from kvcompat.testkit.fake_nixl import Peers, _agent_key

from conftest import (
    BLOCK,
    PREFILLED,
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    nixl_lease,
    patient_steps,
    read_received,
    step_until,
    token_ids,
)

NEVER = 10**9  # polls before a fake NIXL read completes: it stays in flight until the test lowers it
# Steps a request whose read broke may take to end (the release notices a failed read in the step that
# polls it, a failed handshake within a few steps); patient_steps adds wall time for the handshake thread.
ENDS_WITHIN = 20


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _nixl_worker(engine, rank: int = 0):
    """A rank's worker-role Nixl child's worker (what reads over NIXL on D)."""
    return engine.ranks[rank].connector._connectors[engine.nixl_index].connector_worker


def _agent_names(engine) -> set[str]:
    return {_nixl_worker(engine, r).nixl_wrapper.name for r in range(len(engine.ranks))}


def _agent(engine):
    return _nixl_worker(engine).nixl_wrapper


def _handshakes_with(d, p) -> int:
    """Times D's NIXL agent loaded one of P's agents (one per handshake)."""
    names = {n.encode() for n in _agent_names(p)}
    return sum(1 for c in _agent(d).calls_named("add_remote_agent") if bytes(c.args[0]).rpartition(b":")[2] in names)


def _removed(d, p) -> int:
    """Times D's NIXL agent was asked to drop one of P's agents."""
    names = _agent_names(p)
    return sum(1 for c in _agent(d).calls_named("remove_remote_agent") if _agent_key(c.args[0]) in names)


def _nixl_source() -> str:
    """The source of the release's Nixl connector (its module, or every module of its package)."""
    package = importlib.import_module(va.nixl_module())
    names = [package.__name__] + [
        f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(getattr(package, "__path__", []))
    ]
    return "".join(inspect.getsource(importlib.import_module(n)) for n in names)


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


# What the release keeps about a peer on purpose after releasing it (test_nixl_peers.py): the backoff history of
# peers whose metadata broke and the registration generation last seen, an entry per engine id.
_KEPT_ON_PURPOSE = {"_invalid_engine_backoff", "_remote_registration_generations"}


def _holds(d, p) -> list[str]:
    """What D still holds of prefill engine ``p``: containers of D's Nixl workers (and their transfer
    topology) that mention its engine id, P's agents still loaded in D's NIXL agents, and descriptor lists
    D's agents prepared towards P's agents and never released."""
    engine_id, names = p.kv_transfer_name(), _agent_names(p)
    found = []
    for r in range(len(d.ranks)):
        w = _nixl_worker(d, r)
        for n, v in vars(w).items():
            if n not in _KEPT_ON_PURPOSE and isinstance(v, (dict, set, list, tuple)) and _mentions(v, engine_id):
                found.append(f"rank {r}'s {n}")
        for n, v in getattr(getattr(w, "transfer_topo", None), "__dict__", {}).items():
            if isinstance(v, dict) and _mentions(v, engine_id):
                found.append(f"rank {r}'s transfer_topo.{n}")
        found += _agent_holds(w.nixl_wrapper, names)
    return found


def _agent_holds(agent, names: set[str]) -> list[str]:
    """What NIXL agent ``agent`` still holds of the agents ``names``: their metadata, lists prepared for them."""
    found = [f"{agent.name}'s NIXL agent has {n}'s metadata loaded" for n in sorted(names & set(agent.remote_agents))]
    lists = sorted(h for h, (name, _) in agent._dlists.items() if name in names)
    if lists:
        found.append(f"{agent.name}'s NIXL agent holds descriptor-list handles {lists} for them")
    return found


def _registrations(agent) -> int:
    return len(agent.calls_named("register_memory"))


def _add(d, rid: str, prompt: list[int], params: dict):
    req = va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    return req


def _waiting(req) -> bool:
    from vllm.v1.request import RequestStatus

    return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def _ended_as_the_policy_says(req) -> bool:
    """A request whose load failed ends recomputed to its length, or as FINISHED_ERROR where the release's
    kv_load_failure_policy is "fail" (its default)."""
    from vllm.v1.request import RequestStatus

    return req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR)


def _ends_cleanly(engines, d, req, prompt: list[int], what: str) -> None:
    """Step ``engines`` (D first) until D's ``req`` has finished, within ENDS_WITHIN steps (and the wall time
    the handshake thread may need): it ends as the release's load-failure policy says, and in the step D
    samples its first token D's blocks hold the prompt's KV (read, or recomputed): never a token decoded
    over blocks nobody wrote."""
    checked = False
    for _ in patient_steps(ENDS_WITHIN):
        if req.is_finished():
            break
        for e in engines:
            e.step()
        if not checked and req.num_output_tokens > 0 and not req.is_finished():
            checked = True
            blocks = d.scheduler.kv_cache_manager.get_block_ids(req.request_id)
            try:
                assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)
            except AssertionError as e:
                first = str(e).splitlines()[0]
                raise AssertionError(
                    f"{what}: D sampled a token over blocks that do not hold its prompt's KV: {first}"
                ) from None
    assert req.is_finished(), f"{what}: D's request never ended ({req.status} after {ENDS_WITHIN} steps): it hangs"
    assert _ended_as_the_policy_says(req), f"{what}: the request ended {req.status}"
    assert checked or req.num_output_tokens == 0, f"{what}: the request finished with tokens before it could be checked"


def _read_from(p, d, rid: str, prompt: list[int], peers: Peers, params: dict | None = None, others=()) -> None:
    """D reads ``rid`` from P over NIXL (P prefills it first unless ``params`` are given): P's kv_transfer_params
    name P's engine; D waits for the remote KV and reads it from P's agents only, with P's current memory
    registration, and only after it loaded P's agent; its blocks then hold exactly P's KV; the request
    finishes and P frees its blocks."""
    if params is None:
        with setup_owned_by(PREFILLED):
            params = p.prefill(rid, prompt)
    assert params.get("remote_engine_id") == p.kv_transfer_name(), (
        f"P's kv_transfer_params for {rid} name engine {params.get('remote_engine_id')!r}, not {p.kv_transfer_name()!r}"
    )
    reads, ends, stale = len(peers.reads), len(peers.ends), peers.stale_reads
    req = _add(d, rid, prompt, params)
    d.step()
    stale_read = (
        f"D read {rid} with {p.kv_transfer_name()}'s memory registration from before it registered its memory "
        "again (stale remote keys): the read failed"
    )
    assert peers.stale_reads == stale, stale_read
    assert _waiting(req), f"D did not wait for {rid}'s KV from {p.kv_transfer_name()}: {req.status}"
    d_blocks = d.scheduler.kv_cache_manager.get_block_ids(rid)
    assert step_until([d, p, *others], lambda: not _waiting(req)), f"D's read of {rid} never finished"
    assert peers.stale_reads == stale, stale_read
    mine = [r for r in peers.reads[reads:] if r[0] in _agent_names(d)]
    assert mine, f"D did not read {rid} over NIXL"
    strangers = sorted({remote for _, remote, _ in mine} - _agent_names(p))
    assert not strangers, f"D read {rid} (sent by {p.kv_transfer_name()}) from other NIXL agents {strangers}"
    loaded = [i for i, c in enumerate(_agent(d).calls) if c.name == "add_remote_agent" and _is_of(c, p)]
    assert loaded and loaded[0] < mine[0][2], f"D read {rid} from {p.kv_transfer_name()} before loading its agent"
    assert peers.done_towards(_agent_names(p), ends), f"D's read of {rid} from {p.kv_transfer_name()} failed"
    assert read_received(d, rid) and req.num_computed_tokens >= len(prompt) - 1, (
        f"D counts {req.num_computed_tokens} of {len(prompt)} prompt tokens of {rid} as loaded: the read failed"
    )
    assert_blocks_hold_the_prompt(d, d_blocks, prompt, len(prompt) // BLOCK)
    d.run([rid])
    assert step_until([d, p, *others], lambda: rid not in p.scheduler.requests), f"P kept {rid}'s blocks after D's read"


def _is_of(call, p) -> bool:
    return bytes(call.args[0]).rpartition(b":")[2].decode() in _agent_names(p)


# ---------------------------------------------------------------------------
# 1. D moves to the new engine and lets go of the old one
# ---------------------------------------------------------------------------
@pytest.mark.shapes("restarted-prefill")
def test_decode_handshakes_the_new_prefill_before_reading_and_lets_go_of_the_old_one(
    make_pd, nixl_agent, shape, monkeypatch
):
    """D has read from P1; P1 shut down and P2, a new engine, serves at P1's address.  P2's kv_transfer_params
    name P2's engine at that address; the user expects D to handshake with P2 (load its NIXL agent) before
    reading from it, the read to be byte-exact from P2's agent, and D to let go of P1 when the release says
    it should (on P2's handshake where the release tracks which engine serves an address, vllm#58063; at
    its engine_ttl where it only evicts idle engines): no Nixl worker state mentions P1's engine, P1's agent
    is dropped from D's NIXL agent once, and no descriptor list prepared for it is left open.  Nothing
    leaks."""
    peers = Peers(monkeypatch, nixl_agent)
    restart = Restart()
    p2, d = make_pd(shape=shape, restart=restart)
    p1 = restart.old
    assert _holds(d, p1), "scenario not built: D holds nothing of P1 after reading from it"
    source = _nixl_source()
    when = "on P2's handshake"
    if "_track_remote_engine_replacement" not in source and "engine_ttl" in source:
        clock = nixl_clock.install(monkeypatch)
        clock.advance(getattr(_nixl_worker(d), "_engine_ttl", 3600.0) + 1)  # P1 idle past D's engine_ttl
        when = "at its engine_ttl"
    prompt = token_ids(3 * BLOCK + 5, start=5200)
    with setup_owned_by(PREFILLED):
        params = p2.prefill("after-restart", prompt)
    assert (params.get("remote_engine_id"), params.get("remote_port")) == (NEW_ENGINE, restart.port), (
        f"P2's kv_transfer_params name engine {params.get('remote_engine_id')!r} at port "
        f"{params.get('remote_port')}; want {NEW_ENGINE!r} at P1's port {restart.port}"
    )
    since = len(peers.reads)
    _read_from(p2, d, "after-restart", prompt, peers, params)
    assert _handshakes_with(d, p2) == 1, f"D handshook P2 {_handshakes_with(d, p2)} times for one read; want 1"
    assert not peers.reads_towards(_agent_names(p1), since), "D read from P1's agent after P1 went away"
    left = _holds(d, p1)
    assert not left, f"D still holds P1's state after P2 replaced it ({when}): {left}"
    assert _removed(d, p1) == 1, f"D dropped P1's NIXL agent {_removed(d, p1)} times; want once"
    assert_no_leak(p2, d)


# ---------------------------------------------------------------------------
# 2. reads from the old engine when it goes away
# ---------------------------------------------------------------------------
@pytest.mark.shapes("restarted-prefill")
def test_reads_from_the_old_prefill_when_it_goes_away_end_cleanly_and_the_new_one_is_read(
    make_pd, nixl_agent, shape, monkeypatch
):
    """D is reading a request from P1 when P1 goes away (its process gone: NIXL fails the read as a remote
    disconnect), and a proxy still hands D a request P1 had prefilled.  The user expects both to end as the
    release's kv_load_failure_policy says (recomputed, or FINISHED_ERROR), within a few steps, never hanging
    and never decoding a token over blocks nobody wrote (vllm#49238, #55471, #41863); the late request for P1
    is never read from P2, which now answers at P1's address (it holds other KV under other block ids).  D
    then handshakes with P2 and reads its next request byte-exact; no transfer handle is left open and
    nothing leaks."""
    peers = Peers(monkeypatch, nixl_agent)
    held: dict = {}

    def in_flight(p1, d):
        """P1 prefilled two requests; D's read of the first is in flight, the second's params are not sent yet."""
        prompts = {"in-flight": token_ids(3 * BLOCK + 5, start=5300), "late": token_ids(2 * BLOCK + 7, start=5400)}
        with setup_owned_by(PREFILLED):
            params = {rid: p1.prefill(rid, prompt) for rid, prompt in prompts.items()}
        nixl_agent.polls_until_done = NEVER
        reads = len(peers.reads_towards(_agent_names(p1)))
        held["req"] = _add(d, "in-flight", prompts["in-flight"], params["in-flight"])
        assert step_until([d], lambda: len(peers.reads_towards(_agent_names(p1))) > reads, max_steps=20), (
            "scenario not built: D never started reading the in-flight request from P1"
        )
        held["prompts"], held["params"] = prompts, params

    restart = Restart(before_shutdown=in_flight)
    p2, d = make_pd(shape=shape, restart=restart)
    p1 = restart.old
    req = held["req"]
    assert _waiting(req), f"scenario not built: the in-flight read ended ({req.status}) before P1 went away"
    peers.gone |= _agent_names(p1)
    nixl_agent.polls_until_done = 1
    _ends_cleanly([d, p2], d, req, held["prompts"]["in-flight"], "the read in flight when P1 went away")
    since = len(peers.reads)
    late = _add(d, "late", held["prompts"]["late"], held["params"]["late"])
    _ends_cleanly([d, p2], d, late, held["prompts"]["late"], "a request for P1 sent after P1 went away")
    assert not peers.reads_towards(_agent_names(p2), since), (
        "D read a request P1 had prefilled from P2 (a different engine now at P1's address)"
    )
    _read_from(p2, d, "after-p1-went-away", token_ids(2 * BLOCK + 3, start=5500), peers)
    assert not _agent(d)._xfers, f"{len(_agent(d)._xfers)} NIXL transfer handles left open on D"
    assert_no_leak(p2, d)


# ---------------------------------------------------------------------------
# 3. a prefill restarted with the same engine id
# ---------------------------------------------------------------------------
RESTARTED_READS = 3  # requests D may refuse before it must read from the restarted engine
LEASE_S = 2  # P's lease on blocks D never read (kv_lease_duration), run out on the release's clock


def _p_frees(p, d, rid: str, clock) -> bool:
    """Whether P frees ``rid``'s blocks, on D's word within a few steps or once its lease has run out (the
    lease's time passed on the release's clock, kvcompat.testkit.nixl_clock, not waited out)."""
    for _ in range(5):
        if rid not in p.scheduler.requests:
            return True
        d.step()
        p.step()
    clock.advance(LEASE_S + 0.5)
    return step_until([d, p], lambda: rid not in p.scheduler.requests)


@pytest.mark.shapes("restarted-prefill")
def test_a_prefill_restarted_with_its_engine_id_is_never_read_with_the_old_engines_addresses(
    make_pd, nixl_agent, shape, monkeypatch
):
    """P1's pod restarts and keeps its engine id: P2 serves at P1's address under P1's id, with new NIXL
    agents and new KV memory, and D cannot tell from the engine id.  The user expects D never to read P2's
    blocks with what it learnt from P1 (P1's agent or its base addresses): each request P2 sends is either
    read from P2's agent byte-exact after D handshook P2, or refused (ended as the release's
    kv_load_failure_policy says, never decoded over blocks nobody wrote); within 3 requests D
    handshakes P2 and reads from it, and keeps nothing of P1's agent.  Nothing leaks."""
    peers = Peers(monkeypatch, nixl_agent)
    restart = Restart(same_engine_id=True)
    p2, d = make_pd(shape=shape, restart=restart, nixl_extra_config=nixl_lease(monkeypatch, LEASE_S))
    clock = nixl_clock.install(monkeypatch)
    p1 = restart.old
    assert p2.kv_transfer_name() == p1.kv_transfer_name(), "scenario not built: P2 has an engine id of its own"
    peers.gone |= _agent_names(p1)
    outcomes = []
    for n in range(RESTARTED_READS):
        rid, prompt = f"same-id-{n}", token_ids(3 * BLOCK + 5, start=5600 + 50 * n)
        with setup_owned_by(PREFILLED):
            params = p2.prefill(rid, prompt)
        ends = len(peers.ends)
        req = _add(d, rid, prompt, params)
        _ends_cleanly([d, p2], d, req, prompt, f"request {n + 1} after the restart")
        read = peers.done_towards(_agent_names(p2), ends) > 0
        assert _p_frees(p2, d, rid, clock), f"P2 kept {rid}'s blocks past its lease"
        outcomes.append(f"{rid}: {'read from P2' if read else req.status.name}")
        if read:
            break
    assert peers.done_towards(_agent_names(p2)), (
        f"D never read from the restarted prefill (same engine id) in {RESTARTED_READS} requests: {outcomes}"
    )
    assert _handshakes_with(d, p2) == 1, f"D handshook the restarted prefill {_handshakes_with(d, p2)} times; want 1"
    left = [h for r in range(len(d.ranks)) for h in _agent_holds(_nixl_worker(d, r).nixl_wrapper, _agent_names(p1))]
    assert not left, f"D still holds the old engine's NIXL agent after reading from the restarted one: {left}"
    _read_from(p2, d, "same-id-after", token_ids(2 * BLOCK + 3, start=5800), peers)
    assert_no_leak(p2, d)


# ---------------------------------------------------------------------------
# 4. a prefill that slept and woke
# ---------------------------------------------------------------------------
def _sleep_mode_reaches_the_connector() -> None:
    """Explicit probe: the worker's sleep and wake-up reach the connector (KVConnectorBase_V1's
    unregister_kv_caches / restore_kv_caches, v1/worker/gpu_worker.py sleep / wake_up)."""
    base = importlib.import_module(va.KV_BASE + ".v1.base").KVConnectorBase_V1
    if not hasattr(base, "unregister_kv_caches"):
        not_applicable("the release's connector API has no unregister_kv_caches: sleep never reaches the Nixl child")


def _wake_up_republishes_handshake_metadata() -> bool:
    """Whether the release's EngineCore.wake_up hands the workers' handshake metadata to the scheduler's
    connector again after the KV cache woke (v1/engine/core.py 0.34.0 L1162-1165)."""
    source = inspect.getsource(importlib.import_module("vllm.v1.engine.core").EngineCore.wake_up)
    return "_set_kv_connector_handshake_metadata" in source


def _sleep_and_wake(p) -> None:
    """P sleeps (level 1) and wakes as EngineCore drives it: the scheduler paused with its caches cleared
    (pause_scheduler), each worker's connector unregisters its KV caches (gpu_worker.sleep), then restores
    them (gpu_worker.wake_up), and EngineCore hands the workers' new handshake metadata to the scheduler's
    connector where the release does."""
    va.call_with_supported(p.scheduler.reset_prefix_cache, reset_connector=True)
    for rank in p.ranks:
        rank.connector.unregister_kv_caches()
    for rank in p.ranks:
        rank.connector.restore_kv_caches()
    if _wake_up_republishes_handshake_metadata():
        va.serve_nixl_handshake(p.multi, *(r.connector for r in p.ranks))


@pytest.mark.shapes("restarted-prefill")
def test_a_prefill_that_slept_and_woke_is_read_with_its_new_registration(make_pd, nixl_agent, shape, monkeypatch):
    """P2 (the replacement) has served D a read, then sleeps and wakes: its workers deregister their KV
    memory from NIXL and register it again, so the remote keys D loaded are stale.  The user expects D to
    load P2's new registration (handshake again) before its next read from P2, and that read to succeed
    byte-exact (not fail and be recomputed or errored for every request after a wake-up); nothing leaks."""
    _sleep_mode_reaches_the_connector()
    peers = Peers(monkeypatch, nixl_agent, registrations=True)
    p2, d = make_pd(shape=shape)
    _read_from(p2, d, "before-sleep", token_ids(3 * BLOCK + 5, start=5900), peers)
    assert _handshakes_with(d, p2) == 1, f"D handshook P2 {_handshakes_with(d, p2)} times for one read; want 1"
    registered = _registrations(_agent(p2))
    _sleep_and_wake(p2)
    assert _registrations(_agent(p2)) > registered, "scenario not built: P2 registered no KV memory on waking"
    _read_from(p2, d, "after-wake", token_ids(3 * BLOCK + 5, start=6000), peers)
    assert _handshakes_with(d, p2) == 2, (
        f"D handshook P2 {_handshakes_with(d, p2)} times over a read before and after P2's sleep; want 2"
    )
    assert_no_leak(p2, d)
