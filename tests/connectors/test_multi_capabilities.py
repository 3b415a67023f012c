"""What MultiConnector composes from its children: capabilities, per-request answers, stats, shutdown.

MultiConnector answers for the deployment: the KV-cache layout and access the engine prepares for,
whether sleep mode is allowed, which child a cache hit came from and which KV-cache groups it
restored, the transfer stats users see, and whether shutting down went well.  Each answer must come
from its children (all of them, or the one loading the request); each test compares MultiConnector's
answer with the children's own, in the cell's child order.  A capability this release's connector
API does not have is not applicable (an explicit probe of the base class).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable
from kvcompat.testkit.adapter import children as ch

from conftest import BLOCK, token_ids


def _child_classes_and_configs(vllm_config) -> list[tuple[type, Any]]:
    MultiConnector, _ = va.multi_classes()
    return MultiConnector._get_connector_classes_and_configs(vllm_config)


def _ktc_with_nixl(engine, **nixl_overrides) -> Any:
    """The engine's KVTransferConfig with the Nixl child's entry changed (another deployment's)."""
    from vllm.config import KVTransferConfig

    ktc = engine.vllm_config.kv_transfer_config
    kids = [dict(c) for c in ktc.kv_connector_extra_config["connectors"]]
    kids[engine.nixl_index].update(nixl_overrides)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=ktc.kv_role,
        kv_buffer_device="cpu",
        engine_id=ktc.engine_id,
        kv_connector_extra_config={"connectors": kids},
    )


def _child_ktc(parent: Any, child: dict) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**{"engine_id": parent.engine_id, **child})


# ---------------------------------------------------------------------------
# KV-cache layout
# ---------------------------------------------------------------------------
def test_required_kv_cache_layout_is_the_nixl_childs(engine):
    """The KV-cache layout MultiConnector requires is the one its Nixl child requires (HND, LBHNC from
    0.29), whatever the order: the engine allocates its KV cache in it, so a MultiConnector prefill and
    a plain-Nixl decode lay out blocks the same way.  A layout lost in the composition makes them
    disagree and corrupts every transfer between them."""
    MultiConnector, _ = va.multi_classes()
    NixlConnector, _ = va.nixl_classes()
    answers = [
        (cls.__name__, cls.get_required_kvcache_layout(cfg))
        for cls, cfg in _child_classes_and_configs(engine.vllm_config)
    ]
    nixl_cls, nixl_cfg = _child_classes_and_configs(engine.vllm_config)[engine.nixl_index]
    assert issubclass(nixl_cls, NixlConnector)
    nixl_layout = nixl_cls.get_required_kvcache_layout(nixl_cfg)
    assert nixl_layout is not None, f"the Nixl child requires no layout here: {answers}"
    got = MultiConnector.get_required_kvcache_layout(engine.vllm_config)
    assert got == nixl_layout, f"MultiConnector requires {got!r}; its children require {answers}"


# ---------------------------------------------------------------------------
# KV-cache access (0.34)
# ---------------------------------------------------------------------------
def test_kv_cache_access_is_composed_from_every_child(engine):
    """How the deployment reaches the device KV cache is every child's need together: with Nixl on a
    GPU buffer (REGISTERS | EXPORTS_FABRIC) the engine must allocate a registrable, exportable cache,
    whichever child comes first; with Nixl on a CPU buffer nothing beyond in-process access."""
    MultiConnector, _ = va.multi_classes()
    if "kv_cache_access" not in vars(ch.base_class()):
        not_applicable("the release's connector API has no kv_cache_access")
    factory = importlib.import_module(va.KV_BASE + ".factory").KVConnectorFactory
    for buffer_device in ("cuda", "cpu"):
        ktc = _ktc_with_nixl(engine, kv_buffer_device=buffer_device)
        kids = [_child_ktc(ktc, c) for c in ktc.kv_connector_extra_config["connectors"]]
        want = 0
        for k in kids:
            want |= factory.get_connector_class(k).kv_cache_access(k)
        got = MultiConnector.kv_cache_access(ktc)
        assert got == want, f"Nixl on {buffer_device}: MultiConnector says {got!r}, its children need {want!r}"
    assert MultiConnector.kv_cache_access(_ktc_with_nixl(engine, kv_buffer_device="cuda")), (
        "a GPU-buffer Nixl child's access is lost: the engine would allocate a cache NIXL cannot register"
    )


