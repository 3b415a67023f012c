"""``async-sched``: the dense or the hybrid model under async scheduling, in EngineCore's batch-queue order.

GPU users run async scheduling by default from 0.34 (config/vllm.py 0.34.0 L1610-1637); vLLM's CpuPlatform
turns it off (platforms/cpu.py 0.34.0 L345-347).  :func:`configure` turns it on after the platform has
decided, as a GPU engine has it; what the release derives from it is read live from the config
(``max_concurrent_batches``, config/vllm.py 0.34.0 L560-566, and with it ``max_in_flight_tokens``; before
0.23 the executor's: :func:`batch_queue_size`), and
EngineCore builds the class the scheduler config names (``scheduler_config.get_scheduler_cls()``,
v1/engine/core.py 0.34.0 L181: ``AsyncScheduler``).

:func:`step` is EngineCore's ``step_with_batch_queue`` (v1/engine/core.py 0.34.0 L758-871) with a queue of
:func:`batch_queue_size` steps: schedule step N+1 and hand it to the workers before update_from_output(N),
pop the oldest step's output only when the queue is full or nothing more can be scheduled.  The workers
run a step when EngineCore submits it (a fast GPU: its KV writes land in step order before any later step's
connector work); the Scheduler and the connectors see its output only when EngineCore collects it.  An
engine with nothing scheduled and nothing queued steps as the suite's engines do (schedule, execute,
update), as the connectors need an idle engine to keep polling.

What a GPU would make of the async order and the CPU cannot show by itself: a step in flight still writes
its requests' blocks, unordered with a connector's load (NIXL or the CPU tier) into the same block.  So a
step notes, per engine, any KV load started into a block that a step still in flight writes
(``engine.in_flight_overwrites``: the received KV a GPU would overwrite, vllm#48481), read by the async
contracts (tests/connectors/test_shape_async.py).

The model is the shape's (``shape.model``): ``llama`` is the dense model of :mod:`.base`, ``hybrid`` the
hybrid builder's (:mod:`.hybrid`, imported when first needed), whose model, specs, layer kinds and caches
are used as they are, with async scheduling on top.  The tokens the model samples depend on the position
they are sampled for (:func:`kvcompat.testkit.deploy.drafts.target_token`), so a step whose output is
applied twice, late or to the wrong position shows in the tokens.
"""

from __future__ import annotations

import importlib
import time
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

from kvcompat import shapes
from kvcompat.shapes import Shape
from kvcompat.testkit import probes
from kvcompat.testkit.deploy import base as _base
from kvcompat.testkit.deploy import drafts as _tokens
from kvcompat.testkit.deploy.base import *  # noqa: F403

STEP_GAP_S = 0.001  # as the suite's own step (tests/connectors/conftest.py STEP_GAP_S)
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler"


def _model(shape: Shape) -> tuple[ModuleType, Shape]:
    """The builder of the shape's model and the shape it builds (``hybrid``: the hybrid shape's builder)."""
    if shape.model == "llama":
        return _base, shapes.DENSE
    family = shapes.BY_ID[shape.model].family
    return importlib.import_module(f"kvcompat.testkit.deploy.{family.replace('-', '_')}"), shapes.BY_ID[shape.model]


def synchronous(shape: Shape) -> Shape:
    """The same deployment with async scheduling off (the order the CPU platform leaves): the twin a contract
    compares with."""
    import dataclasses

    return dataclasses.replace(shape, id=f"{shape.id}-sync", async_scheduling=False, what=shape.what + ", async off")


def missing(shape: Shape) -> str | None:
    """Explicit probe: the release ships an async scheduler and a scheduler config that turns it on; then
    whatever the shape's model needs (the hybrid builder's own probe)."""
    if not probes.has_module(ASYNC_SCHEDULER):
        return f"the release has no async scheduling ({ASYNC_SCHEDULER} is not shipped)"
    from vllm.config import SchedulerConfig

    if "async_scheduling" not in getattr(SchedulerConfig, "__dataclass_fields__", {}):
        return "the release's SchedulerConfig has no async_scheduling"
    module, inner = _model(shape)
    return module.missing(inner)


def tp_size(shape: Shape, side: str) -> int:
    module, inner = _model(shape)
    return module.tp_size(inner, side)


def model_config(shape: Shape) -> dict[str, Any]:
    module, inner = _model(shape)
    return module.model_config(inner)


def write_model(shape: Shape, directory: Path) -> Path:
    module, inner = _model(shape)
    written = module.write_model(inner, directory)
    _MODEL_OF_DIR[str(Path(written).resolve())] = shape.model
    return written


def config_kwargs(shape: Shape, side: str) -> dict[str, Any]:
    module, inner = _model(shape)
    return module.config_kwargs(inner, side)


def configure(vllm_config: Any, shape: Shape, side: str) -> None:
    """The model's configuration, then async scheduling on, as on a GPU (after the platform turned it off)."""
    module, inner = _model(shape)
    module.configure(vllm_config, inner, side)
    if shape.async_scheduling:
        vllm_config.scheduler_config.async_scheduling = True


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    module, inner = _model(shape)
    return module.layer_specs(vllm_config, inner, block_size, tp)


