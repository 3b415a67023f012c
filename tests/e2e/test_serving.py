"""End to end as a P/D + CPU-tier deployment is used: concurrency, prompt-length edges, the CPU tier and
NIXL on one request, aborts, and no leak afterwards.

Every test drives the suite's real engines (tests/e2e/conftest.py) and compares tokens with a plain
engine's; the ones that say "leaks nothing" read each engine's idle state from its in-process Scheduler
(free device blocks, the CPU tier's pinned blocks: kvcompat.testkit.adapter.idle) and compare it with
the state the engine had right after it started, before any request.
"""

from __future__ import annotations

import time

from workload import (
    ABORT_DECODE,
    ABORT_PREFILL,
    BLOCK_SIZE,
    CONCURRENT,
    EDGES,
    FROM_PREFILL_CPU_TIER,
    INTO_DECODE_CPU_TIER,
    MAX_TOKENS,
    METRICS,
    PD_DEVICE_BLOCKS,
    REMOTE_DECODE,
    ROUND_TRIP_DEVICE_BLOCKS,
    n_tokens,
    pd_fillers,
    proxy_params,
    round_trip_fillers,
)

from kvcompat.testkit import not_applicable, record_fact, setup_owned_by
from kvcompat.testkit.e2e.model import kv_bytes_per_block
from kvcompat.testkit.probes import has_file

REFERENCE = "test_a_plain_engine_generates_the_reference"
PD = "test_prefill_then_decode_over_nixl_gives_the_reference_tokens"
IDLE = "test_every_engine_reads_its_idle_state_at_start"
ROUND_TRIP = "test_repeated_prompts_are_served_from_the_cpu_tier_with_the_reference_tokens"


def _stored(engine, before: dict, after, what: str) -> None:
    """A prompt in the CPU tier, as the round-trip contract gives it: the CPU-offload child stored
    something between the engine's counters ``before`` and the answer ``after``.  When it stores
    nothing, this test is blocked by that contract."""
    with setup_owned_by(ROUND_TRIP):
        stores = _transport(after).get("stores", 0) - before.get("transport", {}).get("stores", 0)
        assert stores > 0, f"the {engine.name}'s CPU-offload child stored nothing of {what}"


def _reference(request, prompts):
    with setup_owned_by(REFERENCE):
        return request.getfixturevalue("reference_of")(prompts)


def _baselines(*engines):
    with setup_owned_by(IDLE):
        return [e.baseline for e in engines]


def _transport(answer) -> dict:
    return answer["counters"].get("transport", {})


def _pd(fleet, prompts, stage):
    """vLLM's proxy, one batch: the prefill (max_tokens=1, do_remote_decode), then the decode with the
    returned kv_transfer_params.  The prefill's and the decode's answers."""
    pre = fleet.prefill.generate(
        prompts,
        stage=f"prefill ({stage})",
        max_tokens=1,
        kv_transfer_params=[dict(REMOTE_DECODE) for _ in prompts],
    )
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p.get("do_remote_prefill") for p in params), f"no remote-prefill params: {params}"
    dec = fleet.decode.generate(
        prompts,
        stage=f"decode ({stage})",
        max_tokens=MAX_TOKENS,
        kv_transfer_params=[proxy_params(p) for p in params],
    )
    return pre, dec


def _no_leaks(*engines, stage):
    leaks = [line for e in engines for line in e.leaks(stage=f"settle ({stage})")]
    settled = {e.name: {k: e.last_settle.get(k) for k in ("steps", "probes", "seconds")} for e in engines}
    record_fact(f"e2e settle after {stage}", str(settled))
    assert not leaks, "blocks held once every request is done: " + "; ".join(leaks)


def test_every_engine_reads_its_idle_state_at_start(fleet):
    """Each engine reports its idle state, read from its own Scheduler right after start: every device
    block free but the block pool's null block, no CPU-tier block pinned.  The baseline the leak checks
    compare with."""
    expected = {"round_trip": ROUND_TRIP_DEVICE_BLOCKS, "prefill": PD_DEVICE_BLOCKS, "decode": PD_DEVICE_BLOCKS}
    for attr, blocks in expected.items():
        base = getattr(fleet, attr).baseline
        assert base["free_device_blocks"] == blocks - 1, f"{attr}: {base} at start, {blocks} device blocks"
        assert base["pinned_cpu_blocks"] == 0, f"{attr}: CPU-tier blocks pinned before any request: {base}"
    plain = fleet.reference.baseline
    assert plain["free_device_blocks"] > 0 and plain["pinned_cpu_blocks"] == 0, plain


