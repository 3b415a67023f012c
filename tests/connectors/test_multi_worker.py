"""The worker half of MultiConnector(Nixl + CPU offload): what a worker does every step, on CPU.

Every engine here runs, each step, the worker-role MultiConnector the release's factory builds with
its real children, through the release's own model-runner code (kvcompat.testkit.adapter.worker).
NIXL is the fake agent (kvcompat.testkit.fake_nixl); SimpleCPUOffload's worker (0.19+) runs as
shipped with its CUDA transport replaced by kvcompat.testkit.cuda_transport, so the KV blocks it
stores to the CPU tier and loads back are real bytes; up to 0.18 OffloadingConnector's transfers are
scripted (kvcompat.testkit.adapter.offload_script).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, setup_owned_by
from kvcompat.testkit.adapter import children as ch
from kvcompat.testkit.fake_nixl import FakeNixlWrapper

from conftest import (
    BLOCK,
    STORED,
    assert_every_call_reached_every_child,
    patient_steps,
    pd_read_is_byte_exact,
    stored_prefix,
    token_ids,
)


def _agents(fake_nixl) -> list[FakeNixlWrapper]:
    return list(fake_nixl.instances)


def _assert_dram_registration(agent: FakeNixlWrapper, caches: dict[str, Any]) -> None:
    regs = agent.calls_named("register_memory")
    assert regs, "NixlConnector never registered memory with NIXL"
    descs = [d for call in regs for d in call.args[0].descs]
    mem_types = {call.args[0].mem_type for call in regs}
    assert mem_types == {"DRAM"}, f"CPU KV caches must be registered as DRAM, got {mem_types}"
    spans = sorted((int(d[0]), int(d[0]) + int(d[1])) for d in descs)
    for name, t in caches.items():
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        pos = start
        for s, e in spans:  # union of registered regions must cover the layer
            if s <= pos < e:
                pos = e
        assert pos >= end, f"layer {name} [{start:#x}, {end:#x}) not covered by registered regions"


def _scrub(engine) -> None:
    """Overwrite every GPU KV cache, as other requests' KV would: freed blocks keep no old prefix."""
    for rank in engine.ranks:
        for cache in rank.kv_caches.values():
            cache.fill_(-1.0)


# ---------------------------------------------------------------------------
# 1. the worker side comes up: KV caches registered with every child
# ---------------------------------------------------------------------------
def test_register_kv_caches_reaches_every_child(
    release, tiny_model_dir, nixl_agent, single_rank_distributed, transport, monkeypatch
):
    """The worker-role MultiConnector the factory builds has both children, and registering the KV
    caches (as the model runner does) reaches every child: Nixl registers DRAM regions covering every
    layer with its NIXL agent, and the CPU-offload child's worker sets up its CPU tier (SimpleCPUOffload:
    a CPU block count the engine asks for at startup).  Without it the CPU-offload child can never
    store, and from 0.34 the engine refuses to start."""
    cfg = va.make_vllm_config(tiny_model_dir, num_gpu_blocks=16)
    kvc = va.make_kv_cache_config(16)
    rank = va.build_rank(cfg, kvc)
    try:
        nixl_cls, _ = va.nixl_classes()
        offload_cls, _ = va.offload_classes()
        order = va.child_order()
        kids = rank.connector._connectors
        assert isinstance(kids[va.child_index("nixl", order)], nixl_cls)
        assert isinstance(kids[va.child_index("offload", order)], offload_cls)
        va.prepare_offload_worker(rank, transport)
        copy_ops = [
            ch.spy(monkeypatch, c, "set_host_xfer_buffer_ops") for c in kids if hasattr(c, "set_host_xfer_buffer_ops")
        ]
        rank.register()
        assert [len(c) for c in copy_ops] in ([], [1, 1]), (
            f"the host-buffer copy op (Nixl's, for a CPU buffer on a GPU) reached the children {[len(c) for c in copy_ops]} times"
        )
        (agent,) = _agents(nixl_agent)
        _assert_dram_registration(agent, rank.kv_caches)
        handler = va.offload_worker_handler(kids[va.child_index("offload", order)])
        assert handler is not None, "the CPU-offload child has no worker"
        if hasattr(handler, "num_cpu_blocks"):
            assert handler.num_cpu_blocks > 0, "the CPU-offload worker set up no CPU blocks"
            assert va.report_offload_blocks(cfg, [rank]) in (None, handler.num_cpu_blocks)
        else:
            assert len(handler.worker.handlers) == 2, "OffloadingConnector registered no transfer handlers"
    finally:
        rank.shutdown()


