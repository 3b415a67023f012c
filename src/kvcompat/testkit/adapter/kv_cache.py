"""KV-cache configs and CPU tensors placed the way the release's model runner places them."""

from __future__ import annotations

import importlib
from typing import Any

from kvcompat.testkit.adapter.capabilities import _field_names, _params
from kvcompat.testkit.adapter.config import BLOCK_SIZE, HEAD_SIZE, LAYER_NAMES, NUM_KV_HEADS


def attention_spec(block_size: int, sliding_window: int | None = None, num_kv_heads: int = NUM_KV_HEADS) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cls = FullAttentionSpec if sliding_window is None else SlidingWindowSpec
    kwargs: dict[str, Any] = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
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
    num_kv_heads: int = NUM_KV_HEADS,
) -> Any:
    """KVCacheConfig with real ``kv_cache_tensors``; ``num_kv_heads``: the heads one rank holds.

    One full-attention group over both layers, or (``sliding_window`` given)
    a full-attention group (layer 0) and a sliding-window group (layer 1).
    Tensor layout: ``KVCacheTensor(size, shared_by)`` per layer up to 0.28, and
    from 0.29 one layer-outer ``KVCacheTensor(size=<whole allocation>, layers,
    layer_stride, block_stride, offset)`` per group.

    The hybrid model's groups get bytes of their own.  vLLM's planner lays the
    groups of such a model over each other from byte 0 (``v1/core/kv_cache_planning.py``
    0.33.0 L684-735; one tensor ``shared_by`` a layer of each group before 0.29),
    so a real engine's Nixl worker sees one region used by both groups and reads
    every group's blocks in it; here each region belongs to one group, and Nixl
    from 0.32 takes its region-to-group path (``nixl/base_worker.py`` 0.33.0
    L212-230), the one a model takes where a region belongs to one group only
    (a group with more layers than another).  Both read the same block pairs.
    """
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if sliding_window is None:
        groups = [KVCacheGroupSpec(list(LAYER_NAMES), attention_spec(block_size, None, num_kv_heads))]
    else:
        groups = [
            KVCacheGroupSpec([LAYER_NAMES[0]], attention_spec(block_size, None, num_kv_heads)),
            KVCacheGroupSpec([LAYER_NAMES[1]], attention_spec(block_size, sliding_window, num_kv_heads)),
        ]
    tensor_fields = _field_names(KVCacheTensor)
    tensors = []
    if "shared_by" in tensor_fields:
        for g in groups:
            for name in g.layer_names:
                tensors.append(KVCacheTensor(size=g.kv_cache_spec.page_size_bytes * num_blocks, shared_by=[name]))
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
    specs = (
        [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        if hasattr(kv_cache_config, "kv_cache_groups")
        else list(kv_cache_config)  # the layers' specs, before planning (EngineCore resolves it first)
    )
    return utils.resolve_kv_cache_layout(vllm_config, [supported], specs).name


def _cpu_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int = NUM_KV_HEADS) -> tuple[int, ...]:
    """Per-layer KV-cache shape: the CPU attention backend's ``get_kv_cache_shape``
    where it defines one, else the layout-based LBHNC view
    ``[num_blocks, heads, block_size, 2 * head_size]`` (K|V packed)."""
    cpu_attn = importlib.import_module("vllm.v1.attention.backends.cpu_attn").CPUAttentionBackend
    if "get_kv_cache_shape" in vars(cpu_attn):  # up to the layout-based releases
        return tuple(cpu_attn.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, HEAD_SIZE))
    return (num_blocks, num_kv_heads, block_size, 2 * HEAD_SIZE)  # LBHNC


MAX_KV_HEADS = 64


def _heads_of(cache: Any, block_size: int) -> int:
    """How many KV heads a per-layer view made by :func:`make_kv_caches` holds (a TP rank holds its share)."""
    for heads in range(1, MAX_KV_HEADS + 1):
        for axis in range(cache.dim()):
            if _cpu_kv_cache_shape(cache.shape[axis], block_size, heads) == tuple(cache.shape):
                return heads
    raise AssertionError(f"cache shape {tuple(cache.shape)} is not the CPU KV-cache shape of any head count")


def head_axis(block_size: int) -> int:
    """The heads axis of one block's view (:func:`kv_cache_block`): the one that grows with the head count."""
    a = _cpu_kv_cache_shape(1, block_size, 1)
    b = _cpu_kv_cache_shape(1, block_size, 2)
    block = _block_axis(block_size)
    (axis,) = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return axis - (axis > block)


def _block_axis(block_size: int) -> int:
    a = _cpu_kv_cache_shape(1, block_size)
    b = _cpu_kv_cache_shape(2, block_size)
    axes = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert len(axes) == 1, f"cannot find the block axis of the CPU KV-cache shape {a} / {b}"
    return axes[0]


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

    specs = {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}
    nb = kv_cache_config.num_blocks

    def shape(spec: Any) -> tuple[int, ...]:
        return _cpu_kv_cache_shape(nb, spec.block_size, spec.num_kv_heads)

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


def kv_cache_block(cache: Any, block_id: int, block_size: int = BLOCK_SIZE) -> Any:
    """Block ``block_id`` (K and V) of a per-layer view made by
    :func:`make_kv_caches`.  The block axis is the one the release's shape
    function grows with ``num_blocks`` (e.g. 0 for ``[num_blocks, H, N, 2*C]``,
    1 for ``(2, num_blocks, H, N, C)``)."""
    axis = _block_axis(block_size)
    heads = _heads_of(cache, block_size)
    assert _cpu_kv_cache_shape(cache.shape[axis], block_size, heads) == tuple(cache.shape), (
        f"cache shape {tuple(cache.shape)} is not the CPU KV-cache shape"
    )
    return cache.select(axis, block_id)


def token_rows(cache: Any, block_id: int, block_size: int) -> list[Any]:
    """Block ``block_id`` of a per-layer view made by :func:`make_kv_caches`, one view per token slot (K and V
    of that token, every head): what a transfer between engines of different block sizes must carry over
    token by token."""
    a = _cpu_kv_cache_shape(1, block_size)
    b = _cpu_kv_cache_shape(1, 2 * block_size)
    (axis,) = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    block_axis = [i for i, (x, y) in enumerate(zip(a, _cpu_kv_cache_shape(2, block_size), strict=True)) if x != y][0]
    view = kv_cache_block(cache, block_id, block_size)
    axis -= axis > block_axis  # the block axis is gone from the view
    return [view.select(axis, t) for t in range(block_size)]


def layer_tensors(cache: Any) -> list[Any]:
    """A layer's KV cache as its tensors: the one tensor, or a Mamba layer's states (a list, before 0.33)."""
    return list(cache) if isinstance(cache, (list, tuple)) else [cache]


def group_block_ids(block_ids: Any, group: int = 0) -> list[int]:
    """Block ids of KV-cache group ``group`` from a flat list (<= 0.17) or a
    per-group sequence (0.18.1+)."""
    ids = list(block_ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [int(b) for b in ids[group]]
    if group != 0:
        raise IndexError("flat block-id list has only group 0")
    return [int(b) for b in ids]