def test_concurrent_requests_across_prefill_and_decode_give_the_reference_and_leak_nothing(fleet, request):
    """Ten requests of mixed lengths (two groups sharing a prefix) go through P/D as a proxy streams
    them: each request is handed to the decode as soon as its prefill finishes, while the others are
    still prefilling, so at least eight are in flight across the two engines.  Every decode's tokens are
    its reference; then both engines, settled, hold what they held at start."""
    reference = _reference(request, CONCURRENT)
    _baselines(fleet.prefill, fleet.decode)
    ids = [f"c{i}" for i in range(len(CONCURRENT))]
    prompt_of = dict(zip(ids, CONCURRENT, strict=True))
    fleet.prefill.ask(
        "add",
        stage="prefill (concurrent)",
        requests=[
            {"id": i, "prompt": prompt_of[i], "max_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE)} for i in ids
        ],
    )
    decoded: dict[str, dict] = {}
    in_prefill, in_decode, most = set(ids), set(), 0
    deadline = time.monotonic() + 240
    while in_prefill or in_decode:
        assert time.monotonic() < deadline, f"P/D did not finish: {len(in_prefill)} prefilling, {len(in_decode)}"
        most = max(most, len(in_prefill) + len(in_decode))
        if in_prefill:
            got = fleet.prefill.ask("step", stage="prefill (concurrent)")
            new = [
                {
                    "id": i,
                    "prompt": prompt_of[i],
                    "max_tokens": MAX_TOKENS,
                    "kv_transfer_params": proxy_params(o["kv_transfer_params"]),
                }
                for i, o in got["finished"].items()
            ]
            if new:
                fleet.decode.ask("add", stage="decode (concurrent)", requests=new)
                in_prefill -= {r["id"] for r in new}
                in_decode |= {r["id"] for r in new}
        if in_decode:
            got = fleet.decode.ask("step", stage="decode (concurrent)")
            decoded.update(got["finished"])
            in_decode -= set(got["finished"])
    record_fact("e2e concurrency", f"{len(ids)} requests, at most {most} in flight across prefill and decode")
    assert most >= 8, f"only {most} requests were in flight at once"
    for i, ref in zip(ids, reference, strict=True):
        assert decoded[i]["token_ids"] == ref, f"request {i} ({n_tokens(prompt_of[i])} tokens): decode != reference"
    _no_leaks(fleet.prefill, fleet.decode, stage="concurrent")


def test_prompt_length_edges_over_nixl_give_the_reference(fleet, request):
    """P/D with prompts shorter than one block, of exactly four blocks, four blocks and one token, and as
    long as the model takes: the decode's tokens are the reference for each."""
    _baselines(fleet.prefill, fleet.decode)  # both engines up: that start is the idle-state contract's
    prompts = list(EDGES.values())
    reference = _reference(request, prompts)
    _, dec = _pd(fleet, prompts, "edges")
    for (name, prompt), ref, out in zip(EDGES.items(), reference, dec["outputs"], strict=True):
        assert out["num_prompt_tokens"] == n_tokens(prompt)
        assert out["token_ids"] == ref, f"{name} ({n_tokens(prompt)} tokens): the decode's tokens != reference"


def test_prompt_length_edges_through_the_cpu_tier_give_the_reference(fleet, request):
    """The same edges through the CPU tier: served once, evicted from the device by fillers, served again.
    Each prompt of a block or more comes back from the CPU tier (cached tokens; the shorter one has no
    full block to keep) and every repeat gives the reference."""
    _baselines(fleet.round_trip)
    prompts = list(EDGES.values())
    reference = _reference(request, prompts)
    engine = fleet.round_trip
    start = engine.ask("counters", stage="edges, counters")
    first = engine.generate(prompts, stage="edges, first pass", max_tokens=MAX_TOKENS)
    filled = engine.generate(round_trip_fillers(600), stage="edges, fillers", max_tokens=4)
    _stored(engine, start, filled, "the first pass")
    again = engine.generate(prompts, stage="edges, repeat", max_tokens=MAX_TOKENS)
    cached = {name: o["num_cached_tokens"] for name, o in zip(EDGES, again["outputs"], strict=True)}
    loads = _transport(again).get("loads", 0) - _transport(first).get("loads", 0)
    record_fact("e2e prompt-length edges via the CPU tier", f"cached tokens on repeat {cached}; {loads} load copies")
    for (name, prompt), ref, a, b in zip(EDGES.items(), reference, first["outputs"], again["outputs"], strict=True):
        assert a["token_ids"] == ref, f"{name} ({n_tokens(prompt)} tokens): first pass != reference"
        assert b["token_ids"] == ref, f"{name} ({n_tokens(prompt)} tokens): repeat via the CPU tier != reference"
        if n_tokens(prompt) > 32:
            assert b["num_cached_tokens"] > 0, f"{name}: recomputed, not loaded from the CPU tier: {cached}"
    assert loads > 0, "the CPU-offload child's worker loaded nothing back for the repeats"


def test_a_prefill_loads_from_its_cpu_tier_then_sends_over_nixl(fleet, request):
    """On the prefill node, a prompt already in its CPU tier (served once, then evicted from the device by
    fillers) is loaded from there for a remote-decode request, and that KV is what the decode reads over
    NIXL: the decode's tokens are the reference."""
    _baselines(fleet.prefill, fleet.decode)
    prompt = FROM_PREFILL_CPU_TIER
    (ref,) = _reference(request, [prompt])
    start = fleet.prefill.ask("counters", stage="prefill node, counters")
    fleet.prefill.generate([prompt], stage="prefill node, first serve", max_tokens=1)
    before = fleet.prefill.generate(pd_fillers(700), stage="prefill node, fillers", max_tokens=1)
    _stored(fleet.prefill, start, before, "the prompt it served")
    pre, dec = _pd(fleet, [prompt], "from the prefill's CPU tier")
    loads = _transport(pre).get("loads", 0) - _transport(before).get("loads", 0)
    cached = pre["outputs"][0]["num_cached_tokens"]
    record_fact("e2e prefill CPU tier -> NIXL", f"prefill cached {cached} tokens, {loads} CPU-tier load copies")
    assert cached > 0 and loads > 0, f"the prefill recomputed the prompt: {cached} cached tokens, {loads} loads"
    assert dec["outputs"][0]["token_ids"] == ref, "the decode of KV loaded from the prefill's CPU tier != reference"


def test_kv_received_over_nixl_is_kept_in_the_decode_cpu_tier_and_served_from_it(fleet, request):
    """On the decode node, KV received over NIXL is stored in its CPU tier: after fillers evict the device
    copy, the same prompt sent to the decode node alone (no prefill) is served from its CPU tier, with
    the reference tokens."""
    _baselines(fleet.prefill, fleet.decode)
    prompt = INTO_DECODE_CPU_TIER
    (ref,) = _reference(request, [prompt])
    start = fleet.decode.ask("counters", stage="decode node, counters")
    _, dec = _pd(fleet, [prompt], "into the decode's CPU tier")
    stores = _transport(dec).get("stores", 0) - start.get("transport", {}).get("stores", 0)
    assert dec["outputs"][0]["token_ids"] == ref, "the decode's tokens != reference"
    assert stores > 0, "the decode stored none of the KV it received over NIXL to its CPU tier"
    before = fleet.decode.generate(pd_fillers(800), stage="decode node, fillers", max_tokens=1)
    alone = fleet.decode.generate([prompt], stage="decode node alone", max_tokens=MAX_TOKENS)
    loads = _transport(alone).get("loads", 0) - _transport(before).get("loads", 0)
    cached = alone["outputs"][0]["num_cached_tokens"]
    record_fact("e2e NIXL -> decode CPU tier", f"{stores} store copies; alone: {cached} cached tokens, {loads} loads")
    assert cached > 0 and loads > 0, f"not served from the decode's CPU tier: {cached} cached tokens, {loads} loads"
    assert alone["outputs"][0]["token_ids"] == ref, "served from the decode's CPU tier: tokens != reference"


def _prefill_batch(fleet, prompts, stage):
    pre = fleet.prefill.generate(
        prompts, stage=stage, max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE) for _ in prompts]
    )
    return [o["kv_transfer_params"] for o in pre["outputs"]]


