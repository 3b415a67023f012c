"""MLA (the ``mla`` shapes): the latent is replicated, so D reads it once, and every P rank must still let go.

An MLA layer caches one latent a token (576 values for DeepSeek-V2/V3), not split across TP ranks: every
P rank holds all of it.  A D rank reads it from one P rank only, and with P at a larger TP than D the
other P ranks, which hold the same request's blocks, are never read: they free them only when told
(Nixl's "read done" notification, ``nixl/pull_worker.py`` 0.34.0 L466-488) or when their lease on the
blocks expires (``kv_lease_duration``, 30 s by default).  Users run MLA P/D with P TP > D TP (vllm#26848,
the mapping fixed again for hybrid MLA by #49297) and see failed MLA reads answered as if they had worked
(#52276).  The byte-for-byte read of each shape is ``test_shapes.py``'s contract; these are the MLA
bookkeeping around it: how often D reads, when each P rank frees, what a failed or aborted read leaves.

P and D are built by ``make_pd(shape=...)`` (kvcompat.testkit.deploy.mla: a tiny DeepSeek-V2, the
release's MLAAttentionSpec and planner, block 16 as CpuPlatform sets it for MLA, prefix caching and
chunked prefill as a GPU user has them).  Nixl's lease is set long (``LEASE_S``) and its clock is the
test's (kvcompat.testkit.nixl_clock): a P rank that frees before the clock moved was told; one that frees
only once the clock passes the lease was not.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import nixl_clock, setup_owned_by
from kvcompat.testkit.adapter import children as ch
from kvcompat.testkit.adapter.idle import worker_object
from kvcompat.testkit.fake_nixl import _expand

from conftest import (
    PREFILLED,
    assert_no_leak,
    deployed,
    nixl_lease,
    patient_steps,
    read_received,
    step_until,
    token_ids,
)

LEASE_S = 600  # Nixl's lease on P's unread blocks: far longer than a test runs, so only the clock ends it
PROMPT_STEPS = 12  # steps after D's read (or abort) within which every P rank has heard of it


def _deploy(make_pd, shape, monkeypatch):
    """P and D as ``shape`` deploys them, with a lease of ``LEASE_S`` and Nixl on the test's clock."""
    lease = nixl_lease(monkeypatch, LEASE_S)
    p, d = deployed(make_pd, shape, nixl_extra_config=lease)
    return p, d, nixl_clock.install(monkeypatch)


def _block_size(engine) -> int:
    return engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def _agent(engine, rank: int):
    """The (fake) NIXL agent of ``engine``'s TP rank ``rank``."""
    return worker_object(engine.ranks[rank].connector._connectors[engine.nixl_index]).nixl_wrapper


@dataclasses.dataclass
class Read:
    d_rank: int
    p_rank: int
    descriptors: int
    nbytes: int


def _reads(d, p) -> list[Read]:
    """Every READ D's ranks posted to P's agents: which D rank, which P rank, how many descriptors and bytes."""
    p_rank_of = {_agent(p, q).name: q for q in range(len(p.ranks))}
    out = []
    for r in range(len(d.ranks)):
        agent = _agent(d, r)
        for call in agent.calls_named("make_prepped_xfer"):
            op, local, local_indices, remote = call.args[:4]
            if op != "READ":
                continue
            descs = _expand(agent._dlists[local][1].descs)
            nbytes = sum(descs[i][1] for i in local_indices)
            out.append(Read(r, p_rank_of.get(agent._dlists[remote][0], -1), len(local_indices), nbytes))
    return out


class SentByRank:
    """What each P rank's Nixl worker reports finished sending, step by step, with the Nixl clock's offset
    then (0: before any lease time was let pass)."""

    def __init__(self, monkeypatch, p, clock) -> None:
        self.clock = clock
        self.sent: dict[int, dict[str, float]] = {q: {} for q in range(len(p.ranks))}
        hook = ch.completion_hook()
        for q, rank in enumerate(p.ranks):
            child = rank.connector._connectors[p.nixl_index]
            ch.spy(monkeypatch, child, hook, self._recorder(q, getattr(child, hook), hook))

    def _recorder(self, q: int, real, hook: str):
        def answer(*args):
            got = real(*args)
            sending = got.finished_sending if hook == "get_transfer_results" else (got or (None,))[0]
            for rid in sending or ():
                self.sent[q].setdefault(rid, self.clock.offset)
            return got

        return answer

    def ranks_not_done(self, rid: str) -> list[int]:
        return [q for q, done in self.sent.items() if rid not in done]

    def ranks_freed_by_lease(self, rid: str) -> list[int]:
        return [q for q, done in self.sent.items() if done.get(rid, 0.0) >= LEASE_S]


