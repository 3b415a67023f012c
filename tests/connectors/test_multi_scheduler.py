"""Scheduler-side contracts of MultiConnector with a NixlConnector and a CPU-offload child.

Every test drives vLLM's real Scheduler, which builds the MultiConnector and its children through
the release's own factory, with the worker half of every step run by the worker-role MultiConnector
(see conftest).  The children are in the cell's order: MultiConnector's load rule is "the first child,
in config order, that has tokens", so which child loads a request depends on it.
"""

from __future__ import annotations

from packaging.version import Version

from kvcompat.testkit import adapter as va
from kvcompat.testkit import probes, setup_owned_by

from conftest import BLOCK, STORED, assert_every_call_reached_every_child, stored_prefix, token_ids


def _release_at_least(v: str) -> bool:
    return Version(probes.vllm_version()).release >= Version(v).release


def _request_block_ids(engine, req_id: str) -> list[list[int]]:
    """Block ids the scheduler allocated to a live request, per KV-cache group."""
    return [list(g) for g in engine.scheduler.kv_cache_manager.get_block_ids(req_id)]


# ---------------------------------------------------------------------------
# 2. load selection: the first child with tokens loads a remote-prefill request
# ---------------------------------------------------------------------------
def test_remote_prefill_request_is_loaded_by_the_first_child_with_tokens(pd):
    """A decode-side request carrying do_remote_prefill params (vLLM's proxy protocol) whose prompt the
    CPU-offload child also holds is loaded by the first child in config order that has tokens for it:
    with Nixl first, Nixl pulls the whole prompt (async) and the CPU-offload child plans no load; with
    the CPU-offload child first, it loads its stored blocks and Nixl, told of no tokens, still names the
    request to its worker so the prefill side learns it may free its blocks.  MultiConnector binds the
    request to that child until it finishes."""
    from vllm.v1.request import RequestStatus

    p, d = pd
    n = 3 * BLOCK + 5
    prompt = token_ids(n)
    stored_prefix(d, prompt, "warm-1")
    params = p.prefill("decode-1", prompt)
    req = va.make_request("decode-1", prompt, max_tokens=4, kv_transfer_params=params)
    d.scheduler.add_request(req)

    offload_hit = d.offload.get_num_new_matched_tokens(req, 0)[0]
    with setup_owned_by(STORED):  # that the CPU tier serves a stored prompt is that contract
        assert offload_hit == 3 * BLOCK, f"the CPU-offload child holds {offload_hit} tokens, not the 3 stored blocks"
    got = d.multi.get_num_new_matched_tokens(req, 0)
    first = min(d.nixl_index, d.offload_index)
    want = (n, True) if first == d.nixl_index else (offload_hit, True)
    assert got == want, f"MultiConnector returned {got}; the first child with tokens (child {first}) answers {want}"
    assert d.multi._requests_to_connector.get(req.request_id) == first

    so = d.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.multi._requests_to_connector.get(req.request_id) == first
    nixl_meta, offload_meta = d.nixl_meta(so), d.offload_meta(so)
    assert req.request_id in nixl_meta.reqs_to_recv, "Nixl's worker is never told about the remote prefill"
    if first == d.nixl_index:
        assert not va.offload_load_work(offload_meta), "the CPU-offload child must not load a request Nixl loads"
    else:
        assert va.offload_load_work(offload_meta), "the CPU-offload child, first with tokens, plans no load"
    d.run(["decode-1"])
    p.settle()
    assert "decode-1" not in p.scheduler.requests, "the prefill side never freed the blocks it held for D"


# ---------------------------------------------------------------------------
# 3. after a store, the CPU-offload child serves the prefix
# ---------------------------------------------------------------------------
def test_offload_child_loads_prefix_after_store_completes(engine, transport):
    """Once the CPU-offload child has stored a request's full blocks, a new request with the same
    prompt (local GPU prefix cache cleared, no Nixl params) is loaded by the CPU-offload child:
    MultiConnector returns all stored tokens as an async load, binds the request to that child, only
    that child's metadata carries the load, and the loaded tokens count as computed."""
    from vllm.v1.request import RequestStatus

    prompt = token_ids(3 * BLOCK + 5)
    engine.scheduler.add_request(va.make_request("store-src", prompt, max_tokens=2))
    engine.run(["store-src"])
    engine.settle()
    assert "store-src" not in engine.scheduler.requests, "first request was never freed"
    assert transport.stores(), "the CPU-offload child never stored the first request's blocks"
    assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the store completed"

    second = va.make_request("load-dst", prompt, max_tokens=2)
    engine.scheduler.add_request(second)
    assert engine.nixl.get_num_new_matched_tokens(second, 0) == (0, False)
    toks, load_async = engine.multi.get_num_new_matched_tokens(second, 0)
    assert toks == 3 * BLOCK, f"expected the 3 stored blocks ({3 * BLOCK} tokens), got {toks}"
    assert load_async is True
    assert engine.multi._requests_to_connector.get("load-dst") == engine.offload_index

    so = engine.step()
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS or second.num_computed_tokens >= toks
    assert va.offload_load_work(engine.offload_meta(so)), "the CPU-offload child's metadata carries no load"
    assert "load-dst" not in engine.nixl_meta(so).reqs_to_recv
    engine.run(["load-dst"])
    assert second.num_computed_tokens >= toks, "loaded tokens were not counted as computed"


