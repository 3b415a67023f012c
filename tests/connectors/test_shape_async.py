"""Async scheduling (the ``async-sched`` shapes): P/D and the CPU tier in EngineCore's batch-queue order.

GPU users run async scheduling by default from 0.34 (config/vllm.py 0.34.0 L1610-1637): EngineCore schedules
step N+1 before it has applied step N's output (``step_with_batch_queue``, v1/engine/core.py 0.34.0 L758),
so the Scheduler and the connectors see a finished load, a finished request or an abort one step late,
while a step still writes its requests' blocks on the GPU.  vLLM's CpuPlatform turns async scheduling off
(platforms/cpu.py 0.34.0 L345-347); the shape turns it on again after it (kvcompat.testkit.deploy.async_sched).
Users report accuracy lost only in this order: hybrid models under disaggregation (vllm#42182), and an
in-flight step overwriting a freshly received Mamba state in a reused block (vllm#45096, #48481).  The
byte-for-byte read of the shape is ``test_shapes.py``'s contract; these compare the async order with the
order the CPU platform leaves, on the same deployment.

The tokens the model samples depend on the position they are sampled for (kvcompat.testkit.deploy.drafts
``target_token``), so the tokens a request outputs after a prompt of ``L`` tokens are exactly
``target_token(L), target_token(L + 1), ...`` in either order.
"""

from __future__ import annotations

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import setup_owned_by
from kvcompat.testkit.deploy import async_sched, drafts

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

MAX_TOKENS = 6


def _deploy(make_pd, shape, **decode):
    return deployed(make_pd, shape, decode=decode or None)


def _output(engine, rid: str) -> list[int]:
    return [t for o in engine.outputs.get(rid, []) for t in o.new_token_ids]


