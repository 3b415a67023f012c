"""A request's whole life through MultiConnector([NixlConnector, CPU offload]): its lifecycle contracts.

Each test names one contract a P/D deployment relies on.  The scheduler side is the release's
real Scheduler and the MultiConnector it built; the worker side is the engine's worker-role
MultiConnector from the release's factory, run every step (see conftest).  Where a test needs a
child to give an answer its real run would not give here (a load error, a failed receive, a second
async saver), that one answer is scripted in the release's own protocol
(kvcompat.testkit.adapter.children): the contract under test is how MultiConnector forwards to and
combines its children, never the child itself.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable
from kvcompat.testkit.adapter import children as ch

from conftest import BLOCK, fail_a_loaded_block, patient_steps, stored_prefix, token_ids, wait_until


def _finish_hooks(child) -> list[str]:
    return [n for n in ("request_finished", "request_finished_all_groups") if hasattr(child, n)]


def _also_saves_async(monkeypatch, child) -> None:
    """The child answers its finish as an async saver (it keeps the blocks until its
    store is done), as OffloadingConnector does for a request with stores in flight."""
    for name in _finish_hooks(child):
        real = getattr(child, name)
        ch.spy(monkeypatch, child, name, lambda *a, _real=real: (True, _real(*a)[1]))


def _held(engine, req_id: str) -> bool:
    return req_id in engine.scheduler.requests


def _free_blocks(engine) -> int:
    return engine.free_blocks()


# ---------------------------------------------------------------------------
# 1. two async savers
# ---------------------------------------------------------------------------
def test_two_async_savers_are_counted_and_sent_to_the_worker(engine, monkeypatch):
    """A prefill-side request that both children save asynchronously (Nixl holds the
    blocks for the remote read, the CPU-offload child stores them): MultiConnector
    reports one async save to the scheduler, counts the one extra saver, and sends
    that count to the worker side in the next step's metadata; the blocks stay held."""
    _also_saves_async(monkeypatch, engine.offload)
    req = va.make_request(
        "two-savers", token_ids(3 * BLOCK + 5), max_tokens=1, kv_transfer_params=va.remote_decode_params()
    )
    engine.scheduler.add_request(req)
    engine.step()
    assert engine.finished_output("two-savers") is not None, "request did not finish"
    assert _held(engine, "two-savers"), "blocks freed although two children save asynchronously"
    engine.step()  # when the worker reports the sends done is the next test's
    extra = [m.extra_async_saves for m in engine.metas if getattr(m, "extra_async_saves", None)]
    assert extra == [{"two-savers": 1}], f"extra async saves sent to the worker: {extra}"
    assert "two-savers" not in engine.multi._extra_async_saves, "the count stayed on the scheduler side"
    assert _held(engine, "two-savers")


@pytest.mark.parametrize("first", ["nixl", "offload"])
def test_finished_sending_once_after_both_savers_then_blocks_freed_once(engine, monkeypatch, first):
    """The worker reports a request with two async savers in finished_sending exactly once, only after
    both children finished sending (in either order); fed that report, the scheduler frees the
    request's blocks exactly once, and not before."""
    _also_saves_async(monkeypatch, engine.offload)
    free_before = _free_blocks(engine)
    req_id = f"savers-{first}"
    req = va.make_request(req_id, token_ids(3 * BLOCK + 5), max_tokens=1, kv_transfer_params=va.remote_decode_params())
    engine.scheduler.add_request(req)
    engine.step()
    assert engine.finished_output(req_id) is not None, "request did not finish"
    # From the next step on, the worker's children report the request's send done, one per round.
    index = {"nixl": engine.nixl_index, "offload": engine.offload_index}
    order = [index[first], 1 - index[first]]
    for i, child in enumerate(engine.worker._connectors):
        done_at = order.index(i)
        rounds = [({req_id} if r == done_at else set(), set()) for r in range(3)]
        # A child whose worker reports this send itself (OffloadingConnector's, whose stores of the request
        # are real saves) answers only as scripted; the others go on reporting their own transfers too.
        own_send = i == engine.offload_index and va.offload_worker_kind() == va.SCRIPTED
        ch.script_completions(monkeypatch, child, rounds, add_to_real=not own_send)
    reported = []
    for _ in range(3):
        engine.step()
        sending = set(getattr(engine.kv_outputs[-1], "finished_sending", None) or ())
        reported.append(sending & {req_id})
        if not any(reported):
            assert _held(engine, req_id), "blocks freed before every saver finished"
    assert getattr(engine.metas[1], "extra_async_saves", None) == {req_id: 1}, (
        "the worker never learnt of the second saver"
    )
    assert reported == [set(), {req_id}, set()], f"finished_sending per round: {reported}"
    engine.settle()
    assert not _held(engine, req_id), "blocks never freed"
    assert _free_blocks(engine) == free_before, "blocks leaked or freed twice"


