"""An MLA target with an EAGLE-3 GQA draft head (the ``mla-drafts`` shapes): the latent is replicated, the draft's
KV heads are split across TP ranks, and one NIXL read must carry both right.

What users deploy: DeepSeek-V3 / Kimi-K2 with an EAGLE-3 head (a Llama decoder layer with grouped-query
attention).  NixlConnector reads the MLA latent whole from one P rank (REPLICATE) and the draft's KV as the D
rank's head slice of P's (SPLIT, with a draft TP mapping of its own): ``nixl/base_worker.py`` 0.34.0 L395-431,
L2579-2586, L2789-2808, L2909-2924, L2979-2982; vLLM's own ``test_handshake_mla_target_reads_draft_head_slice``
(sdist ``tests/v1/kv_connector/unit/test_nixl_connector.py`` 0.34.0 L1596) checks the descriptors by hand.

P and D are built by ``make_pd(shape=...)`` (kvcompat.testkit.deploy.mla_drafts: the DeepSeek-V2 of the ``mla``
shapes, the release's SpeculativeConfig with a ``LlamaForCausalLMEagle3`` head of 2 KV heads, the release's
planner grouping the MLA layers and the draft layer, each TP rank its own draft heads).  Nixl's lease is long
and its clock the test's (kvcompat.testkit.nixl_clock), so a P rank that frees before the clock moved was told.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from test_shape_drafts import _Errors
from test_shape_mla import LEASE_S, SentByRank, _freed_promptly, _prefill, _request

from kvcompat import shapes
from kvcompat.testkit import adapter as va
from kvcompat.testkit import nixl_clock, not_applicable, record_fact
from kvcompat.testkit.adapter.kv_cache import head_axis
from kvcompat.testkit.deploy import drafts as _drafts
from kvcompat.testkit.deploy import mla_drafts

from conftest import (
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    deployed,
    nixl_lease,
    read_failure,
    read_received,
    step_until,
    token_ids,
)

MAX_TOKENS = 8


@pytest.fixture
def vllm_errors():
    errors = _Errors()
    logging.getLogger("vllm").addHandler(errors)
    yield errors
    logging.getLogger("vllm").removeHandler(errors)


def _deploy(make_pd, shape, monkeypatch, **kwargs):
    lease = nixl_lease(monkeypatch, LEASE_S)
    p, d = deployed(make_pd, shape, nixl_extra_config=lease, **kwargs)
    return p, d, nixl_clock.install(monkeypatch)


def _block_size(engine) -> int:
    return engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def _blocks(engine, rid: str) -> list[int]:
    return va.group_block_ids(engine.scheduler.kv_cache_manager.get_block_ids(rid))


def _draft_layers(engine) -> list[str]:
    return [n for n, k in engine.kinds.items() if k is mla_drafts.DRAFT]


def _p_heads(p, layer: str, block_id: int) -> dict[int, object]:
    """Every draft KV head P's ranks hold in block ``block_id`` of ``layer``, by the head's global index (a
    copy), as each P rank's cache holds it."""
    heads: dict[int, object] = {}
    bs = _block_size(p)
    axis = head_axis(bs)
    for rank in p.ranks:
        cache = rank.kv_caches[layer]
        view = mla_drafts.DRAFT.block(cache, block_id, bs)
        first = getattr(cache, mla_drafts.FIRST_DRAFT_HEAD)
        for h in range(view.shape[axis]):
            heads.setdefault(first + h, view.select(axis, h).clone())
    return heads


def _assert_holds_ps_bytes(p, d, p_blocks: list[int], d_blocks: list[int], full: int, p_bytes: dict) -> int:
    """Every D rank's blocks hold exactly P's bytes: each MLA layer the latent of P's block (every P rank holds
    the same), each draft layer the D rank's heads taken from P's ranks (the concatenation of P's ranks'
    heads, sliced at the D rank's first head).  Returns the block views compared."""
    import torch

    bs = _block_size(d)
    axis = head_axis(bs)
    compared = 0
    for j in range(full):
        for layer, kind in sorted(d.kinds.items()):
            for rank in d.ranks:
                cache = rank.kv_caches[layer]
                got = kind.block(cache, d_blocks[j], bs)
                if kind is mla_drafts.DRAFT:
                    heads = p_bytes[(layer, j)]
                    first = getattr(cache, mla_drafts.FIRST_DRAFT_HEAD)
                    wanted = [first + h for h in range(got.shape[axis])]
                    assert all(h in heads for h in wanted), f"P holds draft heads {sorted(heads)}, not {wanted}"
                    want = torch.stack([heads[h] for h in wanted], dim=axis)
                    what = f"its draft heads {wanted} of P's {sorted(heads)}"
                else:
                    latents = p_bytes[(layer, j)]
                    assert all(va.same_bytes(latents[0], other) for other in latents[1:]), (
                        f"P's ranks hold different latents in block {p_blocks[j]} ({layer}): not replicated"
                    )
                    want, what = latents[0], "P's latent"
                assert va.same_bytes(got, want), (
                    f"D rank {rank.rank} of {len(d.ranks)}: block {d_blocks[j]} ({layer}, prompt block {j}) does not "
                    f"hold {what} (P's block {p_blocks[j]}, P at TP {len(p.ranks)})"
                )
                compared += 1
    return compared