def _expected(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    return [drafts.target_token(len(prompt) + i) for i in range(n)]


def _held_bytes(d, block_ids, prompt: list[int]) -> list[bytes]:
    """What D's blocks of a request hold for the prompt's full blocks, every group, layer and rank, in the
    prompt's order (block ids may differ between two engines, the content may not)."""
    out = []
    full = len(prompt) // BLOCK
    for g, group in enumerate(d.kv_cache_config.kv_cache_groups):
        bs = group.kv_cache_spec.block_size
        for layer in sorted(group.layer_names):
            kind = d.kinds.get(layer, va.ATTENTION)
            for _, block_id, _ in kind.held(va.group_block_ids(block_ids, g), prompt, bs, full):
                for rank in d.ranks:
                    out.append(kind.block(rank.kv_caches[layer], block_id, bs).contiguous().numpy().tobytes())
    return out


def _overwrites(engine) -> list[str]:
    return list(getattr(engine, "in_flight_overwrites", []))


def _pd_and_cpu_tier(make_pd, shape) -> dict[str, object]:
    """The scenario, in ``shape``'s order: D reads a prompt from P over NIXL and decodes it; then D serves
    another prompt from its CPU tier (stored there by an earlier request) and decodes it.  Returns what D's
    blocks held after each load and what each request output."""
    from vllm.v1.request import RequestStatus

    p, d = _deploy(make_pd, shape)
    prompt = token_ids(3 * BLOCK + 5, start=230)
    with setup_owned_by(PREFILLED):
        params = p.prefill("async-pd", prompt)
    d.scheduler.add_request(va.make_request("async-pd", prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params))
    d.step()
    pd_blocks = d.scheduler.kv_cache_manager.get_block_ids("async-pd")
    req = d.scheduler.requests["async-pd"]
    with setup_owned_by(PD_READ):
        assert step_until([d, p], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS), "D's read never ended"
        assert read_received(d, "async-pd"), "D's read of P's blocks never finished"
    pd_held = _held_bytes(d, pd_blocks, prompt)
    assert_blocks_hold_the_prompt(d, pd_blocks, prompt, len(prompt) // BLOCK)
    d.run(["async-pd"], max_steps=80)

    cached = token_ids(4 * BLOCK + 3, start=270)
    stored_prefix(d, cached, "async-cpu-src")
    with setup_owned_by(STORED):
        assert cpu_tier_hit(d, cached, "async-cpu-probe") >= 4 * BLOCK, "the CPU tier does not serve the prompt"
    req = va.make_request("async-cpu", cached, max_tokens=MAX_TOKENS)
    d.scheduler.add_request(req)
    d.step()
    cpu_blocks = d.scheduler.kv_cache_manager.get_block_ids("async-cpu")
    assert step_until([d], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS), "D's CPU-tier load never ended"
    hit = cached[: (len(cached) // BLOCK) * BLOCK]  # what the tier holds: the prompt's full blocks
    cpu_held = _held_bytes(d, cpu_blocks, hit)
    assert_blocks_hold_the_prompt(d, cpu_blocks, hit, len(hit) // BLOCK)
    d.run(["async-cpu"], max_steps=80)
    assert step_until([p], lambda: "async-pd" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)
    return {
        "P/D read": pd_held,
        "P/D tokens": _output(d, "async-pd"),
        "CPU-tier hit": cpu_held,
        "CPU-tier tokens": _output(d, "async-cpu"),
        "expected tokens": (_expected(prompt), _expected(cached)),
        "overwrites": _overwrites(d),
    }


@pytest.mark.shapes("async-sched")
def test_pd_and_cpu_tier_hits_give_the_same_kv_and_tokens_as_with_async_scheduling_off(make_pd, shape):
    """The same deployment run twice, in EngineCore's batch-queue order (async scheduling, the GPU default)
    and in the order the CPU platform leaves (async off): D reads a prompt from P over NIXL and decodes it,
    then serves another prompt from its CPU tier and decodes it.  In both orders D's blocks hold, after each
    load, the KV P (or the stored request) computed, byte for byte in every KV-cache group, no KV load lands
    in a block a step still in flight writes, and each request outputs exactly a single engine's tokens; the
    async order gives the same KV and the same tokens as the other; neither engine leaks."""
    on = _pd_and_cpu_tier(make_pd, shape)
    off = _pd_and_cpu_tier(make_pd, async_sched.synchronous(shape))
    for got in (on, off):
        assert not got["overwrites"], f"a KV load landed in a block a step in flight writes: {got['overwrites'][:2]}"
    pd_want, cpu_want = on["expected tokens"]
    assert off["P/D tokens"] == pd_want and off["CPU-tier tokens"] == cpu_want, (
        f"with async scheduling off D output {off['P/D tokens']} / {off['CPU-tier tokens']}; "
        f"a single engine outputs {pd_want} / {cpu_want}"
    )
    for what in ("P/D read", "CPU-tier hit"):
        assert on[what] == off[what], f"after the {what} D's blocks hold other KV with async scheduling on than off"
    for what in ("P/D tokens", "CPU-tier tokens"):
        assert on[what] == off[what], f"{what}: async scheduling on gives {on[what]}, off {off[what]}"


def _admitted(d, rid: str) -> bool:
    return rid in d.scheduler.requests and any(va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid)))


def _fill(d, start: int) -> list[str]:
    """Fill D's pool with running requests, each the longest D admits (a binary search over whole blocks,
    one engine step a try), until not even a one-block request is admitted or D runs as many requests as
    it may less one; returns them, the first (the longest) first.  Each decodes 40 tokens within the blocks
    it was given (48 tokens short of its last block's end)."""
    from vllm.v1.request import RequestStatus

    cap = d.vllm_config.scheduler_config.max_num_seqs - 1
    filled: list[str] = []
    while len(filled) < cap:
        lo, hi, best = 2, (d.vllm_config.model_config.max_model_len - 64) // BLOCK, None
        while lo <= hi:
            blocks = (lo + hi) // 2
            rid = f"async-fill-{len(filled)}-{blocks}"
            d.scheduler.add_request(va.make_request(rid, token_ids(blocks * BLOCK - 48, start=start), max_tokens=40))
            d.step()
            if _admitted(d, rid):
                if best is not None:
                    d.scheduler.finish_requests(best, RequestStatus.FINISHED_ABORTED)
                best, lo = rid, blocks + 1
            else:
                d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                hi = blocks - 1
            start += 7
        if best is None:
            break
        filled.append(best)
    return filled


@pytest.mark.shapes("async-sched")
def test_a_kv_load_never_lands_in_a_block_a_step_in_flight_still_writes(make_pd, shape):
    """D's pool is full of running requests; a client aborts the longest while EngineCore's next step,
    which writes its blocks, is still in flight, and a remote request arrives that needs its blocks.  D
    gives the remote request the aborted request's blocks only once that step is done: no KV load (P's
    KV over NIXL) lands in a block a step in flight still writes, as on a GPU that step's writes would
    overwrite the received KV (vllm#45096, #48481); D then holds P's KV, decodes it to exactly a single
    engine's tokens, and neither engine leaks."""
    from vllm.v1.request import RequestStatus

    p, d = _deploy(make_pd, shape)
    prompt = token_ids(3 * BLOCK + 5, start=380)
    with setup_owned_by(PREFILLED):
        params = p.prefill("async-reuse", prompt)
    fillers = _fill(d, start=20)
    assert fillers, "setup: D admitted no request to fill its pool"
    d.step()  # a step that writes every filler's blocks, left in flight under async scheduling
    aborted = fillers.pop(0)
    freed_all = {b for g in range(len(d.kv_cache_config.kv_cache_groups)) for b in _group(d, aborted, g)}
    d.scheduler.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    req = va.make_request("async-reuse", prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or req.is_finished()), (
        "D never started the remote request's load"
    )
    blocks = d.scheduler.kv_cache_manager.get_block_ids("async-reuse")
    mine = {b for g in range(len(d.kv_cache_config.kv_cache_groups)) for b in va.group_block_ids(blocks, g)}
    assert mine & freed_all, "setup: the remote request did not reuse any block of the aborted one"
    with setup_owned_by(PD_READ):
        assert step_until([d, p], lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS), "D's read never ended"
    overwrites = _overwrites(d)
    assert not overwrites, f"a KV load landed in a block a step in flight writes: {overwrites[:2]}"
    assert_blocks_hold_the_prompt(d, blocks, prompt, len(prompt) // BLOCK)
    d.run(["async-reuse"], max_steps=80)
    assert _output(d, "async-reuse") == _expected(prompt), (
        f"D output {_output(d, 'async-reuse')}; a single engine outputs {_expected(prompt)}"
    )
    for rid in fillers:
        d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert step_until([p], lambda: "async-reuse" not in p.scheduler.requests), "P kept the blocks after D's read"
    assert_no_leak(p, d)


def _group(d, rid: str, g: int) -> list[int]:
    return [b for b in va.group_block_ids(d.scheduler.kv_cache_manager.get_block_ids(rid), g) if b]
