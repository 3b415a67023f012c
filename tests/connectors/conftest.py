"""In-cell connector tests: MultiConnector with a NixlConnector and a CPU-offload child.

This folder runs inside every matrix cell, in one pytest process, with the cell's vLLM installed.
vLLM is imported once per session (lazily, from the fixtures below); test modules import only
kvcompat at module level.

An :class:`Engine` is what an engine core holds, on vLLM's CpuPlatform: the release's Scheduler (with
the scheduler-role MultiConnector it builds) and one worker rank per TP rank (the worker-role
MultiConnector the release's factory builds, with its real children and registered CPU KV caches).
Each step runs the worker half through the release's own model-runner code (kvcompat.testkit.adapter
.worker) and feeds what it returns to ``update_from_output``.  Only transports are replaced: NIXL by
kvcompat.testkit.fake_nixl (real NIXL in real-NIXL cells), SimpleCPUOffload's CUDA copies by
kvcompat.testkit.cuda_transport.  Up to 0.18 the CPU-offload child is OffloadingConnector, whose
worker's transfers are scripted (kvcompat.testkit.adapter.offload_script).

The children's order is the cell's (``order`` in the matrix, KVCOMPAT_CHILD_ORDER here).
Construction differences between releases live in kvcompat.testkit.adapter.  Whether the pair of
connectors exists at all is decided by explicit probes of the installed distribution
(kvcompat.testkit.probes); a release without them makes every test here not-applicable.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcompat import shapes
from kvcompat.testkit import adapter as va
from kvcompat.testkit import deploy, not_applicable, ports, probes, record_fact, setup_owned_by, user_configuration
from kvcompat.testkit.adapter import children as ch
from kvcompat.testkit.adapter import idle
from kvcompat.testkit.fake_nixl import FakeNixlWrapper
from kvcompat.testkit.shutdowns import DeferredShutdowns
from kvcompat.testkit.shutdowns import report as report_shutdown_failures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# NIXL's UCX backend needs a transport with peer failure handling: keep tcp
# (loopback only, with UCX_NET_DEVICES=lo); "sm,self" alone does not work.
os.environ.setdefault("UCX_TLS", "tcp,cma")
os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")


def _own_side_channel_port() -> None:
    """A port for the next engine's NIXL handshake listener that no other process takes meanwhile
    (kvcompat.testkit.ports: a taken port kills vLLM's listener thread and hangs the engine)."""
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.reserve())


if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
    _own_side_channel_port()
    # a forked process (a mutation run's children, several at once) listens on a port of its own
    os.register_at_fork(after_in_child=_own_side_channel_port)

