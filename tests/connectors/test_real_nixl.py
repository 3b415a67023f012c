"""KV blocks moved by the *real* NIXL library between two NixlConnector workers.

Runs only in cells that install NIXL (marker ``real_nixl``).  In one process:

* a prefill engine P and a decode engine D, each a real vLLM Scheduler whose
  scheduler-role connector is MultiConnector([NixlConnector, CPU offload])
  (built by the release's own factory, distinct engine ids);
* for each, the WORKER-role Nixl child built exactly as MultiConnector builds its
  child 0, on vLLM's CpuPlatform with CPU KV caches (registered as NIXL DRAM) and
  the real ``nixl._api.nixl_agent`` (no fake);
* P's scheduler-side connector serves the Nixl handshake on 127.0.0.1 (a free
  port, VLLM_NIXL_SIDE_CHANNEL_PORT from conftest); UCX on ``lo`` over tcp/cma.

Every worker step runs on the Nixl entry of the step's real
MultiKVConnectorMetadata, and what the worker reports goes back to its
scheduler with the step's output.  The CPU-offload child's *worker* needs CUDA
in every release (SimpleCPUOffload: torch.cuda streams; OffloadingConnector:
"only supported on CUDA-alike GPUs"), so on CPU its completions are reported by
OffloadWorkerEmulator from its own real metadata, as in the scheduler tests.
The worker-role-MultiConnector variant registers KV caches on both children and
is therefore marked ``gpu``.

Not applicable only where the release's NixlConnectorWorker has no CPU entry in
its supported-device table.  A missing ``nixl`` package is not a release
property: it makes these tests error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable

from conftest import BLOCK, build_worker, token_ids

pytestmark = pytest.mark.real_nixl

P_ENGINE = "kvcompat-prefill"
D_ENGINE = "kvcompat-decode"
NUM_BLOCKS = 16
TRANSFER_TIMEOUT_S = 60.0


def _require_nixl_cpu_worker() -> None:
    """Probe: the release's NixlConnectorWorker accepts device 'cpu' with a
    'cpu' KV buffer (its supported-device table)."""
    table = va.nixl_supported_device_table()
    if "cpu" not in table:
        not_applicable(f"NixlConnectorWorker has no 'cpu' device in its supported-device table {table}")
    if "cpu" not in tuple(table["cpu"]):
        not_applicable(f"NixlConnectorWorker on 'cpu' does not support a 'cpu' kv buffer: {table['cpu']}")


@pytest.fixture
def real_nixl(release):
    """The real NIXL agent class, imported the way vLLM imports it (nixl._api)."""
    _require_nixl_cpu_worker()
    tls = os.environ.get("UCX_TLS", "")
    assert not tls or "tcp" in tls.split(","), f"UCX_TLS={tls!r}: NIXL's UCX backend needs tcp"
    # vLLM imports ``nixl._api``: the ``nixl`` meta package (which aliases the
    # nixl_cuXX backend matching torch's CUDA major, any backend for CPU torch)
    # must be installed.  Missing: an error of the cell's setup, never N/A.
    if importlib.util.find_spec("nixl") is None:
        raise RuntimeError(
            "the 'nixl' package is not importable; vLLM imports nixl._api, so install the "
            "nixl meta package (--no-deps) next to the nixl-cuXX backend matching torch's CUDA"
        )
    api = importlib.import_module("nixl._api")
    return api.nixl_agent


@dataclass
class Side:
    name: str
    engine: Any  # conftest.Engine: real Scheduler + scheduler-role MultiConnector
    worker: Any  # WORKER-role Nixl child
    caches: dict[str, Any]


def _make_side(make_engine, name: str, engine_id: str, fill: bool, build) -> Side:
    import torch
    from vllm.config import set_current_vllm_config

    engine = make_engine(
        num_blocks=NUM_BLOCKS,
        kv_transfer_config=va.multi_kv_transfer_config(BLOCK, NUM_BLOCKS, engine_id=engine_id),
    )
    worker = build_worker(engine, build)
    caches = va.make_kv_caches(engine.kv_cache_config)
    if fill:
        gen = torch.Generator().manual_seed(1234)
        for t in caches.values():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
    affinity = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(engine.vllm_config):
            worker.register_kv_caches(caches)
    finally:
        os.sched_setaffinity(0, affinity)
    return Side(name, engine, worker, caches)


def _nixl_child(cfg, role, kvc):
    return va.multi_child_connector(cfg, role, kvc, 0)


@pytest.fixture
def pd_pair(make_engine, single_rank_distributed, real_nixl):
    """P and D engines with real-NIXL Nixl-child workers; P serves the handshake."""
    affinity = os.sched_getaffinity(0)
    sides: list[Side] = []
    try:
        p = _make_side(make_engine, "P", P_ENGINE, True, _nixl_child)
        sides.append(p)
        how = va.serve_nixl_handshake(p.engine.multi, p.worker)
        d = _make_side(make_engine, "D", D_ENGINE, False, _nixl_child)
        sides.append(d)
        for s in sides:
            agent = _nixl_agent_of(s.worker)
            assert isinstance(agent, real_nixl), (
                f"{s.name}'s NIXL agent is {type(agent).__module__}.{type(agent).__name__}, not real NIXL"
            )
        yield p, d, how
    finally:
        for s in reversed(sides):
            s.worker.shutdown()
        for s in reversed(sides):
            s.engine.multi.shutdown()
        os.sched_setaffinity(0, affinity)


def _nixl_agent_of(worker) -> Any:
    cw = worker.connector_worker
    return cw.nixl_wrapper


def _union(results, attr: str) -> set:
    out: set = set()
    for r in results:
        out |= set(getattr(r, attr))
    return out


def test_real_nixl_read_driven_by_multiconnector_metadata(pd_pair):
    """A prefill-side request finishes on P; MultiConnector returns Nixl's
    transfer params; D (given those params) schedules a remote prefill whose
    Nixl metadata entry names the request in reqs_to_recv; D's Nixl worker
    handshakes with P over loopback and READs the blocks with real NIXL.  D's
    received blocks equal P's bytes exactly, D's other blocks stay zero, D
    reports done_recving and P done_sending, no transfer fails, D's scheduler
    then computes and finishes the request, and P frees the held blocks."""
    import torch
    from vllm.v1.request import RequestStatus

    p, d, how = pd_pair
    rid = "pd-real-0"
    prompt = token_ids(3 * BLOCK + 5)  # 3 full blocks + 1 partial
    p_snapshot = {n: t.clone() for n, t in p.caches.items()}

    # --- P: prefill finishes; Nixl holds the blocks for the remote read.
    p.engine.scheduler.add_request(
        va.make_request(rid, prompt, max_tokens=1, kv_transfer_params=va.remote_decode_params())
    )
    p.engine.step(nixl_worker=p.worker)
    out = p.engine.finished_output(rid)
    assert out is not None, "prefill request did not finish"
    params = out.kv_transfer_params
    assert params is not None, "MultiConnector returned no kv_transfer_params on P"
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == P_ENGINE
    assert params["remote_host"] == os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert int(params["remote_port"]) == int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    p_blocks = va.group_block_ids(params["remote_block_ids"])
    assert len(p_blocks) == 4, f"P holds {p_blocks} for a 4-block prompt"
    assert rid in p.engine.scheduler.requests, "P freed the blocks before the remote read"
    p.engine.step(nixl_worker=p.worker)  # P's worker learns the pending send

    # --- D: remote prefill request scheduled from P's real params.
    d.engine.scheduler.add_request(va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=dict(params)))
    so = d.engine.step(nixl_worker=d.worker)
    dreq = d.engine.scheduler.requests[rid]
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS, dreq.status
    nixl_meta, offload_meta = so.kv_connector_metadata.metadata
    assert rid in nixl_meta.reqs_to_recv, "D's Nixl metadata entry does not name the request to pull"
    assert not va.offload_load_work(offload_meta), "D's CPU-offload child must not load this request"
    d_blocks = va.group_block_ids(d.engine.scheduler.kv_cache_manager.get_block_ids(rid))
    assert va.group_block_ids(nixl_meta.reqs_to_recv[rid].local_block_ids) == d_blocks
    assert len(d_blocks) == len(p_blocks)

    # --- both engines step until the pull completes and D finishes the request.
    t0 = time.monotonic()
    while time.monotonic() - t0 < TRANSFER_TIMEOUT_S:
        d.engine.step(nixl_worker=d.worker)
        p.engine.step(nixl_worker=p.worker)
        recv = _union(d.engine.worker_results, "finished_recving")
        sent = _union(p.engine.worker_results, "finished_sending")
        if rid in recv and rid in sent and d.engine.finished_output(rid) is not None:
            break
        time.sleep(0.005)
    elapsed = time.monotonic() - t0
    recv = _union(d.engine.worker_results, "finished_recving")
    sent = _union(p.engine.worker_results, "finished_sending")
    failed = _union(d.engine.worker_results, "failed_recving")
    invalid = _union(d.engine.worker_results, "invalid_block_ids")
    assert not failed and not invalid, f"D reported failed receives {failed} / invalid blocks {invalid}"
    assert rid in recv, f"no done_recving on D after {elapsed:.1f}s (handshake via {how})"
    assert rid in sent, f"no done_sending on P after {elapsed:.1f}s"
    assert not _union(p.engine.worker_results, "finished_recving")
    assert rid not in _union(d.engine.worker_results, "finished_sending")

    # --- bytes: D's pulled blocks equal P's, every other D block is still zero.
    for name in p.caches:
        for lb, rb in zip(d_blocks, p_blocks, strict=True):
            got = va.kv_cache_block(d.caches[name], lb)
            want = va.kv_cache_block(p.caches[name], rb)
            assert torch.equal(got, want), f"{name}: D block {lb} != P block {rb}"
        for b in set(range(NUM_BLOCKS)) - set(d_blocks):
            assert not va.kv_cache_block(d.caches[name], b).any(), f"{name}: untouched D block {b} not zero"
        assert torch.equal(p.caches[name], p_snapshot[name]), f"{name}: P's KV cache changed"

    # --- schedulers act on what the workers reported.
    assert d.engine.finished_output(rid) is not None, "D never finished the request after the pull"
    assert rid not in p.engine.scheduler.requests, "P kept the blocks after done_sending"
    assert rid not in d.engine.multi._requests_to_connector
    assert rid not in p.engine.multi._requests_to_connector


@pytest.mark.gpu
def test_real_nixl_read_through_worker_multiconnector(make_engine, single_rank_distributed, real_nixl):
    """The worker side as vLLM builds it: a WORKER-role MultiConnector (release
    factory) on each side, KV caches registered with *all* its children, driven
    through MultiConnector's own bind/start_load_kv/get_finished with the full
    MultiKVConnectorMetadata; the Nixl child's real-NIXL READ moves P's bytes to
    D.  Needs CUDA for the CPU-offload child's worker (register_kv_caches)."""
    import torch
    from vllm.v1.request import RequestStatus

    affinity = os.sched_getaffinity(0)
    sides: list[Side] = []
    try:
        p = _make_side(make_engine, "P", P_ENGINE, True, va.create_connector)
        sides.append(p)
        va.serve_nixl_handshake(p.engine.multi, p.worker)
        d = _make_side(make_engine, "D", D_ENGINE, False, va.create_connector)
        sides.append(d)
        for s in sides:
            assert isinstance(_nixl_agent_of(s.worker._connectors[0]), real_nixl)

        rid = "pd-real-multi-0"
        prompt = token_ids(3 * BLOCK + 5)

        def step(side: Side) -> Any:
            so = side.engine.scheduler.schedule()
            side.engine.metas.append(so.kv_connector_metadata)
            res = va.run_worker_step(side.worker, so.kv_connector_metadata, set(so.finished_req_ids))
            side.engine.worker_results.append(res)
            kvo = va.kv_connector_output_of(res)  # worker meta: MultiConnector's own
            result = side.engine.scheduler.update_from_output(so, va.make_model_runner_output(so, kvo))
            for eco in (result or {}).values():
                for o in eco.outputs:
                    side.engine.outputs.setdefault(o.request_id, []).append(o)
            return so

        p.engine.scheduler.add_request(
            va.make_request(rid, prompt, max_tokens=1, kv_transfer_params=va.remote_decode_params())
        )
        step(p)
        out = p.engine.finished_output(rid)
        assert out is not None and out.kv_transfer_params is not None
        params = out.kv_transfer_params
        p_blocks = va.group_block_ids(params["remote_block_ids"])
        step(p)
        d.engine.scheduler.add_request(va.make_request(rid, prompt, max_tokens=2, kv_transfer_params=dict(params)))
        step(d)
        assert d.engine.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = va.group_block_ids(d.engine.scheduler.kv_cache_manager.get_block_ids(rid))
        t0 = time.monotonic()
        while time.monotonic() - t0 < TRANSFER_TIMEOUT_S:
            step(d)
            step(p)
            if (
                rid in _union(d.engine.worker_results, "finished_recving")
                and rid in _union(p.engine.worker_results, "finished_sending")
                and d.engine.finished_output(rid) is not None
            ):
                break
            time.sleep(0.005)
        assert rid in _union(d.engine.worker_results, "finished_recving")
        assert rid in _union(p.engine.worker_results, "finished_sending")
        assert not _union(d.engine.worker_results, "failed_recving")
        for name in p.caches:
            for lb, rb in zip(d_blocks, p_blocks, strict=True):
                assert torch.equal(va.kv_cache_block(d.caches[name], lb), va.kv_cache_block(p.caches[name], rb))
    finally:
        for s in reversed(sides):
            s.worker.shutdown()
        for s in reversed(sides):
            s.engine.multi.shutdown()
        os.sched_setaffinity(0, affinity)
