"""Heterogeneous TP between P and D (the ``hetero-tp`` shapes): who reads what, and when P may free.

With P at TP p and D at TP d, each D rank holds its share of the KV heads (the release's rule: split
when the heads divide among the ranks, else one head each, replicated on consecutive ranks) and must read
it from the P rank or ranks that hold those heads; P may free a request's blocks only when every P rank
has been read by every D rank that reads it.  Users report the handshake refusing valid pairs (vllm#45330,
TP above the KV-head count, fixed by #45879), failing for pTP2 -> dTP4 (#50765) and with a hybrid model
(#42895).  The byte-for-byte read of every shape is ``test_shapes.py``'s contract; these are the TP
bookkeeping around it.  P and D are built by ``make_pd(shape=...)``: each rank its own TP rank, KV-cache
configs from the release's planner (kvcompat.testkit.deploy).
"""

from __future__ import annotations

import pytest

from kvcompat import shapes
from kvcompat.testkit import adapter as va
from kvcompat.testkit import setup_owned_by
from kvcompat.testkit.adapter.idle import worker_object

from conftest import (
    BLOCK,
    PREFILLED,
    SHAPE_PD_READ,
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    deployed,
    nixl_lease,
    patient_steps,
    read_failure,
    read_received,
    step_until,
    token_ids,
)

NEVER = 10**9  # polls before a held fake NIXL transfer completes


def _deploy(make_pd, shape):
    return deployed(make_pd, shape)


def _agent(engine, rank: int):
    """The NIXL agent of ``engine``'s TP rank ``rank`` (its Nixl worker's, the fake in this suite)."""
    return worker_object(engine.ranks[rank].connector._connectors[engine.nixl_index]).nixl_wrapper


def _heads(engine, rank: int) -> set[int]:
    """The model's global KV heads that ``engine``'s TP rank ``rank`` holds."""
    cfg = engine.vllm_config
    first, count = va.kv_heads_of_rank(
        cfg.model_config.get_total_num_kv_heads(), cfg.parallel_config.tensor_parallel_size, rank
    )
    return set(range(first, first + count))


def _read_from(d, p) -> dict[int, set[int]]:
    """For each D rank, the P ranks its reads went to (by the remote agent of each transfer it made)."""
    p_rank_of = {_agent(p, q).name: q for q in range(len(p.ranks))}
    out: dict[int, set[int]] = {}
    for r in range(len(d.ranks)):
        agent = _agent(d, r)
        targets = set()
        for call in agent.calls_named("make_prepped_xfer"):
            remote_dlist = call.args[3]
            targets.add(p_rank_of.get(agent._dlists[remote_dlist][0], -1))
        out[r] = targets
    return out


def _prefill_and_send(p, d, rid: str, prompt: list[int]):
    """P prefills ``rid`` and D is handed the request with P's params (vLLM's P/D proxy protocol); the request."""
    with setup_owned_by(PREFILLED):
        params = p.prefill(rid, prompt)
    req = va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    return req


def _prefill_and_read(p, d, rid: str, prompt: list[int]) -> None:
    """:func:`_prefill_and_send`, then D steps until its read is received (the P/D read contract)."""
    _prefill_and_send(p, d, rid, prompt)
    with setup_owned_by(SHAPE_PD_READ):
        assert step_until([d, p], lambda: read_received(d, rid)), "D's read of P's blocks never finished"