BLOCK = va.BLOCK_SIZE
NUM_GPU_BLOCKS = 64
# The contract that owns "the worker side comes up": building the worker-role connectors and
# registering the KV caches with every child (test_multi_worker.py).  Every engine needs it.
WORKER_UP = "test_register_kv_caches_reaches_every_child"
# The contract that owns the Nixl handshake through MultiConnector (test_multi_lifecycle.py): every
# prefill/decode pair needs it.
HANDSHAKE = "test_nixl_handshake_metadata_comes_out_and_goes_to_every_child"
# The contract that owns "a finished request's full blocks end up in the CPU tier, which serves them"
# (test_multi_scheduler.py): every test that needs a stored prefix needs it.
STORED = "test_offload_child_loads_prefix_after_store_completes"
# The contract that owns "the prefill side finishes with the kv_transfer_params D needs"
# (test_multi_scheduler.py), and the one that owns a whole P/D read (test_multi_worker.py).
PREFILLED = "test_prefill_finish_returns_nixl_transfer_params"
PD_READ = "test_decode_reads_exactly_the_kv_the_prefill_side_computed"
# The contract that owns a whole P/D read in a deployment shape (test_shapes.py, once per shape).
SHAPE_PD_READ = "test_pd_read_fills_each_rank_with_its_heads_and_nothing_else"
P_ENGINE = "kvcompat-prefill"
D_ENGINE = "kvcompat-decode"
MAX_IDLE_STEPS = 60  # what an engine may take to drain once its requests are done
# Nixl's handshake and notifications run on its own threads: a real engine keeps stepping in wall time
# while they do.  On a loaded machine (cells side by side, a mutation run) those threads can be starved
# for longer than MAX_IDLE_STEPS fast steps take, so waiting for transfer work also lasts at least this
# long (with a short sleep per step once the step budget is spent) before it is called lost.
# KVCOMPAT_TRANSFER_WAIT_S sets it for a quiet machine (a mutation benchmark): a test whose condition never
# holds pays this wait, so a mutant killed that way costs it.
TRANSFER_WAIT_S = float(os.environ.get("KVCOMPAT_TRANSFER_WAIT_S", "15"))
# Between two steps an engine core returns outputs and reads input; the CPU-offload worker's copy
# thread runs meanwhile (EngineCore's loop also sleeps 1 ms when a step ran nothing).  Without the
# pause this process would hold the GIL from one step to the next and starve that thread.
STEP_GAP_S = 0.001


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA device; run only on GPU cells",
    )
    config.addinivalue_line(
        "markers",
        "real_nixl: moves KV blocks with the real NIXL library; run only in cells that install nixl",
    )
    config.addinivalue_line(
        "markers",
        "shapes(*families): the contract runs once per deployment shape of these families (kvcompat.shapes), "
        "taking the `shape` fixture",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A contract marked ``shapes(*families)`` runs once per selected shape of those families (KVCOMPAT_SHAPES)."""
    marker = metafunc.definition.get_closest_marker("shapes")
    if marker is None or "shape" not in metafunc.fixturenames:
        return
    chosen = shapes.of_families(tuple(marker.args))
    if chosen:
        metafunc.parametrize("shape", chosen, ids=[s.id for s in chosen], indirect=True)
    else:  # no shape of its families selected: the contract does not run in this cell (deselected below)
        metafunc.parametrize("shape", [None], ids=["unselected"], indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unselected = [i for i in items if getattr(getattr(i, "callspec", None), "params", {}).get("shape", 1) is None]
    if unselected:
        config.hook.pytest_deselected(items=unselected)
        items[:] = [i for i in items if i not in unselected]


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
    facts = {
        "platform": how,
        "child order": va.child_order(),
        "offload child": va.offload_child_name(),
        "offload worker": va.offload_worker_kind(),
        "model runner": va.model_runner(),
    }
    for name, value in facts.items():
        record_fact(name, value)
    return {"version": probes.vllm_version(), **facts}


@pytest.fixture
def shape(request, release) -> shapes.Shape:
    """The deployment shape this run of a contract deploys (``dense`` unless the contract is marked
    ``shapes``); recorded with the test's result.  Not applicable where the release cannot have it, by
    the shape's own probe of the installed release."""
    chosen = getattr(request, "param", None) or shapes.DENSE
    request.node.user_properties.append(("shape", chosen.id))
    missing = deploy.missing(chosen)
    if missing is not None:
        not_applicable(f"shape {chosen.id}: {missing}")
    return chosen


@pytest.fixture(autouse=True)
def _cpu_platform_first(release):
    """Every test runs after the release is probed and CpuPlatform selected, whatever the order the
    tests run in (a mutation run puts the tests that killed earlier mutants first)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    return va.write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def shape_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model of a shape (its builder's config.json), written once per session and shape."""
    written: dict[str, Any] = {}

    def _dir(shape: shapes.Shape):
        if shape.id not in written:
            written[shape.id] = deploy.builder(shape).write_model(shape, tmp_path_factory.mktemp(f"model-{shape.id}"))
        return written[shape.id]

    return _dir


def token_ids(n: int, start: int = 10) -> list[int]:
    """n prompt tokens that avoid BOS/EOS."""
    return [start + (i % 400) for i in range(n)]


def assert_every_call_reached_every_child(got_multi: dict, got_kids: list[dict], hooks, caller: str) -> None:
    """Each hook in ``hooks`` that ``caller`` made on MultiConnector (``got_multi``, at least once) reached
    both children (``got_kids``, spies per child) exactly as often."""
    for h in hooks:
        n = len(got_multi[h])
        assert n > 0, f"the {caller} never called MultiConnector.{h}"
        per_child = [len(kid[h]) for kid in got_kids]
        assert per_child == [n, n], f"{h}: MultiConnector got {n} calls, its children {per_child}"


def wait_until(predicate, timeout: float = TRANSFER_WAIT_S):
    """Poll ``predicate`` (without stepping the engine) until it holds or ``timeout`` seconds pass; its last
    answer.  For work another thread does within a step's aftermath (a copy thread submitting a copy)."""
    deadline = time.monotonic() + timeout
    while not (answer := predicate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return answer


def patient_steps(max_steps: int):
    """Step numbers: at least ``max_steps``, and steps on (sleeping a little between them) until
    TRANSFER_WAIT_S of wall time have passed, for work that other threads finish (see TRANSFER_WAIT_S)."""
    start = time.monotonic()
    n = 0
    while n < max_steps or time.monotonic() - start < TRANSFER_WAIT_S:
        if n >= max_steps:
            time.sleep(0.02)
        yield n
        n += 1


@dataclass(repr=False)  # a failing test's message shows the engine: not all of its state
class Engine:
    """What an engine core holds: the release's Scheduler with the MultiConnector it built, and one
    worker rank per TP rank; :meth:`step` is one engine step, worker half included."""

    scheduler: Any
    vllm_config: Any
    kv_cache_config: Any
    ranks: list[va.WorkerRank]
    order: str
    aggregator: Any = None  # the release's KVOutputAggregator, when there is more than one rank
    baseline_free: int = 0  # free blocks when nothing holds any (set when built)
    baseline: va.IdleState | None = None  # free device blocks and pinned CPU-tier blocks when built
    transfers: Any = None  # what moves the CPU-offload child's blocks (the `transport` fixture)
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    metas: list[Any] = field(default_factory=list)
    sched_outputs: list[Any] = field(default_factory=list)
    kv_outputs: list[Any] = field(default_factory=list)  # what the scheduler got from the workers, per step
    request_ids: set[str] = field(default_factory=set)  # every request added to this engine (see make_engine)
    shape: shapes.Shape = shapes.DENSE  # the deployment shape this engine is a side of
    # how each layer's cache looks (va.Forward), attention if absent
    kinds: dict[str, Any] = field(default_factory=dict)
    stepper: Any = None  # the shape's own step order (its builder's ``step``), or None: schedule, execute, update
    # what a rank's model runner returns for a step (its builder's ``runner_output``: drafts sample several tokens)
    runner_output: Any = None

    @property
    def multi(self) -> Any:
        return self.scheduler.connector

    @property
    def hash_block_size(self) -> int:
        """The tokens a request's block hash covers: what EngineCore resolves once and gives both the Scheduler
        and the request block hasher (``v1/engine/core.py`` 0.34.0 L190-201, L242-249: finer than a block under
        ``--prefix-match-unit``), else the block size."""
        return getattr(self.scheduler, "hash_block_size", None) or self.vllm_config.cache_config.block_size

    def request(self, req_id: str, prompt: list[int], **kwargs: Any) -> Any:
        """A Request as this engine's EngineCore makes it: hashed with its block hasher
        (``v1/engine/core.py`` 0.34.0 L242-249)."""
        return va.make_request(req_id, prompt, block_size=self.hash_block_size, **kwargs)

    @property
    def nixl_index(self) -> int:
        return va.child_index("nixl", self.order)

    @property
    def offload_index(self) -> int:
        return va.child_index("offload", self.order)

    @property
    def nixl(self) -> Any:
        return self.multi._connectors[self.nixl_index]

    @property
    def offload(self) -> Any:
        return self.multi._connectors[self.offload_index]

    @property
    def worker(self) -> Any:
        """Rank 0's worker-role MultiConnector."""
        return self.ranks[0].connector

    def nixl_meta(self, so: Any) -> Any:
        return so.kv_connector_metadata.metadata[self.nixl_index]

    def offload_meta(self, so: Any) -> Any:
        return so.kv_connector_metadata.metadata[self.offload_index]

    def step(self) -> Any:
        """One engine step: schedule(); every rank runs the worker half of it (the release's
        model-runner sequence around a forward pass that writes KV); their outputs, aggregated by
        the release's KVOutputAggregator when there are several, go to update_from_output().  A shape
        that orders these otherwise (EngineCore's batch queue under async scheduling) steps its own way
        (its builder's ``step``, kvcompat.testkit.deploy); either way this returns the step's SchedulerOutput."""
        if self.stepper is not None:
            return self.stepper(self)
        so = self.schedule()
        self.update(so, self.execute(so))
        time.sleep(STEP_GAP_S)
        return so

    def schedule(self) -> Any:
        """The scheduler's half of a step: its SchedulerOutput, kept with its connector metadata."""
        so = self.scheduler.schedule()
        self.sched_outputs.append(so)
        self.metas.append(so.kv_connector_metadata)
        return so

    def execute(self, so: Any) -> Any:
        """The workers' half: every rank runs ``so`` (the forward pass writing KV), and their outputs are
        aggregated as the executor does; the ModelRunnerOutput the scheduler gets."""
        forward = va.Forward(self.scheduler, so, self.kv_cache_config, self.kinds)
        kv_outs = [r.execute(so, lambda rank: va.forward_layers(rank, forward.write_kv)) for r in self.ranks]
        # a prefill chunk that does not finish its prompt samples nothing (the runner discards its token)
        unsampled = {
            r
            for r in so.num_scheduled_tokens
            if (q := self.scheduler.requests.get(r)) is not None and q.num_computed_tokens < q.num_tokens
        }
        make_output = self.runner_output or functools.partial(va.make_model_runner_output, unsampled=unsampled)
        runner_outs = [make_output(so, kvo) for kvo in kv_outs]
        return runner_outs[0] if self.aggregator is None else self.aggregator.aggregate(runner_outs, 0)

    def update(self, so: Any, out: Any) -> Any:
        """update_from_output with the workers' output of ``so``; the request outputs are kept per request."""
        self.kv_outputs.append(out.kv_connector_output)
        result = self.scheduler.update_from_output(so, out)
        for eco in (result or {}).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return result

    def run(self, req_ids: list[str], max_steps: int = 60) -> None:
        """Step until every request in ``req_ids`` has finished (fails after ``max_steps``)."""
        for _ in patient_steps(max_steps):
            if all(self.finished_output(r) is not None for r in req_ids):
                return
            self.step()
        missing = [r for r in req_ids if self.finished_output(r) is None]
        raise AssertionError(f"requests {missing} did not finish in {max_steps} steps")

    def run_until_idle(self, max_steps: int = MAX_IDLE_STEPS) -> int:
        """Step while the scheduler says it has work, as EngineCore's loop does; return the steps taken.

        Only the contract that the engine keeps stepping while work is pending relies on this; other
        tests bring an engine to rest with :meth:`settle`, which steps whether or not the scheduler
        asks for it (as new traffic would)."""
        for n in range(max_steps):
            if not self.scheduler.has_requests():
                return n
            self.step()
        raise AssertionError(f"the engine still had work after {max_steps} idle steps")

    def settle(self, max_steps: int = MAX_IDLE_STEPS) -> int:
        """Step until no request holds a block any more (stores done, sends read), or ``max_steps``, as
        an engine that keeps serving traffic does; return the steps taken (the caller checks the blocks)."""
        n = 0
        for n in patient_steps(max_steps):
            if self.free_blocks() == self.baseline_free and not self.scheduler.has_unfinished_requests():
                return n
            self.step()
        return n

    def finished_output(self, req_id: str) -> Any:
        for o in self.outputs.get(req_id, []):
            if o.finish_reason is not None:
                return o
        return None

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def idle_state(self) -> va.IdleState:
        """Free device blocks, pinned CPU-tier blocks and the children's bookkeeping now, read from the
        release's structures."""
        return va.idle_state(self.scheduler, self.offload, self.nixl)

    def leaks(self) -> list[str]:
        """What this engine still holds beyond its baseline once it has settled, and every place a
        connector, scheduler or worker side, still names a request it was given (empty: no leak)."""
        assert self.baseline is not None, "leaks() is for engines with the deployed pair of children"
        self.settle()
        return self.idle_state().leaks_against(self.baseline) + idle.requests_still_held(
            self.connector_state(), self.request_ids
        )

    def connector_state(self) -> dict[str, Any]:
        """The objects that hold the connectors' per-request state: MultiConnector and each child's
        scheduler half, and on every rank MultiConnector and each child's worker half."""
        out = {
            "MultiConnector (scheduler)": self.multi,
            "the Nixl child's scheduler": idle.scheduler_object(self.nixl),
            "the CPU-offload child's scheduler": idle.scheduler_object(self.offload),
        }
        for r, rank in enumerate(self.ranks):
            multi = rank.connector
            out[f"rank {r}'s MultiConnector"] = multi
            out[f"rank {r}'s Nixl worker"] = idle.worker_object(multi._connectors[self.nixl_index])
            out[f"rank {r}'s CPU-offload worker"] = idle.worker_object(multi._connectors[self.offload_index])
        return out

    def kv_transfer_name(self) -> str:
        return self.vllm_config.kv_transfer_config.engine_id

    def shutdown_workers(self) -> None:
        """The first half of EngineCore's shutdown: the workers' connectors (the scheduler's comes after)."""
        for r in self.ranks:
            r.shutdown()

    def prefill(self, req_id: str, prompt: list[int]) -> dict[str, Any]:
        """vLLM's P/D proxy protocol, prefill side: the request with ``max_tokens=1`` and
        ``do_remote_decode``; returns the kv_transfer_params it finished with (for the decode side)."""
        self.scheduler.add_request(
            self.request(req_id, prompt, max_tokens=1, kv_transfer_params=va.remote_decode_params())
        )
        self.run([req_id])
        params = self.finished_output(req_id).kv_transfer_params
        assert params is not None, "the prefill side's MultiConnector returned no kv_transfer_params"
        return dict(params)


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


@pytest.fixture
def nixl_agent(monkeypatch, release):
    """The NIXL agent class the Nixl worker gets: the fake one, patched at the release's target.
    (test_real_nixl.py overrides this fixture with the real library.)"""
    module, attr = va.nixl_wrapper_target()
    mod = importlib.import_module(module)
    assert hasattr(mod, attr), f"{module} has no {attr} to patch"
    monkeypatch.setattr(mod, attr, FakeNixlWrapper)
    FakeNixlWrapper.reset()
    yield FakeNixlWrapper
    FakeNixlWrapper.reset()
    FakeNixlWrapper.polls_until_done = 1


@pytest.fixture
def transport(release):
    """What moves the CPU-offload child's blocks, fresh for each test: the stand-in of its CUDA
    transport (kvcompat.testkit.cuda_transport), or up to 0.18 the scripted transfers."""
    transfers = va.offload_transfers()
    yield transfers
    transfers.release()


@pytest.fixture(scope="session")
def deferred_shutdowns(request):
    """Engines' scheduler-side shutdowns, run beside the next tests (kvcompat.testkit.shutdowns); the
    session waits for them all before its other fixtures end, and one that raised or hung is an error of
    the test that built the engines, reported through pytest's own hook."""
    shutdowns = DeferredShutdowns()
    yield shutdowns
    report_shutdown_failures(request.config, shutdowns.join())


@pytest.fixture
def make_engine(
    request,
    release,
    tiny_model_dir,
    shape_model_dir,
    nixl_agent,
    single_rank_distributed,
    transport,
    deferred_shutdowns,
):
    """Build engines as EngineCore does: workers first (their KV caches registered, the
    SimpleCPUOffload block count asked where the release asks it), then the scheduler."""
    engines: list[Engine] = []

    def _make(
        *,
        num_blocks: int = NUM_GPU_BLOCKS,
        block_size: int = BLOCK,
        sliding_window: int | None = None,
        disable_hybrid_kv_cache_manager: bool | None = None,
        kv_transfer_config: Any = None,
        tensor_parallel_size: int = 1,
        order: str | None = None,
        engine_id: str = "kvcompat-engine",
        nixl_extra_config: dict[str, Any] | None = None,
        offload_extra_config: dict[str, Any] | None = None,
        shape: shapes.Shape | None = None,
        side: str = "prefill",
        side_channel_port: int | None = None,
    ) -> Engine:
        """An engine; with ``shape`` (not the dense one, which keeps the suite's own construction), the
        engine that side (``"prefill"`` or ``"decode"``) of the shape deploys, built by the shape's builder
        (kvcompat.testkit.deploy): its model and VllmConfig, its TP size with each rank its own rank and
        heads, the KV-cache config from the release's planner and the caches from its allocator."""
        # Each engine's Nixl listener gets a port of its own: an earlier test's may still be shutting down;
        # ``side_channel_port``: an engine that takes over another's address (a replaced prefill)
        if side_channel_port is None:
            _own_side_channel_port()
        else:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        order = order or va.child_order()
        shape = shape or shapes.DENSE
        builder = deploy.builder(shape)
        planned = shape is not shapes.DENSE
        model_dir = tiny_model_dir
        extra: dict[str, Any] = {}
        if planned:
            tensor_parallel_size = builder.tp_size(shape, side)
            model_dir = shape_model_dir(shape)
            extra = builder.config_kwargs(shape, side)
        pair = kv_transfer_config is None  # the deployed pair (not a test's own children)
        if kv_transfer_config is None:
            kv_transfer_config = va.multi_kv_transfer_config(
                block_size,
                num_blocks,
                engine_id,
                order=order,
                world_size=tensor_parallel_size,
                nixl_extra_config=nixl_extra_config,
                offload_extra_config=offload_extra_config,
            )
        cfg = va.make_vllm_config(
            model_dir,
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            kv_transfer_config=kv_transfer_config,
            tensor_parallel_size=tensor_parallel_size,
            **extra,
        )
        ranks: list[va.WorkerRank] = []
        kinds: dict[str, Any] = {}
        if planned:
            builder.configure(cfg, shape, side)
            plan = va.plan(cfg, builder.layer_specs(cfg, shape, block_size, tensor_parallel_size), num_blocks)
            kvc = plan.scheduler
            kinds = builder.kinds(cfg, kvc)
            with setup_owned_by(WORKER_UP):
                for r in range(tensor_parallel_size):
                    ranks.append(
                        va.build_rank(
                            cfg,
                            plan.workers[r],
                            r,
                            tp_size=tensor_parallel_size,
                            first_kv_head=va.first_kv_head(cfg, r),
                            make_caches=lambda c: builder.allocate(cfg, c),
                        )
                    )
                    va.prepare_offload_worker(ranks[-1], transport)
                    ranks[-1].register()
                va.report_offload_blocks(cfg, ranks)
        else:
            kvc = va.make_kv_cache_config(num_blocks, block_size=block_size, sliding_window=sliding_window)
            with setup_owned_by(WORKER_UP):
                for r in range(tensor_parallel_size):
                    ranks.append(va.build_rank(cfg, kvc, r))
                    va.prepare_offload_worker(ranks[-1], transport)
                    ranks[-1].register()
                va.report_offload_blocks(cfg, ranks)
        hooks = {"stepper": getattr(builder, "step", None), "runner_output": getattr(builder, "runner_output", None)}
        engine = Engine(
            va.make_scheduler(cfg, kvc), cfg, kvc, ranks, order, shape=shape, kinds=kinds, **(hooks if planned else {})
        )
        _record_request_ids(engine)
        engine.baseline_free = engine.free_blocks()
        if pair:  # a test's own children (an ExampleConnector, ...) have no CPU tier to account for
            engine.baseline = engine.idle_state()
        engine.transfers = transport
        if tensor_parallel_size > 1:
            engine.aggregator = va.aggregator(engine.multi, tensor_parallel_size)
        engines.append(engine)
        return engine

    yield _make
    for e in engines:
        e.shutdown_workers()
    schedulers = [e.scheduler for e in engines]

    def shut_schedulers() -> None:
        for s in schedulers:
            s.shutdown()

    deferred_shutdowns.start(request.node.nodeid, shut_schedulers)


def _record_request_ids(engine: Engine) -> None:
    """Note every request id added to the engine's scheduler (for the leak check; the call goes on unchanged)."""
    add = engine.scheduler.add_request

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        engine.request_ids.add(request.request_id)
        return add(request, *args, **kwargs)

    engine.scheduler.add_request = add_request


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture
def make_pd(make_engine):
    """Build a prefill engine P and a decode engine D on this host, each MultiConnector(Nixl + CPU
    offload) with its own engine id (keyword arguments go to both, ``decode`` to D only); P serves the Nixl handshake as
    EngineCore sets it up (the workers' handshake metadata, through MultiConnector, to the scheduler's
    MultiConnector, which starts Nixl's listener)."""

    def _make(decode: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Engine, Engine]:
        shape = kwargs.get("shape")
        pair = getattr(deploy.builder(shape), "make_pd", None) if shape is not None else None
        if pair is not None:  # a shape whose pair is more than two engines built side by side (kvcompat.testkit.deploy)
            return pair(_prefill, make_engine, shape, decode or {}, kwargs)
        return _prefill(**kwargs), make_engine(engine_id=D_ENGINE, **{**kwargs, "side": "decode", **(decode or {})})

    def _prefill(engine_id: str = P_ENGINE, **kwargs: Any) -> Engine:
        """A prefill engine serving its Nixl handshake, every rank's metadata, as EngineCore sets it up."""
        p = make_engine(engine_id=engine_id, side="prefill", **kwargs)
        with setup_owned_by(HANDSHAKE):
            va.serve_nixl_handshake(p.multi, *(r.connector for r in p.ranks))
        p.baseline = p.idle_state()  # an idle P serves its handshake (EngineCore does it at startup)
        return p

    return _make


@pytest.fixture
def pd(make_pd) -> tuple[Engine, Engine]:
    """P and D in the cell's child order (see :func:`make_pd`)."""
    return make_pd()


def assert_no_leak(*engines: Engine) -> None:
    """Every engine, once settled, is back at its baseline: as many free device blocks and as few
    pinned CPU-tier blocks as when it was built (read from the release, not assumed)."""
    found = [f"{e.kv_transfer_name()}: {'; '.join(leaks)}" for e in engines if (leaks := e.leaks())]
    assert not found, "leak after the scenario: " + " | ".join(found)


def deployed(make: Any, shape: shapes.Shape, **kwargs: Any) -> Any:
    """``make(shape=shape, **kwargs)`` (the ``make_pd`` or ``make_engine`` fixture) as the user's configuration
    of ``shape``: a release that refuses to build it is ``unsupported``, not a test error."""
    with user_configuration(f"MultiConnector(Nixl, CPU offload) in the {shape.id} shape ({shape.what})"):
        return make(shape=shape, **kwargs)


def offload_metric_names() -> Any:
    """Explicit probe: the CPU-offload child's metric names (``v1/simple_kv_offload/metrics.py``), or None."""
    name = "vllm.v1.simple_kv_offload.metrics"
    if importlib.util.find_spec(name) is None:
        return None
    names = getattr(importlib.import_module(name), "MetricName", None)
    return names if hasattr(names, "LOAD_BLOCKS") and hasattr(names, "SAVE_OUTCOMES") else None


def stored_prefix(engine: Engine, prompt: list[int], req_id: str) -> None:
    """A prefix in the CPU tier, as another test's contract gives it: run a request with ``prompt`` to
    its end, let the engine settle (its stores done) and drop the local GPU prefix cache, checking that
    the CPU-offload child stored something.  A release where this fails is that contract's finding (a
    test error here, blocked by it).  (Asking the child for a hit here would pin it, as no engine does.)"""
    with setup_owned_by(STORED):
        engine.scheduler.add_request(engine.request(req_id, prompt, max_tokens=2))
        engine.run([req_id])
        engine.settle()
        assert engine.transfers.stores(), "the CPU-offload child stored nothing of the finished request"
        assert engine.scheduler.reset_prefix_cache(), "GPU blocks still held after the engine settled"


# make_engine / make_pd keywords for a hybrid model (a full-attention and a sliding-window group), HMA on
HYBRID = {"sliding_window": 4 * BLOCK, "disable_hybrid_kv_cache_manager": False}


def require_hma_pair(engine) -> None:
    """Explicit probe: every child MultiConnector builds implements SupportsHMA (else no hybrid model can be
    served by the pair, and the HMA scenarios cannot arise)."""
    MultiConnector, _ = va.multi_classes()
    kids = MultiConnector._get_connector_classes_and_configs(engine.vllm_config)
    lacking = [cls.__name__ for cls, _ in kids if not va.supports_hma(cls)]
    if lacking:
        not_applicable(f"{', '.join(lacking)} does not implement SupportsHMA in this release")


def nixl_lease(monkeypatch, seconds: int) -> dict[str, Any]:
    """Nixl's lease on a prefill's unread blocks set to ``seconds`` by the knob each release reads:
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT before 0.20 (set here), ``kv_lease_duration`` in the Nixl child's extra
    config from 0.20 (returned, for ``make_pd`` / ``make_engine``'s ``nixl_extra_config``)."""
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", str(seconds))
    return {"kv_lease_duration": seconds}


@dataclass
class Lease:
    """P's Nixl lease on the blocks of a prefill nobody has read yet, ``seconds`` long; its time passes on the
    release's own clock (kvcompat.testkit.nixl_clock), moved forward by the test, not waited out."""

    seconds: int
    clock: Any

    def run_out(self, p: Engine, d: Engine | None, *req_ids: str, holding: str = "the blocks nobody read") -> None:
        """Let the lease run out; P must then free ``req_ids`` (stepping D first, then P, as everywhere)."""
        self.clock.advance(self.seconds + 0.5)
        engines = [p] if d is None else [d, p]
        assert step_until(engines, lambda: not any(r in p.scheduler.requests for r in req_ids)), (
            f"P still holds {holding} past its {self.seconds}s lease"
        )


def leased_pd(make_pd, monkeypatch, seconds: int = 2, **kwargs) -> tuple[Engine, Engine, Lease]:
    """A P/D pair (``make_pd(**kwargs)``) whose Nixl lease on unread blocks is ``seconds`` long, and that lease."""
    from kvcompat.testkit import nixl_clock

    p, d = make_pd(nixl_extra_config=nixl_lease(monkeypatch, seconds), **kwargs)
    return p, d, Lease(seconds, nixl_clock.install(monkeypatch))


def can_reset_connectors(engine) -> None:
    """Explicit probe: the release can reset the connectors' caches through the scheduler."""
    if not hasattr(ch.base_class(), "reset_cache"):
        not_applicable("the release's connector API has no reset_cache")
    if "reset_connector" not in inspect.signature(engine.scheduler.reset_prefix_cache).parameters:
        not_applicable("the scheduler cannot reset connectors' caches in this release")


def a_load_held_in_flight(engine, transport, prompt: list[int], req_id: str) -> tuple[Any, Any]:
    """``prompt`` stored in the CPU tier, then a request for it whose load the CPU-offload child has
    started and the transport holds in flight; returns the request and the step's SchedulerOutput."""
    stored_prefix(engine, prompt, f"{req_id}-src")
    transport.hold()
    launched = transport.launched()
    req = engine.request(req_id, prompt, max_tokens=2)
    engine.scheduler.add_request(req)
    so = engine.step()
    with setup_owned_by(STORED):
        assert wait_until(lambda: transport.launched() > launched), "the CPU-offload child never started the load"
    return req, so


def fail_a_loaded_block(monkeypatch, engine: Engine, child: Any, req_id: str, index: int = 1) -> set[int]:
    """Script one answer of a worker-role ``child``: when its load of ``req_id`` completes, it names the request's
    block ``index`` (group 0) in get_block_ids_with_load_errors (once), and reports no failed receive.  Returns
    the failed block ids, filled in when that happens (empty until then)."""
    hook = ch.completion_hook()
    real_hook = getattr(child, hook)
    failed: set[int] = set()
    errors: list[set[int]] = []

    def completions(*args):
        answer = real_hook(*args)
        recving = answer.finished_recving if hook == "get_transfer_results" else answer[1]
        if req_id in set(recving or ()) and not failed:
            failed.add(va.group_block_ids(engine.scheduler.kv_cache_manager.get_block_ids(req_id))[index])
            errors.append(set(failed))
        return answer

    ch.spy(monkeypatch, child, hook, completions)
    ch.spy(monkeypatch, child, "get_block_ids_with_load_errors", lambda: errors.pop() if errors else set())
    return failed


def step_until(engines: list[Engine], until, max_steps: int = 400) -> bool:
    """Step every engine, in the order given (D before P), until ``until()`` holds or ``max_steps`` (and
    TRANSFER_WAIT_S of wall time: reads and notifications run over loopback threads) have passed."""
    for _ in patient_steps(max_steps):
        if until():
            return True
        for e in engines:
            e.step()
    return until()


def nixl_stats_count(key: str) -> bool:
    """Probe: whether the release's NixlKVConnectorStats counts ``key`` (0.34: nixl/stats.py)."""
    for name in ("nixl.stats", "nixl_connector", "nixl.connector"):
        try:
            module = importlib.import_module(f"vllm.distributed.kv_transfer.kv_connector.v1.{name}")
        except ImportError:
            continue
        stats = getattr(module, "NixlKVConnectorStats", None)
        if stats is not None:
            return key in (stats().data or {})
    return False


def nixl_values(kv_outputs: list, key: str) -> list:
    """What Nixl's stats recorded under ``key`` over ``kv_outputs`` (the steps' stats, MultiConnector's per child)."""
    values: list = []
    for o in kv_outputs:
        stats = getattr(o, "kv_connector_stats", None) if o else None
        for child in (getattr(stats, "data", None) or {}).values():
            values += (getattr(child, "data", None) or {}).get(key, [])
    return values


def nixl_counted(kv_outputs: list, key: str) -> int:
    """How many entries Nixl's stats recorded under ``key`` over ``kv_outputs``."""
    return len(nixl_values(kv_outputs, key))


def cpu_tier_hit(engine: Engine, prompt: list[int], req_id: str) -> int:
    """Tokens of ``prompt`` the CPU-offload child would serve now from its CPU tier: asked as the
    scheduler asks (nothing computed locally), then the request is aborted so that nothing stays
    reserved for it."""
    from vllm.v1.request import RequestStatus

    req = engine.request(req_id, prompt, max_tokens=1)
    engine.scheduler.add_request(req)
    toks, _ = engine.offload.get_num_new_matched_tokens(req, 0)
    engine.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    return toks or 0


def read_destination(d: Engine, rid: str) -> set[int]:
    """The blocks D's Scheduler gave ``rid``'s NIXL read, as Nixl's metadata told its workers (every group):
    still known after the request ended and freed them, which the KV-cache manager no longer is."""
    out: set[int] = set()
    for meta in d.metas:
        recv = getattr(meta.metadata[d.nixl_index], "reqs_to_recv", None) if meta is not None else None
        read = (recv or {}).get(rid)
        if read is not None:
            ids = read.local_block_ids
            groups = len(ids) if ids and isinstance(ids[0], (list, tuple)) else 1
            out |= {b for g in range(groups) for b in va.group_block_ids(ids, g)}
    return out


def read_received(d: Engine, rid: str) -> bool:
    """Whether D's workers have reported ``rid``'s remote KV received (the step the read completes)."""
    return any(rid in (o.finished_recving or ()) for o in d.kv_outputs if o)


def read_failure(d: Engine, rid: str) -> str | None:
    """What D's workers reported failed about ``rid``'s read (a failed receive, blocks that failed to load),
    None when nothing: a read reported received may still have failed (the release then recomputes)."""
    d_blocks = set()
    if rid in d.scheduler.requests:
        ids = d.scheduler.kv_cache_manager.get_block_ids(rid)
        d_blocks = {b for g in range(len(d.kv_cache_config.kv_cache_groups)) for b in va.group_block_ids(ids, g)}
    for o in d.kv_outputs:
        if not o:
            continue
        if rid in (getattr(o, "failed_recving", None) or ()):
            return "the workers reported the receive failed"
        invalid = set(getattr(o, "invalid_block_ids", None) or ()) & d_blocks
        if invalid:
            return f"the workers reported blocks {sorted(invalid)} failed to load"
    return None


def assert_blocks_hold_the_prompt(d: Engine, block_ids: Any, prompt: list[int], full: int) -> int:
    """Every rank of D holds, in each layer, the KV a forward pass over ``prompt`` writes for its first
    ``full`` blocks, in the blocks the Scheduler gave that layer's KV-cache group (``block_ids``, as
    ``get_block_ids`` returns them): each rank its own KV heads, each layer as its kind holds it (an
    attention layer every block, a state layer its state blocks).  Returns how many blocks were compared."""
    compared = 0
    for layer, g, j, block_id, prefix, bs in held_blocks(d, block_ids, prompt, full * BLOCK):
        kind = d.kinds.get(layer, va.ATTENTION)
        for rank in d.ranks:
            cache = rank.kv_caches[layer]
            want = kind.expected(cache, layer, prefix, rank.first_kv_head, bs)
            assert va.same_bytes(kind.block(cache, block_id, bs), want), (
                f"D's block {block_id} (prompt block {j}, {layer}, KV-cache group {g}, TP rank {rank.rank} "
                f"of {rank.tp_size}) does not hold the KV P computed"
            )
            compared += 1
    return compared


def held_blocks(engine: Engine, block_ids: Any, tokens: list[int], computed: int):
    """What each layer of ``engine`` holds for a request with ``block_ids`` (as ``get_block_ids`` returns them)
    once the first ``computed`` of ``tokens`` are computed, as the layer's kind says (an attention layer every
    full block, a state layer its state blocks): (layer, group, block index, block id, the prefix the block's
    content depends on, block size) per block."""
    for g, group in enumerate(engine.kv_cache_config.kv_cache_groups):
        bs = group.kv_cache_spec.block_size
        for layer in group.layer_names:
            kind = engine.kinds.get(layer, va.ATTENTION)
            for j, block_id, prefix in kind.held(va.group_block_ids(block_ids, g), tokens, bs, computed // bs):
                yield layer, g, j, block_id, prefix, bs


def pd_read_is_byte_exact(p: Engine, d: Engine, rid: str, prompt: list[int]) -> str:
    """vLLM's P/D proxy protocol through both engines, checked end to end: P prefills (max_tokens=1,
    do_remote_decode) and holds the blocks; D, given P's kv_transfer_params, waits for the remote KV
    while its Nixl worker reads P's blocks over NIXL; D's blocks then hold exactly the KV P's forward
    pass wrote, D computes the rest and finishes, and P frees its blocks once D has read them.
    Returns a line saying what was compared."""
    from vllm.v1.request import RequestStatus

    params = p.prefill(rid, prompt)
    assert rid in p.scheduler.requests, "P freed the blocks before the remote read"
    d.scheduler.add_request(d.request(rid, prompt, max_tokens=2, kv_transfer_params=params))
    d.step()
    req = d.scheduler.requests[rid]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req.status
    d_blocks = d.scheduler.kv_cache_manager.get_block_ids(rid)
    full = len(prompt) // BLOCK
    for _ in patient_steps(400):  # the read runs over loopback: up to a few seconds on a loaded machine
        d.step()
        p.step()
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert req.status != RequestStatus.WAITING_FOR_REMOTE_KVS, "D's read of P's blocks never finished"
    compared = assert_blocks_hold_the_prompt(d, d_blocks, prompt, full)
    d.run([rid])
    for _ in patient_steps(100):
        if rid not in p.scheduler.requests:
            break
        p.step()
    assert rid not in p.scheduler.requests, "P kept the blocks after D had read them"
    return f"P/D read: {full} blocks x {compared // max(full, 1)} layer views compared byte for byte: equal"
