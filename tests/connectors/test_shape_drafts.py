"""Speculative decoding (the ``drafts`` shapes): a request resumed after an async KV load, drafting.

With drafts the release's Scheduler schedules ``1 + k`` tokens a decode step (the last token and ``k``
drafts), pads a request's first decode step after a load to that size, rolls ``num_computed_tokens`` back
by the drafts the model rejected, and admits an async KV load only with room for its first speculative
step (v1/core/sched/scheduler.py 0.34.0 ~L1355-1380, L1462-1492).  Users report lookahead slots taken while
remote KV was still arriving (vllm#46694, fixed 2026-06) and a pair with mismatched drafts crashing on long
prompts instead of refusing to pair (vllm#49230, the compatibility check of nixl/metadata.py 0.34.0 ~L103).
The byte-for-byte read of the shape is ``test_shapes.py``'s contract; these are the drafts around it.

The model's arithmetic is the drafts builder's (kvcompat.testkit.deploy.drafts): the target samples
``target_token(position)``, so whatever the drafts, the tokens a request outputs are exactly
``target_token(L), target_token(L + 1), ...`` for a prompt of ``L`` tokens, as a single engine without
drafts outputs them; a Scheduler that loses count of the rejected drafts outputs other tokens.
"""

from __future__ import annotations

import logging

import pytest

from kvcompat import shapes
from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by
from kvcompat.testkit.deploy import drafts

from conftest import (
    BLOCK,
    PD_READ,
    PREFILLED,
    STORED,
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    cpu_tier_hit,
    deployed,
    read_received,
    step_until,
    stored_prefix,
    token_ids,
)

MAX_TOKENS = 10


def _deploy(make_pd, shape, **decode):
    return deployed(make_pd, shape, decode=decode or None)


def _output(engine, rid: str) -> list[int]:
    return [t for o in engine.outputs.get(rid, []) for t in o.new_token_ids]


