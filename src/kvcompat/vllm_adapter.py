"""Version-adaptive construction of the vLLM objects the connector tests need.

This module only absorbs *construction* differences between vLLM releases
(module paths, constructor signatures, renamed fields).  It never changes what
vLLM does once an object is built and never works around a vLLM bug: if a
release misbehaves, the test that exercises it must fail.

Every branch below is chosen by an explicit probe of the installed release
(:mod:`kvcompat.probes`, ``hasattr`` or ``inspect.signature`` on the real
classes), never by catching an exception and trying something else.

Importing this module does not import vLLM.  Call :func:`select_cpu_platform`
before anything imports a vLLM module that reads ``current_platform``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

from kvcompat import probes

KV_BASE = "vllm.distributed.kv_transfer.kv_connector"
V1 = KV_BASE + ".v1"

# Tiny local model (no weights, no hub).  head_size 32 and block_size 32 suit the
# CPU attention backend (head sizes 32..512, block size a multiple of 32).
TINY_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NUM_KV_HEADS = 2
HEAD_SIZE = 32
LAYER_NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 100  # any non-EOS token


# ---------------------------------------------------------------------------
# platform
# ---------------------------------------------------------------------------
def _target_device_env_selects_cpu() -> bool:
    """Probe, without importing vLLM: does this release's ``cpu_platform_plugin``
    (vllm/platforms/__init__.py) honour VLLM_TARGET_DEVICE?"""
    import ast

    path = probes.vllm_distribution().locate_file("vllm/platforms/__init__.py")
    tree = ast.parse(Path(str(path)).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "cpu_platform_plugin":
            return "VLLM_TARGET_DEVICE" in ast.unparse(node)
    return False


def select_cpu_platform() -> str:
    """Select vLLM's own CpuPlatform for this process (construction only).

    The official CUDA wheels resolve to ``UnspecifiedPlatform`` on a GPU-less
    box.  From 0.28.0 ``VLLM_TARGET_DEVICE=cpu`` makes vLLM's own resolver pick
    ``CpuPlatform``; older releases get ``vllm.platforms._current_platform`` set
    to a ``CpuPlatform`` before any connector module reads it.  Returns how the
    platform was selected.
    """
    if _target_device_env_selects_cpu():
        # Before vllm.envs / vllm.platforms are imported (some releases cache env reads).
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        how = "VLLM_TARGET_DEVICE=cpu"
        import vllm.platforms as platforms
    else:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
        how = "vllm.platforms._current_platform = CpuPlatform()"
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        raise RuntimeError(
            f"could not select CpuPlatform ({how}); got {type(current_platform).__name__}"
        )
    return how


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def _params(obj: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(obj).parameters)


def call_with_supported(fn: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts."""
    params = _params(fn)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def write_tiny_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG, indent=1))
    return directory


# ---------------------------------------------------------------------------
# classes by release
# ---------------------------------------------------------------------------
def has_offloading_connector() -> bool:
    return probes.has_module(V1 + ".offloading_connector")


def has_simple_cpu_offload() -> bool:
    return probes.has_module("vllm.v1.simple_kv_offload") and probes.has_module(
        V1 + ".simple_cpu_offload_connector"
    )


def has_multi_connector() -> bool:
    return probes.has_module(V1 + ".multi_connector")


def nixl_module() -> str:
    """N1 (one module) up to 0.19.x, N2/N3 (package) from 0.20."""
    if probes.has_module(V1 + ".nixl"):
        return V1 + ".nixl"
    return V1 + ".nixl_connector"


def nixl_wrapper_target() -> tuple[str, str]:
    """(module, attribute) to patch with a fake NIXL agent: N1/N2/N3 in the notes."""
    if probes.has_module(V1 + ".nixl.base_worker"):
        return V1 + ".nixl.base_worker", "NixlWrapper"  # N3, 0.24+
    if probes.has_module(V1 + ".nixl.worker"):
        return V1 + ".nixl.worker", "NixlWrapper"  # N2, 0.20-0.23
    return V1 + ".nixl_connector", "NixlWrapper"  # N1


def nixl_classes() -> tuple[type, type]:
    mod = importlib.import_module(nixl_module())
    return mod.NixlConnector, mod.NixlConnectorMetadata