# ---------------------------------------------------------------------------
# sleep mode (0.33)
# ---------------------------------------------------------------------------
def test_sleep_mode_only_when_every_child_supports_it(engine):
    """Sleep mode is allowed for MultiConnector only when every child supports it: with Nixl on UCX
    (supported) and the CPU-offload child, yes; with Nixl on another backend (not validated for sleep
    mode), no, whatever the order: the engine must refuse enable_sleep_mode rather than break Nixl."""
    MultiConnector, _ = va.multi_classes()
    if "supports_sleep_mode" not in vars(ch.base_class()):
        not_applicable("the release's connector API has no supports_sleep_mode")
    factory = importlib.import_module(va.KV_BASE + ".factory").KVConnectorFactory
    for backends in (["UCX"], ["UCX", "GDS"]):
        extra = {"backends": backends}
        ktc = _ktc_with_nixl(engine, kv_connector_extra_config=extra)
        kids = [_child_ktc(ktc, c) for c in ktc.kv_connector_extra_config["connectors"]]
        want = all(factory.get_connector_class(k).supports_sleep_mode(k) for k in kids)
        got = MultiConnector.supports_sleep_mode(ktc)
        assert got is want, f"Nixl on {backends}: MultiConnector says {got}, its children {want}"


# ---------------------------------------------------------------------------
# per-request answers: the loading child's
# ---------------------------------------------------------------------------
def test_cache_hit_source_and_restored_groups_are_the_loading_childs(release, request):
    """For a request a child loads, MultiConnector reports that child's cache-hit source (the
    prompt-tokens-by-source metric: host for the CPU tier, p2p for Nixl) and that child's restored
    KV-cache groups (which decide the blocks the scheduler zeroes), never the other child's."""
    if not hasattr(ch.base_class(), "get_external_cache_hit_sources"):
        not_applicable("the release's connector API has no cache-hit sources (get_external_cache_hit_sources)")
    p, d = request.getfixturevalue("pd")
    local = token_ids(3 * BLOCK + 5)
    d.scheduler.add_request(va.make_request("src", local, max_tokens=2))
    d.run(["src"])
    d.settle()
    assert d.scheduler.reset_prefix_cache()
    remote_prompt = token_ids(3 * BLOCK + 5, start=200)
    cases = {
        "offload": va.make_request("from-cpu", local, max_tokens=2),
        "nixl": va.make_request(
            "from-p", remote_prompt, max_tokens=2, kv_transfer_params=p.prefill("from-p", remote_prompt)
        ),
    }
    for kind, req in cases.items():
        d.scheduler.add_request(req)
        toks, _ = d.multi.get_num_new_matched_tokens(req, 0)
        assert toks, f"no child has tokens for the {kind} request"
        loader = d.multi._connectors[{"nixl": d.nixl_index, "offload": d.offload_index}[kind]]
        other = d.multi._connectors[1 - d.multi._connectors.index(loader)]
        want = loader.get_external_cache_hit_sources(req, toks)
        got = d.multi.get_external_cache_hit_sources(req, toks)
        assert got == want, f"{kind} load: MultiConnector reports sources {got}, the loading child {want}"
        assert got != other.get_external_cache_hit_sources(req, toks), "both children report the same source"
        if hasattr(ch.base_class(), "get_loaded_kv_cache_group_ids"):
            want_groups = loader.get_loaded_kv_cache_group_ids(req)
            assert d.multi.get_loaded_kv_cache_group_ids(req) == want_groups
    d.run(["from-cpu", "from-p"])


# ---------------------------------------------------------------------------
# stats: per child, added up over ranks and steps
# ---------------------------------------------------------------------------
def _counted_stats_class() -> type:
    Stats = ch.kv_connector_stats_class()

    @dataclasses.dataclass
    class Counted(Stats):
        def aggregate(self, other):
            return Counted(data={"n": self.data.get("n", 0) + other.data.get("n", 0)})

        def reset(self):
            self.data = {"n": 0}

        def reduce(self):
            return dict(self.data)

        def is_empty(self):
            return not self.data.get("n")

    return Counted