def test_cross_layer_kv_cache_reaches_every_child(engine, monkeypatch):
    """Where the model runner registers one KV cache for all layers (a uniform layout the connector
    prefers), MultiConnector hands that cache and its attention backend to every child, as it does the
    per-layer caches."""
    multi = engine.worker
    if "register_cross_layers_kv_cache" not in vars(type(multi)):
        not_applicable("MultiConnector has no register_cross_layers_kv_cache in this release")
    calls = [ch.spy(monkeypatch, c, "register_cross_layers_kv_cache", lambda *a: None) for c in multi._connectors]
    cache, backend = object(), object()
    multi.register_cross_layers_kv_cache(cache, backend)
    assert [c.args for c in calls] == [[(cache, backend)], [(cache, backend)]], (
        f"the cross-layer KV cache reached the children {[len(c) for c in calls]} times"
    )


# ---------------------------------------------------------------------------
# 2. every worker step reaches every child
# ---------------------------------------------------------------------------
def _worker_hooks() -> list[str]:
    """The worker hooks the release's model runner calls on the connector, every step or per layer."""
    base = ch.base_class()
    hooks = ["bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"]
    hooks.append(ch.completion_hook())
    hooks += [h for h in ("get_block_ids_with_load_errors", "build_connector_worker_meta") if hasattr(base, h)]
    if (
        hasattr(base, "handle_preemptions")
        and "preempted_req_ids" not in inspect.signature(base.handle_preemptions).parameters
    ):
        hooks.append("handle_preemptions")  # every step from 0.19 (with the step's metadata)
    if va.model_runner() == "v2" and hasattr(base, "finish_forward"):
        hooks.append("finish_forward")
    return hooks + ["clear_connector_metadata"]


def test_every_worker_step_reaches_every_child(engine, monkeypatch):
    """Each worker hook the model runner calls on MultiConnector (bind the metadata, start loads, per
    layer wait for loads and save, wait for saves, collect finished transfers, load errors and worker
    metadata, preemptions, clear) reaches every child as often as MultiConnector gets it, and binding
    gives each child its own entry of the step's metadata: a hook not forwarded leaves a child's loads
    never started (requests wait forever) or its stores never launched."""
    hooks = _worker_hooks()
    multi = engine.worker
    got_multi = {h: ch.spy(monkeypatch, multi, h) for h in hooks}
    got_kids = [{h: ch.spy(monkeypatch, c, h) for h in hooks} for c in multi._connectors]
    prompt = token_ids(3 * BLOCK + 5)
    # A request whose blocks the CPU tier stores, then one with the same prompt that it loads (where the
    # release stores at all: the hooks are forwarded or not either way).
    engine.scheduler.add_request(va.make_request("steps-src", prompt, max_tokens=2))
    engine.run(["steps-src"])
    engine.settle()
    engine.scheduler.reset_prefix_cache()
    _scrub(engine)
    engine.scheduler.add_request(va.make_request("steps-dst", prompt, max_tokens=2))
    engine.run(["steps-dst"])
    engine.settle()
    assert_every_call_reached_every_child(got_multi, got_kids, hooks, "model runner")
    for i, kid in enumerate(got_kids):
        bound = [a[0] for a in kid["bind_connector_metadata"].args]
        expected = [a[0].metadata[i] for a in got_multi["bind_connector_metadata"].args]
        assert all(b is e for b, e in zip(bound, expected, strict=True)), (
            f"child {i} was bound another child's metadata"
        )


