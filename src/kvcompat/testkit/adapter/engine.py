"""The release's own Scheduler, connectors, requests and model-runner outputs, built per release."""

from __future__ import annotations

import importlib
import time
from typing import Any

from kvcompat.testkit import probes
from kvcompat.testkit.adapter.capabilities import _field_names, _params, call_with_supported, multi_classes
from kvcompat.testkit.adapter.config import BLOCK_SIZE, EOS_TOKEN_ID, SAMPLED_TOKEN_ID


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
    """The scheduler EngineCore builds: the class the scheduler config names (``get_scheduler_cls``,
    v1/engine/core.py 0.34.0 L181: AsyncScheduler under async scheduling, else Scheduler), where the
    release has that choice."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    get_cls = getattr(vllm_config.scheduler_config, "get_scheduler_cls", None)
    cls = get_cls() if get_cls is not None else Scheduler
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    kwargs: dict[str, Any] = dict(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
    )
    params = _params(Scheduler)  # AsyncScheduler(*args, **kwargs) passes them on
    if "block_size" in params:
        kwargs["block_size"] = vllm_config.cache_config.block_size
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    if "hash_block_size" in params and hasattr(utils, "resolve_kv_cache_block_sizes"):
        # The sizes EngineCore resolves (v1/engine/core.py 0.34.0 L190-201): the LCM of a hybrid model's
        # groups, and requests hashed finer than a block under --prefix-match-unit.
        kwargs["block_size"], kwargs["hash_block_size"] = utils.resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
    return cls(**kwargs)


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
    scheduler_output: Any,
    kv_connector_output: Any = None,
    token_id: int = SAMPLED_TOKEN_ID,
    unsampled: frozenset[str] | set[str] = frozenset(),
) -> Any:
    """One sampled token for every request scheduled in ``scheduler_output``, none for those in ``unsampled``:
    a request whose prompt this step does not finish (a chunk of a prefill), whose sampled token the model
    runner discards (``discard_request_mask``, v1/worker/gpu_model_runner.py)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens.keys())
    ann = str(_params(ModelRunnerOutput)["sampled_token_ids"].annotation)
    if "ndarray" in ann:
        import numpy as np

        sampled = [np.array([] if r in unsampled else [token_id], dtype=np.int64) for r in req_ids]
    else:
        sampled = [[] if r in unsampled else [token_id] for r in req_ids]
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