def test_transfer_stats_add_up_across_ranks_and_steps(make_engine, monkeypatch):
    """The transfer stats reach the user per child: what Nixl's worker reports on each rank is added
    up by the release's aggregator, the CPU-offload child's own stats (kept on the scheduler side,
    from 0.31) join them under its name, and a step's stats added to the next ones (as the stats
    logger does) keep each child's running total: both children report in every step, so a fold
    that keeps only one child's later steps is seen."""
    if ch.kv_connector_stats_class() is None or not ch.multi_overrides("get_kv_connector_stats"):
        not_applicable("no KV-connector stats in this release")
    Counted = _counted_stats_class()
    engine = make_engine(tensor_parallel_size=2)
    for rank in engine.ranks:  # Nixl's worker reports one unit of transfer per step on each rank
        ch.spy(
            monkeypatch,
            rank.connector._connectors[engine.nixl_index],
            "get_kv_connector_stats",
            lambda: Counted(data={"n": 1}),
        )
    nixl_name = type(engine.worker._connectors[engine.nixl_index]).__name__
    offload_name = type(engine.offload).__name__
    offload_own = engine.offload.get_kv_connector_stats()  # the scheduler-side child's own stats, if any
    # The CPU-offload child reports one unit per step too, on the side the release collects it from:
    # the scheduler's own connector where update_from_output asks it (0.31+), else each worker rank.
    import inspect

    scheduler_side = "connector.get_kv_connector_stats()" in inspect.getsource(
        type(engine.scheduler).update_from_output
    )
    offload_reporters = (
        [engine.offload] if scheduler_side else [r.connector._connectors[engine.offload_index] for r in engine.ranks]
    )
    for c in offload_reporters:
        ch.spy(monkeypatch, c, "get_kv_connector_stats", lambda: Counted(data={"n": 1}))
    engine.scheduler.add_request(va.make_request("stats", token_ids(BLOCK + 5), max_tokens=3))
    steps = 3
    for _ in range(steps):
        engine.step()
    per_step = [o.kv_connector_stats for o in engine.kv_outputs[-steps:]]
    # The reference: each child's stats added up on their own (copies: aggregate may work in place).
    expected = {}
    for s in copy.deepcopy(per_step):
        for name, child in s.data.items():
            expected[name] = expected[name].aggregate(child) if name in expected else child
    for s in per_step:
        assert s is not None, "a step's stats never reached the scheduler"
        assert s.data[nixl_name].data["n"] == 2, f"one step, two ranks: {s.data}"
    total = per_step[0]
    for s in per_step[1:]:
        total = total.aggregate(s)
    assert total.data[nixl_name].data["n"] == 2 * steps, f"{steps} steps, two ranks: {total.data}"
    assert offload_name in total.data, f"the CPU-offload child's stats were dropped: {sorted(total.data)}"
    want = len(offload_reporters) * steps
    assert total.data[offload_name].data["n"] == want, f"{steps} steps of the CPU-offload child: {total.data}"
    # What the stats logger prints and serializes: every child's own, under its name, added up.
    reduced = total.reduce()
    assert reduced == {k: v.reduce() for k, v in expected.items()}, f"reduce(): {reduced}"
    if hasattr(total, "to_dict"):
        assert set(total.to_dict()) == set(expected), f"to_dict(): {sorted(total.to_dict())}"
    assert not total.is_empty(), "stats with transfers in them count as empty"
    # is_empty() decides whether a step's stats are logged at all: one child with transfers is enough,
    # whichever child it is.  Where the CPU-offload child has no stats of its own (up to 0.30) Nixl's
    # entry is the only one; from 0.31 either child may be the one with data in a step.
    Multi = type(total)
    assert not Multi(data={nixl_name: Counted(data={"n": 1})}).is_empty(), "Nixl's transfers alone count as empty"
    if offload_own is not None:
        for busy in (nixl_name, offload_name):
            data = {n: Counted(data={"n": int(n == busy)}) for n in (nixl_name, offload_name)}
            assert not Multi(data=data).is_empty(), f"stats where only {busy} transferred count as empty"
    # What the stats logger starts from, and rebuilds from what the engine sends it.
    MultiConnector, _ = va.multi_classes()
    assert MultiConnector.build_kv_connector_stats().data == {}, "the empty stats a logger starts from are not empty"
    total.reset()
    for name, child in total.data.items():
        fresh = copy.deepcopy(child)
        fresh.reset()
        assert child.reduce() == fresh.reduce(), f"reset() left {name}'s stats as they were"
    # One child with nothing to report and one with something: the stats are not empty.
    ch.spy(
        monkeypatch,
        engine.worker._connectors[engine.nixl_index],
        "get_kv_connector_stats",
        lambda: Counted(data={"n": 0}),
    )
    if offload_own is not None and not offload_own.is_empty():
        mixed = engine.worker.get_kv_connector_stats().aggregate(engine.multi.get_kv_connector_stats())
        assert not mixed.is_empty(), "stats with one child's data in them count as empty"


