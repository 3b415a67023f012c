"""Two TP ranks: a transfer is over only when every rank says so, and any rank's failure counts.

With tensor parallelism every rank's worker-role MultiConnector reports its own completions; the
release's KVOutputAggregator (kv_connector/utils.py) combines them for the Scheduler.  These contracts
fail when the aggregator, or the Scheduler's handling of what it hands on, trusts one rank: a send or
a load declared done while another rank is still moving bytes frees or uses blocks under it; a failed
block that only one rank saw is lost.  One rank is made *slow* by holding back what its worker reports
(and handing it on later, as a slow rank would): the rank's own answers, never a combined one.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by
from kvcompat.testkit.adapter import children as ch

from conftest import (
    BLOCK,
    STORED,
    assert_no_leak,
    can_reset_connectors,
    cpu_tier_hit,
    fail_a_loaded_block,
    patient_steps,
    stored_prefix,
    token_ids,
    wait_until,
)


class SlowRank:
    """Holds back the completions one rank's worker-role MultiConnector reports, until released; then
    hands them on with that rank's next report (nothing dropped, nothing invented)."""

    def __init__(self, monkeypatch, connector) -> None:
        self.hook = ch.completion_hook()
        self.real = getattr(connector, self.hook)
        self.held_sending: set[str] = set()
        self.held_recving: set[str] = set()
        self.holding = True
        monkeypatch.setattr(connector, self.hook, self._answer)

    def _answer(self, *args):
        answer = self.real(*args)
        if self.hook == "get_transfer_results":
            sending, recving = set(answer.finished_sending or ()), set(answer.finished_recving or ())
        else:
            sending, recving = (set(x or ()) for x in (answer or (None, None)))
        if self.holding:
            self.held_sending |= sending
            self.held_recving |= recving
            sending, recving = set(), set()
        else:
            sending |= self.held_sending
            recving |= self.held_recving
            self.held_sending, self.held_recving = set(), set()
        if self.hook == "get_transfer_results":
            return dataclasses.replace(answer, finished_sending=sending, finished_recving=recving)
        return sending or None, recving or None


class SlowWorkerMeta:
    """Holds back one rank's worker metadata (what its CPU-offload worker reports done: its stores)
    until released; then hands each held report on, one a step, in the order the rank made them."""

    def __init__(self, monkeypatch, connector) -> None:
        self.real = connector.build_connector_worker_meta
        self.held: list = []
        self.holding = True
        monkeypatch.setattr(connector, "build_connector_worker_meta", self._answer)

    def _answer(self, *args, **kwargs):
        meta = self.real(*args, **kwargs)
        if meta is not None:
            self.held.append(meta)
        if self.holding or not self.held:
            return None
        return self.held.pop(0)


def _store_done_on_rank_0_only(engine, slow: SlowWorkerMeta, req_id: str, prompt: list[int]) -> None:
    """A request run to its end whose store to the CPU tier rank 0 has reported done and rank 1 (``slow``)
    has done but not reported: a store that never reports is the store contract's finding."""
    engine.scheduler.add_request(va.make_request(req_id, prompt, max_tokens=2))
    engine.run([req_id])
    for _ in patient_steps(20):
        if slow.held:
            break
        engine.step()
    with setup_owned_by(STORED):
        assert slow.held, "rank 1 never reported a store done"


def _tp2(make_engine):
    engine = make_engine(tensor_parallel_size=2)
    assert engine.aggregator is not None
    return engine


def _send_read_by_one_rank_then_both(engine, nixl_agent, req_id: str) -> None:
    """A prefill-side request on two ranks: finished, read on rank 0 only (it must stay held), then on
    rank 1 too (it must be freed)."""
    engine.scheduler.add_request(
        va.make_request(req_id, token_ids(2 * BLOCK + 3), max_tokens=1, kv_transfer_params=va.remote_decode_params())
    )
    engine.run([req_id])
    agents = list(nixl_agent.instances)
    assert len(agents) == 2, f"{len(agents)} NIXL agents for two ranks"
    agents[0].inject_notif("decode-agent-0", f"{req_id}:1".encode())
    for _ in range(6):  # a notification is read in the step after it arrives
        engine.step()
    assert req_id in engine.scheduler.requests, "the send finished when only rank 0's half had been read"
    agents[1].inject_notif("decode-agent-1", f"{req_id}:1".encode())
    for _ in patient_steps(20):
        if req_id not in engine.scheduler.requests:
            break
        engine.step()
    assert req_id not in engine.scheduler.requests, "the send never finished once both ranks had been read"