# ---------------------------------------------------------------------------
# 3. the CPU tier round trip, byte for byte
# ---------------------------------------------------------------------------
def test_cpu_tier_round_trip_is_byte_exact(engine, transport):
    """A prompt's full blocks stored to the CPU tier by the CPU-offload child's own worker, and loaded
    back into other GPU blocks for a new request with the same prompt, hold exactly the KV the forward
    pass wrote (every layer, K and V, every byte); the request resumes from them and finishes.  Where
    the child's transfers are scripted (OffloadingConnector, up to 0.18) the stores and the load are
    checked, the bytes cannot be."""
    prompt = token_ids(3 * BLOCK + 5)
    stored_prefix(engine, prompt, "trip-src")
    stores = len(transport.stores())
    _scrub(engine)
    from vllm.v1.request import RequestStatus

    req = va.make_request("trip-dst", prompt, max_tokens=3)
    engine.scheduler.add_request(req)
    for _ in patient_steps(30):  # the copy thread completes the load
        engine.step()
        if req.status == RequestStatus.RUNNING:  # its load has finished and it computes again
            break
    assert req.status == RequestStatus.RUNNING, f"the request never resumed after its load ({req.status})"
    assert req.num_computed_tokens >= 3 * BLOCK, f"only {req.num_computed_tokens} tokens after the load"
    assert transport.loads(), "the CPU-offload child's worker loaded nothing back"
    if va.offload_worker_kind() == va.REAL:
        blocks = va.group_block_ids(engine.scheduler.kv_cache_manager.get_block_ids("trip-dst"))[:3]
        compared = 0
        for rank in engine.ranks:
            for layer, cache in rank.kv_caches.items():
                for j, block_id in enumerate(blocks):
                    want = va.expected_block(cache, layer, prompt[: (j + 1) * BLOCK])
                    got = va.kv_cache_block(cache, block_id)
                    assert va.same_bytes(got, want), (
                        f"block {j} of the prompt (GPU block {block_id}, {layer}, rank {rank.rank}) holds other "
                        "bytes than the forward pass wrote: the CPU tier round trip lost or mixed up KV"
                    )
                    compared += 1
        print(
            f"CPU tier round trip: {stores} store copies, {len(transport.loads())} load copies; "
            f"{len(blocks)} blocks x {compared // len(blocks)} layer views compared byte for byte: equal"
        )
    engine.run(["trip-dst"])


# ---------------------------------------------------------------------------
# 4. worker metadata: routed to its child, added up over ranks
# ---------------------------------------------------------------------------
def _children_make_worker_metadata(engine) -> bool:
    base = ch.base_class()
    if not hasattr(base, "build_connector_worker_meta"):
        return False
    return any(
        type(c).build_connector_worker_meta is not base.build_connector_worker_meta for c in engine.worker._connectors
    )


def _wait_for_copies(transport, n: int, timeout: float = 10.0) -> None:
    """Wait until the workers' copy threads have handed ``n`` transfers to the transport."""
    deadline = time.monotonic() + timeout
    while transport.launched() < n:
        assert time.monotonic() < deadline, (
            f"the CPU-offload workers launched {transport.launched()} transfers, not {n}"
        )
        time.sleep(0.002)


def test_worker_metadata_reaches_its_child_and_two_ranks_add_up(make_engine, transport):
    """With two TP ranks, each rank's worker reports its stores done in its own worker metadata; in
    the step where both report, the release's aggregator adds them up through MultiConnector's worker
    metadata, and MultiConnector hands the CPU-offload child its slot: the stores complete (the child
    waits for every rank), the blocks are freed, and the CPU tier serves the prompt.  Metadata handed
    to the wrong child, or one rank's report dropped, pins the blocks for good."""
    engine = make_engine(tensor_parallel_size=2)
    if not _children_make_worker_metadata(engine):
        not_applicable("no child of this release reports worker metadata (build_connector_worker_meta)")
    baseline = engine.free_blocks()
    prompt = token_ids(3 * BLOCK + 5)
    transport.hold()
    engine.scheduler.add_request(va.make_request("ranks-src", prompt, max_tokens=2))
    engine.run(["ranks-src"])
    for _ in range(3):
        engine.step()
    with setup_owned_by(STORED):  # both ranks launched their stores: their reports land in one step
        _wait_for_copies(transport, 2)
    transport.release()
    engine.settle()
    assert engine.free_blocks() == baseline, "the stores never completed on both ranks: blocks stay pinned"
    assert engine.scheduler.reset_prefix_cache()
    dst = va.make_request("ranks-dst", prompt, max_tokens=2)
    engine.scheduler.add_request(dst)
    toks, _ = engine.multi.get_num_new_matched_tokens(dst, 0)
    assert toks == 3 * BLOCK, f"the CPU tier serves {toks} tokens of the stored prompt, not {3 * BLOCK}"