def multi_classes() -> tuple[type, type]:
    mod = importlib.import_module(V1 + ".multi_connector")
    return mod.MultiConnector, mod.MultiKVConnectorMetadata


def offload_child_name() -> str:
    return "SimpleCPUOffloadConnector" if has_simple_cpu_offload() else "OffloadingConnector"


def offload_classes() -> tuple[type, type]:
    if has_simple_cpu_offload():
        conn = importlib.import_module(V1 + ".simple_cpu_offload_connector")
        meta = importlib.import_module("vllm.v1.simple_kv_offload.metadata")
        return conn.SimpleCPUOffloadConnector, meta.SimpleCPUOffloadMetadata
    mod = importlib.import_module(V1 + ".offloading_connector")
    return mod.OffloadingConnector, mod.OffloadingConnectorMetadata


def supports_hma(obj: Any) -> bool:
    """vLLM's own HMA predicate (v1/base.py, 0.11.2+)."""
    base = importlib.import_module(V1 + ".base")
    return bool(base.supports_hma(obj))


def kv_connector_role() -> Any:
    return importlib.import_module(V1 + ".base").KVConnectorRole


# ---------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------
def offload_child_extra_config(block_size: int, num_gpu_blocks: int) -> dict[str, Any]:
    """Extra config of the CPU-offload child: room for as many CPU blocks as GPU ones."""
    page = 2 * NUM_KV_HEADS * HEAD_SIZE * 4 * block_size  # fp32 K+V per layer per block
    cpu_bytes = page * len(LAYER_NAMES) * num_gpu_blocks
    if has_simple_cpu_offload():
        return {"cpu_bytes_to_use": cpu_bytes}
    # OffloadingConnector (CPUOffloadingSpec): num_cpu_blocks up to 0.13,
    # cpu_bytes_to_use from 0.14.1.  Probe the spec's source for the key it reads.
    spec_src = inspect.getsource(importlib.import_module(_cpu_offloading_spec_module()))
    if '"cpu_bytes_to_use"' in spec_src:
        return {"cpu_bytes_to_use": cpu_bytes}
    return {"num_cpu_blocks": num_gpu_blocks}


def _cpu_offloading_spec_module() -> str:
    if probes.has_module("vllm.v1.kv_offload.cpu.spec"):
        return "vllm.v1.kv_offload.cpu.spec"
    return "vllm.v1.kv_offload.cpu"


def multi_kv_transfer_config(
    block_size: int, num_gpu_blocks: int, engine_id: str = "kvcompat-engine"
) -> Any:
    """KVTransferConfig for MultiConnector([Nixl, CPU offload]); children without engine_id."""
    from vllm.config import KVTransferConfig

    children = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
        {
            "kv_connector": offload_child_name(),
            "kv_role": "kv_both",
            "kv_connector_extra_config": offload_child_extra_config(block_size, num_gpu_blocks),
        },
    ]
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        engine_id=engine_id,
        kv_connector_extra_config={"connectors": children},
    )


