"""The worker half of an engine: one worker-role connector per TP rank, driven in the model runner's order.

A rank's connector is what the release's factory builds for the WORKER role (MultiConnector with its
real children).  Each step runs the release's own model-runner code for KV connectors where it can be
called on its own, and emulates only the forward pass in between:

* up to 0.33, ``KVConnectorModelRunnerMixin`` (v1/worker/kv_connector_model_runner_mixin.py): its
  ``_get_kv_connector_output`` context (bind, start_load_kv, wait_for_save, finished transfers, load
  errors, stats, events, worker metadata, clear) and ``kv_connector_no_forward``; the GPU model runner
  itself calls ``handle_preemptions`` first and registers the KV caches, which is done here as it does;
* from 0.34, ``ActiveKVConnector`` (v1/worker/gpu/kv_connector.py): built with the KV caches (it
  registers them), then ``pre_forward``, ``finish_forward``, ``post_forward`` or ``no_forward``.

The forward pass (:func:`forward_layers`) does what the attention layers' ``maybe_transfer_kv_layer``
hook does around each layer: ``wait_for_layer_load``, the layer writes its KV, ``save_kv_layer``.
With more than one rank, their outputs go to the scheduler through the release's
``KVOutputAggregator`` (built as EngineCore builds it, from the scheduler's connector); with one,
as with vLLM's single-process executor, unaggregated.  Nothing here forwards to a child, merges what
children report or builds MultiConnector's structures: MultiConnector does that itself, or fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

from kvcompat.testkit import probes
from kvcompat.testkit.adapter.capabilities import V1
from kvcompat.testkit.adapter.engine import create_connector
from kvcompat.testkit.adapter.kv_cache import make_kv_caches, resolve_kv_cache_layout
from kvcompat.testkit.adapter.parallel import tp_rank

MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin"
ACTIVE = "vllm.v1.worker.gpu.kv_connector"


class LayerAttentionMetadata:
    """What a layer's attention metadata is to the connector hooks: present (the hooks skip None)."""


def model_runner() -> str:
    """The model runner whose KV-connector sequence a step follows: ``"mixin"`` where the release
    ships v1's mixin (up to 0.33), else ``"v2"`` (``ActiveKVConnector``, 0.34)."""
    return "mixin" if probes.has_module(MIXIN) else "v2"


@contextlib.contextmanager
def kv_transfer_group(connector: Any) -> Iterator[None]:
    """Make ``connector`` this process's KV transfer group (what a worker process holds) for a while.

    The model runner's code reaches the connector through ``get_kv_transfer_group()``; in a
    worker process that is the one connector the worker built.  Ranks share this process, so
    each rank's connector is the group while that rank runs.
    """
    state = importlib.import_module("vllm.distributed.kv_transfer.kv_transfer_state")
    previous = state._KV_CONNECTOR_AGENT
    state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        state._KV_CONNECTOR_AGENT = previous


@contextlib.contextmanager
def _affinity_kept() -> Iterator[None]:
    # Nixl's CPU path pins the process to one core (nixl/base_worker.py): the test process keeps its cores.
    affinity = os.sched_getaffinity(0)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)


def layer_order(layer_names: Any) -> list[str]:
    """Layers in the order a forward pass runs them (``model.layers.<i>.``, by ``i``)."""

    def index(name: str) -> tuple[int, str]:
        parts = name.split(".")
        numbers = [int(p) for p in parts if p.isdigit()]
        return (numbers[0] if numbers else 0, name)

    return sorted(layer_names, key=index)


@dataclasses.dataclass
class WorkerRank:
    """One TP rank's worker side: its connector, its KV caches and, from 0.34, the runner's ActiveKVConnector.

    ``rank`` of ``tp_size`` is what the release's code reads as this rank's place in its TP group while
    the rank is built, registers and runs (:func:`kvcompat.testkit.adapter.parallel.tp_rank`);
    ``first_kv_head`` is the model's global index of the first KV head it holds."""

    rank: int
    connector: Any
    kv_caches: dict[str, Any]
    vllm_config: Any
    active: Any = None  # ActiveKVConnector (v2 runner), built at registration
    registered: bool = False
    tp_size: int = 1
    first_kv_head: int = 0

    @property
    def layer_names(self) -> list[str]:
        return layer_order(self.kv_caches)

    def identity(self) -> contextlib.AbstractContextManager:
        """This rank's place in its TP group, as the release reads it (see the class)."""
        return tp_rank(self.rank, self.tp_size)

    def register(self) -> None:
        """Register the KV caches the way the release's model runner does, once."""
        from vllm.config import set_current_vllm_config

        with (
            self.identity(),
            kv_transfer_group(self.connector),
            set_current_vllm_config(self.vllm_config),
            _affinity_kept(),
        ):
            if model_runner() == "v2":
                self.active = importlib.import_module(ACTIVE).get_kv_connector(self.vllm_config, self.kv_caches)
            else:  # gpu_model_runner.initialize_kv_cache: register, then the host-buffer copy op
                self.connector.register_kv_caches(self.kv_caches)
                utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
                if hasattr(self.connector, "set_host_xfer_buffer_ops") and hasattr(utils, "copy_kv_blocks"):
                    self.connector.set_host_xfer_buffer_ops(utils.copy_kv_blocks)
        self.registered = True

    def execute(self, scheduler_output: Any, forward: Callable[[WorkerRank], None]) -> Any:
        """This rank's model-runner step for ``scheduler_output``: the KVConnectorOutput it returns.

        ``forward`` is the forward pass (:func:`forward_layers` with what the layers write); it runs
        only when the step schedules tokens, as in the runner.
        """
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        cfg = self.vllm_config
        runs_forward = bool(scheduler_output.total_num_scheduled_tokens)
        with self.identity(), kv_transfer_group(self.connector), set_current_vllm_config(cfg), _affinity_kept():
            if self.active is not None:  # ActiveKVConnector (v1/worker/gpu/kv_connector.py)
                if not runs_forward:
                    return self.active.no_forward(scheduler_output).kv_connector_output
                with set_forward_context(None, cfg):  # piecewise/eager: pre_forward in the forward context
                    self.active.pre_forward(scheduler_output)
                    forward(self)
                if hasattr(self.active, "finish_forward"):
                    self.active.finish_forward()
                return self.active.post_forward(scheduler_output.finished_req_ids)
            mixin = importlib.import_module(MIXIN).KVConnectorModelRunnerMixin
            _handle_preemptions(self.connector, scheduler_output)  # gpu_model_runner.execute_model, first
            if not runs_forward:
                return mixin.kv_connector_no_forward(scheduler_output, cfg).kv_connector_output
            with set_forward_context(None, cfg), mixin._get_kv_connector_output(scheduler_output) as output:
                forward(self)
            return output

    def shutdown(self) -> None:
        with self.identity(), _affinity_kept():
            self.connector.shutdown()