# ---------------------------------------------------------------------------
# 5. the engine keeps stepping while stores are in flight
# ---------------------------------------------------------------------------
def test_engine_keeps_stepping_until_stores_complete(engine, transport):
    """When the last request finishes while the CPU-offload child's stores are still in flight, the
    engine keeps stepping (the scheduler has work: MultiConnector reports a child's pending push work)
    until they complete, and only then is the free-block count back at its baseline.  An engine that
    goes idle with stores in flight leaves their GPU blocks pinned, and resetting the prefix cache
    fails until new traffic arrives."""
    baseline = engine.free_blocks()
    transport.hold()
    engine.scheduler.add_request(va.make_request("flight", token_ids(3 * BLOCK + 5), max_tokens=2))
    engine.run(["flight"])
    for _ in range(2):
        engine.step()
    with setup_owned_by(STORED):  # that the child stores at all is that test's contract
        _wait_for_copies(transport, 1)
    assert engine.scheduler.has_requests(), "the engine has no work although stores are in flight"
    assert engine.free_blocks() < baseline, "the blocks of stores in flight were freed before they completed"
    transport.release()
    steps = engine.run_until_idle()  # the contract: EngineCore's loop, driven by has_requests()
    assert engine.free_blocks() == baseline, (
        f"the engine went idle after {steps} steps with {baseline - engine.free_blocks()} blocks still pinned "
        "by stores that completed meanwhile"
    )
    assert engine.scheduler.reset_prefix_cache(), "prefix cache reset fails once the engine is idle"


# ---------------------------------------------------------------------------
# 6. Nixl: the prefill side's send completes when the decode side has read
# ---------------------------------------------------------------------------
def test_prefill_blocks_freed_once_the_decode_side_has_read(engine, nixl_agent):
    """A prefill-side request's blocks stay held after it finishes until the Nixl child's worker hears
    (a NIXL notification) that the decode side read them; MultiConnector reports that send as
    finished, and the scheduler frees the blocks."""
    baseline = engine.free_blocks()
    req = va.make_request("pd-send", token_ids(BLOCK - 5), max_tokens=1, kv_transfer_params=va.remote_decode_params())
    engine.scheduler.add_request(req)
    engine.run(["pd-send"])
    for _ in range(3):
        engine.step()
    assert "pd-send" in engine.scheduler.requests, "blocks freed before the decode side read them"
    (agent,) = _agents(nixl_agent)
    agent.inject_notif("decode-agent", b"pd-send:1")
    engine.settle()
    for _ in range(3):
        if "pd-send" not in engine.scheduler.requests:
            break
        engine.step()
    assert "pd-send" not in engine.scheduler.requests, "the finished send never freed the request's blocks"
    assert engine.free_blocks() == baseline
    assert agent.calls_named("get_new_notifs"), "Nixl never polled NIXL notifications"


def test_worker_nixl_child_registers_cpu_kv_caches(release, tiny_model_dir, nixl_agent, single_rank_distributed):
    """On CPU, the Nixl child alone (built as MultiConnector builds it, with the fake NIXL agent)
    registers the CPU KV caches as DRAM regions covering every layer."""
    cfg = va.make_vllm_config(tiny_model_dir, num_gpu_blocks=16)
    kvc = va.make_kv_cache_config(16)
    index = va.child_index("nixl")
    rank = va.build_rank(cfg, kvc, build=lambda c, role, k: va.multi_child_connector(c, role, k, index))
    try:
        nixl_cls, _ = va.nixl_classes()
        assert isinstance(rank.connector, nixl_cls)
        with va.kv_transfer_group(rank.connector):
            rank.connector.register_kv_caches(rank.kv_caches)
        (agent,) = _agents(nixl_agent)
        _assert_dram_registration(agent, rank.kv_caches)
    finally:
        rank.shutdown()


# ---------------------------------------------------------------------------
# 7. P/D: the decode side reads what the prefill side computed
# ---------------------------------------------------------------------------
def test_decode_reads_exactly_the_kv_the_prefill_side_computed(pd):
    """vLLM's P/D protocol between two engines, each MultiConnector(Nixl + CPU offload): D's Nixl worker
    reads (over the fake NIXL transport, which moves bytes between the two agents of this process)
    the blocks P holds for it; D's blocks hold exactly the KV P's forward pass wrote, D finishes, and
    P frees its blocks once D has read them."""
    p, d = pd
    print(pd_read_is_byte_exact(p, d, "pd-fake-0", token_ids(3 * BLOCK + 5, start=120)))