def kinds(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    module, _ = _model_served(vllm_config)
    return module.kinds(vllm_config, kv_cache_config)


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    module, _ = _model_served(vllm_config)
    return module.allocate(vllm_config, kv_cache_config)


# The model each written model directory holds (write_model), for the hooks that get only the VllmConfig.
_MODEL_OF_DIR: dict[str, str] = {}


def _model_served(vllm_config: Any) -> tuple[ModuleType, Shape]:
    """The builder of the model ``vllm_config`` serves (by the directory :func:`write_model` wrote it to)."""
    model = _MODEL_OF_DIR.get(str(Path(vllm_config.model_config.model).resolve()), "llama")
    return _model(Shape("_", "async-sched", "", model=model))


# --- EngineCore's batch queue ----------------------------------------------------------------------------


def runner_output(so: Any, kv_connector_output: Any) -> Any:
    """A rank's ModelRunnerOutput: the token the model samples for each request's position (worked out by
    :func:`step` when it scheduled ``so``)."""
    return _tokens.runner_output(so, kv_connector_output)


def _scheduler_class_check(engine: Any) -> None:
    cfg = engine.vllm_config.scheduler_config
    get_cls = getattr(cfg, "get_scheduler_cls", None)
    want = get_cls() if get_cls is not None else None
    if want is not None and type(engine.scheduler) is not want:
        raise TypeError(
            f"the engine's scheduler is {type(engine.scheduler).__name__}; EngineCore builds "
            f"{want.__name__} for this config (scheduler_config.get_scheduler_cls(), v1/engine/core.py): "
            "kvcompat.testkit.adapter.make_scheduler must build that class"
        )


def _waiting_for_kv(scheduler: Any) -> set[str]:
    from vllm.v1.request import RequestStatus

    return {r for r, req in scheduler.requests.items() if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS}


def _written(engine: Any, so: Any) -> set[tuple[int, int]]:
    """(KV-cache group, block id) of every block the workers write in step ``so`` (read right after its
    schedule, as the Forward does)."""
    from kvcompat.testkit import adapter as va

    group_of = {n: g for g, grp in enumerate(engine.kv_cache_config.kv_cache_groups) for n in grp.layer_names}
    forward = va.Forward(engine.scheduler, so, engine.kv_cache_config, engine.kinds)
    return {(group_of[layer], block_id) for layer, block_id, _, _ in forward.writes}


def _loaded_into(engine: Any, req_id: str) -> set[tuple[int, int]]:
    from kvcompat.testkit import adapter as va

    block_ids = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    groups = len(engine.kv_cache_config.kv_cache_groups)
    return {(g, b) for g in range(groups) for b in va.group_block_ids(block_ids, g) if b != 0}


def _schedule_and_submit(engine: Any, queue: deque) -> Any:
    """schedule(); note KV loads started into blocks that steps still in flight write; the workers run the
    step (its output kept until EngineCore collects it)."""
    scheduler = engine.scheduler
    before = _waiting_for_kv(scheduler)
    so = engine.schedule()
    in_flight = set().union(*(w for _, _, w in queue)) if queue else set()
    for req_id in sorted(_waiting_for_kv(scheduler) - before):
        clash = _loaded_into(engine, req_id) & in_flight
        if clash:
            vars(engine).setdefault("in_flight_overwrites", []).append(
                f"{req_id}'s KV load went into blocks {sorted(clash)} (group, block) that a step still in flight writes"
            )
    written = _written(engine, so)
    _tokens._SAMPLED[id(so)] = _tokens.sampled(scheduler, so)
    try:
        out = engine.execute(so)
    finally:
        _tokens._SAMPLED.pop(id(so), None)
    return so, out, written


def batch_queue_size(vllm_config: Any) -> int:
    """EngineCore's batch queue size: ``VllmConfig.max_concurrent_batches`` where the release has it (0.23+:
    PP size, plus one under async scheduling), else the executor's (v1/executor/uniproc_executor.py 0.22.1
    L76-78 and multiproc_executor.py L474-478: 2 under async scheduling with PP 1, else the PP size)."""
    if hasattr(vllm_config, "max_concurrent_batches"):
        return vllm_config.max_concurrent_batches
    pp = vllm_config.parallel_config.pipeline_parallel_size
    return 2 if pp <= 1 and vllm_config.scheduler_config.async_scheduling else pp


def step(engine: Any) -> Any:
    """One call of EngineCore's ``step_with_batch_queue`` (async scheduling), or of its ``step`` with async
    scheduling off; returns the SchedulerOutput scheduled (the one collected when none was)."""
    _scheduler_class_check(engine)
    size = batch_queue_size(engine.vllm_config)
    queue: deque = vars(engine).setdefault("batch_queue", deque())
    scheduler = engine.scheduler
    if size <= 1 or (not queue and not scheduler.has_requests()):
        so, out, _ = _schedule_and_submit(engine, queue)  # EngineCore.step, or an idle engine's step
        engine.update(so, out)
        time.sleep(STEP_GAP_S)
        return so
    scheduled = None
    if scheduler.has_requests():
        item = _schedule_and_submit(engine, queue)
        queue.appendleft(item)
        scheduled = item[0]
        executed = scheduled.total_num_scheduled_tokens > 0
        if len(queue) < size and (executed or scheduler.has_requests()):
            time.sleep(STEP_GAP_S)
            return scheduled
    so, out, _ = queue.pop()
    engine.update(so, out)
    time.sleep(STEP_GAP_S)
    return scheduled if scheduled is not None else so
