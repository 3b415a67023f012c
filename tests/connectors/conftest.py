"""In-cell connector tests: MultiConnector([NixlConnector, CPU offload]).

This folder runs inside every matrix cell, in one pytest process, with the
cell's vLLM installed.  vLLM is imported once per session (lazily, from the
fixtures below); test modules import only kvcompat at module level.

Construction differences between releases live in kvcompat.testkit.adapter.
Whether the pair of connectors exists at all is decided by explicit probes of
the installed distribution (kvcompat.testkit.probes); a release without them makes every
test here not-applicable.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, probes
from kvcompat.testkit.fake_nixl import FakeNixlWrapper

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# NIXL's UCX backend needs a transport with peer failure handling: keep tcp
# (loopback only, with UCX_NET_DEVICES=lo); "sm,self" alone does not work.
os.environ.setdefault("UCX_TLS", "tcp,cma")
os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
    _s = socket.socket()
    _s.bind(("127.0.0.1", 0))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_s.getsockname()[1])
    _s.close()

BLOCK = va.BLOCK_SIZE
NUM_GPU_BLOCKS = 64


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA device (the CPU-offload child's worker); run only on GPU cells",
    )
    config.addinivalue_line(
        "markers",
        "real_nixl: moves KV blocks with the real NIXL library; run only in cells that install nixl",
    )


def _missing_capability() -> str | None:
    if not probes.has_module(va.V1 + ".multi_connector"):
        return "MultiConnector is not shipped in this release"
    if not (probes.has_module(va.V1 + ".nixl") or probes.has_module(va.V1 + ".nixl_connector")):
        return "NixlConnector is not shipped in this release"
    if not (va.has_offloading_connector() or va.has_simple_cpu_offload()):
        return "no CPU-offload connector (OffloadingConnector, from 0.11.2) in this release"
    return None


@pytest.fixture(scope="session")
def release() -> dict[str, Any]:
    """Probe the installed release, then select vLLM's CpuPlatform (once)."""
    missing = _missing_capability()
    if missing is not None:
        not_applicable(missing)
    how = va.select_cpu_platform()
    return {
        "version": probes.vllm_version(),
        "platform": how,
        "offload_child": va.offload_child_name(),
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    return va.write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def token_ids(n: int, start: int = 10) -> list[int]:
    """n prompt tokens that avoid BOS/EOS."""
    return [start + (i % 400) for i in range(n)]


@dataclass
class Engine:
    """A real Scheduler with the MultiConnector it built, plus a step driver."""

    scheduler: Any
    vllm_config: Any
    kv_cache_config: Any
    emulator: va.OffloadWorkerEmulator
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    metas: list[Any] = field(default_factory=list)
    sched_outputs: list[Any] = field(default_factory=list)
    worker_results: list[va.WorkerStepResult] = field(default_factory=list)

    @property
    def multi(self) -> Any:
        return self.scheduler.connector

    @property
    def nixl(self) -> Any:
        return self.multi._connectors[0]

    @property
    def offload(self) -> Any:
        return self.multi._connectors[1]

    def step(self, report_offload: bool = True, nixl_worker: Any = None) -> Any:
        """schedule() + update_from_output() with one sampled token per scheduled
        request; the offload child's transfers issued in the step are reported
        complete (OffloadWorkerEmulator) unless ``report_offload`` is False.

        With ``nixl_worker`` (a WORKER-role Nixl child), that worker runs the
        step on the Nixl entry of the step's MultiKVConnectorMetadata, and what
        it reports (finished sends/receives, failures, worker metadata) goes
        back to the scheduler with the step's output; each report is kept in
        ``worker_results``."""
        so = self.scheduler.schedule()
        self.sched_outputs.append(so)
        self.metas.append(so.kv_connector_metadata)
        kvo = self.emulator.step(so) if report_offload else None
        if nixl_worker is not None:
            res = va.run_worker_step(nixl_worker, so.kv_connector_metadata.metadata[0], set(so.finished_req_ids))
            self.worker_results.append(res)
            kvo = va.merge_child_worker_output(kvo, res, n_children=2, child_index=0)
        result = self.scheduler.update_from_output(so, va.make_model_runner_output(so, kvo))
        for eco in (result or {}).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return so

    def finished_output(self, req_id: str) -> Any:
        for o in self.outputs.get(req_id, []):
            if o.finish_reason is not None:
                return o
        return None


@pytest.fixture
def make_engine(release, tiny_model_dir):
    def _make(
        *,
        num_blocks: int = NUM_GPU_BLOCKS,
        sliding_window: int | None = None,
        disable_hybrid_kv_cache_manager: bool | None = None,
        kv_transfer_config: Any = None,
    ) -> Engine:
        cfg = va.make_vllm_config(
            tiny_model_dir,
            block_size=BLOCK,
            num_gpu_blocks=num_blocks,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            kv_transfer_config=kv_transfer_config,
        )
        kvc = va.make_kv_cache_config(num_blocks, block_size=BLOCK, sliding_window=sliding_window)
        sched = va.make_scheduler(cfg, kvc)
        return Engine(sched, cfg, kvc, va.OffloadWorkerEmulator(n_children=2, child_index=1))

    return _make


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(scope="session")
def single_rank_distributed(release, tiny_model_dir):
    """World-size-1 gloo process group + TP/PP groups, as a single-rank worker has
    (needed by worker-role connectors)."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        with set_current_vllm_config(va.make_vllm_config(tiny_model_dir)):
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{tempfile.mktemp(prefix='kvcompat-dist-')}",
            )
            ps.initialize_model_parallel(1, 1)
    yield


def build_worker(engine, build):
    """Build a WORKER-role connector for ``engine`` with ``build(cfg, role, kv_cache_config)``.

    The KV-cache layout is resolved as EngineCore does first; CPU affinity is restored
    afterwards, since Nixl's CPU path pins the process to one core.
    """
    from vllm.config import set_current_vllm_config

    cfg, kvc = engine.vllm_config, engine.kv_cache_config
    va.resolve_kv_cache_layout(cfg, kvc)
    affinity = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(cfg):
            return build(cfg, va.kv_connector_role().WORKER, kvc)
    finally:
        os.sched_setaffinity(0, affinity)


@pytest.fixture
def fake_nixl(monkeypatch, release):
    module, attr = va.nixl_wrapper_target()
    mod = importlib.import_module(module)
    assert hasattr(mod, attr), f"{module} has no {attr} to patch"
    monkeypatch.setattr(mod, attr, FakeNixlWrapper)
    FakeNixlWrapper.reset()
    yield FakeNixlWrapper
    FakeNixlWrapper.reset()


@pytest.fixture
def worker_multi(make_engine, fake_nixl, single_rank_distributed):
    """A WORKER-role MultiConnector built by the release's factory, on CPU."""
    engine = make_engine(num_blocks=16)
    affinity = os.sched_getaffinity(0)
    multi = build_worker(engine, va.create_connector)
    yield engine, multi
    multi.shutdown()
    os.sched_setaffinity(0, affinity)