# ---------------------------------------------------------------------------
# 2. load failure recovery
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("failing", [0, 1])
def test_load_errors_of_either_child_reach_the_scheduler(engine, monkeypatch, failing):
    """Block ids a child failed to load (get_block_ids_with_load_errors) reach the
    scheduler through MultiConnector, whichever child failed, together with the other's."""
    multi = engine.worker
    if not ch.multi_overrides("get_block_ids_with_load_errors") and not hasattr(
        ch.base_class(), "get_block_ids_with_load_errors"
    ):
        not_applicable("the release's connectors have no load-error reporting")
    errors = {0: {3, 4}, 1: {9}}
    for i, child in enumerate(multi._connectors):
        bad = errors[i] if i == failing else set()
        ch.spy(monkeypatch, child, "get_block_ids_with_load_errors", lambda _bad=bad: set(_bad))
    assert multi.get_block_ids_with_load_errors() == errors[failing]


def test_failed_receives_of_either_child_come_out_of_the_worker(engine, monkeypatch):
    """A child's failed receive (failed_recving: a load that will never complete) comes out
    of the worker-side MultiConnector's transfer results, so the scheduler can recompute the
    request instead of waiting on it forever."""
    multi = engine.worker
    if ch.completion_hook() != "get_transfer_results":
        not_applicable("this release's connectors report no failed receives (get_finished only)")
    import importlib

    Results = importlib.import_module(va.V1 + ".base").KVConnectorTransferResults
    for i, child in enumerate(multi._connectors):
        failed = {f"lost-{i}"}
        answer = lambda *_, _f=failed: Results(finished_recving=set(_f), failed_recving=set(_f))  # noqa: E731
        ch.spy(monkeypatch, child, "get_transfer_results", answer)
    results = multi.get_transfer_results(set())
    assert results.failed_recving == {"lost-0", "lost-1"}, f"failed_recving: {results.failed_recving}"
    assert {"lost-0", "lost-1"} <= results.finished_recving