def _expected(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """What a single engine outputs after ``prompt`` (the target's token of each position)."""
    return [drafts.target_token(len(prompt) + i) for i in range(n)]


def _drafted(engine, rid: str) -> tuple[int, int]:
    """(steps that verified real drafts of ``rid``, steps where the model rejected some of them), from what
    the drafts builder's steps verified (``engine.verified``: request, drafts, tokens sampled)."""
    real = [(spec, got) for r, spec, got in getattr(engine, "verified", []) if r == rid and min(spec) >= 0]
    return len(real), sum(1 for spec, got in real if len(got) < len(spec) + 1)


def _writes_outside(engine, rid: str) -> list[str]:
    return [w for w in getattr(engine, "out_of_block_writes", []) if w.startswith(f"{rid}:")]


def _resume_from_nixl(make_pd, shape, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    """P prefills ``prompt``; D takes P's params and reads it over NIXL (byte for byte); returns (P, D)."""
    p, d = _deploy(make_pd, shape)
    with setup_owned_by(PREFILLED):
        params = p.prefill(rid, prompt)
    d.scheduler.add_request(va.make_request(rid, prompt, max_tokens=max_tokens, kv_transfer_params=params))
    d.step()
    blocks = d.scheduler.kv_cache_manager.get_block_ids(rid)
    with setup_owned_by(PD_READ):
        assert step_until([d, p], lambda: read_received(d, rid)), "D's read of P's blocks never finished"
        assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)
    return p, d


def _resume_from_cpu_tier(make_engine, shape, rid: str, prompt: list[int]):
    """``prompt`` stored in D's CPU tier, then a request for it that loads the hit asynchronously."""
    from vllm.v1.request import RequestStatus

    d = deployed(make_engine, shape, side="decode")
    stored_prefix(d, prompt, f"{rid}-src")
    with setup_owned_by(STORED):
        assert cpu_tier_hit(d, prompt, f"{rid}-probe") >= (len(prompt) // BLOCK) * BLOCK, "no CPU-tier hit"
    req = va.make_request(rid, prompt, max_tokens=MAX_TOKENS)
    d.scheduler.add_request(req)
    d.step()
    with setup_owned_by(STORED):
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"the CPU tier did not load the hit: {req.status}"
    return None, d


@pytest.mark.parametrize("source", ["nixl", "cpu-tier"])
@pytest.mark.shapes("drafts")
def test_a_request_resumed_after_an_async_load_gets_the_slots_of_its_first_speculative_step(
    make_pd, make_engine, shape, source
):
    """A decode request whose prompt KV arrived by an async load (P's blocks over NIXL, or a CPU-tier hit)
    resumes speculating: each of its steps, the padded first one included, writes KV only into blocks the
    Scheduler gave it (its tokens, its drafts and the drafter's lookahead slots; a GPU runner would write a
    position past them into another request's block), the model verifies real drafts and rejects some, and
    the request outputs exactly the tokens a single engine without drafts outputs; no leak.  The NIXL
    prompt (4 blocks less one token) makes the padded first step reach into a fifth block."""
    rid = f"drafts-resume-{source}"
    if source == "nixl":
        prompt = token_ids(4 * BLOCK - 1, start=300)
        p, d = _resume_from_nixl(make_pd, shape, rid, prompt)
    else:
        prompt = token_ids(4 * BLOCK + 1, start=340)
        p, d = _resume_from_cpu_tier(make_engine, shape, rid, prompt)
    d.run([rid], max_steps=80)
    stray = _writes_outside(d, rid)
    assert not stray, f"a step of the resumed request wrote past the blocks it holds: {stray[:3]}"
    assert _output(d, rid) == _expected(prompt), (
        f"D output {_output(d, rid)} after the load; a single engine outputs {_expected(prompt)}"
    )
    verified, rejected = _drafted(d, rid)
    assert verified and rejected, (
        f"the scenario drafted too little: {verified} steps verified drafts, {rejected} rejected"
    )
    assert_no_leak(*(e for e in (p, d) if e is not None))


@pytest.mark.parametrize("source", ["nixl", "nixl-one-draft", "cpu-tier"])
@pytest.mark.shapes("drafts")
def test_the_first_step_after_an_async_load_is_a_whole_speculative_step(make_pd, make_engine, shape, source):
    """Once its KV has arrived, a resumed request's first decode step is the speculative step every decode
    runs: ``1 + k`` tokens, the ``k`` drafts it has none of yet as placeholders (``-1``), so that the batch stays
    uniform and the runner keeps its full CUDA graph (v1/core/sched/scheduler.py 0.34.0 L1358-1380, L1642-1646;
    the slots the admission above reserves are the ones this step uses).  A release whose Scheduler has no such
    padding schedules the step unpadded by design: not applicable, by a probe of its source.  With one draft
    (``nixl-one-draft``) the step is two tokens."""
    _require_padding()
    rid = f"drafts-padded-{source}"
    if source == "nixl":
        _, d = _resume_from_nixl(make_pd, shape, rid, token_ids(3 * BLOCK + 9, start=640))
    elif source == "nixl-one-draft":  # k = 1, the smallest lookahead users run (an MTP head, ngram with k 1)
        one = shapes.Shape(f"{shape.id}-k1", "drafts", "ngram with 1 draft token on both sides", drafts="ngram1")
        _, d = _resume_from_nixl(make_pd, one, rid, token_ids(3 * BLOCK + 9, start=660))
    else:
        # the tier serves whole blocks: one token past them leaves the request one token to compute
        _, d = _resume_from_cpu_tier(make_engine, shape, rid, token_ids(3 * BLOCK + 1, start=680))
    k = d.vllm_config.speculative_config.num_speculative_tokens
    scheduled, drafts_sent = _first_step(d, rid)
    assert (scheduled, drafts_sent) == (1 + k, [-1] * k), (
        f"the first step after the load scheduled {scheduled} tokens with drafts {drafts_sent}; a speculative "
        f"step is {1 + k} tokens with {k} placeholder drafts"
    )
    d.run([rid], max_steps=80)


def _require_padding() -> None:
    """Probe: the release's Scheduler pads a resumed request's first decode step (``pad_spec_decode``), also when
    nothing else runs (before 0.30 it padded only beside running requests: ``scheduled_running_reqs and not
    prefill_scheduled``, scheduler.py 0.26.0 L846-850; the scenario here has the resumed request alone)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    source = inspect.getsource(Scheduler.schedule)
    if "pad_spec_decode" not in source:
        not_applicable("this release's Scheduler does not pad a resumed request's first decode step")
    if "scheduled_running_reqs and not prefill_scheduled" in source:
        not_applicable("this release's Scheduler pads a resumed request's first decode step only beside running ones")


def _first_step(d, rid: str) -> tuple[int, list[int]]:
    """(tokens scheduled, drafts sent) of ``rid``'s first step on ``d`` once its KV has arrived."""
    for _ in range(40):
        so = d.step()
        if rid in so.num_scheduled_tokens:
            return so.num_scheduled_tokens[rid], list(so.scheduled_spec_decode_tokens.get(rid, []))
    raise AssertionError("the resumed request was never scheduled after its KV arrived")


@pytest.mark.parametrize("edge", ["fits-exactly", "one-over"])
@pytest.mark.shapes("drafts")
def test_a_first_speculative_step_near_the_model_length_is_padded_only_where_it_fits(make_pd, shape, edge):
    """At the end of the model's length the first step after a load is padded to ``1 + k`` tokens only if the
    step and the token it samples still fit: a prompt whose padded step ends exactly at ``max_model_len`` is
    padded (a request that may run the whole speculative step must get it), one a token longer is scheduled
    unpadded, one token and no drafts, never a step past the model's length (scheduler.py 0.34.0 L1366-1372).
    The request then ends at the model's length with exactly a single engine's tokens; no leak."""
    _require_padding()
    p, d = _deploy(make_pd, shape)
    k = d.vllm_config.speculative_config.num_speculative_tokens
    limit = d.vllm_config.model_config.max_model_len
    # D computes the prompt's last token itself: with len(prompt) - 1 tokens loaded the padded step ends at
    # len(prompt) + k and its sampled token at one more
    length = limit - k - 1 if edge == "fits-exactly" else limit - k
    rid = f"drafts-edge-{edge}"
    prompt = token_ids(length, start=720)
    with setup_owned_by(PREFILLED):
        params = p.prefill(rid, prompt)
    d.scheduler.add_request(va.make_request(rid, prompt, max_tokens=limit - length, kv_transfer_params=params))
    with setup_owned_by(PD_READ):
        assert step_until([d, p], lambda: read_received(d, rid)), "D's read of P's blocks never finished"
    want = (1 + k, [-1] * k) if edge == "fits-exactly" else (1, [])
    got = _first_step(d, rid)
    assert got == want, (
        f"a {length}-token prompt at max_model_len {limit} (k = {k}): its first step after the load scheduled "
        f"{got[0]} tokens with drafts {got[1]}; it should be {want[0]} with {want[1]}"
    )
    d.run([rid], max_steps=80)
    assert _output(d, rid) == _expected(prompt, limit - length), (
        f"D output {_output(d, rid)} at the end of the model length; a single engine outputs "
        f"{_expected(prompt, limit - length)}"
    )
    assert_no_leak(p, d)


@pytest.mark.shapes("drafts")
def test_an_async_load_is_admitted_only_when_its_first_speculative_step_fits(make_pd, shape):
    """D's pool has room for a remote request's load but not for the step after it once that step is
    padded to ``1 + k`` tokens (another request holds the rest of the pool).  D starts the load only if the
    request can run the step that follows it: once the KV has arrived the request is scheduled at once, not
    left holding its blocks without progress until another request frees some, and no running request is
    preempted to make room (vllm#46694's area: scheduler.py 0.34.0 L1483-1492 reserves the speculative step's
    blocks).  The request then decodes P's KV to exactly a single engine's tokens; no leak."""
    from vllm.v1.request import RequestStatus

    # the smallest pool the release accepts for the model's length (32 blocks), and a few more
    p, d = _deploy(make_pd, shape, num_blocks=36)
    prompt = token_ids(4 * BLOCK - 1, start=520)  # the load: 4 blocks; the padded step after it reaches a fifth
    load_blocks = -(-len(prompt) // BLOCK)
    other_blocks = d.free_blocks() - load_blocks
    assert other_blocks >= 1, f"D's pool of {d.free_blocks()} free blocks is too small for the scenario"
    # the other request holds other_blocks blocks (one token into the last), and decodes within them for longer
    # than the load takes (28 tokens, at most 3 a step)
    other = token_ids(other_blocks * BLOCK - 31, start=20)
    d.scheduler.add_request(va.make_request("drafts-other", other, max_tokens=28))
    d.step()
    assert "drafts-other" in d.scheduler.requests and d.free_blocks() == load_blocks, (
        f"setup: the other request should leave {load_blocks} blocks free, left {d.free_blocks()}"
    )
    with setup_owned_by(PREFILLED):
        params = p.prefill("drafts-tight", prompt)
    req = va.make_request("drafts-tight", prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    d.scheduler.add_request(req)
    stalled, preempted = 0, set()
    for _ in range(200):
        if req.is_finished():
            break
        was_loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        so = d.step()
        p.step()
        preempted |= set(getattr(so, "preempted_req_ids", None) or ())
        arrived = was_loading and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        if (arrived or stalled) and not req.is_finished():
            if "drafts-tight" in so.num_scheduled_tokens:
                break
            stalled += 1
    assert not stalled, (
        f"D started the load, then left the request holding its {load_blocks} blocks without a step for "
        f"{stalled} steps once its KV had arrived: its first step after the load did not fit"
    )
    assert not preempted, f"D preempted {sorted(preempted)} to run the loaded request"
    d.run(["drafts-tight"], max_steps=80)
    assert _output(d, "drafts-tight") == _expected(prompt), (
        f"D output {_output(d, 'drafts-tight')}; a single engine outputs {_expected(prompt)}"
    )
    assert not _writes_outside(d, "drafts-tight"), _writes_outside(d, "drafts-tight")[:3]
    assert step_until([p], lambda: "drafts-tight" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


def _pair(p_drafts: str, d_drafts: str) -> shapes.Shape:
    return shapes.Shape(
        f"drafts-p-{p_drafts}-d-{d_drafts}",
        "drafts",
        f"prefill drafting with {p_drafts}, decode with {d_drafts}",
        drafts=f"{p_drafts}|{d_drafts}",
    )


# Pairs whose drafts differ only in what the drafter proposes: ngram drafts have no KV of their own, so the
# target's KV is the same on both sides and the release hashes no speculative factor for them (nixl/
# metadata.py 0.34.0 _get_speculative_compatibility_factors: hidden-state drafters only).
SHARED_KV_PAIRS = [_pair("ngram", "none"), _pair("ngram", "ngram3")]
# EAGLE on D only (vllm#49230: "EAGLE3 on D but not P: handshake succeeds, long prompts hit illegal memory
# access"): D has a draft layer P never computed.
EAGLE_ON_D = _pair("none", "eagle")


@pytest.mark.parametrize("pair", SHARED_KV_PAIRS, ids=[s.id for s in SHARED_KV_PAIRS])
def test_a_pair_whose_drafts_differ_only_in_the_drafter_reads_the_targets_kv(make_pd, pair, request):
    """P and D with different ngram settings (D without drafts, or with three drafts where P has two) pair
    as one deployment: D reads P's target KV byte for byte and decodes it to exactly a single engine's
    tokens; no leak."""
    request.node.user_properties.append(("shape", pair.id))
    rid = "drafts-pair"
    prompt = token_ids(3 * BLOCK + 5, start=610)
    p, d = _resume_from_nixl(make_pd, pair, rid, prompt)
    d.run([rid], max_steps=80)
    assert _output(d, rid) == _expected(prompt), f"D output {_output(d, rid)}; a single engine {_expected(prompt)}"
    assert step_until([p], lambda: rid not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


class _Errors(logging.Handler):
    """vLLM's log records of ERROR and above, with the exception each carries (what an operator reads)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        self.lines.append(record.getMessage() + (f" ({type(error).__name__}: {error})" if error else ""))


def test_a_pair_with_eagle_drafts_on_decode_only_is_refused_with_a_clear_error(make_pd, request):
    """P without drafts and D with an EAGLE draft head (whose KV P never computes) are not one deployment.
    Where the release checks the pair's speculative configuration (nixl/metadata.py 0.34.0
    ``_get_speculative_compatibility_factors``), D refuses P's KV with an error naming the incompatible
    configuration (the compatibility check's, or one naming the draft layer P does not hold) and reads nothing.  Either way the request ends or runs on (failed, or recomputed locally
    under the release's load-failure policy) instead of waiting forever, and once D has the prompt's KV,
    its blocks hold exactly the KV of the prompt (never KV read wrong from P); D does not leak."""
    from vllm.v1.request import RequestStatus

    request.node.user_properties.append(("shape", EAGLE_ON_D.id))
    errors = _Errors()
    logging.getLogger("vllm").addHandler(errors)
    try:
        p, d = _deploy(make_pd, EAGLE_ON_D)
        prompt = token_ids(3 * BLOCK + 5, start=660)
        with setup_owned_by(PREFILLED):
            params = p.prefill("drafts-eagle", prompt)
        req = va.make_request("drafts-eagle", prompt, max_tokens=4, kv_transfer_params=params)
        d.scheduler.add_request(req)
        d.step()
        done = step_until([d, p], lambda: req.is_finished() or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert done, "D still waits for the KV of a P whose drafts it cannot pair with: the request hangs"
        if _speculative_check():
            assert not (read_received(d, "drafts-eagle") and not _failed(d, "drafts-eagle")), (
                "D read P's KV although the release's check says their drafts are incompatible"
            )
            drafts_layers = _draft_layers(d)
            named = [e for e in errors.lines if "compatib" in e.lower() or any(n in e for n in drafts_layers)]
            assert named, f"the refusal names no incompatible configuration; D's errors: {errors.lines[:3]}"
        assert step_until([d], lambda: req.is_finished() or req.num_computed_tokens >= len(prompt)), (
            "D never computed the prompt after the refused read"
        )
        if not req.is_finished():
            d.kinds = {**d.kinds, **{n: _NOT_ON_P for n in _draft_layers(d)}}
            blocks = d.scheduler.kv_cache_manager.get_block_ids("drafts-eagle")
            assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)
        d.run(["drafts-eagle"], max_steps=120)
        assert_no_leak(d)
    finally:
        logging.getLogger("vllm").removeHandler(errors)


def _failed(d, rid: str) -> bool:
    """Whether D's workers reported ``rid``'s remote KV as failed to arrive."""
    return any(rid in (getattr(o, "failed_recving", None) or ()) for o in d.kv_outputs if o)


class _NotOnP(va.AttentionKind):
    """D's draft layer, which P does not have: nothing of it is compared."""

    def held(self, ids, prompt, block_size, full):
        return []


_NOT_ON_P = _NotOnP()


def _draft_layers(engine) -> list[str]:
    return [n for g in engine.kv_cache_config.kv_cache_groups for n in g.layer_names if n not in va.LAYER_NAMES]


def _speculative_check() -> bool:
    """Explicit probe: the release's NIXL compatibility hash includes the speculative configuration."""
    import importlib

    for name in ("nixl.metadata", "nixl_connector"):
        try:
            module = importlib.import_module(f"vllm.distributed.kv_transfer.kv_connector.v1.{name}")
        except ImportError:
            continue
        if hasattr(module, "_get_speculative_compatibility_factors"):
            return True
    return False
