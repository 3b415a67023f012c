"""Replay what NixlConnector's register_kv_caches does with a CPU_ATTN KV cache, with the release's own code.

Run it with a cell's Python, on vLLM's CpuPlatform (docs/vllm-multiconnector-history.md §1):

    PYTHONPATH=src VLLM_TARGET_DEVICE=cpu .kvcompat/venvs/vllm-0.23.0__torch-2.11.0/bin/python \
        docs/evidence/cpu_attn_topology_probe.py

The cache is shaped as the model runner shapes it (the backend's ``get_kv_cache_shape``, identity stride
order), handed to the release's ``TransferTopology``, and split into registration regions the way
``get_transfer_cache_regions`` does; then the worker's check ``cache.shape[0] != num_blocks`` is applied to
each region.  0.23.0-0.25.1 print ``-> ... True`` (the AssertionError every MultiConnector engine on CPU dies
of); 0.22.1 has no TransferTopology, and from 0.26.0 each layer's tensor is one region (K and V packed,
utils.py 0.26.0 L618-621), so the check holds.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import torch

NUM_BLOCKS, BLOCK_SIZE = 16, 32


def main() -> None:
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as backend

    from kvcompat.testkit.adapter.config import HEAD_SIZE, NUM_KV_HEADS  # the suite's model geometry

    print("vllm", importlib.metadata.version("vllm"))
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    print("runner shape", tuple(cache.shape), "stride", tuple(cache.stride()))
    # The suite's adapter (testkit/adapter/kv_cache.py) must build exactly this tensor, or the red would be ours.
    from kvcompat.testkit.adapter import kv_cache

    ours = kv_cache._cpu_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
    print("adapter shape", ours, "same as the runner's:", ours == tuple(cache.shape))
    if not hasattr(utils, "TransferTopology"):
        print("no TransferTopology in this release: the worker checks the layout another way")
        return
    fields = {f.name for f in dataclasses.fields(utils.TransferTopology)}
    kw = dict(
        tp_rank=0,
        tp_size=1,
        block_size=BLOCK_SIZE,
        engine_id="probe",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=NUM_KV_HEADS,
        attn_backends=[backend],
        tensor_shape=cache.shape,
    )
    topo = utils.TransferTopology(**{k: v for k, v in kw.items() if k in fields})
    if hasattr(topo, "split_k_and_v"):  # 0.23.0-0.25.1; 0.26.0 registers K and V packed, one region a layer
        print("blocks_first", topo.is_kv_layout_blocks_first, "split_k_and_v", topo.split_k_and_v)
    regions = topo.get_transfer_cache_regions(cache, None)  # None: not a MambaSpec, the attention path
    first = regions[0]
    print("regions type", type(regions).__name__, "len", len(regions), "first region shape", tuple(first.shape))
    bad = first.shape[0] != NUM_BLOCKS
    print(f"register_kv_caches check cache.shape[0] != num_blocks -> {first.shape[0]} != {NUM_BLOCKS} {bad}")


if __name__ == "__main__":
    main()