@pytest.mark.shapes("hetero-tp")
def test_each_decode_rank_reads_its_heads_from_the_prefill_ranks_that_hold_them(make_pd, shape):
    """Each D rank handshakes with and reads from exactly the P ranks that hold its KV heads: with D at a
    larger TP every D rank reads its slice of the one P rank holding its heads (a replicated head from the
    P rank holding it), with P at a larger TP the D rank reads every P rank's heads; no D rank reads a P
    rank holding none of its heads, and each P rank it reads was handshaken first."""
    p, d = _deploy(make_pd, shape)
    _prefill_and_read(p, d, "tp-who", token_ids(3 * BLOCK + 5, start=700))
    read = _read_from(d, p)
    for r in range(len(d.ranks)):
        want = {q for q in range(len(p.ranks)) if _heads(p, q) & _heads(d, r)}
        what = f"P ranks {sorted(read[r])}" if read[r] else "nothing (its handshake or read failed: see the log)"
        assert read[r] == want, (
            f"D rank {r} (KV heads {sorted(_heads(d, r))}) read {what}; the heads are on P ranks "
            f"{sorted(want)} (P at TP {len(p.ranks)}, D at TP {len(d.ranks)})"
        )
        added = {bytes(c.args[0]).split(b":", 1)[-1].decode() for c in _agent(d, r).calls_named("add_remote_agent")}
        wanted = {_agent(p, q).name for q in want}
        assert wanted <= added, f"D rank {r} read P ranks it never handshook: missing {sorted(wanted - added)}"
    d.run(["tp-who"])
    assert step_until([p], lambda: "tp-who" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


class HeldNotifications:
    """Holds back the notifications one P rank's NIXL agent receives from some D agents (a D rank whose
    "read done" is still on its way), handing them on when released; nothing dropped, nothing invented."""

    def __init__(self, monkeypatch, agent, senders: set[str] | None) -> None:
        self.real = agent.get_new_notifs
        self.senders = senders  # None: every sender
        self.held: dict[str, list[bytes]] = {}
        self.holding = True
        monkeypatch.setattr(agent, "get_new_notifs", self._answer)

    def _answer(self):
        got = self.real()
        if self.holding:
            for sender in [s for s in got if self.senders is None or s in self.senders]:
                self.held.setdefault(sender, []).extend(got.pop(sender))
            return got
        for sender, msgs in self.held.items():
            got.setdefault(sender, []).extend(msgs)
        self.held = {}
        return got


def _last_reader(p, d) -> tuple[int, set[str] | None]:
    """The P rank whose "read done" to hold, and from which D agents: with D at a larger TP, P rank 0's
    notification from the last D rank; otherwise every notification to the last P rank."""
    if len(d.ranks) > len(p.ranks):
        return 0, {_agent(d, len(d.ranks) - 1).name}
    return len(p.ranks) - 1, None


def _step_until_held(engines, held, polls: int, never: str, then) -> None:
    """Step ``engines`` (in that order) until ``held`` holds something back, which the scenario needs (else
    ``never``), then step ``then`` 8 times more: however long they go on, nothing held may get through."""
    for _ in patient_steps(polls):
        if held.held:
            break
        for e in engines:
            e.step()
    with setup_owned_by(SHAPE_PD_READ):
        assert held.held, never
    for _ in range(8):
        for e in then:
            e.step()


def _release_and_free(p, d, held, rid: str) -> None:
    """Let what ``held`` held through: D finishes ``rid``, P then frees its blocks, and neither engine leaks."""
    held.holding = False
    d.run([rid])
    assert step_until([p], lambda: rid not in p.scheduler.requests), "P kept the blocks after every read"
    assert_no_leak(p, d)


@pytest.mark.shapes("hetero-tp")
def test_the_prefill_frees_a_request_only_when_every_reading_rank_has_read(make_pd, shape, monkeypatch):
    """P keeps a request's blocks while any reading D rank's "read done" has not reached the P rank it read
    (held back in flight), however long P keeps stepping, and frees them once it has; neither engine
    leaks.  A P that counts one D rank's read as everyone's (a TP ratio of 1 where it is 2 or 4) frees
    blocks a slower D rank is still reading."""
    p, d = _deploy(make_pd, shape)
    q, senders = _last_reader(p, d)
    held = HeldNotifications(monkeypatch, _agent(p, q), senders)
    _prefill_and_read(p, d, "tp-free", token_ids(3 * BLOCK + 5, start=760))
    _step_until_held([p, d], held, 30, f"P rank {q} never received the last reader's notification", then=[p])
    assert "tp-free" in p.scheduler.requests, (
        f"P freed the request while P rank {q} had not yet heard that D rank(s) {sorted(held.held)} read it"
    )
    _release_and_free(p, d, held, "tp-free")


class HeldReads:
    """Holds in flight the READs one D agent posts towards one P agent (the transfer still on the wire), handing
    the real state on once released; records what that P agent receives from that D agent meanwhile."""

    def __init__(self, monkeypatch, reader, target) -> None:
        self.reader, self.target = reader, target
        self.holding = True
        self.held: set[int] = set()
        self.heard: list[bytes] = []  # what ``target`` received from ``reader`` while a READ was held
        real_check, real_inject = reader.check_xfer_state, target.inject_notif

        def check_xfer_state(handle):
            x = reader._xfers.get(handle)
            if self.holding and x is not None and x.state == "PROC" and reader._remote_name(x) == target.name:
                self.held.add(handle)
                return "PROC"
            return real_check(handle)

        def inject_notif(sender, msg):
            if self.holding and sender == reader.name and self.held:
                self.heard.append(bytes(msg))
            return real_inject(sender, msg)

        monkeypatch.setattr(reader, "check_xfer_state", check_xfer_state)
        monkeypatch.setattr(target, "inject_notif", inject_notif)


@pytest.mark.shapes("hetero-tp")
def test_a_prefill_rank_hears_of_a_read_only_once_the_read_from_it_has_completed(make_pd, shape, monkeypatch):
    """A P rank may reuse a request's blocks once it hears that D has read them, so it must hear so only when
    the READ from it has completed: while the last D rank's READ from the last P rank holding its heads is still
    in flight (the other READs done), that P rank receives no notification from that D rank and P still holds
    the request; once the READ completes, P frees it and neither engine leaks.  A decode that notifies a P rank
    as it posts the READ (not as the READ completes) lets P free blocks still being read."""
    p, d = _deploy(make_pd, shape)
    r = len(d.ranks) - 1
    q = max(q for q in range(len(p.ranks)) if _heads(p, q) & _heads(d, r))
    held = HeldReads(monkeypatch, _agent(d, r), _agent(p, q))
    _prefill_and_send(p, d, "tp-notify", token_ids(3 * BLOCK + 5, start=820))
    _step_until_held([d, p], held, 40, f"D rank {r} never posted a READ from P rank {q}", then=[d, p])
    assert not held.heard, (
        f"P rank {q} was notified by D rank {r} while D rank {r}'s READ from it was still in flight: {held.heard}"
    )
    assert "tp-notify" in p.scheduler.requests, (
        f"P freed the request while D rank {r}'s READ from P rank {q} was in flight"
    )
    _release_and_free(p, d, held, "tp-notify")


@pytest.mark.shapes("hetero-tp", "mla")
def test_a_read_that_fails_to_post_reads_and_announces_nothing_more_of_the_request(
    make_pd, shape, nixl_agent, monkeypatch
):
    """A D rank whose first READ of a request cannot be posted (the backend refuses it) gives the request up
    there: it posts no further READ of it (from another P rank, into blocks the Scheduler may already free and
    reuse) and tells no P rank that it read it (P would count the request as read), on every pair: a D rank
    reading several P ranks (P TP 2 -> D TP 1), MLA's D notifying the P ranks it does not read.  The request
    then ends as the load-failure policy says (recomputed or failed), P frees its blocks, no transfer handle
    is left open and nothing leaks (``nixl/pull_worker.py`` 0.34.0 L361-377)."""
    from test_nixl_peers import _ended_as_the_policy_says, _p_frees

    from kvcompat.testkit import nixl_clock

    lease_s = 2
    p, d = deployed(make_pd, shape, nixl_extra_config=nixl_lease(monkeypatch, lease_s))
    clock = nixl_clock.install(monkeypatch)
    failed: list[tuple[object, int]] = []  # (the D agent whose post failed, its call count then)
    real_transfer = nixl_agent.transfer

    def transfer(agent, handle, notif_msg=b""):
        if not failed:
            failed.append((agent, len(agent.calls)))
            raise RuntimeError("NIXL_ERR_BACKEND: the transfer could not be posted (injected)")
        return real_transfer(agent, handle, notif_msg)

    monkeypatch.setattr(nixl_agent, "transfer", transfer)
    req = _prefill_and_send(p, d, "tp-post-fails", token_ids(3 * BLOCK + 5, start=880))
    assert step_until([d, p], lambda: req.is_finished()), f"D's request never finished ({req.status})"
    with setup_owned_by(SHAPE_PD_READ):  # a pair whose handshake is refused posts no READ: the read contract's red
        assert failed, "no READ of the request was posted"
    agent, at = failed[0]
    after = [
        c.name if c.name != "send_notif" else f"send_notif({bytes(c.args[1])!r})"
        for c in agent.calls[at:]
        if c.name in ("make_prepped_xfer", "transfer")
        or (c.name == "send_notif" and not bytes(c.args[1]).startswith(b"HB:"))  # a heartbeat only renews a lease
    ]
    assert not after, f"after its READ failed to post, D's agent {agent.name} went on: {after}"
    assert _ended_as_the_policy_says(req), f"the request ended {req.status}"
    assert sum(len(_agent(d, r)._xfers) for r in range(len(d.ranks))) == 0, "transfer handles left open on D"
    assert _p_frees(p, d, "tp-post-fails", clock, lease_s), "P kept the blocks past its lease"
    assert_no_leak(p, d)


@pytest.mark.shapes("hetero-tp")
def test_a_decode_that_slept_and_woke_reads_its_next_request_into_every_rank(make_pd, shape):
    """D reads a request, then sleeps and wakes as EngineCore drives it (its prefix cache reset, every rank's
    connector unregistering its KV caches from NIXL and restoring them: the release's sleep mode frees and
    re-registers KV memory).  The user expects D's next read, from every P rank holding its heads, to land
    byte for byte in every D rank (not to go through the transfer handles D released when it slept, nor fail
    and be recomputed); P frees; nothing leaks."""
    from test_shape_restarted import _sleep_mode_reaches_the_connector
    from vllm.v1.request import RequestStatus

    _sleep_mode_reaches_the_connector()
    p, d = _deploy(make_pd, shape)
    _prefill_and_read(p, d, "tp-before-sleep", token_ids(3 * BLOCK + 5, start=940))
    d.run(["tp-before-sleep"])
    assert step_until([p], lambda: "tp-before-sleep" not in p.scheduler.requests), "P kept the first request's blocks"
    va.call_with_supported(d.scheduler.reset_prefix_cache, reset_connector=True)
    for rank in d.ranks:
        rank.connector.unregister_kv_caches()
    for rank in d.ranks:
        rank.connector.restore_kv_caches()
    prompt = token_ids(3 * BLOCK + 5, start=980)
    req = _prefill_and_send(p, d, "tp-after-wake", prompt)
    d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D did not wait for P's KV after waking: {req.status}"
    blocks = d.scheduler.kv_cache_manager.get_block_ids("tp-after-wake")
    assert step_until([d, p], lambda: read_received(d, "tp-after-wake")), "D's read after waking never finished"
    failure = read_failure(d, "tp-after-wake")
    assert failure is None, f"D's read after waking failed: {failure}"
    assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)
    d.run(["tp-after-wake"])
    assert step_until([p], lambda: "tp-after-wake" not in p.scheduler.requests), "P kept the blocks after D read"
    assert_no_leak(p, d)