# ---------------------------------------------------------------------------
# 4. store goes to all children
# ---------------------------------------------------------------------------
def test_store_scheduled_on_offload_child_while_nixl_tracks(engine):
    """A prefill-side request (do_remote_decode) is handed to every child: the CPU-offload child
    schedules a store of its full blocks, and NixlConnector tracks the same request for sending (its
    metadata names it in reqs_to_send / reqs_in_batch and its finish delays the block free)."""
    # Two output tokens, so the request lives one step after its prefill: some releases'
    # SimpleCPUOffload (e.g. 0.22.1) store only blocks confirmed computed in an earlier step.
    prompt = token_ids(3 * BLOCK + 5)
    req = va.make_request("prefill-1", prompt, max_tokens=2, kv_transfer_params=va.remote_decode_params())
    engine.scheduler.add_request(req)
    engine.step()
    blocks = _request_block_ids(engine, "prefill-1")[0]
    for _ in range(3):
        engine.step()

    store_work = [va.offload_store_work(m.metadata[engine.offload_index]) for m in engine.metas]
    stored_gpu_blocks: set[int] = set()
    store_reqs: set[str] = set()
    for w in store_work:
        if isinstance(w, dict):
            store_reqs |= set(w)
        elif w:
            stored_gpu_blocks |= set(w)
    assert store_reqs == {"prefill-1"} or set(blocks[:3]) <= stored_gpu_blocks, (
        f"CPU-offload child scheduled no store of the request's full blocks {blocks[:3]}: {store_work}"
    )

    nixl_named = set()
    for m in engine.metas:
        nm = m.metadata[engine.nixl_index]
        nixl_named |= set(getattr(nm, "reqs_to_send", {}) or {})
        nixl_named |= set(getattr(nm, "reqs_in_batch", set()) or set())
    assert "prefill-1" in nixl_named, "NixlConnector's metadata never named the request"
    assert "prefill-1" in engine.scheduler.requests, "Nixl's pending send must keep the blocks"


# ---------------------------------------------------------------------------
# 5. metadata aggregation
# ---------------------------------------------------------------------------
def test_metadata_one_entry_per_child_in_config_order(pd):
    """build_connector_meta returns a MultiKVConnectorMetadata with exactly one entry per child, in
    config order: Nixl's metadata (carrying the remote-prefill request) at Nixl's place, the CPU-offload
    child's (carrying the store of another request) at its own."""
    MultiConnector, MultiMeta = va.multi_classes()
    NixlConnector, NixlMeta = va.nixl_classes()
    OffloadConnector, OffloadMeta = va.offload_classes()

    p, engine = pd
    assert isinstance(engine.multi, MultiConnector)
    assert isinstance(engine.nixl, NixlConnector)
    assert isinstance(engine.offload, OffloadConnector)

    prompt = token_ids(2 * BLOCK + 3)
    remote = va.make_request("decode-2", prompt, max_tokens=4, kv_transfer_params=p.prefill("decode-2", prompt))
    local = va.make_request("local-2", token_ids(3 * BLOCK + 5, start=200), max_tokens=3)
    engine.scheduler.add_request(remote)
    engine.scheduler.add_request(local)
    for _ in range(3):
        engine.step()

    for meta in engine.metas:
        assert type(meta) is MultiMeta
        assert isinstance(meta.metadata, tuple) and len(meta.metadata) == 2
        assert isinstance(meta.metadata[engine.nixl_index], NixlMeta), type(meta.metadata[engine.nixl_index])
        assert isinstance(meta.metadata[engine.offload_index], OffloadMeta), type(meta.metadata[engine.offload_index])
    assert "decode-2" in engine.metas[0].metadata[engine.nixl_index].reqs_to_recv
    with setup_owned_by(STORED):  # that the child schedules stores at all is that contract
        assert any(va.offload_store_work(m.metadata[engine.offload_index]) for m in engine.metas), (
            "no step carried the CPU-offload child's store work in its entry"
        )
    engine.run(["decode-2", "local-2"])


