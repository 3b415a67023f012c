"""Version-adaptive construction of the vLLM objects the connector tests need.

This package only absorbs *construction* differences between vLLM releases
(module paths, constructor signatures, renamed fields).  It never changes what
vLLM does once an object is built and never works around a vLLM bug: if a
release misbehaves, the test that exercises it must fail.

One module per concern; tests use the names re-exported here
(``from kvcompat.testkit import adapter as va``):

* platform          select vLLM's CpuPlatform
* capabilities      which connector classes the release has, signature probes
* config            the tiny model, VllmConfig, MultiConnector's KVTransferConfig
* kv_cache          KVCacheConfig and CPU KV-cache tensors
* engine            Scheduler, connectors, requests, model-runner outputs
* worker            the worker half: a worker-role connector per TP rank, in the model runner's order
* forward           the KV a forward pass writes, deterministic from the tokens
* parallel          a worker rank's place in its TP group (rank, size, heads), as the release reads it
* planner           KV-cache configs from the release's planner, caches from its allocator
* offload_worker    the CPU-offload child's worker on CPU, EngineCore's startup question, its metadata
* offload_script    OffloadingConnector's transfers, scripted (up to 0.18)
* children          a child's answers, observed or scripted (the lifecycle contracts)
* nixl              Nixl transfer params, device table, handshake
* idle              what an idle engine holds (free device blocks, pinned CPU-tier blocks, the children's bookkeeping): leak checks

Importing this package does not import vLLM.  Call :func:`select_cpu_platform`
before anything imports a vLLM module that reads ``current_platform``.
"""

from kvcompat.testkit.adapter.capabilities import (
    KV_BASE,
    V1,
    call_with_supported,
    has_offloading_connector,
    has_simple_cpu_offload,
    kv_connector_role,
    multi_classes,
    nixl_classes,
    nixl_module,
    nixl_wrapper_target,
    offload_child_name,
    offload_classes,
    supports_hma,
)
from kvcompat.testkit.adapter.config import (
    BLOCK_SIZE,
    EOS_TOKEN_ID,
    HEAD_SIZE,
    LAYER_NAMES,
    MAX_MODEL_LEN,
    NUM_KV_HEADS,
    OFFLOAD_CHILD_MODULE,
    SAMPLED_TOKEN_ID,
    TINY_MODEL_CONFIG,
    child_index,
    child_order,
    hma_enabled,
    make_vllm_config,
    multi_kv_transfer_config,
    offload_child_extra_config,
    write_tiny_model,
)
from kvcompat.testkit.adapter.engine import (
    block_hasher,
    create_connector,
    make_kv_connector_output,
    make_model_runner_output,
    make_request,
    make_scheduler,
    multi_child_connector,
)
from kvcompat.testkit.adapter.forward import ATTENTION, AttentionKind, Forward, expected_block, same_bytes
from kvcompat.testkit.adapter.idle import IdleState, idle_state, pinned_cpu_blocks
from kvcompat.testkit.adapter.kv_cache import (
    group_block_ids,
    kv_cache_block,
    layer_tensors,
    make_kv_cache_config,
    make_kv_caches,
    resolve_kv_cache_layout,
    token_rows,
)
from kvcompat.testkit.adapter.nixl import (
    nixl_supported_device_table,
    remote_decode_params,
    remote_prefill_params,
    serve_nixl_handshake,
)
from kvcompat.testkit.adapter.offload_worker import (
    REAL,
    SCRIPTED,
    offload_load_work,
    offload_store_work,
    offload_transfers,
    offload_worker_handler,
    offload_worker_kind,
    prepare_offload_worker,
    report_offload_blocks,
)
from kvcompat.testkit.adapter.parallel import kv_heads_of_rank, tp_rank
from kvcompat.testkit.adapter.planner import Plan, allocate, attention_layer_specs, first_kv_head, plan
from kvcompat.testkit.adapter.platform import select_cpu_platform
from kvcompat.testkit.adapter.worker import (
    WorkerRank,
    aggregator,
    build_rank,
    forward_layers,
    kv_transfer_group,
    model_runner,
)

__all__ = [
    "ATTENTION",
    "AttentionKind",
    "Plan",
    "allocate",
    "attention_layer_specs",
    "first_kv_head",
    "kv_heads_of_rank",
    "plan",
    "tp_rank",
    "REAL",
    "SCRIPTED",
    "Forward",
    "expected_block",
    "same_bytes",
    "select_cpu_platform",
    "BLOCK_SIZE",
    "EOS_TOKEN_ID",
    "HEAD_SIZE",
    "IdleState",
    "KV_BASE",
    "LAYER_NAMES",
    "MAX_MODEL_LEN",
    "NUM_KV_HEADS",
    "OFFLOAD_CHILD_MODULE",
    "SAMPLED_TOKEN_ID",
    "TINY_MODEL_CONFIG",
    "V1",
    "WorkerRank",
    "aggregator",
    "block_hasher",
    "build_rank",
    "call_with_supported",
    "child_index",
    "child_order",
    "create_connector",
    "forward_layers",
    "group_block_ids",
    "layer_tensors",
    "has_offloading_connector",
    "has_simple_cpu_offload",
    "hma_enabled",
    "idle_state",
    "kv_cache_block",
    "kv_connector_role",
    "kv_transfer_group",
    "make_kv_cache_config",
    "make_kv_caches",
    "make_kv_connector_output",
    "make_model_runner_output",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "model_runner",
    "multi_child_connector",
    "multi_classes",
    "multi_kv_transfer_config",
    "nixl_classes",
    "nixl_module",
    "nixl_supported_device_table",
    "nixl_wrapper_target",
    "offload_child_extra_config",
    "offload_child_name",
    "offload_classes",
    "offload_load_work",
    "offload_store_work",
    "offload_transfers",
    "offload_worker_handler",
    "offload_worker_kind",
    "pinned_cpu_blocks",
    "prepare_offload_worker",
    "remote_decode_params",
    "remote_prefill_params",
    "report_offload_blocks",
    "resolve_kv_cache_layout",
    "serve_nixl_handshake",
    "supports_hma",
    "token_rows",
    "write_tiny_model",
]
