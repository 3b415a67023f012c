"""What the installed release has: connector classes, their modules, and signature probes.

Every branch is chosen by an explicit probe of the installed release (its
RECORD through :mod:`kvcompat.testkit.probes`, ``hasattr`` or
``inspect.signature`` on the real classes), never by catching an exception
and trying something else.  Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

from kvcompat.testkit import probes

KV_BASE = "vllm.distributed.kv_transfer.kv_connector"


V1 = KV_BASE + ".v1"


def _params(obj: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(obj).parameters)


def call_with_supported(fn: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts."""
    params = _params(fn)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def has_offloading_connector() -> bool:
    return probes.has_module(V1 + ".offloading_connector")


def has_simple_cpu_offload() -> bool:
    return probes.has_module("vllm.v1.simple_kv_offload") and probes.has_module(V1 + ".simple_cpu_offload_connector")


def nixl_module() -> str:
    """``v1/nixl_connector.py`` (one module) up to 0.19.x, the ``v1/nixl/`` package from 0.20."""
    if probes.has_module(V1 + ".nixl"):
        return V1 + ".nixl"
    return V1 + ".nixl_connector"


def nixl_wrapper_target() -> tuple[str, str]:
    """(module, attribute) to patch with a fake NIXL agent: where the Nixl worker looks ``NixlWrapper`` up.

    The worker moved twice: ``nixl_connector.py`` defines it up to 0.19, ``nixl/worker.py``
    imports it from ``vllm.distributed.nixl_utils`` in 0.20-0.23, and from 0.24 (where
    ``nixl/worker.py`` is only an alias) ``nixl/base_worker.py`` does.
    """
    if probes.has_module(V1 + ".nixl.base_worker"):
        return V1 + ".nixl.base_worker", "NixlWrapper"  # 0.24+
    if probes.has_module(V1 + ".nixl.worker"):
        return V1 + ".nixl.worker", "NixlWrapper"  # 0.20-0.23
    return V1 + ".nixl_connector", "NixlWrapper"  # up to 0.19


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