def make_vllm_config(
    model_dir: Path,
    *,
    block_size: int = BLOCK_SIZE,
    num_gpu_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 1024,
    kv_transfer_config: Any = None,
    disable_hybrid_kv_cache_manager: bool | None = None,
) -> Any:
    """VllmConfig with the tiny local model on DeviceConfig("cpu").

    ``disable_hybrid_kv_cache_manager=None`` leaves the release's own default, so
    the release decides whether HMA is on (drift item 8).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = call_with_supported(
        ModelConfig,
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
    )
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    if disable_hybrid_kv_cache_manager is not None:
        sched_kwargs["disable_hybrid_kv_cache_manager"] = disable_hybrid_kv_cache_manager
    scheduler_config = call_with_supported(SchedulerConfig, **sched_kwargs)
    cache_config = call_with_supported(
        CacheConfig,
        block_size=block_size,
        enable_prefix_caching=True,
        cache_dtype="auto",
    )
    if kv_transfer_config is None:
        kv_transfer_config = multi_kv_transfer_config(block_size, num_gpu_blocks)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return vllm_config


def hma_enabled(vllm_config: Any) -> bool:
    """Whether the release left the hybrid KV cache manager on for this config."""
    return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


# ---------------------------------------------------------------------------
# KV cache config with real tensors
# ---------------------------------------------------------------------------
def _attention_spec(block_size: int, sliding_window: int | None = None) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cls = FullAttentionSpec if sliding_window is None else SlidingWindowSpec
    kwargs: dict[str, Any] = dict(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
    )
    params = _params(cls)
    if "use_mla" in params:  # required up to 0.10.2
        kwargs["use_mla"] = False
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    return cls(**kwargs)


def make_kv_cache_config(
    num_blocks: int,
    *,
    block_size: int = BLOCK_SIZE,
    sliding_window: int | None = None,
) -> Any:
    """KVCacheConfig with real ``kv_cache_tensors``.

    One full-attention group over both layers, or (``sliding_window`` given)
    a full-attention group (layer 0) and a sliding-window group (layer 1).
    Tensor layout: ``KVCacheTensor(size, shared_by)`` per layer up to 0.28, and
    from 0.29 one layer-outer ``KVCacheTensor(size=<whole allocation>, layers,
    layer_stride, block_stride, offset)`` per group.
    """
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if sliding_window is None:
        groups = [KVCacheGroupSpec(list(LAYER_NAMES), _attention_spec(block_size))]
    else:
        groups = [
            KVCacheGroupSpec([LAYER_NAMES[0]], _attention_spec(block_size)),
            KVCacheGroupSpec([LAYER_NAMES[1]], _attention_spec(block_size, sliding_window)),
        ]
    tensor_fields = _field_names(KVCacheTensor)
    tensors = []
    if "shared_by" in tensor_fields:
        for g in groups:
            for name in g.layer_names:
                tensors.append(
                    KVCacheTensor(size=g.kv_cache_spec.page_size_bytes * num_blocks, shared_by=[name])
                )
    else:
        total = sum(g.kv_cache_spec.page_size_bytes * num_blocks * len(g.layer_names) for g in groups)
        offset = 0
        for g in groups:
            page = g.kv_cache_spec.page_size_bytes
            tensors.append(
                KVCacheTensor(
                    size=total,
                    layers=list(g.layer_names),
                    layer_stride=page * num_blocks,
                    block_stride=page,
                    offset=offset,
                )
            )
            offset += page * num_blocks * len(g.layer_names)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def resolve_kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Resolve the KV-cache layout the way EngineCore does before building workers.

    Releases that resolve it in the engine core (``resolve_kv_cache_layout`` in
    ``vllm.v1.attention.backends.utils``) refuse to build a Nixl worker until
    ``cache_config.kv_cache_layout`` is set.  The supported layouts are those of
    the attention backends vLLM selects for this config (CpuPlatform here).
    Returns the layout name, or None on releases without this step.
    """
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    if not hasattr(utils, "resolve_kv_cache_layout"):
        return None
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)
    supported = [layout.name for layout in utils.get_supported_kv_cache_layouts(backends)]
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    return utils.resolve_kv_cache_layout(vllm_config, [supported], specs).name


