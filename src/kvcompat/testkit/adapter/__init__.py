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
* offload_emulator  the CPU-offload child's worker answers, in the release's protocol
* children          a child's answers, observed or scripted (the lifecycle contracts)
* nixl              Nixl transfer params, device table, handshake
* worker            worker-role connectors driven step by step

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
    SAMPLED_TOKEN_ID,
    TINY_MODEL_CONFIG,
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
from kvcompat.testkit.adapter.kv_cache import (
    group_block_ids,
    kv_cache_block,
    make_kv_cache_config,
    make_kv_caches,
    resolve_kv_cache_layout,
)
from kvcompat.testkit.adapter.nixl import (
    nixl_supported_device_table,
    remote_decode_params,
    remote_prefill_params,
    serve_nixl_handshake,
)
from kvcompat.testkit.adapter.offload_emulator import OffloadWorkerEmulator, offload_load_work, offload_store_work
from kvcompat.testkit.adapter.platform import select_cpu_platform
from kvcompat.testkit.adapter.worker import (
    WorkerStepResult,
    kv_connector_output_of,
    merge_child_worker_output,
    run_worker_step,
)

__all__ = [
    "BLOCK_SIZE",
    "EOS_TOKEN_ID",
    "HEAD_SIZE",
    "KV_BASE",
    "LAYER_NAMES",
    "MAX_MODEL_LEN",
    "NUM_KV_HEADS",
    "SAMPLED_TOKEN_ID",
    "TINY_MODEL_CONFIG",
    "V1",
    "OffloadWorkerEmulator",
    "WorkerStepResult",
    "block_hasher",
    "call_with_supported",
    "create_connector",
    "group_block_ids",
    "has_offloading_connector",
    "has_simple_cpu_offload",
    "hma_enabled",
    "kv_cache_block",
    "kv_connector_output_of",
    "kv_connector_role",
    "make_kv_cache_config",
    "make_kv_caches",
    "make_kv_connector_output",
    "make_model_runner_output",
    "offload_load_work",
    "offload_store_work",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "merge_child_worker_output",
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
    "remote_decode_params",
    "remote_prefill_params",
    "resolve_kv_cache_layout",
    "run_worker_step",
    "select_cpu_platform",
    "serve_nixl_handshake",
    "supports_hma",
    "write_tiny_model",
]