# ---------------------------------------------------------------------------
# shutdown
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("failing", ["nixl", "offload"])
def test_child_shutdown_error_reaches_the_caller_and_the_other_child_still_shuts_down(engine, monkeypatch, failing):
    """When one child fails to shut down, its error reaches whoever shuts MultiConnector down (the
    engine logs and reports it), and the other child is still shut down (its threads and NIXL agent
    released), whichever child fails."""
    multi = engine.worker
    bad = {"nixl": engine.nixl_index, "offload": engine.offload_index}[failing]
    raised: list[bool] = []

    def boom(*_a):
        if not raised:  # once: the engine's own shutdown at the end of the test goes through
            raised.append(True)
            raise RuntimeError(f"{failing} child failed to shut down")

    calls = [ch.spy(monkeypatch, c, "shutdown", boom if i == bad else None) for i, c in enumerate(multi._connectors)]
    with pytest.raises(RuntimeError, match=f"{failing} child failed to shut down"):
        multi.shutdown()
    assert [len(c) for c in calls] == [1, 1], f"shutdown calls per child: {[len(c) for c in calls]}"


# ---------------------------------------------------------------------------
# sleep mode: the KV caches unregistered and restored on every child
# ---------------------------------------------------------------------------
def test_sleep_and_wake_unregister_and_restore_the_kv_caches_on_every_child(engine, nixl_agent, monkeypatch):
    """A worker going to sleep unregisters the KV caches with the connector, and waking restores them
    (gpu_worker.sleep / wake_up): through MultiConnector every child drops its registrations (Nixl
    deregisters its memory from NIXL, so no peer reads freed memory) and registers them again."""
    base = ch.base_class()
    if not hasattr(base, "unregister_kv_caches"):
        not_applicable("the release's connector API has no unregister_kv_caches (no sleep-mode remap)")
    multi = engine.worker
    calls = {
        n: [ch.spy(monkeypatch, c, n) for c in multi._connectors] for n in ("unregister_kv_caches", "restore_kv_caches")
    }
    (agent,) = nixl_agent.instances
    registered = len(agent.registered)
    assert registered, "the Nixl child registered nothing at startup"
    multi.unregister_kv_caches()
    assert [len(c) for c in calls["unregister_kv_caches"]] == [1, 1], "a child kept its registrations over sleep"
    assert not agent.registered, "Nixl still has KV-cache memory registered with NIXL while asleep"
    multi.restore_kv_caches()
    assert [len(c) for c in calls["restore_kv_caches"]] == [1, 1], "a child did not restore its registrations"
    assert len(agent.registered) == registered, "Nixl's KV-cache memory was not registered again on wake"