def _step_until(engine, rid, ok, stage, steps=50):
    for _ in range(steps):
        state = engine.ask("step", stage=stage)["states"].get(rid, {})
        if ok(state):
            return state
    raise AssertionError(f"request {rid} never reached the state to abort it in: {state}")


def test_a_decode_aborted_while_waiting_for_remote_kv_leaks_nothing(fleet, request):
    """A decode-side request aborted while it waits for its remote KV: the engine does not hang, the other
    requests finish with the reference tokens, and neither node holds a block more than at start."""
    reference = _reference(request, ABORT_DECODE)
    _baselines(fleet.prefill, fleet.decode)
    params = _prefill_batch(fleet, ABORT_DECODE, "prefill (decode abort)")
    ids = ["d-abort", "d-1", "d-2"]
    fleet.decode.ask(
        "add",
        stage="decode (abort)",
        requests=[
            {"id": i, "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": proxy_params(k)}
            for i, p, k in zip(ids, ABORT_DECODE, params, strict=True)
        ],
    )
    state = _step_until(fleet.decode, ids[0], lambda s: s.get("status") == "WAITING_FOR_REMOTE_KVS", "decode (abort)")
    fleet.decode.ask("abort", stage="decode (abort)", ids=[ids[0]])
    got = fleet.decode.ask("drain", stage="decode (abort, drain)")["outputs"]
    record_fact("e2e decode abort", f"aborted in {state}; finished {sorted(got)}")
    assert ids[0] not in got or got[ids[0]]["finish_reason"] == "abort", got.get(ids[0])
    for i, ref in zip(ids[1:], reference[1:], strict=True):
        assert got[i]["token_ids"] == ref, f"{i}: tokens != reference beside an aborted request"
    _no_leaks(fleet.prefill, fleet.decode, stage="decode abort")