def _cpu_kv_cache_shape(num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Per-layer KV-cache shape: the CPU attention backend's ``get_kv_cache_shape``
    where it defines one, else the layout-based LBHNC view
    ``[num_blocks, heads, block_size, 2 * head_size]`` (K|V packed)."""
    cpu_attn = importlib.import_module("vllm.v1.attention.backends.cpu_attn").CPUAttentionBackend
    if "get_kv_cache_shape" in vars(cpu_attn):  # up to the layout-based releases
        return tuple(cpu_attn.get_kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE))
    return (num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE)  # LBHNC


def make_kv_caches(kv_cache_config: Any) -> dict[str, Any]:
    """CPU KV-cache tensors placed the way the model runner places them.

    Each ``KVCacheTensor`` is one raw byte allocation; up to 0.28 each is
    ``size`` bytes shared by ``shared_by``; from 0.29 every ``KVCacheTensor``
    describes placement in one backing allocation of ``size`` bytes, the layer
    ``i`` of a tensor starting at ``offset + i * layer_stride``.  Per-layer views
    have the CPU attention backend's ``get_kv_cache_shape`` where it defines one
    (``(2, num_blocks, heads, block_size, head_size)``), else the layout-based
    LBHNC view ``[num_blocks, heads, block_size, 2 * head_size]`` (K|V packed).
    """
    import torch

    specs = {
        name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names
    }
    nb = kv_cache_config.num_blocks

    def shape(spec: Any) -> tuple[int, ...]:
        return _cpu_kv_cache_shape(nb, spec.block_size)

    def view(raw: Any, start: int, name: str) -> Any:
        spec = specs[name]
        nbytes = spec.page_size_bytes * nb
        return raw[start : start + nbytes].view(torch.float32).view(*shape(spec))

    caches: dict[str, Any] = {}
    tensors = kv_cache_config.kv_cache_tensors
    if "shared_by" in _field_names(type(tensors[0])):
        for t in tensors:
            raw = torch.zeros(t.size, dtype=torch.int8)
            for name in t.shared_by:
                caches[name] = view(raw, 0, name)
    else:
        raw = torch.zeros(tensors[0].size, dtype=torch.int8)
        for t in tensors:
            for i, name in enumerate(t.layers):
                caches[name] = view(raw, t.offset + i * t.layer_stride, name)
    return caches


# ---------------------------------------------------------------------------
# connectors, scheduler, requests, outputs
# ---------------------------------------------------------------------------
def multi_child_connector(vllm_config: Any, role: Any, kv_cache_config: Any, index: int) -> Any:
    """Child ``index`` built exactly as MultiConnector builds it (its own child
    class and derived config, 0.11.2+), without building the other children."""
    MultiConnector, _ = multi_classes()
    cls, temp_config = MultiConnector._get_connector_classes_and_configs(vllm_config)[index]
    if "kv_cache_config" in _params(cls):
        return cls(temp_config, role, kv_cache_config)
    return cls(temp_config, role)


def create_connector(vllm_config: Any, role: Any, kv_cache_config: Any) -> Any:
    """The release's factory entry point (create_connector[_v1], kv_cache_config when taken)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if hasattr(KVConnectorFactory, "create_connector"):
        fn = KVConnectorFactory.create_connector
    else:
        fn = KVConnectorFactory.create_connector_v1
    kwargs = {"config": vllm_config, "role": role}
    if "kv_cache_config" in _params(fn):
        kwargs["kv_cache_config"] = kv_cache_config
    return fn(**kwargs)


def make_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    kwargs: dict[str, Any] = dict(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
    )
    if "block_size" in _params(Scheduler):
        kwargs["block_size"] = vllm_config.cache_config.block_size
    return Scheduler(**kwargs)


_HASH_INITIALISED: dict[int, Any] = {}


def block_hasher(block_size: int) -> Any:
    """get_request_block_hasher(block_size, sha256) after init_none_hash, as EngineCore does."""
    from vllm.v1.core import kv_cache_utils

    if probes.has_module("vllm.utils.hashing"):
        hash_fn = importlib.import_module("vllm.utils.hashing").sha256
    else:
        hash_fn = importlib.import_module("vllm.utils").sha256
    if not _HASH_INITIALISED:
        kv_cache_utils.init_none_hash(hash_fn)
        _HASH_INITIALISED[0] = hash_fn
    return kv_cache_utils.get_request_block_hasher(block_size, hash_fn)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
    block_size: int = BLOCK_SIZE,
) -> Any:
    """A Request with a block hasher; kv_transfer_params go in sampling_params.extra_args."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    if kv_transfer_params is not None:
        sp.extra_args = {"kv_transfer_params": kv_transfer_params}
    kwargs: dict[str, Any] = dict(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sp,
        pooling_params=None,
        eos_token_id=EOS_TOKEN_ID,
        arrival_time=time.time(),
        block_hasher=block_hasher(block_size),
        mm_features=None,
    )
    return call_with_supported(Request, **kwargs)


def make_kv_connector_output(
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    kv_connector_worker_meta: Any = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
) -> Any:
    """KVConnectorOutput; the optional fields are passed only when non-empty, and
    passing one the release's KVConnectorOutput lacks raises TypeError."""
    from vllm.v1.outputs import KVConnectorOutput

    kwargs: dict[str, Any] = dict(finished_sending=finished_sending, finished_recving=finished_recving)
    optional = {
        "kv_connector_worker_meta": kv_connector_worker_meta,
        "failed_recving": failed_recving or None,
        "invalid_block_ids": invalid_block_ids or None,
    }
    fields = _field_names(KVConnectorOutput)
    for name, value in optional.items():
        if value is None:
            continue
        if name not in fields:
            raise TypeError(f"this release's KVConnectorOutput has no {name}")
        kwargs[name] = value
    return KVConnectorOutput(**kwargs)