def test_failed_load_tokens_are_recomputed_not_counted(engine, monkeypatch):
    """A load from the CPU-offload child whose block failed (the child's worker names it in
    get_block_ids_with_load_errors when the load completes) does not count that block's tokens as
    computed: the request is recomputed from the failed block on, or ends in error, as the release's
    load-failure policy says, and its blocks are returned."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    if "invalid_block_ids" not in va.capabilities._field_names(KVConnectorOutput):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    prompt = token_ids(3 * BLOCK + 5)
    stored_prefix(engine, prompt, "fail-src")
    # The offload child's worker: its load of fail-dst completes, and block 1 of it failed.
    failed = fail_a_loaded_block(monkeypatch, engine, engine.worker._connectors[engine.offload_index], "fail-dst")
    req = va.make_request("fail-dst", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    engine.step()
    # The worker hands its copies to its copy thread: the load is submitted when that thread runs.
    assert wait_until(engine.transfers.loads), "the CPU-offload child did not take the load"
    for _ in patient_steps(20):  # the copy thread completes the load
        if failed:
            break
        engine.step()
    assert failed, "the CPU-offload child's load never completed"
    policy = getattr(engine.vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    assert req.num_computed_tokens <= BLOCK or req.is_finished(), (
        f"{req.num_computed_tokens} tokens counted as computed although block 1 ({failed}) failed to load"
    )
    for _ in range(6):
        if req.is_finished():
            break
        engine.step()
    if policy == "fail":  # the release's default: the request ends in error, its blocks returned
        assert req.status == RequestStatus.FINISHED_ERROR, f"policy 'fail', request ended {req.status}"
    else:
        assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED), req.status
        assert req.num_computed_tokens >= len(prompt), "failed tokens never recomputed"
    assert "fail-dst" not in engine.scheduler.requests, "blocks of the failed request still held"


# ---------------------------------------------------------------------------
# 3. preemption
# ---------------------------------------------------------------------------
def test_handle_preemptions_reaches_every_child(engine, monkeypatch):
    """handle_preemptions (the worker telling connectors which requests were preempted)
    reaches every child: each with its own entry of the MultiKVConnectorMetadata where
    the hook takes metadata (0.19+), the same preempted request ids where it takes ids
    (0.16-0.18).  A MultiConnector that does not forward it leaves the children holding
    transfers for requests that are gone."""
    import inspect

    multi = engine.worker
    base = ch.base_class()
    if not hasattr(base, "handle_preemptions"):
        not_applicable("the release's connector API has no handle_preemptions")
    _, MultiMeta = va.multi_classes()
    calls = [ch.spy(monkeypatch, c, "handle_preemptions", lambda *a: None) for c in multi._connectors]
    takes_ids = "preempted_req_ids" in inspect.signature(base.handle_preemptions).parameters
    if takes_ids:
        given, expected = {"preempted-1"}, [[{"preempted-1"}], [{"preempted-1"}]]
    else:
        entries = (object(), object())
        given, expected = MultiMeta(metadata=entries), [[entries[0]], [entries[1]]]
    multi.handle_preemptions(given)
    got = [[a[0] for a in c.args] for c in calls]
    assert got == expected, f"children's handle_preemptions calls: {got}"


def test_preempted_request_with_a_store_in_flight_is_freed_exactly_once(make_engine, transport):
    """A request preempted while the CPU-offload child's stores of it are still in flight
    keeps its blocks pinned until the stores complete, and is freed exactly once: when it
    has been resumed, finished, and its stores reported done, every block is back."""
    from vllm.v1.request import RequestStatus

    engine = make_engine(num_blocks=8)
    free_before = _free_blocks(engine)
    transport.hold()  # stores stay in flight until a request is preempted
    a = va.make_request("pre-a", token_ids(2 * BLOCK + 5), max_tokens=30)
    engine.scheduler.add_request(a)
    engine.step()
    b = va.make_request("pre-b", token_ids(2 * BLOCK + 8, start=300), max_tokens=30)
    engine.scheduler.add_request(b)
    preempted = False
    for _ in range(80):
        engine.step()
        preempted |= a.status == RequestStatus.PREEMPTED or a.num_preemptions > 0 or b.num_preemptions > 0
        if preempted:
            transport.release()  # the stores in flight complete after the preemption
        if engine.finished_output("pre-a") and engine.finished_output("pre-b"):
            break
    if not preempted:
        pytest.fail("the scheduler never preempted a request: the scenario was not built")
    assert engine.finished_output("pre-a") and engine.finished_output("pre-b"), "requests did not finish"
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(), "blocks still held after every store completed"
    assert _free_blocks(engine) == free_before, "blocks leaked or freed twice around the preemption"


# ---------------------------------------------------------------------------
# 4. receive completions from every child
# ---------------------------------------------------------------------------
def test_finished_recving_of_every_child_reaches_the_scheduler(engine, monkeypatch):
    """A finished load (finished_recving) of either child comes out of the worker-side
    MultiConnector: Nixl's remote read and the CPU-offload child's load alike."""
    multi = engine.worker
    ch.script_completions(monkeypatch, multi._connectors[engine.nixl_index], [(set(), {"from-nixl"})])
    ch.script_completions(monkeypatch, multi._connectors[engine.offload_index], [(set(), {"from-offload"})])
    _, recving = ch.finished_of(multi, set())
    assert recving == {"from-nixl", "from-offload"}, f"finished_recving: {recving}"


@pytest.mark.parametrize("child", ["nixl", "offload"])
def test_finished_recving_unblocks_the_waiting_request(request, transport, nixl_agent, child):
    """A request waiting for an async load (Nixl's read from the prefill side, or the CPU-offload
    child's load of its stored prefix) waits while the load is in flight and runs again, to its end,
    once the load is reported finished."""
    from vllm.v1.request import RequestStatus

    # Nixl's read needs a prefill side; the CPU tier needs none (and no handshake).
    p, engine = request.getfixturevalue("pd") if child == "nixl" else (None, request.getfixturevalue("engine"))
    n = 3 * BLOCK + 5
    prompt = token_ids(n, start=50 if child == "nixl" else 10)
    if child == "offload":
        stored_prefix(engine, prompt, "recv-src")
        req = va.make_request("recv-dst", prompt, max_tokens=2)
        transport.hold()  # the load stays in flight
    else:
        req = va.make_request("recv-dst", prompt, max_tokens=2, kv_transfer_params=p.prefill("recv-dst", prompt))
        nixl_agent.polls_until_done = 10**9  # the read stays in flight
    engine.scheduler.add_request(req)
    engine.step()
    assert engine.multi._requests_to_connector.get("recv-dst") == {"nixl": engine.nixl_index}.get(
        child, engine.offload_index
    )
    for _ in range(3):
        engine.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"ran before its load finished ({req.status})"
    transport.release()
    nixl_agent.polls_until_done = 1
    for _ in patient_steps(20):  # Nixl's and the copy thread's completions come from other threads
        engine.step()
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert req.status != RequestStatus.WAITING_FOR_REMOTE_KVS, "the finished load never unblocked the request"
    assert req.num_computed_tokens >= 3 * BLOCK
    engine.run(["recv-dst"])
    assert "recv-dst" not in engine.multi._requests_to_connector, "the finished request's load choice was kept"


# ---------------------------------------------------------------------------
# 5. NIXL handshake
# ---------------------------------------------------------------------------
def test_nixl_handshake_metadata_comes_out_and_goes_to_every_child(engine, monkeypatch):
    """The worker-side MultiConnector returns the Nixl child's handshake metadata, and
    the scheduler-side MultiConnector hands set_xfer_handshake_metadata to every child,
    so Nixl's side-channel listener starts.  A MultiConnector that does not forward
    either makes a P/D deployment hang: a failure, never n/a."""
    multi = engine.worker  # its KV caches are registered: Nixl has its handshake metadata
    if not hasattr(ch.base_class(), "get_handshake_metadata"):
        not_applicable("the release's connector API has no handshake metadata (the worker serves the handshake)")
    own = multi._connectors[engine.nixl_index].get_handshake_metadata()
    assert own is not None, "the Nixl child produced no handshake metadata"
    assert multi.get_handshake_metadata() == own, "MultiConnector does not return the Nixl child's handshake"

    setter = "set_xfer_handshake_metadata"
    if not hasattr(ch.base_class(), setter):
        not_applicable("the release's connector API has no set_xfer_handshake_metadata")
    calls = [ch.spy(monkeypatch, c, setter) for c in engine.multi._connectors]
    getattr(engine.multi, setter)({0: own})
    got = [len(c) for c in calls]
    assert got == [1, 1], f"{setter} calls per child: {got}"
    assert calls[engine.nixl_index].args[0][0] == {0: own}
    pp_aware = "set_xfer_handshake_metadata_pp_aware"
    if hasattr(ch.base_class(), pp_aware):  # what EngineCore calls from 0.23 (engine/core.py)
        calls = [ch.spy(monkeypatch, c, pp_aware, lambda *a: None) for c in engine.multi._connectors]
        getattr(engine.multi, pp_aware)({(0, 0): own})
        assert [len(c) for c in calls] == [1, 1], f"{pp_aware} calls per child: {[len(c) for c in calls]}"


# ---------------------------------------------------------------------------
# 6. reset_cache
# ---------------------------------------------------------------------------
def test_reset_cache_goes_to_both_children_and_clears_the_offloaded_prefix(engine, transport, monkeypatch):
    """Resetting the prefix cache with external caches reaches both children and
    returns whether every child reset; afterwards no child serves the old prefix.
    A child that raises fails this test with vLLM's error."""
    import inspect

    if not hasattr(ch.base_class(), "reset_cache"):
        not_applicable("the release's connector API has no reset_cache")
    if "reset_connector" not in inspect.signature(engine.scheduler.reset_prefix_cache).parameters:
        not_applicable("the scheduler cannot reset connectors' caches in this release")
    prompt = token_ids(3 * BLOCK + 5)
    stored_prefix(engine, prompt, "reset-src")
    calls = [ch.spy(monkeypatch, c, "reset_cache") for c in engine.multi._connectors]
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert [len(c) for c in calls] == [1, 1], f"reset_cache calls per child: {[len(c) for c in calls]}"
    after = va.make_request("reset-after", prompt, max_tokens=1)
    toks, _ = engine.multi.get_num_new_matched_tokens(after, 0)
    assert toks == 0, f"{toks} tokens of the old prefix served after the reset"


def test_reset_cache_is_false_when_a_child_could_not_reset(engine, monkeypatch):
    """MultiConnector's reset_cache is True only if every child reset: one child
    answering False makes it False, whichever child it is."""
    if not ch.multi_overrides("reset_cache"):
        not_applicable("MultiConnector has no reset_cache in this release")
    for refusing in (0, 1):
        calls = [
            ch.spy(monkeypatch, c, "reset_cache", lambda _r=(i != refusing): _r)
            for i, c in enumerate(engine.multi._connectors)
        ]
        assert engine.multi.reset_cache() is False, f"child {refusing} did not reset, MultiConnector said it did"
        assert [len(c) for c in calls] == [1, 1], "a child that failed to reset kept the other from resetting"
    for c in engine.multi._connectors:
        ch.spy(monkeypatch, c, "reset_cache", lambda: True)
    assert engine.multi.reset_cache() is True


# ---------------------------------------------------------------------------
# 7. KV events and transfer stats
# ---------------------------------------------------------------------------
def test_take_events_yields_every_childs_events_in_order(engine, monkeypatch):
    """take_events yields the KV-cache events of every child, in config order."""
    if not ch.multi_overrides("take_events"):
        not_applicable("MultiConnector has no take_events in this release")
    events = ([object(), object()], [object()])
    for c, evs in zip(engine.multi._connectors, events, strict=True):
        ch.spy(monkeypatch, c, "take_events", lambda _e=evs: list(_e))
    assert list(engine.multi.take_events()) == events[0] + events[1]


def test_connector_stats_are_kept_per_child_under_the_releases_key(engine, monkeypatch):
    """Transfer stats from both children come out of get_kv_connector_stats side by side,
    each under its child's class name (NixlPullConnector from 0.24, where NixlConnector is
    an alias), and a child without stats adds no entry."""
    multi = engine.worker
    Stats = ch.kv_connector_stats_class()
    if Stats is None or not ch.multi_overrides("get_kv_connector_stats"):
        not_applicable("no KV-connector stats in this release")

    @dataclasses.dataclass
    class Counted(Stats):
        def aggregate(self, other):
            return Counted(data={"n": self.data["n"] + other.data["n"]})

        def reset(self):
            self.data = {"n": 0}

        def reduce(self):
            return dict(self.data)

        def is_empty(self):
            return not self.data.get("n")

    given = (Counted(data={"n": 2}), Counted(data={"n": 5}))
    for c, s in zip(multi._connectors, given, strict=True):
        ch.spy(monkeypatch, c, "get_kv_connector_stats", lambda _s=s: _s)
    stats = multi.get_kv_connector_stats()
    names = [type(c).__name__ for c in multi._connectors]
    assert stats is not None, "MultiConnector dropped both children's stats"
    assert {k: v.data for k, v in stats.data.items()} == {names[0]: {"n": 2}, names[1]: {"n": 5}}
    ch.spy(monkeypatch, multi._connectors[1], "get_kv_connector_stats", lambda: None)
    assert list(multi.get_kv_connector_stats().data) == [names[0]]
    ch.spy(monkeypatch, multi._connectors[0], "get_kv_connector_stats", lambda: None)
    ch.spy(monkeypatch, multi._connectors[1], "get_kv_connector_stats", lambda: given[1])
    assert list(multi.get_kv_connector_stats().data) == [names[1]], "a child without stats hid the next one's"