# P at TP 4 with 2 KV heads replicates them (two P ranks per head); D at TP 1 would read one copy of each.
# vLLM refuses P-side replication with P TP > D TP in the handshake (nixl/base_worker.py 0.34.0:
# _validate_remote_agent_handshake's "not supported" guard); the pair is a user's to ask for all the same.
REPLICATED_P = shapes.Shape(
    "hetero-tp-p4d1",
    "hetero-tp",
    "prefill TP 4 with 2 KV heads (replicated), decode TP 1",
    prefill_tp=4,
)


def test_a_tp_pair_the_release_cannot_serve_fails_the_request_instead_of_hanging_or_reading_wrong_kv(make_pd, request):
    """A pair the release cannot serve (P at TP 4 replicating 2 KV heads, D at TP 1) is refused cleanly: the
    decode request finishes (failed, or recomputed locally under the release's load-failure policy) within
    the release's timeouts, never waits forever for a read that will not come, and never decodes over
    blocks the read did not fill; D is back at its baseline afterwards."""
    from vllm.v1.request import RequestStatus

    request.node.user_properties.append(("shape", REPLICATED_P.id))
    p, d = _deploy(make_pd, REPLICATED_P)
    req = _prefill_and_send(p, d, "tp-refused", token_ids(3 * BLOCK + 5, start=820))
    done = step_until([d, p], lambda: req.is_finished() or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert done, "D still waits for the KV of a P it cannot pair with: the request hangs"
    if read_received(d, "tp-refused"):
        blocks = d.scheduler.kv_cache_manager.get_block_ids("tp-refused") if not req.is_finished() else None
        computed = req.num_computed_tokens
        assert blocks is None or computed <= 1, (
            f"D counted {computed} prompt tokens as loaded from a P the handshake refused: it decodes over "
            "blocks no read filled"
        )
    d.run(["tp-refused"], max_steps=120)
    assert_no_leak(d)