def _freed_promptly(p, d, sent: SentByRank, rid: str) -> None:
    """P frees ``rid`` within PROMPT_STEPS steps of both engines (the clock not moved: no lease ran out);
    else the P ranks that never heard are named, and whether the lease then frees them."""
    for _ in patient_steps(PROMPT_STEPS):
        if rid not in p.scheduler.requests:
            return
        d.step()
        p.step()
    if rid in p.scheduler.requests:
        silent = sent.ranks_not_done(rid)
        sent.clock.advance(LEASE_S + 1)
        step_until([p], lambda: rid not in p.scheduler.requests, max_steps=20)
        by_lease = sent.ranks_freed_by_lease(rid)
        raise AssertionError(
            f"P held {rid!r} after D was done with it: P rank(s) {silent} of {len(p.ranks)} never counted D's read "
            "(or abort) as done"
            + (
                f" and freed it only when their {LEASE_S} s lease expired (ranks {by_lease})"
                if by_lease
                else ", and not even the lease freed it"
            )
        )


def _request(engine, rid: str, prompt: list[int], max_tokens: int = 2, params: dict | None = None):
    """A request as EngineCore makes it for ``engine``: its block hashes of the engine's block size (16 for
    MLA on CpuPlatform: the suite's default of 32 would hash blocks the Scheduler never matches)."""
    return va.make_request(
        rid, prompt, max_tokens=max_tokens, kv_transfer_params=params, block_size=_block_size(engine)
    )


def _prefill(p, rid: str, prompt: list[int]) -> dict:
    """vLLM's P/D proxy protocol, prefill side (as ``Engine.prefill``): P's kv_transfer_params for D."""
    with setup_owned_by(PREFILLED):
        p.scheduler.add_request(_request(p, rid, prompt, max_tokens=1, params=va.remote_decode_params()))
        p.run([rid])
        params = p.finished_output(rid).kv_transfer_params
        assert params is not None, "the prefill side's MultiConnector returned no kv_transfer_params"
        assert rid in p.scheduler.requests, "P freed the blocks before the remote read"
        return dict(params)


def _read(p, d, rid: str, prompt: list[int], params: dict) -> list[int]:
    """D takes P's params for ``rid`` and steps until its read is received; D's block ids for the request."""
    d.scheduler.add_request(_request(d, rid, prompt, params=params))
    d.step()
    blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid))
    assert step_until([d, p], lambda: read_received(d, rid)), f"D's read of P's latent for {rid!r} never finished"
    return blocks