def _handle_preemptions(connector: Any, scheduler_output: Any) -> None:
    """What v1's gpu_model_runner.execute_model does before anything else: tell the connector about
    preemptions, with the ids when preempted (0.14-0.18), with the step's metadata every step (0.19+)."""
    base = importlib.import_module(V1 + ".base").KVConnectorBase_V1
    if not hasattr(base, "handle_preemptions"):
        return
    if "preempted_req_ids" in inspect.signature(base.handle_preemptions).parameters:
        if scheduler_output.preempted_req_ids:
            connector.handle_preemptions(scheduler_output.preempted_req_ids)
    else:
        connector.handle_preemptions(scheduler_output.kv_connector_metadata)


def forward_layers(rank: WorkerRank, write_kv: Callable[[str, Any, int], None]) -> None:
    """A forward pass as the connector sees it: around each attention layer, what the release's
    ``maybe_transfer_kv_layer`` does: if metadata is bound, ``wait_for_layer_load`` before the layer,
    and ``save_kv_layer`` with the layer's KV cache after it; the layer itself writes its KV
    (``write_kv(layer_name, kv_cache, first_kv_head)``: the rank's share of the heads)."""
    connector = rank.connector
    for name in rank.layer_names:
        hooked = connector.has_connector_metadata()
        if hooked:
            connector.wait_for_layer_load(name)
        write_kv(name, rank.kv_caches[name], rank.first_kv_head)
        if hooked:
            connector.save_kv_layer(name, rank.kv_caches[name], LayerAttentionMetadata())


def build_rank(
    vllm_config: Any,
    kv_cache_config: Any,
    rank: int = 0,
    build: Callable[..., Any] = create_connector,
    *,
    tp_size: int = 1,
    first_kv_head: int = 0,
    make_caches: Callable[[Any], dict[str, Any]] = make_kv_caches,
) -> WorkerRank:
    """A worker rank: the KV-cache layout resolved as EngineCore does, the WORKER-role connector from
    ``build`` (the release's factory), and CPU KV caches placed as the model runner places them
    (``make_caches``).  With ``tp_size`` > 1 the rank is built as TP rank ``rank`` of ``tp_size``.
    The caches are not registered yet (:meth:`WorkerRank.register`)."""
    from vllm.config import set_current_vllm_config

    resolve_kv_cache_layout(vllm_config, kv_cache_config)
    role = importlib.import_module(V1 + ".base").KVConnectorRole.WORKER
    with tp_rank(rank, tp_size), set_current_vllm_config(vllm_config), _affinity_kept():
        connector = build(vllm_config, role, kv_cache_config)
        caches = make_caches(kv_cache_config)
    return WorkerRank(rank, connector, caches, vllm_config, tp_size=tp_size, first_kv_head=first_kv_head)


def aggregator(scheduler_connector: Any, world_size: int) -> Any:
    """The release's KVOutputAggregator, as EngineCore has the executor build it."""
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    return utils.KVOutputAggregator.from_connector(scheduler_connector, world_size)


def simple_cpu_offload_blocks(ranks: list[WorkerRank]) -> int | None:
    """What EngineCore asks the workers at startup (0.34: ``get_simple_cpu_offload_num_blocks``): each
    worker's SimpleCPUOffload connector's aligned CPU block count, found the worker's way, the
    smallest of them; None when no worker reports one."""
    connector_mod = importlib.import_module(V1 + ".simple_cpu_offload_connector")
    counts = []
    for r in ranks:
        found = connector_mod._find_simple_cpu_offload_connector(r.connector)
        counts.append(found.get_aligned_num_cpu_blocks() if found is not None else None)
    known = [c for c in counts if c is not None]
    return min(known) if known else None