def _ps_bytes(p, p_blocks: list[int], full: int) -> dict:
    """A copy of what P holds for the request's first ``full`` blocks: per (layer, block index), the latent of
    every P rank (MLA layers) or the draft heads by global index (draft layers)."""
    bs = _block_size(p)
    out: dict = {}
    for j in range(full):
        for layer, kind in p.kinds.items():
            if kind is mla_drafts.DRAFT:
                out[(layer, j)] = _p_heads(p, layer, p_blocks[j])
            else:
                out[(layer, j)] = [kind.block(r.kv_caches[layer], p_blocks[j], bs).clone() for r in p.ranks]
    return out


def _snapshot(engine) -> dict:
    return {(r.rank, name): cache.clone() for r in engine.ranks for name, cache in r.kv_caches.items()}


def _written_outside(engine, before: dict, allowed: set[int]) -> list[str]:
    bs = _block_size(engine)
    changed = []
    for (rank, name), old in before.items():
        kind = engine.kinds[name]
        cache = engine.ranks[rank].kv_caches[name]
        for block_id in range(1, engine.kv_cache_config.num_blocks):
            if block_id not in allowed and not va.same_bytes(
                kind.block(cache, block_id, bs), kind.block(old, block_id, bs)
            ):
                changed.append(f"rank {rank} {name} block {block_id}")
    return changed


def _output(engine, rid: str) -> list[int]:
    return [t for o in engine.outputs.get(rid, []) for t in o.new_token_ids]


