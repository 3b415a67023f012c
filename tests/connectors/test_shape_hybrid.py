"""The hybrid shape's own contracts: a Mamba2 hybrid model with full attention and a sliding-window group, HMA on.

The model and its KV-cache groups are built the release's way (kvcompat.testkit.deploy.hybrid): a Mamba
state group per Mamba2 layer (``mamba_cache_mode="align"``), a full-attention group and a sliding-window group
whose window (80 tokens) the prompts here exceed, none of them block-aligned.  A Mamba layer's blocks hold
recurrent states (kvcompat.testkit.deploy.hybrid_kinds): a step that continues a state derives it from the
state it starts from, so a decode that continues from a state a connector did not move, or moved wrong, ends
with a state no single engine would hold.  Each contract compares what an engine holds with what one engine
that computed the same tokens itself holds, group by group, byte for byte.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by
from kvcompat.testkit.adapter import children as ch
from kvcompat.testkit.adapter.forward import NULL_BLOCK

from conftest import (
    BLOCK,
    PREFILLED,
    STORED,
    assert_no_leak,
    cpu_tier_hit,
    deployed,
    held_blocks,
    offload_metric_names,
    patient_steps,
    read_received,
    step_until,
    stored_prefix,
    token_ids,
    wait_until,
)

PROMPT = 5 * BLOCK + 7  # longer than the 80-token window, not block-aligned


def _engine(make_engine, shape, **kwargs) -> Any:
    """An engine of ``shape``; a release that refuses to build a shape other than the suite's own is
    ``unsupported`` (the dense engine's construction is the worker contract's, as everywhere)."""
    if shape.id == "dense":
        return make_engine(shape=shape, **kwargs)
    return deployed(make_engine, shape, **kwargs)


def _pair(make_pd, shape) -> tuple[Any, Any]:
    return deployed(make_pd, shape)


def _groups_held(engine, block_ids, tokens: list[int]) -> list[tuple[str, int, int, list[int], int]]:
    """What every layer of ``engine`` must hold once it has computed ``tokens`` (its kinds say which blocks):
    (layer, group, block id, the prefix the block depends on, block size)."""
    return [
        (layer, g, b, prefix, bs) for layer, g, _, b, prefix, bs in held_blocks(engine, block_ids, tokens, len(tokens))
    ]


def _not_holding(engine, block_ids, tokens: list[int]) -> list[str]:
    """The blocks of ``engine`` (a request's ``block_ids``) that do not hold what computing ``tokens`` leaves
    there, as its layers' kinds say (one line each, empty when every group holds it)."""
    wrong = []
    for layer, g, block_id, prefix, bs in _groups_held(engine, block_ids, tokens):
        kind = engine.kinds.get(layer, va.ATTENTION)
        cache = engine.ranks[0].kv_caches[layer]
        if not va.same_bytes(kind.block(cache, block_id, bs), kind.expected(cache, layer, prefix, 0, bs)):
            wrong.append(f"block {block_id} of {layer} (KV-cache group {g}, the content of {len(prefix)} tokens)")
    return wrong


def _block(engine, layer: str, block_id: int, bs: int) -> Any:
    return engine.kinds.get(layer, va.ATTENTION).block(engine.ranks[0].kv_caches[layer], block_id, bs)


def _scrub(engine) -> None:
    """Every device block zeroed, as a device whose freed blocks were reused holds nothing of them."""
    for rank in engine.ranks:
        for cache in rank.kv_caches.values():
            for t in va.layer_tensors(cache):
                t.zero_()


def _step_to(engine, req, n: int, max_steps: int = 60) -> None:
    """Step ``engine`` until ``req`` has computed ``n`` tokens."""
    for _ in patient_steps(max_steps):
        if req.num_computed_tokens >= n or req.is_finished():
            break
        engine.step()
    assert req.num_computed_tokens == n, f"{req.request_id} computed {req.num_computed_tokens} tokens, not {n}"


# ---------------------------------------------------------------------------
# 1. P/D: the read, then the decode, as one engine would
# ---------------------------------------------------------------------------
@pytest.mark.shapes("hybrid")
def test_hybrid_pd_decode_continues_exactly_as_one_engine(make_pd, make_engine, shape):
    """A hybrid model served P/D: P prefills the prompt but its last token (NixlConnector's prefill back-off:
    the decoder derives the last state itself), D reads every group's blocks (the Mamba states, the full
    attention blocks, the sliding window's blocks) over NIXL and computes the last prompt token; D then holds,
    in every group, exactly what a single engine that computed the whole prompt holds (the state after the
    prompt, every full-attention block, every block of the window), and after a decode step still exactly what
    that engine holds after the same step; P frees its blocks once D has read them; nothing leaks."""
    _pd_as_one_engine(make_pd, make_engine, shape, token_ids(PROMPT, start=1500))


@pytest.mark.shapes("hybrid")
def test_a_one_token_prompt_served_pd_continues_exactly_as_one_engine(make_pd, make_engine, shape):
    """The shortest prompt a user sends (a lone BOS or a one-token probe) through P/D on a hybrid model: the
    prefill back-off cannot leave P fewer than one token (``nixl/base_scheduler.py`` 0.34.0 L402-409, L419-426:
    a prompt no longer than the back-off is neither truncated on P nor shortened on D), so P prefills it, D
    waits for and reads P's KV as for any remote prefill, and D then holds and outputs exactly what a single
    engine does; P frees its blocks; nothing leaks."""
    _pd_as_one_engine(make_pd, make_engine, shape, token_ids(1, start=1700))


@pytest.mark.shapes("hybrid")
def test_a_pd_prompt_ending_late_in_a_block_reads_each_window_block_into_its_place(make_pd, make_engine, shape):
    """P sends the sliding-window group's last blocks (as many as the window can span); how many of them D
    still holds depends on where the prompt ends in its last block: with 5 blocks and 20 tokens (D computes
    179 tokens before the last), D's window has one block fewer than P sends (``nixl/base_scheduler.py`` 0.34.0
    L151-154, ``v1/core/single_type_kv_cache_manager.py`` L301-317), so the read must pair D's blocks with P's
    last ones, not its first.  D then holds and outputs exactly what a single engine does (on the model without a
    window, the same P/D as any other prompt length); nothing leaks."""
    _pd_as_one_engine(make_pd, make_engine, shape, token_ids(5 * BLOCK + 20, start=1900))


def _pd_as_one_engine(make_pd, make_engine, shape, prompt: list[int]) -> None:
    """``prompt`` prefilled on P and read by D over NIXL, then computed and decoded a step on D; D's tokens and
    every group's blocks equal a single engine's after the prompt and after the step; P frees; no leak."""
    from vllm.v1.request import RequestStatus

    p, d = _pair(make_pd, shape)
    one = _engine(make_engine, shape, engine_id="kvcompat-single-engine")
    with setup_owned_by(PREFILLED):
        params = p.prefill("hybrid-pd", prompt)
    req = d.request("hybrid-pd", prompt, max_tokens=3, kv_transfer_params=params)
    d.scheduler.add_request(req)
    d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"D did not wait for P's KV: {req.status}"
    assert step_until([d, p], lambda: read_received(d, "hybrid-pd")), "D's read of P's blocks never finished"
    _step_to(d, req, len(prompt))
    alone = one.request("hybrid-one", prompt, max_tokens=3)
    one.scheduler.add_request(alone)
    _step_to(one, alone, len(prompt))
    for n in (len(prompt), len(prompt) + 1):
        if n > len(prompt):
            _step_to(d, req, n)
            _step_to(one, alone, n)
        tokens = list(req.all_token_ids)[:n]
        assert tokens == list(alone.all_token_ids)[:n], "D and the single engine computed different tokens"
        mine = _groups_held(d, d.scheduler.kv_cache_manager.get_block_ids("hybrid-pd"), tokens)
        theirs = _groups_held(one, one.scheduler.kv_cache_manager.get_block_ids("hybrid-one"), tokens)
        assert [m[:2] for m in mine] == [t[:2] for t in theirs], "D and the single engine hold different groups"
        for (layer, g, block_id, prefix, bs), (_, _, single_id, _, _) in zip(mine, theirs, strict=True):
            held = _block(d, layer, block_id, bs)
            want = _block(one, layer, single_id, bs)
            assert va.same_bytes(held, want), (
                f"after {n} tokens D's block {block_id} ({layer}, KV-cache group {g}, content of {len(prefix)} "
                f"tokens) differs from what a single engine holds there (its block {single_id})"
            )
    d.run(["hybrid-pd"])
    one.run(["hybrid-one"])
    assert step_until([p], lambda: "hybrid-pd" not in p.scheduler.requests, 100), "P kept the blocks after D read"
    assert_no_leak(p, d, one)


# ---------------------------------------------------------------------------
# 2. CPU tier: a hit restores every group
# ---------------------------------------------------------------------------
def _hit_restores(engine, transport, prompt: list[int], rid: str, shape, *, served: bool = True) -> None:
    """``prompt`` stored in the CPU tier, the device's blocks gone; a request for it loads from the tier (when
    ``served``: else the tier may serve nothing), and once it has computed the prompt every group holds what
    computing the prompt leaves.  (That the tier serves a stored prompt at all is the store contract's for the
    dense model, this contract's for the others.)"""
    from vllm.v1.request import RequestStatus

    stored_prefix(engine, prompt, f"{rid}-src")
    _scrub(engine)
    launched = transport.launched()
    req = engine.request(rid, prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    engine.step()
    loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    with setup_owned_by(STORED) if shape.id == "dense" else contextlib.nullcontext():
        assert loading or not served, (
            f"the CPU tier did not serve the stored prompt ({shape.id}): the request is {req.status}"
        )
        if loading:
            assert wait_until(lambda: transport.launched() > launched), "the CPU-offload child never started the load"
    _step_to(engine, req, len(prompt))
    wrong = _not_holding(engine, engine.scheduler.kv_cache_manager.get_block_ids(rid), prompt)
    assert not wrong, f"after a CPU-tier hit ({shape.id}) the request does not hold what its prompt leaves: {wrong}"
    engine.run([rid])
    assert_no_leak(engine)


@pytest.mark.shapes("dense", "hybrid")
def test_a_cpu_tier_hit_restores_every_kv_cache_group(make_engine, transport, shape):
    """A prompt served from the CPU tier after the device lost it comes back in every KV-cache group of the
    model, byte for byte: full attention's blocks, the sliding window's in-window blocks and the Mamba state
    the request continues from (a state restored wrong, or not at all, leaves a state after the prompt that no
    engine computing the prompt holds).  The engine then finishes the request and nothing leaks."""
    engine = _engine(make_engine, shape)
    _hit_restores(engine, transport, token_ids(PROMPT, start=2100), "tier-hit", shape)


def _zeroed_since(engine, first: int) -> set[int]:
    """The blocks the engine's steps since its ``first`` SchedulerOutput asked the model runner to zero."""
    return {b for so in engine.sched_outputs[first:] for b in (getattr(so, "new_block_ids_to_zero", None) or ())}


def _loaded_blocks(engine, req, end: int) -> dict[int, list[int]]:
    """The blocks an async load of ``req``'s first ``end`` tokens writes, per KV-cache group: the groups the
    connector says its load restores (``get_loaded_kv_cache_group_ids``, where the release asks it; before,
    the Scheduler skips every group's blocks in the loaded range), each group's blocks up to ``end``."""
    groups = engine.kv_cache_config.kv_cache_groups
    loaded = getattr(engine.multi, "get_loaded_kv_cache_group_ids", None)
    ids = set(loaded(req)) if loaded is not None else set(range(len(groups)))
    held = engine.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    out = {}
    for g in sorted(ids):
        bs = groups[g].kv_cache_spec.block_size
        out[g] = [b for b in held[g][: -(-end // bs)] if b != NULL_BLOCK]
    return out


@pytest.mark.shapes("hybrid")
@pytest.mark.parametrize("via", ["nixl", "cpu-tier"])
def test_a_load_never_has_the_model_runner_zero_the_blocks_it_writes(make_pd, make_engine, transport, shape, via):
    """A hybrid model's new attention blocks are zeroed by the model runner at the start of a step
    (``SchedulerOutput.new_block_ids_to_zero``: stale Mamba bytes read as NaN in attention, vllm#35219).  A block
    an async load (a NIXL read, a CPU-tier hit) is writing must never be on that list: the runner's zeroing
    races the load's write and the request attends over zeros (vllm#48481; ``scheduler.py`` 0.34.0 L1505-1509:
    "must not be zeroed").  From the step that starts the load until it has finished, no step names a block
    the load writes; the zeroing is live on this model (the stored or prefilled prompt's own blocks were
    named)."""
    from vllm.v1.request import RequestStatus

    if not _zeroing_in_release():
        not_applicable("the release's SchedulerOutput names no blocks for the model runner to zero")
    prompt = token_ids(PROMPT, start=5300)
    if via == "nixl":
        p, engine = _pair(make_pd, shape)
        with setup_owned_by(PREFILLED):
            params = p.prefill("zero-pd", prompt)
        source, peers = p, [p]
        req = engine.request("zero-pd", prompt, max_tokens=2, kv_transfer_params=params)
    else:
        engine = _engine(make_engine, shape)
        stored_prefix(engine, prompt, "zero-src")
        _scrub(engine)
        source, peers = engine, []
        req = engine.request("zero-hit", prompt, max_tokens=2)
    assert _zeroed_since(source, 0), "no step asked the runner to zero a block: the zeroing is not on here"
    first = len(engine.sched_outputs)
    engine.scheduler.add_request(req)
    engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"the {via} load did not start: {req.status}"
    written = _loaded_blocks(engine, req, req.num_computed_tokens)
    rid = req.request_id
    done = (
        (lambda: read_received(engine, rid))
        if via == "nixl"
        else (lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
    )
    assert step_until([engine, *peers], done), f"the {via} load never finished"
    zeroed = _zeroed_since(engine, first)
    hit = {g: sorted(set(bs) & zeroed) for g, bs in written.items() if set(bs) & zeroed}
    assert not hit, (
        f"the step that started the {via} load (or one before it finished) had the model runner zero blocks the "
        f"load writes, per KV-cache group: {hit}"
    )
    engine.run([rid])
    assert_no_leak(engine, *peers)


def _zeroing_in_release() -> bool:
    """Probe: the release's SchedulerOutput has ``new_block_ids_to_zero`` (the model runner zeroes new blocks)."""
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    return "new_block_ids_to_zero" in {f.name for f in dataclasses.fields(SchedulerOutput)}


@pytest.mark.shapes("hybrid")
def test_a_cpu_tier_hit_on_a_block_aligned_prompt_restores_a_state_that_consumed_exactly_its_tokens(
    make_engine, transport, shape
):
    """A prompt of whole blocks (an exact chunk boundary, vllm#51094's case): the CPU tier never serves a state
    that already consumed the prompt's last token; what it serves is a state that consumed exactly the tokens
    it is counted for, and the request recomputes from it to the same state as an engine computing the prompt.
    Where the release's Mamba layers export a checkpoint inside a prefill (``num_prefill_checkpoint_blocks``,
    0.33+), the stored prompt has a state one block short of its end, and the tier must serve it; before,
    align mode keeps no such state and serving nothing is the right answer."""
    engine = _engine(make_engine, shape)
    specs = [g.kv_cache_spec for g in engine.kv_cache_config.kv_cache_groups]
    checkpoints = any(getattr(s, "num_prefill_checkpoint_blocks", 0) for s in specs)
    _hit_restores(engine, transport, token_ids(5 * BLOCK, start=2700), "tier-boundary", shape, served=checkpoints)


@pytest.mark.shapes("hybrid")
def test_a_prompt_sharing_part_of_a_block_with_a_stored_one_is_served_to_the_last_shared_unit(
    make_engine, transport, shape
):
    """Prefix-cache hits end where the engine hashes: at a block boundary, or under ``--prefix-match-unit``
    inside a block (``v1/core/kv_cache_utils.py`` 0.34.0 L812-860; Qwen3.5 and Nemotron-H users set it so that
    a 32- or 64-token Mamba block does not throw away a shared system prompt's tail).  A prompt that shares
    five and a half blocks (176 tokens) with a stored, longer one is served from the CPU tier exactly to the
    last shared unit (160 tokens with 32-token hashing, 176 with 16), never past it, and once computed every
    group holds what computing the prompt leaves (the Mamba state included, restored at a position inside a
    block); the engine then finishes it and nothing leaks."""
    engine = _engine(make_engine, shape)
    shared = 5 * BLOCK + BLOCK // 2
    stored = token_ids(shared + 9, start=4100)
    prompt = stored[:shared] + token_ids(2 * BLOCK + 5, start=4900)
    stored_prefix(engine, stored, "unit-src")
    _scrub(engine)
    req = engine.request("unit-hit", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    engine.step()
    unit = engine.hash_block_size
    want = shared // unit * unit
    served = req.num_computed_tokens if req.status.name == "WAITING_FOR_REMOTE_KVS" else 0
    assert served == want, (
        f"the CPU tier served {served} tokens of a prompt sharing {shared} with a stored one; with {unit}-token "
        f"hashing the last shared unit ends at {want} ({shape.id})"
    )
    _step_to(engine, req, len(prompt))
    wrong = _not_holding(engine, engine.scheduler.kv_cache_manager.get_block_ids("unit-hit"), prompt)
    assert not wrong, (
        f"after a hit of {served} tokens ({shape.id}) the request does not hold what its prompt leaves: {wrong}"
    )
    engine.run(["unit-hit"])
    assert_no_leak(engine)


@pytest.mark.shapes("hybrid")
def test_a_prompt_whose_shared_prefix_the_device_holds_without_its_state_is_served_whole_from_the_cpu_tier(
    make_engine, transport, shape
):
    """Two users share a system prompt on a hybrid model. The device still holds the first user's
    conversation (the shared prefix and their own suffix; a Mamba state only where that conversation's
    steps left one), and the CPU tier holds the second user's whole prompt, stored earlier. Full attention
    then hits the shared prefix on the device while the Mamba state lags behind it (a divergent local hit),
    and the tier holds more than either. The user expects the second prompt served as computing it would
    leave it: once computed, every group holds what its prompt leaves, and the engine then finishes it and
    nothing leaks. Which tokens come from the device and which from the tier is the release's choice."""
    engine = _engine(make_engine, shape)
    shared = 3 * BLOCK + 11
    second = token_ids(shared, start=5100) + token_ids(2 * BLOCK + 5, start=5300)
    first = second[:shared] + token_ids(BLOCK + 3, start=5500)
    stored_prefix(engine, second, "shared-second-src")
    _scrub(engine)
    engine.scheduler.add_request(engine.request("shared-first", first, max_tokens=2))
    engine.run(["shared-first"])
    engine.settle()
    req = engine.request("shared-second", second, max_tokens=2)
    engine.scheduler.add_request(req)
    _step_to(engine, req, len(second))
    wrong = _not_holding(engine, engine.scheduler.kv_cache_manager.get_block_ids("shared-second"), second)
    assert not wrong, (
        f"a prompt whose shared prefix the device held without its Mamba state, the tier holding it whole "
        f"({shape.id}): it does not hold what its prompt leaves: {wrong}"
    )
    engine.run(["shared-second"])
    assert_no_leak(engine)


@pytest.mark.shapes("hybrid")
def test_the_cpu_tier_counts_each_state_it_saved_and_each_it_already_held(make_engine, transport, shape, monkeypatch):
    """A user who sees a low CPU-tier hit rate on a hybrid model reads why in the save-outcome counter
    (``vllm:simple_kv_offload_save_outcomes_total{outcome}``) and in ``get_boundary_store_stats()``: the
    Mamba states the Scheduler hands the tier are each counted once under what happened to them.  A prompt
    stored into an empty tier counts as many ``stored`` as the tier then holds Mamba states; the same prompt
    computed again counts each of them ``skipped_already_cached`` and stores nothing new; ``published`` is the
    sum of the outcomes; an outcome that did not happen is not reported (``v1/simple_kv_offload/manager.py``
    0.34.0 L733-790, L1038-1052)."""
    engine = _engine(make_engine, shape)
    names = offload_metric_names()
    if names is None or not hasattr(engine.offload, "get_boundary_store_stats"):
        not_applicable("this release's CPU-offload child keeps no count of the Mamba states handed to it")
    groups = engine.offload.scheduler_manager.cpu_kv_cache_config.kv_cache_groups
    mamba = {g for g, grp in enumerate(groups) if _is_state(engine, engine.kv_cache_config.kv_cache_groups[g])}
    assert mamba, "the hybrid engine has no Mamba state group"

    def states() -> int:
        return _tier_blocks(engine, mamba)

    reports = ch.spy(monkeypatch, engine.offload, "get_kv_connector_stats").returned

    def outcomes() -> dict[str, int]:
        out: dict[str, int] = {}
        for r in reports:
            for labels, n in (r.data.get("data", {}).get(names.SAVE_OUTCOMES, {}) if r else {}).items():
                assert n > 0, f"a report counts {n} for outcome {labels[0]!r}, an outcome that did not happen"
                out[labels[0]] = out.get(labels[0], 0) + n
        return out

    prompt = token_ids(PROMPT, start=5100)
    stored_prefix(engine, prompt, "outcomes-src")
    held = states()
    assert held > 0, "the CPU tier holds no Mamba state of the stored hybrid prompt"
    assert outcomes() == {"stored": held}, f"the tier holds {held} Mamba states and its metric counts {outcomes()}"
    engine.scheduler.add_request(engine.request("outcomes-again", prompt, max_tokens=2))
    engine.run(["outcomes-again"])
    engine.settle()
    assert states() == held, f"computing the stored prompt again left {states()} Mamba states in the tier, not {held}"
    counted = outcomes()
    assert counted == {"stored": held, "skipped_already_cached": held}, (
        f"the prompt's {held} states were stored once and already held the second time; the metric counts {counted}"
    )
    stats = engine.offload.get_boundary_store_stats()
    fields = {f: getattr(stats, f) for f in ("stored", "skipped_already_cached")}
    assert fields == counted, f"get_boundary_store_stats() says {stats}; the metric counted {counted}"
    assert stats.published == sum(counted.values()), f"published {stats.published} is not the sum of the outcomes"
    assert_no_leak(engine)


def _tier_blocks(engine, groups: set[int] | None = None) -> int:
    """The CPU tier's blocks that hold a stored block (of ``groups``, else of any group)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    pool = engine.offload.scheduler_manager.cpu_block_pool
    return sum(
        1 for b in pool.blocks if b.block_hash is not None and (groups is None or get_group_id(b.block_hash) in groups)
    )


@pytest.mark.shapes("hybrid")
@pytest.mark.parametrize("room", [-1, 0, 1], ids=["one-block-short", "exactly", "one-block-over"])
def test_a_nearly_full_cpu_tier_drops_a_state_only_when_it_has_no_room(
    make_engine, transport, shape, monkeypatch, room
):
    """A CPU tier sized near the Mamba states a prompt hands it (one block fewer, exactly as many, one more;
    its stores held in flight, so nothing frees room meanwhile): the engine finishes the request; a state is
    counted ``dropped_cpu_full`` only in a step where the tier had fewer free blocks than the states that
    step stored or dropped (a state dropped beside a free block is lost for nothing, and the counter then
    misleads a user sizing the tier); ``published`` is the sum of the outcomes; once the stores complete the
    tier holds what was counted ``stored`` and nothing leaks (``v1/simple_kv_offload/manager.py`` 0.34.0
    L768-790)."""
    if not va.has_simple_cpu_offload() or '"num_cpu_blocks"' not in _offload_source():
        not_applicable("this release's CPU-offload child takes no num_cpu_blocks")
    names = offload_metric_names()
    roomy = _engine(make_engine, shape)
    if names is None or not hasattr(roomy.offload, "get_boundary_store_stats"):
        not_applicable("this release's CPU-offload child keeps no count of the Mamba states handed to it")
    prompt = token_ids(PROMPT, start=5500)
    stored_prefix(roomy, prompt, "nearly-full-src")
    mamba = {g for g, grp in enumerate(roomy.kv_cache_config.kv_cache_groups) if _is_state(roomy, grp)}
    states = _tier_blocks(roomy, mamba)
    assert states > 0, "a roomy CPU tier holds no Mamba state of the hybrid prompt"
    usable = max(states + room, 1)
    engine = _engine(
        make_engine, shape, offload_extra_config={"num_cpu_blocks": usable + 1}, engine_id="kvcompat-nearly-full"
    )  # block 0 is the pool's null block
    pool = engine.offload.scheduler_manager.cpu_block_pool
    reports = ch.spy(monkeypatch, engine.offload, "get_kv_connector_stats").returned

    def counted(since: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in reports[since:]:
            for labels, n in (r.data.get("data", {}).get(names.SAVE_OUTCOMES, {}) if r else {}).items():
                out[labels[0]] = out.get(labels[0], 0) + n
        return out

    transport.hold()
    engine.scheduler.add_request(engine.request("nearly-full", prompt, max_tokens=2))
    for _ in patient_steps(80):
        if engine.finished_output("nearly-full") is not None:
            break
        free, since = pool.get_num_free_blocks(), len(reports)
        engine.step()
        step = counted(since)
        needing = step.get("stored", 0) + step.get("dropped_cpu_full", 0)
        assert step.get("dropped_cpu_full", 0) <= max(needing - free, 0), (
            f"a tier of {usable} blocks with {free} free dropped {step.get('dropped_cpu_full', 0)} of the {needing} "
            f"Mamba states a step handed it for lack of room ({step})"
        )
    assert engine.finished_output("nearly-full") is not None, "the request never finished beside a nearly full tier"
    transport.release()
    engine.settle()
    total = counted(0)
    stats = engine.offload.get_boundary_store_stats()
    assert stats.published == sum(total.values()), f"published {stats.published} is not the sum of {total}"
    assert _tier_blocks(engine, mamba) == total.get("stored", 0), (
        f"the tier holds {_tier_blocks(engine, mamba)} Mamba states and counted {total}"
    )
    assert_no_leak(engine)


def _offload_source() -> str:
    import importlib
    import inspect

    return inspect.getsource(importlib.import_module(va.V1 + ".simple_cpu_offload_connector"))


@pytest.mark.shapes("dense", "hybrid")
def test_a_stored_prompt_computed_again_takes_no_new_cpu_tier_block(make_engine, transport, shape):
    """A prompt the CPU tier already holds, computed again (served from the tier: the next turn, a retry),
    stores nothing a second time: the tier holds as many blocks afterwards as before, in every group (its
    ending inside a block included, the tail block a sub-block hit is served from).  A second copy would take
    room that evicts other users' prefixes."""
    engine = _engine(make_engine, shape)
    if not hasattr(engine.offload, "scheduler_manager"):
        not_applicable("this release's CPU-offload child has no scheduler-side block pool to count")
    prompt = token_ids(5 * BLOCK + BLOCK // 2 + 9, start=6100)
    stored_prefix(engine, prompt, "again-src")
    held = _tier_blocks(engine)
    engine.scheduler.add_request(engine.request("again", prompt, max_tokens=2))
    engine.run(["again"])
    engine.settle()
    assert _tier_blocks(engine) == held, (
        f"the tier held {held} blocks of the stored prompt and {_tier_blocks(engine)} after computing it again"
    )
    assert_no_leak(engine)


@pytest.mark.shapes("hybrid")
def test_a_prompt_tail_block_that_decode_fills_is_stored_once(make_engine, transport, shape):
    """A prompt ending inside a block whose decode then fills that block: the block is stored once, whether
    the tier takes it as a full block or as the prompt's tail (``v1/simple_kv_offload/manager.py`` 0.34.0
    L1311-1320: "appending again would allocate two CPU blocks for one GPU block"), also while the copies the
    tier made during decode are still in flight when the request finishes (L1376); the full-attention group then
    holds one CPU block per full block the request computed."""
    engine = _engine(make_engine, shape)
    full = {g for g, grp in enumerate(engine.kv_cache_config.kv_cache_groups) if _is_full_attention(grp)}
    prompt = token_ids(5 * BLOCK + BLOCK // 2 + 9, start=6500)
    req = engine.request("filled-tail", prompt, max_tokens=12)
    transport.hold()
    engine.scheduler.add_request(req)
    engine.run(["filled-tail"])
    engine.step()
    transport.release()
    engine.settle()
    computed = len(prompt) + 12 - 1
    assert _tier_blocks(engine, full) == computed // BLOCK, (
        f"the request computed {computed // BLOCK} full blocks and the tier holds {_tier_blocks(engine, full)} "
        "of its full-attention group"
    )
    assert_no_leak(engine)


# ---------------------------------------------------------------------------
# 3. a state block being stored stays pinned
# ---------------------------------------------------------------------------
@pytest.mark.shapes("hybrid")
def test_a_state_block_being_stored_stays_pinned_until_its_store_completes(make_engine, transport, shape):
    """A finished request's Mamba state blocks that the CPU tier is copying (the store held in flight) stay
    pinned: while the copy is in flight no other request is given them and nothing overwrites them, however
    many blocks later requests need; once the copy completes the tier serves the prompt and the blocks are
    released (no leak)."""
    engine = _engine(make_engine, shape)
    mamba = [g for g, grp in enumerate(engine.kv_cache_config.kv_cache_groups) if _is_state(engine, grp)]
    assert mamba, "the hybrid engine has no Mamba state group"
    prompt = token_ids(PROMPT, start=3300)
    transport.hold()
    req = engine.request("stored-state", prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    _step_to(engine, req, len(prompt))
    ids = engine.scheduler.kv_cache_manager.get_block_ids("stored-state")
    states = {
        (engine.kv_cache_config.kv_cache_groups[g].layer_names[0], b)
        for g in mamba
        for b in va.group_block_ids(ids, g)
        if b != NULL_BLOCK
    }
    engine.run(["stored-state"])
    with setup_owned_by(STORED):
        assert wait_until(lambda: transport.in_flight_count > 0), "the CPU-offload child started no store"
    stored = {(layer, b) for layer, b in states if _being_copied(engine, transport, layer, b)}
    assert stored, "no Mamba state block of the finished request is among the copies in flight"
    before = {(layer, b): _block(engine, layer, b, BLOCK) for layer, b in stored}
    pool = engine.scheduler.kv_cache_manager.block_pool
    for layer, b in stored:
        assert pool.blocks[b].ref_cnt > 0, f"state block {b} ({layer}) is free while the CPU tier copies it"
    others = [f"pressure-{i}" for i in range(3)]
    for i, rid in enumerate(others):
        engine.scheduler.add_request(engine.request(rid, token_ids(11 * BLOCK + 3, start=3700 + 97 * i), max_tokens=2))
    given: set[int] = set()
    for _ in range(40):
        engine.step()
        for rid in (r for r in others if r in engine.scheduler.requests):
            ids = engine.scheduler.kv_cache_manager.get_block_ids(rid)
            given |= {b for g in range(len(engine.kv_cache_config.kv_cache_groups)) for b in va.group_block_ids(ids, g)}
        if all(engine.finished_output(r) is not None for r in others):
            break
    reused = sorted(b for _, b in stored if b in given)
    assert not reused, f"state blocks {reused} were given to other requests while the CPU tier copied them"
    changed = [
        f"{layer} block {b}"
        for (layer, b), old in before.items()
        if not va.same_bytes(_block(engine, layer, b, BLOCK), old)
    ]
    assert not changed, f"state blocks overwritten while the CPU tier copied them: {changed}"
    transport.release()
    engine.run(others, max_steps=120)
    engine.settle()
    assert cpu_tier_hit(engine, prompt, "stored-state-again") > 0, "the CPU tier does not serve the stored prompt"
    assert_no_leak(engine)


def _is_full_attention(group) -> bool:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    return isinstance(spec, FullAttentionSpec) and not isinstance(spec, SlidingWindowSpec)


def _is_state(engine, group) -> bool:
    from kvcompat.testkit.deploy.hybrid_kinds import MambaStateKind

    return isinstance(engine.kinds.get(group.layer_names[0]), MambaStateKind)


def _being_copied(engine, transport, layer: str, block_id: int) -> bool:
    """Whether a copy in flight reads from block ``block_id`` of ``layer``'s cache."""
    cache = engine.ranks[0].kv_caches[layer]
    spans = [
        (s[block_id].data_ptr(), s[block_id].data_ptr() + s[block_id].numel() * s.element_size())
        for s in va.layer_tensors(cache)
    ]
    return any(lo <= c.src < hi for c in list(transport._queued) for lo, hi in spans)


# ---------------------------------------------------------------------------
# 4. a failed NIXL read of a hybrid request
# ---------------------------------------------------------------------------
@pytest.mark.shapes("hybrid")
def test_a_failed_hybrid_read_fails_the_request_or_recomputes_it_never_decodes_unwritten_blocks(
    make_pd, nixl_agent, shape
):
    """D's NIXL read of a hybrid request fails (vllm#52234: a failed HMA read answered with corrupted tokens):
    the request ends as an error, or D recomputes it; D never samples a token from blocks the read did not
    write: when D produces its first token, every group holds exactly what computing the prompt leaves (the
    Mamba state included).  The request ends and D holds nothing of it (P's lease on its blocks is the Nixl
    child's contract)."""
    from vllm.v1.request import RequestStatus

    p, d = _pair(make_pd, shape)
    prompt = token_ids(PROMPT, start=4100)
    with setup_owned_by(PREFILLED):
        params = p.prefill("hybrid-failed", prompt)
    nixl_agent.failing_transfers = 1
    req = d.request("hybrid-failed", prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    assert step_until([d, p], lambda: nixl_agent.failed == 1 or req.is_finished()), "the fake NIXL failed no read"
    assert nixl_agent.failed == 1, "the fake NIXL failed no read: no scenario"
    for _ in patient_steps(60):
        if req.is_finished() or req.num_output_tokens:
            break
        d.step()
        p.step()
    if req.num_output_tokens:  # D sampled: from what it holds after the prompt
        assert not req.is_finished(), "D sampled both tokens of the request whose read failed in one step"
        wrong = _not_holding(d, d.scheduler.kv_cache_manager.get_block_ids("hybrid-failed"), prompt)
        assert not wrong, f"D sampled a token from blocks its failed read never wrote: {wrong}"
    assert step_until([d, p], lambda: req.is_finished()), f"D's request whose read failed never finished ({req.status})"
    assert req.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR), req.status
    assert_no_leak(d)
