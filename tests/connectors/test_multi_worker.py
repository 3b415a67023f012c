"""Worker-side contracts of MultiConnector([NixlConnector, CPU offload]) on CPU.

NIXL is replaced by kvcompat.testkit.fake_nixl.FakeNixlWrapper, patched at the
release's NixlWrapper target (N1/N2/N3).  The process runs on vLLM's own
CpuPlatform (selected in conftest), whose device type "cpu" is in
_NIXL_SUPPORTED_DEVICE from 0.11.2.

The CPU-offload children's workers need CUDA (SimpleCPUOffloadWorker creates
torch.cuda streams in register_kv_caches; OffloadingConnector's handlers need a
CUDA-alike platform), so the test that registers KV caches on *both* children
is marked ``gpu``: on a GPU-less cell it fails with vLLM's own CUDA error.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit.adapter import children as ch
from kvcompat.testkit.fake_nixl import FakeNixlWrapper

from conftest import BLOCK, build_worker, token_ids


@pytest.fixture
def worker_nixl_child(make_engine, fake_nixl, single_rank_distributed):
    """Only the Nixl child, built the way MultiConnector builds its child 0."""
    engine = make_engine(num_blocks=16)
    affinity = os.sched_getaffinity(0)
    nixl = build_worker(engine, lambda cfg, role, kvc: va.multi_child_connector(cfg, role, kvc, 0))
    yield engine, nixl
    nixl.shutdown()
    os.sched_setaffinity(0, affinity)


def _agent(fake_nixl) -> FakeNixlWrapper:
    assert len(fake_nixl.instances) == 1, f"expected one NIXL agent, got {len(fake_nixl.instances)}"
    return fake_nixl.instances[0]


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


def _prefill_side_metadata(engine, req_id: str):
    """Real scheduler-side metadata for a prefill-side request that finishes.
    Its prompt is shorter than one block, so the CPU-offload child has no store
    or load to run for it."""
    req = va.make_request(req_id, token_ids(BLOCK - 5), max_tokens=1, kv_transfer_params=va.remote_decode_params())
    engine.scheduler.add_request(req)
    engine.step(report_offload=False)
    engine.step(report_offload=False)
    assert any(req_id in (getattr(m.metadata[0], "reqs_to_send", {}) or {}) for m in engine.metas)
    assert not any(va.offload_store_work(m.metadata[1]) for m in engine.metas)
    assert not any(va.offload_load_work(m.metadata[1]) for m in engine.metas)
    return list(zip(engine.metas, engine.sched_outputs, strict=True))


def test_worker_nixl_child_registers_cpu_kv_caches_and_send_completes(worker_nixl_child, fake_nixl):
    """On CPU, the Nixl child (built as MultiConnector builds child 0, with the
    fake NIXL agent) registers the CPU KV caches as DRAM regions covering every
    layer; given the scheduler's real metadata for a prefill-side request it
    tracks the send, and reports it finished only after the decode side's
    notification arrives."""
    engine, nixl = worker_nixl_child
    NixlConnector, _ = va.nixl_classes()
    assert isinstance(nixl, NixlConnector)
    caches = va.make_kv_caches(engine.kv_cache_config)
    nixl.register_kv_caches(caches)
    agent = _agent(fake_nixl)
    _assert_dram_registration(agent, caches)

    sending_seen: set[str] = set()
    for meta, so in _prefill_side_metadata(engine, "pd-send-0"):
        nixl.bind_connector_metadata(meta.metadata[0])
        nixl.start_load_kv(None)
        nixl.wait_for_save()
        sending, _ = nixl.get_finished(set(so.finished_req_ids))
        sending_seen |= set(sending or ())
        nixl.clear_connector_metadata()
    assert "pd-send-0" not in sending_seen, "send reported done before the decode side read it"

    agent.inject_notif("decode-agent", b"pd-send-0:1")
    sending, recving = nixl.get_finished(set())
    assert "pd-send-0" in set(sending or ())
    assert not recving


def test_worker_multi_get_finished_aggregates_children(worker_multi, fake_nixl, monkeypatch):
    """Through a WORKER-role MultiConnector on CPU: metadata bound through
    MultiConnector reaches each child in order, and MultiConnector.get_finished
    reports the Nixl child's completed send in finished_sending (aggregated over
    both children; no extra async saves pending).  KV caches are registered with
    the Nixl child only: the CPU-offload child's register_kv_caches needs CUDA
    (see test_worker_register_kv_caches_on_all_children), so its completions are
    scripted (none): a worker without KV caches cannot exist, and from 0.28 its
    get_finished asserts a copy backend (simple_kv_offload/worker.py L281)."""
    engine, multi = worker_multi
    NixlConnector, _ = va.nixl_classes()
    OffloadConnector, _ = va.offload_classes()
    assert isinstance(multi._connectors[0], NixlConnector)
    assert isinstance(multi._connectors[1], OffloadConnector)

    caches = va.make_kv_caches(engine.kv_cache_config)
    multi._connectors[0].register_kv_caches(caches)
    agent = _agent(fake_nixl)
    _assert_dram_registration(agent, caches)
    ch.script_completions(monkeypatch, multi._connectors[1], [])

    sending_seen: set[str] = set()
    for meta, so in _prefill_side_metadata(engine, "pd-send-1"):
        multi.bind_connector_metadata(meta)
        assert multi._connectors[0]._connector_metadata is meta.metadata[0]
        assert multi._connectors[1]._connector_metadata is meta.metadata[1]
        multi.start_load_kv(None)
        multi.wait_for_save()
        sending, _ = multi.get_finished(set(so.finished_req_ids))
        sending_seen |= set(sending or ())
        multi.clear_connector_metadata()
    assert "pd-send-1" not in sending_seen, "send reported done before the decode side read it"

    agent.inject_notif("decode-agent", b"pd-send-1:1")
    sending, recving = multi.get_finished(set())
    assert sending is not None and "pd-send-1" in sending
    assert not recving
    assert agent.calls_named("get_new_notifs"), "Nixl never polled NIXL notifications"


@pytest.mark.gpu
def test_worker_register_kv_caches_on_all_children(worker_multi, fake_nixl):
    """MultiConnector.register_kv_caches registers the KV caches with every
    child: Nixl registers DRAM regions with its NIXL agent and the CPU-offload
    child's worker sets up its offload pool.  (Needs CUDA for the offload
    child's worker; fails on GPU-less cells with vLLM's CUDA error.)"""
    engine, multi = worker_multi
    caches = va.make_kv_caches(engine.kv_cache_config)
    multi.register_kv_caches(caches)
    _assert_dram_registration(_agent(fake_nixl), caches)
    offload = multi._connectors[1]
    handler = getattr(offload, "worker_handler", None) or getattr(offload, "connector_worker", None)
    assert handler is not None, "CPU-offload child has no worker"
    if hasattr(handler, "num_cpu_blocks"):
        assert handler.num_cpu_blocks > 0, "offload worker allocated no CPU blocks"