def make_model_runner_output(
    scheduler_output: Any, kv_connector_output: Any = None, token_id: int = SAMPLED_TOKEN_ID
) -> Any:
    """One sampled token for every request scheduled in ``scheduler_output``."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens.keys())
    ann = str(_params(ModelRunnerOutput)["sampled_token_ids"].annotation)
    if "ndarray" in ann:
        import numpy as np

        sampled = [np.array([token_id]) for _ in req_ids]
    else:
        sampled = [[token_id] for _ in req_ids]
    kwargs: dict[str, Any] = dict(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )
    return call_with_supported(ModelRunnerOutput, **kwargs)


# ---------------------------------------------------------------------------
# reading offload-child metadata (field names drift, item 8/24)
# ---------------------------------------------------------------------------
def offload_store_work(meta: Any) -> Any:
    """The store work carried by the CPU-offload child's metadata (empty if none).

    SimpleCPUOffloadMetadata: list of GPU block ids to store (store_gpu_blocks).
    OffloadingConnectorMetadata: reqs_to_store (<=0.20) or store_jobs (0.21+).
    """
    names = _field_names(type(meta)) if dataclasses.is_dataclass(meta) else set(vars(meta))
    for field in ("store_gpu_blocks", "store_jobs", "reqs_to_store"):
        if field in names:
            return getattr(meta, field)
    raise TypeError(f"no known store field on {type(meta).__name__}: {sorted(names)}")


def offload_load_work(meta: Any) -> Any:
    names = _field_names(type(meta)) if dataclasses.is_dataclass(meta) else set(vars(meta))
    for field in ("load_gpu_blocks", "load_jobs", "reqs_to_load"):
        if field in names:
            return getattr(meta, field)
    raise TypeError(f"no known load field on {type(meta).__name__}: {sorted(names)}")


class OffloadWorkerEmulator:
    """What the worker side of the CPU-offload child reports back, step by step,
    when every transfer issued in a step completes within that step.

    It reads only the real metadata the scheduler-side connector produced and
    answers in the release's protocol (drift item 14):

    * SimpleCPUOffload: stores complete as
      ``SimpleCPUOffloadWorkerMetadata(completed_store_events={event: 1})``
      wrapped in ``MultiKVConnectorWorkerMetadata`` at the child's index; loads
      complete as ``finished_recving`` request ids (``load_event_to_reqs``).
    * OffloadingConnector up to 0.20 (``reqs_to_store``/``reqs_to_load``): loads
      complete as ``finished_recving``; a request's stores are reported in
      ``finished_sending`` once the request has finished (it is then in
      ``scheduler_output.finished_req_ids``), as ``OffloadingConnectorWorker.
      get_finished`` does.
    """

    def __init__(self, n_children: int, child_index: int):
        self.n_children = n_children
        self.child_index = child_index
        self._reqs_with_stores: set[str] = set()
        self.completed_store_events: list[int] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()

    def step(self, scheduler_output: Any) -> Any:
        """KVConnectorOutput for the step whose ``scheduler_output`` is given (or None)."""
        multi_meta = scheduler_output.kv_connector_metadata
        assert len(multi_meta.metadata) == self.n_children, (
            f"MultiKVConnectorMetadata has {len(multi_meta.metadata)} entries for {self.n_children} children"
        )
        meta = multi_meta.metadata[self.child_index]
        fields = _field_names(type(meta))
        sending: set[str] = set()
        recving: set[str] = set()
        worker_meta = None
        if "store_event" in fields:  # SimpleCPUOffload
            if meta.store_event >= 0 and meta.store_gpu_blocks:
                child = importlib.import_module(
                    "vllm.v1.simple_kv_offload.metadata"
                ).SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
                worker_meta = _wrap_multi_worker_meta(child, self.n_children, self.child_index)
                self.completed_store_events.append(meta.store_event)
            if meta.load_event >= 0 and meta.load_gpu_blocks:
                recving |= set(meta.load_event_to_reqs.get(meta.load_event, []))
        elif "reqs_to_store" in fields:  # OffloadingConnector <= 0.20
            self._reqs_with_stores |= set(meta.reqs_to_store)
            recving |= set(meta.reqs_to_load)
            done = self._reqs_with_stores & set(scheduler_output.finished_req_ids)
            sending |= done
            self._reqs_with_stores -= done
        else:
            raise TypeError(
                f"no worker-completion protocol known for {type(meta).__name__} ({sorted(fields)})"
            )
        self.finished_sending |= sending
        self.finished_recving |= recving
        if not (sending or recving or worker_meta is not None):
            return None
        return make_kv_connector_output(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta,
        )


def _wrap_multi_worker_meta(child: Any, n_children: int, child_index: int) -> Any:
    mod = importlib.import_module(V1 + ".multi_connector")
    metas: list[Any] = [None] * n_children
    metas[child_index] = child
    return mod.MultiKVConnectorWorkerMetadata(metadata=tuple(metas))


# ---------------------------------------------------------------------------
# Nixl transfer params
# ---------------------------------------------------------------------------
def remote_prefill_params(
    *, remote_engine_id: str, remote_request_id: str, remote_block_ids: list[int]
) -> dict[str, Any]:
    """D-side params (item 19/20); remote_request_id is sent always (needed from 0.13)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": remote_engine_id,
        "remote_request_id": remote_request_id,
        "remote_block_ids": remote_block_ids,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def remote_decode_params() -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False}