def test_a_prefill_aborted_mid_prefill_leaks_nothing(fleet, request):
    """A prefill-side request aborted mid-prefill (its prompt computed in part, chunked prefill): the
    other requests finish, their decodes give the reference, and neither node holds a block more than at
    start."""
    t = [time.monotonic()]
    reference = _reference(request, ABORT_PREFILL[1:])
    _baselines(fleet.prefill, fleet.decode)
    t.append(time.monotonic())
    ids = ["p-abort", "p-1", "p-2"]
    fleet.prefill.ask(
        "add",
        stage="prefill (abort)",
        requests=[
            {"id": i, "prompt": p, "max_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE)}
            for i, p in zip(ids, ABORT_PREFILL, strict=True)
        ],
    )
    t.append(time.monotonic())
    state = _step_until(
        fleet.prefill, ids[0], lambda s: 0 < s.get("computed", 0) < s.get("prompt", 0), "prefill (abort)"
    )
    t.append(time.monotonic())
    fleet.prefill.ask("abort", stage="prefill (abort)", ids=[ids[0]])
    t.append(time.monotonic())
    got = fleet.prefill.ask("drain", stage="prefill (abort, drain)")["outputs"]
    t.append(time.monotonic())
    spans = [round(b - a, 1) for a, b in zip(t, t[1:], strict=False)]
    phases = dict(zip(["reference", "add", "steps", "abort", "drain"], spans, strict=True))
    record_fact("e2e prefill abort", f"aborted at {state}; finished {sorted(got)}; seconds {phases}")
    assert ids[0] not in got or got[ids[0]]["finish_reason"] == "abort", got.get(ids[0])
    dec = fleet.decode.generate(
        ABORT_PREFILL[1:],
        stage="decode (after a prefill abort)",
        max_tokens=MAX_TOKENS,
        kv_transfer_params=[proxy_params(got[i]["kv_transfer_params"]) for i in ids[1:]],
    )
    record_fact("e2e decode after a prefill abort", f"{dec['seconds']:.1f}s")
    for i, ref, out in zip(ids[1:], reference, dec["outputs"], strict=True):
        assert out["token_ids"] == ref, f"{i}: tokens != reference beside an aborted prefill"
    _no_leaks(fleet.prefill, fleet.decode, stage="prefill abort")


# The release's metrics the workload moves (kvcompat.testkit.e2e.engine.metrics keys: NAME{label=value}, a
# counter by its family's name, without "_total"), each with the release file that defines it: a metric is
# exported where the decode has it at start (bound at init) or the release's file list has that file (the
# CPU-offload child binds its series on first use).
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"  # prefix-cache hit tokens by the tier that held them
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
OFFLOAD_LOADS = "vllm:simple_kv_offload_load_blocks"
WATCHED = {
    CACHED_BY_SOURCE: "vllm/v1/metrics/cache_hit_source.py",
    NIXL_BYTES: "vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py",
    OFFLOAD_LOADS: "vllm/v1/simple_kv_offload/metrics.py",
}


def _total(metrics: dict, name: str, **labels: str) -> float:
    """The sum of metric ``name`` over the series whose labels include ``labels``."""
    want = {f"{k}={v}" for k, v in labels.items()}
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and want <= set(rest.rstrip("}").split(",")) - {""}:
            total += value
    return total


def test_metrics_move_as_the_workload_says(fleet, request):
    """The release's own metrics, where it exports them, say what the workload did: a prompt through P/D
    moves the decode's NIXL bytes (at least its full blocks' KV) and its prefix-cache hits from p2p; the
    same prompt on the decode alone, evicted from its device, moves its hits from host and the CPU-offload
    child's loaded blocks (one per block of those hits), not p2p.  (SimpleCPUOffload's save outcomes count
    only boundary hand-offs, v1/simple_kv_offload/metrics.py 0.32.0 L185-192 and manager.py L119-139: no store of
    this model's blocks moves them, so they are not watched.)  Not applicable where the
    engines log no stats (the probe: engine.stats_in_process, from the release's source) or where the
    release exports none of these metrics (the probe: the decode's metrics at start); a metric the
    release lacks is named and left out."""
    _baselines(fleet.prefill, fleet.decode)
    for e in (fleet.prefill, fleet.decode):
        ready = e.wait_ready()
        if not ready.get("log_stats"):
            not_applicable(f"the {e.name} engine logs no stats: {ready.get('log_stats_why')}")
    at_start = fleet.decode.wait_ready()["counters"]["metrics"]
    exported = {m for m, f in WATCHED.items() if any(k.partition("{")[0] == m for k in at_start) or has_file(f)}
    missing = sorted(set(WATCHED) - exported)
    if not exported:
        not_applicable(f"this release exports none of {list(WATCHED)} (the decode's metrics at start, its files)")
    (ref,) = _reference(request, [METRICS])
    d0 = fleet.decode.ask("counters", stage="metrics, decode before")["metrics"]
    _, dec = _pd(fleet, [METRICS], "metrics")
    assert dec["outputs"][0]["token_ids"] == ref, "the decode's tokens != reference"
    d1 = dec["counters"]["metrics"]
    fleet.decode.generate(pd_fillers(900), stage="metrics, decode fillers", max_tokens=1)
    d2 = fleet.decode.ask("counters", stage="metrics, decode before alone")["metrics"]
    alone = fleet.decode.generate([METRICS], stage="metrics, decode alone", max_tokens=MAX_TOKENS)
    d3 = alone["counters"]["metrics"]
    assert alone["outputs"][0]["token_ids"] == ref, "served from the decode's CPU tier: tokens != reference"

    def moved(before, after, name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    full_blocks = n_tokens(METRICS) // BLOCK_SIZE
    seen = {
        "P/D: decode p2p hits": moved(d0, d1, CACHED_BY_SOURCE, source="p2p"),
        "P/D: decode NIXL bytes": moved(d0, d1, NIXL_BYTES),
        "alone: decode host hits": moved(d2, d3, CACHED_BY_SOURCE, source="host"),
        "alone: decode p2p hits": moved(d2, d3, CACHED_BY_SOURCE, source="p2p"),
        "alone: decode CPU-offload loaded blocks": moved(d2, d3, OFFLOAD_LOADS),
    }
    record_fact("e2e metrics", f"{seen}; not exported: {missing or 'none'}")
    if CACHED_BY_SOURCE in exported:
        assert seen["P/D: decode p2p hits"] >= full_blocks * BLOCK_SIZE, seen
        assert seen["alone: decode host hits"] > 0 and seen["alone: decode p2p hits"] == 0, seen
    if NIXL_BYTES in exported:
        assert seen["P/D: decode NIXL bytes"] >= full_blocks * kv_bytes_per_block(BLOCK_SIZE), seen
    if OFFLOAD_LOADS in exported:
        hits = (
            seen["alone: decode host hits"]
            if CACHED_BY_SOURCE in exported
            else alone["outputs"][0]["num_cached_tokens"]
        )
        assert seen["alone: decode CPU-offload loaded blocks"] == hits // BLOCK_SIZE > 0, seen
