"""``hybrid``: a Mamba2 hybrid model with full attention and a sliding-window group, HMA on (kvcompat.shapes).

The model is a tiny Granite-4-style ``GraniteMoeHybridForCausalLM`` (Mamba2 mixers and attention layers, no
experts), a hybrid architecture every supported release registers and whose HF config class transformers has
offline.  The release builds it as a worker does, on the meta device (no weights): its layers register
themselves in the config's static forward context, the platform aligns the block sizes the release's way
(``Platform.update_block_size_for_backend``, which EngineCore's executor calls once the model is loaded:
``platforms/interface.py`` 0.34.0 ``_align_hybrid_block_size`` pads the Mamba page to the attention page), and
each layer reports its own KV-cache spec (the model runner's ``get_kv_cache_spec``: ``MambaMixer2.
get_kv_cache_spec`` a ``MambaSpec`` from the state shapes and dtypes of its calculators, ``Attention.
get_kv_cache_spec`` a ``FullAttentionSpec``).  The release's planner groups them and its allocator lays the
caches out (``kvcompat.testkit.adapter.planner``).

No architecture in the releases combines Mamba2, full attention and a sliding window (Nemotron-H and Granite
give every attention layer the same window or none), so the sliding-window group is built as such a model
would have it: the second attention layer is the release's own ``Attention`` built with a per-layer window
(``per_layer_sliding_window``, as Gemma-style interleaved models build theirs), so that its
``get_kv_cache_spec`` reports a ``SlidingWindowSpec``.  Its window (80 tokens) is not a multiple of the block
size, and the suite's prompts are longer than it.

What a user sets: HMA on (``disable_hybrid_kv_cache_manager=False``), prefix caching with
``mamba_cache_mode="align"`` (the CPU tier needs both), ``--max-model-len 512`` (a hybrid model's every group
is sized for the whole length, and the suite's engines have 64 blocks), and the DS conv-state layout NIXL's
Mamba transfer requires (``VLLM_SSM_CONV_STATE_LAYOUT=DS``), which CpuPlatform picks itself when a Nixl
connector is configured (``platforms/cpu.py`` 0.34.0 L440-455).

Not applicable only where no hybrid SSM model can be served by the pair at all: a release without a
``MambaSpec`` in v1, without this architecture, or whose Nixl or CPU-offload child does not implement
SupportsHMA.  A release that refuses the configuration is ``unsupported`` (the shape is built inside
``user_configuration``), one that serves it wrongly fails.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit import probes
from kvcompat.testkit.adapter import capabilities as _caps
from kvcompat.testkit.adapter import config as _config
from kvcompat.testkit.adapter import planner as _planner
from kvcompat.testkit.deploy.base import *  # noqa: F403
from kvcompat.testkit.deploy.base import write_config
from kvcompat.testkit.deploy.hybrid_kinds import MambaStateKind, SlidingWindowKind

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
LAYER_TYPES = ("mamba", "attention", "mamba", "attention")
SLIDING_WINDOW = 80  # tokens: not a multiple of the block size; the suite's prompts are longer
WINDOWED_LAYER = "model.layers.3.self_attn.attn"  # the second attention layer: the sliding-window group
MAX_MODEL_LEN = 512

MODEL_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "model_type": "granitemoehybrid",
    "hidden_size": 64,
    "intermediate_size": 128,
    "shared_intermediate_size": 0,  # no MLP: its SiluAndMul binds a compiled op the CUDA wheels cannot load here (0.26-0.30)
    "num_attention_heads": 2,
    "num_key_value_heads": 2,  # head size 32, as the CPU attention backend takes
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": list(LAYER_TYPES),
    "mamba_n_heads": 2,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "position_embedding_type": "rope",
    "attention_multiplier": 0.125,
    "rms_norm_eps": 1e-5,
    **_config.TINY_MODEL_COMMON,
}


def missing(shape: Shape) -> str | None:
    """Explicit probes of the installed release: a ``MambaSpec`` in v1, the architecture, HMA children."""
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    if not hasattr(interface, "MambaSpec"):
        return "v1 has no MambaSpec: no hybrid SSM model has a KV-cache group"
    if not probes.has_file("vllm/model_executor/models/granitemoehybrid.py"):
        return f"the release does not register {ARCHITECTURE}"
    nixl, _ = _caps.nixl_classes()
    offload, _ = _caps.offload_classes()
    lacking = [cls.__name__ for cls in (nixl, offload) if not _caps.supports_hma(cls)]
    if lacking:
        return f"{', '.join(lacking)} does not implement SupportsHMA: the pair cannot serve a hybrid model"
    if shape.prefix_match_unit is not None:
        cache_config = importlib.import_module("vllm.config").CacheConfig
        if "prefix_match_unit" not in _caps._params(cache_config):
            return "CacheConfig has no prefix_match_unit: prefix-cache hits land on block boundaries only"
    return None


def model_config(shape: Shape) -> dict[str, Any]:
    return dict(MODEL_CONFIG)


def write_model(shape: Shape, directory: Path) -> Path:
    """The tiny hybrid model's ``config.json`` in ``directory``."""
    return write_config(directory, model_config(shape))


