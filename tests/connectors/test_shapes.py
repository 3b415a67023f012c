"""The pair's transfer, storage and block-accounting contracts, once per deployment shape.

Each contract here takes the ``shape`` fixture and is marked with the shape families it applies to
(kvcompat.testkit.shapes): it runs as ``test_x[dense]``, ``test_x[hetero-tp-p1d2]``, ... and its
result carries the shape.  P and D are built as that shape deploys them (``make_pd(shape=shape)``):
each TP rank with its own rank and share of the KV heads, KV-cache configs from the release's own
planner, the handshake served for every rank.  What moves is checked byte for byte against what the
forward pass wrote, head by head (kvcompat.testkit.adapter.forward).
"""

from __future__ import annotations

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import setup_owned_by

from conftest import (
    BLOCK,
    PREFILLED,
    assert_blocks_hold_the_prompt,
    assert_no_leak,
    deployed,
    patient_steps,
    read_failure,
    read_received,
    token_ids,
)

# Every family whose P/D transfer the contracts below check: all of them.
TRANSFER_SHAPES = ("dense", "hybrid", "hetero-tp", "mla", "drafts", "restarted-prefill", "async-sched")


def _deploy(make_pd, shape):
    """P and D as ``shape`` deploys them; a release that refuses to build the shape is ``unsupported``."""
    return deployed(make_pd, shape)


def _snapshot(engine) -> dict[tuple[int, str], object]:
    """A copy of every rank's KV caches, to tell afterwards which blocks were written."""
    return {(r.rank, name): _clone(cache) for r in engine.ranks for name, cache in r.kv_caches.items()}


def _clone(cache):
    """A layer's cache copied: one tensor, or a Mamba layer's states (a list of tensors, before 0.33)."""
    return [c.clone() for c in cache] if isinstance(cache, (list, tuple)) else cache.clone()


def _written_outside(engine, before: dict, allowed: set[int]) -> list[str]:
    """Blocks of ``engine`` that changed since ``before`` although no request held them: block ids in ``allowed``
    (held in any KV-cache group: the groups share one block pool, and the release's planner lays a hybrid
    model's groups over the same bytes) may change, any other block of any layer on any rank may not.  Each
    layer's block is read as its kind holds it (an attention block, a Mamba state)."""
    groups = engine.kv_cache_config.kv_cache_groups
    group_of = {name: g for g, grp in enumerate(groups) for name in grp.layer_names}
    changed = []
    for (rank, name), old in before.items():
        cache = engine.ranks[rank].kv_caches[name]
        kind = engine.kinds.get(name, va.ATTENTION)
        bs = groups[group_of[name]].kv_cache_spec.block_size
        for block_id in range(1, engine.kv_cache_config.num_blocks):
            if block_id in allowed:
                continue
            if not va.same_bytes(kind.block(cache, block_id, bs), kind.block(old, block_id, bs)):
                changed.append(f"rank {rank} {name} block {block_id}")
    return changed


@pytest.mark.shapes(*TRANSFER_SHAPES)
def test_pd_read_fills_each_rank_with_its_heads_and_nothing_else(make_pd, shape):
    """vLLM's P/D proxy protocol in the shape's deployment: P prefills and holds the blocks; D, given P's
    kv_transfer_params, reads them over NIXL; then every D rank holds, in every layer of every KV-cache
    group, exactly the KV of its own heads that P's forward pass wrote (P's ranks together hold all heads;
    a D rank with fewer heads reads its slice, one with more reads several P ranks); no block outside the
    request's was written on any D rank; D finishes the request and P frees its blocks once every D rank
    has read; neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d = _deploy(make_pd, shape)
    prompt = token_ids(3 * BLOCK + 5, start=400)
    with setup_owned_by(PREFILLED):
        params = p.prefill("shape-pd", prompt)
    before = _snapshot(d)
    d.scheduler.add_request(d.request("shape-pd", prompt, max_tokens=2, kv_transfer_params=params))
    d.step()
    req = d.scheduler.requests["shape-pd"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D did not wait for P's KV: {req.status}"
    d_blocks = d.scheduler.kv_cache_manager.get_block_ids("shape-pd")
    for _ in patient_steps(400):
        d.step()
        p.step()
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert read_received(d, "shape-pd"), f"D's read of P's blocks never finished ({shape.id})"
    failure = read_failure(d, "shape-pd")
    assert failure is None, f"D's read of P's blocks failed ({shape.id}): {failure}"
    full = len(prompt) // BLOCK
    assert_blocks_hold_the_prompt(d, d_blocks, prompt, full)
    held = {b for g in range(len(d.kv_cache_config.kv_cache_groups)) for b in va.group_block_ids(d_blocks, g)}
    stray = _written_outside(d, before, held)
    assert not stray, f"the read wrote outside the request's blocks: {stray[:6]}"
    d.run(["shape-pd"])
    for _ in patient_steps(100):
        if "shape-pd" not in p.scheduler.requests:
            break
        p.step()
    assert "shape-pd" not in p.scheduler.requests, "P kept the blocks after every D rank had read them"
    assert_no_leak(p, d)