# ---------------------------------------------------------------------------
# 6. finishing a plain request
# ---------------------------------------------------------------------------
def test_plain_request_finish_has_no_async_save_and_cleans_up(engine):
    """A request with no transfer params and nothing to store (prompt shorter than a block) finishes
    through request_finished / request_finished_all_groups (whichever the scheduler calls) with no
    async save: its blocks are freed at once, no kv_transfer_params are returned, and MultiConnector's
    per-request bookkeeping is empty."""
    req = va.make_request("plain-1", token_ids(BLOCK - 7), max_tokens=1)
    engine.scheduler.add_request(req)
    engine.step()

    out = engine.finished_output("plain-1")
    assert out is not None, "request did not finish"
    assert out.kv_transfer_params is None
    assert "plain-1" not in engine.scheduler.requests, "blocks kept: an async save was reported"
    assert "plain-1" not in engine.multi._requests_to_connector
    assert "plain-1" not in engine.multi._extra_async_saves
    engine.step()
    assert not engine.multi._requests_to_connector
    assert not engine.multi._extra_async_saves


# ---------------------------------------------------------------------------
# 7. prefill side returns Nixl's params
# ---------------------------------------------------------------------------
def test_prefill_finish_returns_nixl_transfer_params(engine):
    """A prefill-side request (do_remote_decode=True) that finishes returns NixlConnector's transfer
    params through MultiConnector: do_remote_prefill True, remote_engine_id equal to Nixl's engine id,
    host and port, remote_request_id (from 0.13) and the request's block ids; its blocks are held for
    the remote decode."""
    prompt = token_ids(3 * BLOCK + 5)
    req = va.make_request("prefill-2", prompt, max_tokens=1, kv_transfer_params=va.remote_decode_params())
    engine.scheduler.add_request(req)
    engine.step()
    out = engine.finished_output("prefill-2")
    assert out is not None, "request did not finish"
    params = out.kv_transfer_params
    assert params is not None, "MultiConnector returned no kv_transfer_params"

    engine_id = engine.vllm_config.kv_transfer_config.engine_id
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == engine_id
    assert params["remote_engine_id"] == engine.nixl._kv_transfer_config.engine_id
    assert params.get("remote_host")
    assert isinstance(params.get("remote_port"), int)
    if _release_at_least("0.13.0"):
        assert params.get("remote_request_id") == "prefill-2"

    held = _request_block_ids(engine, "prefill-2")
    rbi = params["remote_block_ids"]
    if rbi and isinstance(rbi[0], (list, tuple)):
        assert [list(g) for g in rbi] == held
    else:
        assert list(rbi) == held[0]
    assert "prefill-2" in engine.scheduler.requests, "blocks must be held for the remote read"
    assert "prefill-2" not in engine.multi._requests_to_connector


# ---------------------------------------------------------------------------
# 8. every scheduler step reaches every child
# ---------------------------------------------------------------------------
def test_every_scheduler_step_reaches_every_child(engine, monkeypatch):
    """Each scheduler hook MultiConnector gets (a new request, after allocation, building the step's
    metadata, the workers' output, a request finished) reaches every child as often, and the workers'
    output reaches each child with that child's own worker metadata (never another child's)."""
    from kvcompat.testkit.adapter import children as ch

    base = ch.base_class()
    hooks = ["update_state_after_alloc", "build_connector_meta", "update_connector_output"]
    hooks += [h for h in ("on_new_request",) if hasattr(base, h)]
    finish = [h for h in ("request_finished", "request_finished_all_groups") if hasattr(engine.multi, h)]
    seen_meta: list[list] = [[], []]
    got_multi = {h: ch.spy(monkeypatch, engine.multi, h) for h in hooks}
    got_kids = []
    for i, c in enumerate(engine.multi._connectors):
        spies = {h: ch.spy(monkeypatch, c, h) for h in hooks if h != "update_connector_output"}
        real = c.update_connector_output

        def update(output, _i=i, _real=real):
            seen_meta[_i].append(getattr(output, "kv_connector_worker_meta", None))
            return _real(output)

        spies["update_connector_output"] = ch.spy(monkeypatch, c, "update_connector_output", update)
        spies.update({h: ch.spy(monkeypatch, c, h) for h in finish})
        got_kids.append(spies)
    prompt = token_ids(3 * BLOCK + 5)
    engine.scheduler.add_request(va.make_request("hooks", prompt, max_tokens=2))
    engine.run(["hooks"])
    engine.settle()
    assert_every_call_reached_every_child(got_multi, got_kids, hooks, "scheduler")
    finished = [sum(len(k[h]) for h in finish) for k in got_kids]
    assert finished == [1, 1], f"the finished request reached the children {finished} times"
    for i, metas in enumerate(seen_meta):
        for outer, mine in zip(got_multi["update_connector_output"].args, metas, strict=True):
            whole = getattr(outer[0], "kv_connector_worker_meta", None)
            if whole is not None and hasattr(whole, "metadata"):
                assert mine is whole.metadata[i], f"child {i} was handed another child's worker metadata"