# ---------------------------------------------------------------------------
# Prometheus metrics: every child's
# ---------------------------------------------------------------------------
class _Metric:
    """A Prometheus metric that registers nowhere (the suite builds many; the process has one registry)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = kwargs.get("name", args[0] if args else "")

    def labels(self, *args: Any, **kwargs: Any) -> _Metric:
        return self

    def set(self, *a: Any) -> None: ...

    def inc(self, *a: Any) -> None: ...

    def observe(self, *a: Any) -> None: ...


def test_prometheus_metrics_of_every_child(engine):
    """The Prometheus metrics a user scrapes are every child's (vllm:nixl_*, and the CPU-offload child's
    where it has some): MultiConnector builds each child class's metrics, once per class, and keys
    them by the class name its stats come under, whatever the order."""
    MultiConnector, _ = va.multi_classes()
    if "build_prom_metrics" not in vars(MultiConnector):
        not_applicable("MultiConnector builds no Prometheus metrics of its own in this release")
    from prometheus_client import Counter, Gauge, Histogram

    types = {Gauge: _Metric, Counter: _Metric, Histogram: _Metric}
    labels, per_engine = ["model_name", "engine"], {0: ["tiny", "0"]}
    want = {
        cls.__name__
        for cls, cfg in _child_classes_and_configs(engine.vllm_config)
        if cls.build_prom_metrics(cfg, types, labels, per_engine) is not None
    }
    assert want, "no child of the pair builds Prometheus metrics here"
    prom = MultiConnector.build_prom_metrics(engine.vllm_config, types, labels, per_engine)
    got = set(prom._prom_metrics)
    assert got == want, f"MultiConnector's Prometheus metrics are {sorted(got)}, its children's {sorted(want)}"


# ---------------------------------------------------------------------------
# properties composed from the children
# ---------------------------------------------------------------------------
def test_divergent_local_hybrid_hits_only_when_every_child_allows_them(engine):
    """A hybrid model may take local prefix hits that differ per KV-cache group only when every
    child can load around them: MultiConnector allows it exactly when all its children do (Nixl does,
    the CPU-offload child does not), whatever the order."""
    MultiConnector, _ = va.multi_classes()
    if "supports_divergent_local_hybrid_hits" not in vars(MultiConnector):
        not_applicable("MultiConnector has no supports_divergent_local_hybrid_hits in this release")
    kids = {type(c).__name__: c.supports_divergent_local_hybrid_hits for c in engine.multi._connectors}
    assert engine.multi.supports_divergent_local_hybrid_hits is all(kids.values()), f"children: {kids}"
    assert len(set(kids.values())) == 2, f"the pair no longer disagrees ({kids}): this test sees less"


@pytest.mark.parametrize("preferring", ["nixl", "offload", "both"])
def test_cross_layer_blocks_only_when_every_child_prefers_them(engine, monkeypatch, preferring):
    """The model runner lays the KV cache out across layers (one tensor for all of them) only when
    the connector prefers it: MultiConnector prefers it exactly when every child does, so a child
    that registers per-layer caches (the CPU offload) never gets a layout it cannot take.  (On this
    CPU Nixl does not prefer it, so each child's answer is set here.)"""
    MultiConnector, _ = va.multi_classes()
    if "prefer_cross_layer_blocks" not in vars(MultiConnector):
        not_applicable("MultiConnector has no prefer_cross_layer_blocks in this release")
    yes = {"nixl": {engine.nixl_index}, "offload": {engine.offload_index}, "both": {0, 1}}[preferring]
    for i, c in enumerate(engine.worker._connectors):
        monkeypatch.setattr(type(c), "prefer_cross_layer_blocks", property(lambda _self, _y=(i in yes): _y))
    assert engine.worker.prefer_cross_layer_blocks is (len(yes) == 2), (
        f"children preferring cross-layer blocks: {preferring}; MultiConnector: {engine.worker.prefer_cross_layer_blocks}"
    )


def test_kv_delivery_required_when_any_child_requires_it(engine):
    """When any child must deliver KV to a peer (Nixl as a producer), MultiConnector requires KV
    delivery, so the scheduler keeps a preempted request's output for the remote decode instead of
    dropping it; a child that only caches (the CPU offload) does not lift that, whatever the order."""
    MultiConnector, _ = va.multi_classes()
    if "requires_kv_delivery" not in vars(MultiConnector):
        not_applicable("MultiConnector has no requires_kv_delivery in this release")
    kids = {type(c).__name__: c.requires_kv_delivery for c in engine.multi._connectors}
    assert engine.multi.requires_kv_delivery is any(kids.values()), f"children: {kids}"
    assert engine.multi.requires_kv_delivery is True, f"Nixl produces KV here, yet no delivery is required: {kids}"


@pytest.mark.parametrize("hook", ["has_pending_push_work", "has_pending_block_frees"])
def test_pending_work_of_either_child_keeps_the_scheduler_waiting(engine, monkeypatch, hook):
    """A child with work pending (push transfers in flight, as NixlPushConnector has; block frees
    pending) makes MultiConnector report it, whichever child it is: the engine keeps stepping instead
    of going idle (push work), or waits for blocks instead of preempting (block frees)."""
    if not hasattr(ch.base_class(), hook):
        not_applicable(f"the release's connector API has no {hook}")
    for busy in range(2):
        for i, c in enumerate(engine.multi._connectors):
            ch.spy(monkeypatch, c, hook, lambda _b=(i == busy): _b)
        assert getattr(engine.multi, hook)() is True, f"child {busy}'s pending work is not reported"
        if hook == "has_pending_push_work":
            assert engine.scheduler.has_requests(), f"child {busy} has push work, yet the engine would go idle"
    for c in engine.multi._connectors:
        ch.spy(monkeypatch, c, hook, lambda: False)
    assert getattr(engine.multi, hook)() is False


def test_empty_multiconnector_claims_no_capability():
    """A MultiConnector configured with no children claims no HMA support and no lookahead hashing
    (nothing it could forward them to), rather than the vacuous "all of none"."""
    from vllm.config import KVTransferConfig

    MultiConnector, _ = va.multi_classes()
    ktc = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", engine_id="e", kv_connector_extra_config={"connectors": []}
    )
    claims = [n for n in ("all_children_support_hma", "supports_lookahead_block_hashes") if n in vars(MultiConnector)]
    if not claims:
        not_applicable("MultiConnector composes neither HMA support nor lookahead hashing from its children here")
    for name in claims:
        assert getattr(MultiConnector, name)(ktc) is False, f"{name}: a MultiConnector without children claims it"