def finished_length_capped() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_LENGTH_CAPPED


# ---------------------------------------------------------------------------
# real NIXL: the Nixl child's worker driven like the model runner drives it
# ---------------------------------------------------------------------------
def nixl_supported_device_table() -> dict[str, tuple[str, ...]]:
    """The release's NixlConnectorWorker device table (device type -> kv buffer
    devices): ``_NIXL_SUPPORTED_DEVICE`` (``_NIXL_SUPPORTED_XPUS`` in 0.10.2) in
    ``v1/nixl/utils.py`` (0.20.2+) or in ``v1/nixl_connector.py`` (N1)."""
    if probes.has_module(V1 + ".nixl.utils"):
        mod = importlib.import_module(V1 + ".nixl.utils")
    else:
        mod = importlib.import_module(V1 + ".nixl_connector")
    for name in ("_NIXL_SUPPORTED_DEVICE", "_NIXL_SUPPORTED_XPUS"):
        if hasattr(mod, name):
            return dict(getattr(mod, name))
    raise TypeError(f"{mod.__name__} has no NIXL supported-device table")


def serve_nixl_handshake(scheduler_connector: Any, worker_connector: Any) -> str:
    """Hand the worker's handshake metadata to the scheduler-side connector, as
    EngineCore does after KV-cache registration (this starts the Nixl side-channel
    listener on VLLM_NIXL_SIDE_CHANNEL_HOST/PORT).  TP=1, PP=1.  Returns which
    entry point the release has; on releases with neither, the worker serves the
    handshake itself and nothing is done here."""
    metadata = worker_connector.get_handshake_metadata()
    if metadata is None:
        raise RuntimeError(f"{type(worker_connector).__name__} worker produced no handshake metadata")
    if hasattr(scheduler_connector, "set_xfer_handshake_metadata_pp_aware"):
        scheduler_connector.set_xfer_handshake_metadata_pp_aware({(0, 0): metadata})
        return "set_xfer_handshake_metadata_pp_aware"
    if hasattr(scheduler_connector, "set_xfer_handshake_metadata"):
        scheduler_connector.set_xfer_handshake_metadata({0: metadata})
        return "set_xfer_handshake_metadata"
    return "worker-served"