def _assert_latent(d, blocks: list[int], prompt: list[int], what: str) -> None:
    """Every rank of D holds, in every layer, the latent a forward pass over ``prompt`` writes for each of its
    full blocks, in ``blocks`` (the request's block ids), byte for byte; else fails saying ``what`` went wrong."""
    bs = _block_size(d)
    for layer in sorted(d.kinds):
        kind = d.kinds[layer]
        for j in range(len(prompt) // bs):
            for rank in d.ranks:
                cache = rank.kv_caches[layer]
                want = kind.expected(cache, layer, prompt[: (j + 1) * bs], rank.first_kv_head, bs)
                if not va.same_bytes(kind.block(cache, blocks[j], bs), want):
                    raise AssertionError(
                        f"{what}: D rank {rank.rank}'s block {blocks[j]} ({layer}, prompt block {j}) does not hold "
                        "the prompt's latent"
                    )


def _latent_bytes(engine, blocks: int) -> int:
    """Bytes of ``blocks`` blocks of every layer's latent."""
    layers = sum(len(g.layer_names) for g in engine.kv_cache_config.kv_cache_groups)
    return blocks * layers * engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes


@pytest.mark.shapes("mla")
def test_decode_reads_the_replicated_latent_once_and_every_prefill_rank_frees_it_promptly(make_pd, shape, monkeypatch):
    """D handshakes with every P rank and reads the request's latent once, from one P rank: one READ of
    the request's blocks of every layer, no more bytes (P's other ranks hold the same latent and are not
    read); every P rank then frees the request promptly, the ones D did not read included, because D told
    them (not because their lease ran out); D finishes the request; neither engine leaks."""
    p, d, clock = _deploy(make_pd, shape, monkeypatch)
    sent = SentByRank(monkeypatch, p, clock)
    bs = _block_size(d)
    prompt = token_ids(5 * bs + 5, start=300)
    params = _prefill(p, "mla-once", prompt)
    blocks = _read(p, d, "mla-once", prompt, params)
    for r in range(len(d.ranks)):
        added = {bytes(c.args[0]).split(b":", 1)[-1].decode() for c in _agent(d, r).calls_named("add_remote_agent")}
        missing = [q for q in range(len(p.ranks)) if _agent(p, q).name not in added]
        assert not missing, f"D rank {r} never handshook P rank(s) {missing} (P at TP {len(p.ranks)})"
    reads = _reads(d, p)
    assert len(reads) == len(d.ranks), (
        f"D's {len(d.ranks)} rank(s) made {len(reads)} reads of the replicated latent ({reads}); one each is needed"
    )
    want = _latent_bytes(d, len(blocks))
    for read in reads:
        assert read.nbytes == want, (
            f"D rank {read.d_rank} read {read.nbytes} bytes from P rank {read.p_rank}: the request's "
            f"{len(blocks)} blocks of latent are {want}"
        )
    _freed_promptly(p, d, sent, "mla-once")
    d.run(["mla-once"])
    assert_no_leak(p, d)


@pytest.mark.shapes("mla")
def test_a_failed_mla_read_never_decodes_over_the_unread_latent_and_every_prefill_rank_frees(
    make_pd, shape, monkeypatch, nixl_agent
):
    """D's read of P's latent fails (NIXL reports the transfer failed: no bytes moved): D fails the request
    or recomputes the prompt (its blocks then hold the latent D computed), never decodes over blocks the
    read left empty and answers as if it had worked (vllm#52276); every P rank frees the request, at the
    latest when its lease expires; neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d, clock = _deploy(make_pd, shape, monkeypatch)
    sent = SentByRank(monkeypatch, p, clock)
    bs = _block_size(d)
    prompt = token_ids(4 * bs + 3, start=360)
    params = _prefill(p, "mla-fail", prompt)
    nixl_agent.failing_transfers = 1
    req = _request(d, "mla-fail", prompt, params=params)
    d.scheduler.add_request(req)
    d.step()
    blocks = va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids("mla-fail"))
    assert step_until([d, p], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS), (
        "D still waits for a read NIXL reported failed"
    )
    assert nixl_agent.failed == 1, f"{nixl_agent.failed} transfers failed; the test failed one read"
    d.run(["mla-fail"])
    out = d.finished_output("mla-fail")
    if not str(out.finish_reason).lower().endswith("error"):
        _assert_latent(d, blocks, prompt, f"D answered the request ({out.finish_reason}) after its read failed")
    clock.advance(LEASE_S + 1)
    assert step_until([p, d], lambda: "mla-fail" not in p.scheduler.requests), (
        f"P rank(s) {sent.ranks_not_done('mla-fail')} held the request past their lease after D's read failed"
    )
    assert_no_leak(p, d)


@pytest.mark.shapes("mla")
def test_an_mla_request_aborted_on_decode_frees_every_prefill_rank_promptly(make_pd, shape, monkeypatch):
    """The client goes away while D waits for P's latent (D aborts the request before reading): D tells P,
    and every P rank frees the request promptly (not at lease expiry); neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d, clock = _deploy(make_pd, shape, monkeypatch)
    sent = SentByRank(monkeypatch, p, clock)
    prompt = token_ids(3 * _block_size(d) + 7, start=420)
    params = _prefill(p, "mla-abort", prompt)
    d.scheduler.add_request(_request(d, "mla-abort", prompt, params=params))
    d.scheduler.finish_requests("mla-abort", RequestStatus.FINISHED_ABORTED)
    _freed_promptly(p, d, sent, "mla-abort")
    assert_no_leak(p, d)


@pytest.mark.shapes("mla")
def test_decode_reads_only_the_latent_it_lacks_and_every_prefill_rank_frees_it(make_pd, shape, monkeypatch):
    """D already holds the first blocks of a prompt (its prefix cache, from an earlier request): for a
    longer prompt with that prefix D reads from P only the blocks it lacks, once, and its blocks then hold
    the whole prompt's latent byte for byte; every P rank frees the request promptly, the unread ones
    included; neither engine leaks."""
    p, d, clock = _deploy(make_pd, shape, monkeypatch)
    sent = SentByRank(monkeypatch, p, clock)
    bs = _block_size(d)
    first = token_ids(3 * bs + 2, start=500)
    _read(p, d, "mla-first", first, _prefill(p, "mla-first", first))
    d.run(["mla-first"])
    _freed_promptly(p, d, sent, "mla-first")
    before = len(_reads(d, p))
    prompt = first[: 3 * bs] + token_ids(3 * bs + 4, start=900)
    params = _prefill(p, "mla-more", prompt)
    blocks = _read(p, d, "mla-more", prompt, params)
    reads = _reads(d, p)[before:]
    lacking = len(blocks) - 3
    assert [r.nbytes for r in reads] == [_latent_bytes(d, lacking)] * len(d.ranks), (
        f"D held 3 of the prompt's {len(blocks)} blocks and read {[r.nbytes for r in reads]} bytes; the "
        f"{lacking} it lacked are {_latent_bytes(d, lacking)} bytes, once a D rank"
    )
    _assert_latent(d, blocks, prompt, "D's blocks after its local hit and its read of the rest")
    _freed_promptly(p, d, sent, "mla-more")
    d.run(["mla-more"])
    assert_no_leak(p, d)