def test_a_send_finishes_only_when_both_ranks_have_been_read(make_engine, nixl_agent):
    """A prefill-side request on two ranks keeps its blocks while only rank 0's NIXL agent has heard
    that the decode side read its half; when rank 1's hears too, the send finishes, the blocks are
    freed, and the engine is back at its idle baseline."""
    engine = _tp2(make_engine)
    _send_read_by_one_rank_then_both(engine, nixl_agent, "tp-send")
    assert_no_leak(engine)


def test_a_request_id_sent_again_after_its_send_finished_is_counted_afresh(make_engine, nixl_agent):
    """A client may reuse a request id once its request is over (a retry of the same id): the second
    send on two ranks is counted from scratch, held while one rank has been read, finished when both
    have.  A count left over from the first send (the aggregator or a child still tracking the id)
    finishes it too early or never."""
    engine = _tp2(make_engine)
    with setup_owned_by("test_a_send_finishes_only_when_both_ranks_have_been_read"):
        _send_read_by_one_rank_then_both(engine, nixl_agent, "tp-again")
    _send_read_by_one_rank_then_both(engine, nixl_agent, "tp-again")
    assert_no_leak(engine)


def test_a_load_finishes_only_when_both_ranks_have_loaded(make_engine, transport, monkeypatch):
    """A prompt loaded from the CPU tier on two ranks stays in WAITING_FOR_REMOTE_KVS while rank 1
    has not reported its load done, although rank 0 has; once rank 1 reports, the request runs,
    finishes, and the engine is back at its idle baseline."""
    from vllm.v1.request import RequestStatus

    engine = _tp2(make_engine)
    prompt = token_ids(3 * BLOCK + 5, start=130)
    stored_prefix(engine, prompt, "tp-src")
    slow = SlowRank(monkeypatch, engine.ranks[1].connector)
    req = va.make_request("tp-load", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    for _ in patient_steps(20):
        engine.step()
        if "tp-load" in slow.held_recving:
            break
    with setup_owned_by(STORED):
        assert "tp-load" in slow.held_recving, "rank 1 never finished loading the stored prompt"
    for _ in range(3):
        engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, (
        f"the request is {req.status}: its load counted as done while rank 1 was still loading"
    )
    slow.holding = False
    engine.run(["tp-load"])
    assert req.num_computed_tokens >= 3 * BLOCK, "the loaded tokens were not counted as computed"
    assert_no_leak(engine)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_block_failed_on_either_rank_is_recomputed(make_engine, monkeypatch, failing_rank):
    """A CPU-tier load on two ranks where one rank's CPU-offload worker names a block it failed to
    load: the scheduler learns it whichever rank it was, does not count that block's tokens as
    computed, and recomputes (or fails the request, as the release's policy says); no block leaks."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    if "invalid_block_ids" not in va.capabilities._field_names(KVConnectorOutput):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    engine = _tp2(make_engine)
    prompt = token_ids(3 * BLOCK + 5, start=160)
    stored_prefix(engine, prompt, "tp-fail-src")
    child = engine.ranks[failing_rank].connector._connectors[engine.offload_index]
    failed = fail_a_loaded_block(monkeypatch, engine, child, "tp-fail")
    req = va.make_request("tp-fail", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    engine.step()
    assert wait_until(lambda: engine.transfers.loads()), "the CPU-offload child did not take the load"
    for _ in patient_steps(20):
        if failed:
            break
        engine.step()
    assert failed, f"rank {failing_rank}'s load never completed"
    for _ in range(3):
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        engine.step()
    assert req.num_computed_tokens <= BLOCK or req.is_finished(), (
        f"{req.num_computed_tokens} tokens counted as computed although rank {failing_rank} failed block {failed}"
    )
    for _ in patient_steps(6):
        if req.is_finished() and "tp-fail" not in engine.scheduler.requests:
            break
        engine.step()
    assert req.is_finished(), "the request whose block failed never finished"
    # a finished request stays while its blocks are being stored (another thread): wait for that, then it goes
    assert "tp-fail" not in engine.scheduler.requests, "the finished request was never freed"
    assert_no_leak(engine)


def test_a_store_counts_only_when_both_ranks_have_stored(make_engine, transport, monkeypatch):
    """A finished request's blocks stored to the CPU tier on two ranks: while rank 1 has not reported
    its store done (rank 0 has), the CPU tier does not serve the prompt and the device blocks stay
    pinned; once rank 1 reports, the CPU tier serves every full block and nothing leaks."""
    if not hasattr(ch.base_class(), "build_connector_worker_meta"):
        not_applicable("this release's workers report no metadata (store completions per rank)")
    engine = _tp2(make_engine)
    slow = SlowWorkerMeta(monkeypatch, engine.ranks[1].connector)
    prompt = token_ids(3 * BLOCK + 5, start=180)
    _store_done_on_rank_0_only(engine, slow, "tp-store", prompt)
    for _ in range(4):
        engine.step()
    served = cpu_tier_hit(engine, prompt, "tp-store-early")
    assert served == 0, f"the CPU tier serves {served} tokens whose store rank 1 has not finished"
    assert engine.free_blocks() < engine.baseline_free, "device blocks freed before rank 1's store finished"
    slow.holding = False
    engine.settle()
    served = cpu_tier_hit(engine, prompt, "tp-store-late")
    assert served == 3 * BLOCK, f"the CPU tier serves {served} tokens once both ranks stored, not {3 * BLOCK}"
    assert_no_leak(engine)


def test_a_reset_while_one_rank_still_stores_releases_the_store_when_that_rank_finishes(
    make_engine, transport, monkeypatch
):
    """Resetting the caches while a store to the CPU tier is done on rank 0 and still running on rank 1
    abandons it: nothing of that prompt is served afterwards, and once rank 1 reports its half done the
    abandoned store's CPU and device blocks are released (a reset on the settled engine succeeds, nothing
    leaks) and the tier stores and serves the next prompt."""
    if not hasattr(ch.base_class(), "build_connector_worker_meta"):
        not_applicable("this release's workers report no metadata (store completions per rank)")
    engine = _tp2(make_engine)
    can_reset_connectors(engine)
    slow = SlowWorkerMeta(monkeypatch, engine.ranks[1].connector)
    prompt = token_ids(3 * BLOCK + 5, start=6100)
    _store_done_on_rank_0_only(engine, slow, "tp-reset", prompt)
    engine.step()
    engine.scheduler.reset_prefix_cache(reset_connector=True)
    slow.holding = False
    engine.settle()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True, "reset failed on a settled engine"
    served = cpu_tier_hit(engine, prompt, "tp-reset-again")
    assert served == 0, f"the CPU tier serves {served} tokens of a store the reset abandoned"
    assert_no_leak(engine)
    after = token_ids(3 * BLOCK + 5, start=6300)
    stored_prefix(engine, after, "tp-after-reset")
    assert cpu_tier_hit(engine, after, "tp-after-reset-hit") == 3 * BLOCK, "the tier stopped serving after the reset"
    assert_no_leak(engine)


def test_blocks_failed_on_different_ranks_all_reach_the_scheduler_and_are_recomputed(
    make_engine, transport, monkeypatch
):
    """A CPU-tier load on two ranks where each rank's CPU-offload worker names a different block it failed
    to load (rank 0 the prompt's third block, rank 1 its second): the scheduler is told both (the union of
    what the ranks report, not one rank's), counts nothing from the first failed block on as computed,
    recomputes or fails the request as the release's load-failure policy says, and nothing leaks."""
    from vllm.v1.outputs import KVConnectorOutput

    if "invalid_block_ids" not in va.capabilities._field_names(KVConnectorOutput):
        not_applicable("this release's KVConnectorOutput has no invalid_block_ids (no load-failure recovery)")
    engine = _tp2(make_engine)
    prompt = token_ids(3 * BLOCK + 5, start=6500)
    stored_prefix(engine, prompt, "tp-union-src")
    children = [r.connector._connectors[engine.offload_index] for r in engine.ranks]
    failed = [
        fail_a_loaded_block(monkeypatch, engine, children[0], "tp-union", index=2),
        fail_a_loaded_block(monkeypatch, engine, children[1], "tp-union", index=1),
    ]
    req = va.make_request("tp-union", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    for _ in patient_steps(20):
        if all(failed):
            break
        engine.step()
    with setup_owned_by("test_a_block_failed_on_either_rank_is_recomputed"):
        assert all(failed), f"a rank's load never completed (failed so far: {failed})"
    engine.step()
    told = set().union(*(set(getattr(o, "invalid_block_ids", None) or ()) for o in engine.kv_outputs if o))
    both = failed[0] | failed[1]
    assert both <= told, (
        f"the scheduler was told blocks {sorted(told)} failed; the ranks reported {sorted(failed[0])} (rank 0) "
        f"and {sorted(failed[1])} (rank 1)"
    )
    assert req.num_computed_tokens <= BLOCK or req.is_finished(), (
        f"{req.num_computed_tokens} tokens counted as computed although the prompt's second block failed on rank 1"
    )
    engine.run(["tp-union"])
    assert_no_leak(engine)