def config_kwargs(shape: Shape, side: str) -> dict[str, Any]:
    """HMA on, prefix caching with Mamba's align mode (where the release has the setting), and the user's
    ``--prefix-match-unit`` where the shape sets one."""
    cache: dict[str, Any] = {}
    cache_config = importlib.import_module("vllm.config").CacheConfig
    if "mamba_cache_mode" in _caps._params(cache_config):
        cache["mamba_cache_mode"] = "align"
    if shape.prefix_match_unit is not None:
        cache["prefix_match_unit"] = shape.prefix_match_unit
    return {"scheduler_extra": {"disable_hybrid_kv_cache_manager": False}, "cache_extra": cache}


def configure(vllm_config: Any, shape: Shape, side: str) -> None:
    """What the engine does with the config before it plans: the user's ``--max-model-len``, the model built
    by the worker (its layers registered), the platform's block-size alignment."""
    vllm_config.model_config.max_model_len = MAX_MODEL_LEN
    if hasattr(vllm_config.scheduler_config, "max_model_len"):
        vllm_config.scheduler_config.max_model_len = MAX_MODEL_LEN
    _ds_conv_layout()
    _build_model(vllm_config, windowed=shape.prefix_match_unit is None)
    from vllm.platforms import current_platform

    if hasattr(current_platform, "update_block_size_for_backend"):  # before: VllmConfig's own post-init
        with _current(vllm_config):
            current_platform.update_block_size_for_backend(vllm_config)


def _ds_conv_layout() -> None:
    """NIXL's Mamba transfer needs the DS conv-state layout (``nixl/base_worker.py`` 0.34.0 L758-767), which a
    user sets (``VLLM_SSM_CONV_STATE_LAYOUT=DS``, as vLLM's refusal says) and CpuPlatform picks itself with a
    Nixl connector from 0.31.  Set after the platform: 0.30's CpuPlatform overwrites it with SD on any
    AVX-512-BF16 host for its own causal-conv kernels (``platforms/cpu.py`` 0.30.0 L400-404), a kernel choice a
    GPU user's deployment never meets and whose conv kernels the suite does not run."""
    envs = importlib.import_module("vllm.envs")
    if "VLLM_SSM_CONV_STATE_LAYOUT" in getattr(envs, "environment_variables", {}):
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"


@contextlib.contextmanager
def _current(vllm_config: Any):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


def _layers(vllm_config: Any) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return get_layers_from_vllm_config(vllm_config, AttentionLayerBase)


def _build_model(vllm_config: Any, *, windowed: bool = True) -> None:
    """The model as a worker builds it (on the meta device: no weights), and the windowed attention layer.

    Not where the shape asks for hits inside a block (``--prefix-match-unit``): a sliding-window group looks
    prefixes up only at its block boundaries, and the release then turns sub-block hits off for the whole model
    (``v1/core/kv_cache_utils.py`` 0.34.0 L780-797, "Disabling fine-grained prefix-cache hits"), so that shape
    is the model as Granite-4 and Nemotron-H ship it: Mamba2 and full attention only."""
    import torch
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    with _current(vllm_config), torch.device("meta"):
        model = model_cls(vllm_config=vllm_config, prefix="")
        if not windowed:
            return
        full = _layers(vllm_config)[WINDOWED_LAYER]
        del vllm_config.compilation_config.static_forward_context[WINDOWED_LAYER]
        windowed = type(full)(
            full.num_heads,
            full.head_size,
            model_config.hf_config.attention_multiplier,
            num_kv_heads=full.num_kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=WINDOWED_LAYER,
            per_layer_sliding_window=SLIDING_WINDOW,
        )
    model.model.layers[3].self_attn.attn = windowed


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    """Each rank's ``{layer: spec}`` as the model runner collects them from the layers (the platform chose the
    block size: ``block_size``, the user's, is what it started from)."""
    with _current(vllm_config):
        specs = _runner_specs(vllm_config)
    return [dict(specs) for _ in range(tp)]