def _expected(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """What a single engine outputs after ``prompt``: the target's token of each position, whatever was drafted."""
    return [_drafts.target_token(len(prompt) + i) for i in range(n)]


# The release refuses a head-sharded draft under an MLA target when P's TP exceeds D's ("requires local TP >=
# remote TP", nixl/base_worker.py 0.34.0 L2799-2808, 0.33.0 L2751-2760; vLLM's own
# test_handshake_mla_target_rejects_draft_with_prefill_tp_above_decode): such a pair may be refused, with that
# error, but never served wrong.  Every other pair must be served.
REFUSAL = ("head-sharded draft", "local tp >= remote tp")


@pytest.mark.shapes("mla-drafts")
def test_pd_read_gives_decode_the_latent_and_its_draft_heads_and_every_prefill_rank_frees_promptly(
    make_pd, shape, monkeypatch, vllm_errors
):
    """vLLM's P/D proxy protocol with an MLA target and an EAGLE-3 GQA head on both sides: once D's read is done,
    every D rank holds, in every full block of the prompt, exactly P's bytes: each MLA layer's latent (the same on
    every P rank) and, in the draft layer, its own draft heads taken from P's ranks (a D rank of TP 2 holds one
    of the 2 heads P's rank holds); no block outside the request's was written on any D rank; every P rank frees
    the request promptly because D told it (not at its lease); D then decodes, drafting, exactly the tokens a
    single engine gives; neither engine leaks.  A pair with P's TP above D's may instead be refused at the
    handshake with the release's error for it (nixl/base_worker.py 0.34.0 L2799-2808): then D never decodes over
    blocks it did not fill, the request ends, and every P rank frees it, at the latest at its lease."""
    from vllm.v1.request import RequestStatus

    p, d, clock = _deploy(make_pd, shape, monkeypatch)
    assert _draft_layers(d) and _draft_layers(p), "the shape deployed no draft layer"
    sent = SentByRank(monkeypatch, p, clock)
    bs = _block_size(d)
    rid = "mla-eagle"
    prompt = token_ids(5 * bs + 5, start=300)
    full = len(prompt) // bs
    params = _prefill(p, rid, prompt)
    p_blocks = _blocks(p, rid)
    p_bytes = _ps_bytes(p, p_blocks, full)
    before = _snapshot(d)
    req = _request(d, rid, prompt, max_tokens=MAX_TOKENS, params=params)
    d.scheduler.add_request(req)
    d.step()
    d_blocks = _blocks(d, rid)
    done = step_until(
        [d, p], lambda: read_received(d, rid) or req.is_finished() or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    )
    assert done, f"D still waits for P's KV ({shape.id}): the request hangs"
    failure = read_failure(d, rid)
    refused = [e for e in vllm_errors.lines if all(w in e.lower() for w in REFUSAL)]
    if failure is not None and refused and shape.prefill_tp > shape.decode_tp:
        # the release's refusal of the pair (see REFUSAL): D must not decode over what it never read
        print(f"{shape.id}: the release refused the pair: {refused[0]}")
        d.run([rid], max_steps=120)
        out = d.finished_output(rid)
        if not str(out.finish_reason).lower().endswith("error"):
            assert_blocks_hold_the_prompt(d, d_blocks, prompt, len(prompt) // va.BLOCK_SIZE)
            assert _output(d, rid) == _expected(prompt), f"D output {_output(d, rid)} after a refused read"
        clock.advance(LEASE_S + 1)
        assert step_until([p, d], lambda: rid not in p.scheduler.requests), (
            f"P rank(s) {sent.ranks_not_done(rid)} held the request past their lease after D refused the pair"
        )
        assert_no_leak(p, d)
        return
    assert failure is None, (
        f"D's read of P's latent and draft failed ({shape.id}): {failure}; vLLM's errors: {vllm_errors.lines[:3]}"
    )
    compared = _assert_holds_ps_bytes(p, d, p_blocks, d_blocks, full, p_bytes)
    assert compared == full * len(d.kinds) * len(d.ranks), compared
    # the forward pass's own pattern too (the helper counts in the suite's 32-token blocks)
    assert_blocks_hold_the_prompt(
        d, d.scheduler.kv_cache_manager.get_block_ids(rid), prompt, len(prompt) // va.BLOCK_SIZE
    )
    stray = _written_outside(d, before, set(d_blocks))
    assert not stray, f"the read wrote outside the request's blocks: {stray[:6]}"
    _freed_promptly(p, d, sent, rid)
    d.run([rid], max_steps=120)
    assert _output(d, rid) == _expected(prompt), f"D output {_output(d, rid)}; a single engine {_expected(prompt)}"
    drafted = [(spec, got) for r, spec, got in getattr(d, "verified", []) if r == rid and min(spec) >= 0]
    assert any(len(got) == len(spec) + 1 for spec, got in drafted) and any(
        len(got) < len(spec) + 1 for spec, got in drafted
    ), f"D's decode drafted too little to say drafts ran: {drafted}"
    assert_no_leak(p, d)


def _ends_over_its_own_kv_and_p_frees(p, d, clock, rid: str, prompt: list[int], held) -> None:
    """D finishes ``rid``: in error as the load-failure policy says, or decoded over blocks that hold the prompt's own
    KV (served, or recomputed), never over KV read wrong or not at all; every P rank frees it at the latest at its
    lease (else ``held()``); nothing leaks."""
    d.run([rid], max_steps=120)
    out = d.finished_output(rid)
    if not str(out.finish_reason).lower().endswith("error"):
        blocks = d.scheduler.kv_cache_manager.get_block_ids(rid)
        assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // va.BLOCK_SIZE)
    clock.advance(LEASE_S + 1)
    assert step_until([p, d], lambda: rid not in p.scheduler.requests), held()
    assert_no_leak(p, d)


def _pair(p_drafter: str, d_drafter: str) -> shapes.Shape:
    return shapes.Shape(
        f"mla-eagle-p-{p_drafter}-d-{d_drafter}",
        "mla-drafts",
        f"the MLA model, P drafting with {p_drafter}, D with {d_drafter}",
        model="mla",
        drafts=f"{p_drafter}|{d_drafter}",
    )


# P's EAGLE-3 head has 2 KV heads, D's is another head with 4: D's draft layer is not P's.
OTHER_HEAD = _pair("eagle3", "eagle3-h4")


def test_a_pair_whose_eagle_heads_differ_is_refused_at_the_handshake(make_pd, monkeypatch, vllm_errors, request):
    """P and D with different EAGLE-3 heads (2 and 4 KV heads) under the same MLA target are not one deployment:
    D refuses P at the handshake with an error naming the incompatibility (the release hashes the draft model
    into Nixl's compatibility check, nixl/metadata.py 0.34.0 L107-146, L203; or the draft region's block
    length) and reads nothing of P's; the request ends or is recomputed locally, never decoded over KV read
    wrong from P or not at all; every P rank frees the request at the latest at its lease; nothing leaks."""
    from vllm.v1.request import RequestStatus

    request.node.user_properties.append(("shape", OTHER_HEAD.id))
    why = mla_drafts.missing(OTHER_HEAD)
    if why is not None:
        not_applicable(f"shape {OTHER_HEAD.id}: {why}")
    p, d, clock = _deploy(make_pd, OTHER_HEAD, monkeypatch)
    sent = SentByRank(monkeypatch, p, clock)
    bs = _block_size(d)
    rid = "mla-eagle-other"
    prompt = token_ids(4 * bs + 3, start=640)
    params = _prefill(p, rid, prompt)
    req = _request(d, rid, prompt, max_tokens=4, params=params)
    d.scheduler.add_request(req)
    d.step()
    done = step_until([d, p], lambda: req.is_finished() or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert done, "D still waits for the KV of a P whose draft head it cannot pair with: the request hangs"
    assert not (read_received(d, rid) and read_failure(d, rid) is None), (
        "D read P's KV although P's EAGLE-3 head is not D's"
    )
    named = [e for e in vllm_errors.lines if "compatib" in e.lower() or any(n in e for n in _draft_layers(d))]
    assert named, f"the refusal names no incompatible configuration; vLLM's errors: {vllm_errors.lines[:3]}"
    _ends_over_its_own_kv_and_p_frees(
        p,
        d,
        clock,
        rid,
        prompt,
        lambda: f"P rank(s) {sent.ranks_not_done(rid)} held the request past their lease after D refused it",
    )


# mla-eagle-p1d2 as a user first writes it: without VLLM_KV_CACHE_LAYOUT, each side in the release's own layout.
DEFAULT_LAYOUT_P1D2 = dataclasses.replace(
    shapes.BY_ID["mla-eagle-p1d2"],
    id="mla-eagle-p1d2-default-layout",
    what="the MLA model with an EAGLE-3 GQA draft head, prefill TP 1, decode TP 2, in the release's own layout",
    kv_cache_layout=None,
)


def test_a_split_draft_pair_in_the_default_layout_is_served_or_refused_naming_the_layout(
    make_pd, monkeypatch, vllm_errors, request
):
    """P at TP 1 and D at TP 2 under an MLA target with an EAGLE-3 GQA head, without the layout the release wants
    for slicing the draft's heads (VLLM_KV_CACHE_LAYOUT unset).  The user expects D either to serve it (every D
    rank then holds the prompt's KV) or to refuse it with an error that names the KV-cache layout to set (the
    release's check, nixl/base_worker.py 0.34.0 L2909-2924), never to decode over KV read wrong or not at all;
    the request ends or is recomputed locally, P frees it at the latest at its lease, and nothing leaks."""
    from vllm.v1.request import RequestStatus

    request.node.user_properties.append(("shape", DEFAULT_LAYOUT_P1D2.id))
    why = mla_drafts.missing(DEFAULT_LAYOUT_P1D2)
    if why is not None:
        not_applicable(f"shape {DEFAULT_LAYOUT_P1D2.id}: {why}")
    p, d, clock = _deploy(make_pd, DEFAULT_LAYOUT_P1D2, monkeypatch)
    bs = _block_size(d)
    rid = "mla-eagle-unset"  # (no "layout" in it: the check below reads vLLM's messages for that word)
    prompt = token_ids(4 * bs + 3, start=660)
    full = len(prompt) // bs
    params = _prefill(p, rid, prompt)
    p_blocks = _blocks(p, rid)
    p_bytes = _ps_bytes(p, p_blocks, full)
    req = _request(d, rid, prompt, max_tokens=4, params=params)
    d.scheduler.add_request(req)
    d.step()
    d_blocks = _blocks(d, rid)
    done = step_until(
        [d, p], lambda: read_received(d, rid) or req.is_finished() or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    )
    assert done, "D still waits for the KV of a P it cannot pair with in this layout: the request hangs"
    served = read_received(d, rid) and read_failure(d, rid) is None
    if served:  # then byte for byte: each D rank holds P's latent and its own slice of P's draft heads
        compared = _assert_holds_ps_bytes(p, d, p_blocks, d_blocks, full, p_bytes)
        assert compared == full * len(d.kinds) * len(d.ranks), compared
    else:
        named = [e for e in vllm_errors.lines if "layout" in e.lower()]
        assert named, f"D refused the pair without naming the KV-cache layout; vLLM's errors: {vllm_errors.lines[:3]}"
    said = named[0][max(0, named[0].lower().find("layout") - 120) :][:240] if not served else ""
    record_fact(DEFAULT_LAYOUT_P1D2.id, f"refused: …{said}" if said else "served, byte for byte")
    _ends_over_its_own_kv_and_p_frees(p, d, clock, rid, prompt, lambda: "P held the request past its lease")