@dataclasses.dataclass
class WorkerStepResult:
    """What one worker-side connector reported in one step."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    invalid_block_ids: set[int]
    worker_meta: Any = None
    stats: Any = None


def run_worker_step(connector: Any, metadata: Any, finished_req_ids: set[str]) -> WorkerStepResult:
    """One step of a worker-side connector in the order the model runner's KV
    connector mixin uses: bind, start_load_kv, wait_for_save, transfer results
    (``get_transfer_results`` from 0.30, else ``get_finished``), load errors,
    stats, worker metadata, clear."""
    connector.bind_connector_metadata(metadata)
    try:
        connector.start_load_kv(None)
        connector.wait_for_save()
        if hasattr(connector, "get_transfer_results"):
            r = connector.get_transfer_results(set(finished_req_ids))
            sending, recving = set(r.finished_sending), set(r.finished_recving)
            failed = set(getattr(r, "failed_recving", set()) or set())
        else:
            s, rv = connector.get_finished(set(finished_req_ids))
            sending, recving, failed = set(s or ()), set(rv or ()), set()
        invalid: set[int] = set()
        if hasattr(connector, "get_block_ids_with_load_errors"):
            invalid = set(connector.get_block_ids_with_load_errors() or ())
        stats = connector.get_kv_connector_stats() if hasattr(connector, "get_kv_connector_stats") else None
        worker_meta = None
        if hasattr(connector, "build_connector_worker_meta"):
            worker_meta = connector.build_connector_worker_meta()
    finally:
        connector.clear_connector_metadata()
    return WorkerStepResult(sending, recving, failed, invalid, worker_meta, stats)


def kv_connector_output_of(result: WorkerStepResult) -> Any:
    """The KVConnectorOutput a worker whose connector reported ``result`` sends
    to the scheduler (None when it reported nothing)."""
    r = result
    if not (r.finished_sending or r.finished_recving or r.failed_recving or r.invalid_block_ids
            or r.worker_meta is not None):
        return None
    return make_kv_connector_output(
        finished_sending=r.finished_sending or None,
        finished_recving=r.finished_recving or None,
        kv_connector_worker_meta=r.worker_meta,
        failed_recving=r.failed_recving,
        invalid_block_ids=r.invalid_block_ids,
    )


def merge_child_worker_output(
    kv_connector_output: Any, child: WorkerStepResult, *, n_children: int, child_index: int
) -> Any:
    """Add one child's worker results to a step's KVConnectorOutput (or None), the
    way MultiConnector aggregates its children on the worker side: request-id sets
    are unioned, and worker metadata goes into ``MultiKVConnectorWorkerMetadata``
    at the child's index."""
    out = kv_connector_output
    sending = set(getattr(out, "finished_sending", None) or ()) | child.finished_sending
    recving = set(getattr(out, "finished_recving", None) or ()) | child.finished_recving
    failed = set(getattr(out, "failed_recving", None) or ()) | child.failed_recving
    invalid = set(getattr(out, "invalid_block_ids", None) or ()) | child.invalid_block_ids
    prev_meta = getattr(out, "kv_connector_worker_meta", None)
    worker_meta = prev_meta
    if child.worker_meta is not None:
        metas: list[Any] = list(prev_meta.metadata) if prev_meta is not None else [None] * n_children
        metas[child_index] = child.worker_meta
        mod = importlib.import_module(V1 + ".multi_connector")
        worker_meta = mod.MultiKVConnectorWorkerMetadata(metadata=tuple(metas))
    if not (sending or recving or failed or invalid or worker_meta is not None):
        return None
    return make_kv_connector_output(
        finished_sending=sending or None,
        finished_recving=recving or None,
        kv_connector_worker_meta=worker_meta,
        failed_recving=failed,
        invalid_block_ids=invalid,
    )


def kv_cache_block(cache: Any, block_id: int, block_size: int = BLOCK_SIZE) -> Any:
    """Block ``block_id`` (K and V) of a per-layer view made by
    :func:`make_kv_caches`.  The block axis is the one the release's shape
    function grows with ``num_blocks`` (e.g. 0 for ``[num_blocks, H, N, 2*C]``,
    1 for ``(2, num_blocks, H, N, C)``)."""
    a = _cpu_kv_cache_shape(1, block_size)
    b = _cpu_kv_cache_shape(2, block_size)
    axes = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert len(axes) == 1, f"cannot find the block axis of the CPU KV-cache shape {a} / {b}"
    assert _cpu_kv_cache_shape(cache.shape[axes[0]], block_size) == tuple(cache.shape), (
        f"cache shape {tuple(cache.shape)} is not the CPU KV-cache shape"
    )
    return cache.select(axes[0], block_id)


def group_block_ids(block_ids: Any, group: int = 0) -> list[int]:
    """Block ids of KV-cache group ``group`` from a flat list (<= 0.17) or a
    per-group sequence (0.18.1+)."""
    ids = list(block_ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [int(b) for b in ids[group]]
    if group != 0:
        raise IndexError("flat block-id list has only group 0")
    return [int(b) for b in ids]