def _runner_specs(vllm_config: Any) -> dict[str, Any]:
    """The release's ``get_kv_cache_spec`` of the model runner: the v2 runner's function (0.34), else v1's
    ``GPUModelRunner.get_kv_cache_spec`` (which reads only the config and records shared layers)."""
    if probes.has_module("vllm.v1.worker.gpu.attn_utils"):
        attn_utils = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
        if hasattr(attn_utils, "get_kv_cache_spec"):
            return attn_utils.get_kv_cache_spec(vllm_config)
    from types import SimpleNamespace

    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
    return runner.get_kv_cache_spec(SimpleNamespace(vllm_config=vllm_config, shared_kv_cache_layers={}))


def kinds(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A Mamba group's layers hold states (align mode), the sliding-window group's its window."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    out: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            kind: Any = MambaStateKind(_checkpoint_rule(vllm_config, kv_cache_config, spec))
        elif isinstance(spec, SlidingWindowSpec):
            kind = SlidingWindowKind(spec.sliding_window)
        else:
            continue
        out.update((name, kind) for name in group.layer_names)
    return out


def _checkpoint_rule(vllm_config: Any, kv_cache_config: Any, spec: Any):
    """Where the release's Mamba kernels export an internal prefill checkpoint (``model_executor/layers/mamba/
    checkpoint.py`` ``MambaPrefillCheckpointBuilder.build``, 0.33+): the release's own rule, with the block sizes
    EngineCore resolves; None where the release has none or the spec asks for none."""
    name = "vllm.model_executor.layers.mamba.checkpoint"
    if not probes.has_module(name) or getattr(spec, "num_prefill_checkpoint_blocks", 0) == 0:
        return None
    if vllm_config.cache_config.mamba_cache_mode != "align":
        return None
    compute = importlib.import_module(name).compute_mamba_prefill_checkpoints
    hash_block, alignment = _planner.resolved_block_sizes(vllm_config, kv_cache_config)

    def position(start: int, end: int) -> int:
        offsets, _ = _caps.call_with_supported(
            compute,
            seq_lens=[end],
            query_lens=[end - start],
            hash_block_size=hash_block,
            mamba_block_size=spec.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=False,
            cache_hit_alignment_tokens=alignment,
            num_hash_lookahead_tokens=0,
        )
        return start + offsets[0] if offsets[0] else 0

    return position


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A rank's caches as the release's model runner allocates them: its ``allocate_kv_cache`` (0.33+, the
    suite's planner module), else the v1 runner's own ``_allocate_kv_cache_tensors`` and
    ``_reshape_kv_cache_tensors`` (a Mamba layer's cache is its list of state tensors), run with what they
    read of the runner: the device, the KV-cache groups with their layers' backends, the cache config."""
    if hasattr(importlib.import_module("vllm.v1.worker.utils"), "allocate_kv_cache"):
        return _planner.allocate(vllm_config, kv_cache_config)
    import inspect
    from types import MethodType, SimpleNamespace

    import torch

    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
    layers = _layers(vllm_config)
    groups = [
        SimpleNamespace(
            kv_cache_spec=g.kv_cache_spec,
            backend=layers[g.layer_names[0]].get_attn_backend(),
            kv_cache_group_id=i,
            layer_names=list(g.layer_names),
        )
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    me = SimpleNamespace(
        device=torch.device("cpu"),
        runner_only_attn_layers=set(),
        cache_config=vllm_config.cache_config,
        kv_cache_config=kv_cache_config,
        attn_groups=[[g] for g in groups],
    )
    me._kv_cache_spec_attn_group_iterator = MethodType(runner._kv_cache_spec_attn_group_iterator, me)
    me._update_hybrid_attention_mamba_layout = MethodType(runner._update_hybrid_attention_mamba_layout, me)
    raw = runner._allocate_kv_cache_tensors(me, kv_cache_config)
    if "kernel_block_sizes" in inspect.signature(runner._reshape_kv_cache_tensors).parameters:
        sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        return runner._reshape_kv_cache_tensors(me, raw, sizes)
    return runner._reshape_kv_cache_tensors(me, raw)
