"""KV blocks moved by the *real* NIXL library between a prefill and a decode engine, on CPU.

Runs only in cells that install NIXL (marker ``real_nixl``).  In one process, a prefill engine P and
a decode engine D, each MultiConnector(Nixl + CPU offload) built by the release's factory on both
sides (scheduler and worker), the Nixl children with the real ``nixl._api.nixl_agent`` (no fake),
CPU KV caches registered as NIXL DRAM, UCX on ``lo`` over tcp/cma; P's scheduler-side MultiConnector
serves the Nixl handshake on 127.0.0.1 (a port of its own, VLLM_NIXL_SIDE_CHANNEL_PORT from conftest).
The CPU-offload children run their own workers (CUDA transport replaced), as everywhere.

Not applicable only where the release's NixlConnectorWorker has no CPU entry in its supported-device
table.  A missing ``nixl`` package is not a release property: it makes these tests error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable

from conftest import BLOCK, pd_read_is_byte_exact, token_ids

pytestmark = pytest.mark.real_nixl


def _require_nixl_cpu_worker() -> None:
    """Probe: the release's NixlConnectorWorker accepts device 'cpu' with a 'cpu' KV buffer
    (its supported-device table)."""
    table = va.nixl_supported_device_table()
    if "cpu" not in table:
        not_applicable(f"NixlConnectorWorker has no 'cpu' device in its supported-device table {table}")
    if "cpu" not in tuple(table["cpu"]):
        not_applicable(f"NixlConnectorWorker on 'cpu' does not support a 'cpu' kv buffer: {table['cpu']}")


@pytest.fixture
def nixl_agent(release):
    """The real NIXL agent class, imported the way vLLM imports it (nixl._api): the Nixl workers here
    get it as the release resolves it, nothing is patched."""
    _require_nixl_cpu_worker()
    tls = os.environ.get("UCX_TLS", "")
    assert not tls or "tcp" in tls.split(","), f"UCX_TLS={tls!r}: NIXL's UCX backend needs tcp"
    # vLLM imports ``nixl._api``: the ``nixl`` meta package (which aliases the nixl_cuXX backend
    # matching torch's CUDA major, any backend for CPU torch) must be installed.  Missing: an error of
    # the cell's setup, never N/A.
    if importlib.util.find_spec("nixl") is None:
        raise RuntimeError(
            "the 'nixl' package is not importable; vLLM imports nixl._api, so install the "
            "nixl meta package (--no-deps) next to the nixl-cuXX backend matching torch's CUDA"
        )
    return importlib.import_module("nixl._api").nixl_agent


def test_real_nixl_read_is_byte_exact_through_multiconnector(pd, nixl_agent):
    """vLLM's P/D protocol over real NIXL, each side MultiConnector(Nixl + CPU offload) on both halves:
    D's Nixl worker reads the blocks P holds for it, D's blocks hold exactly the KV P computed, D
    finishes, and P frees its blocks once D has read them."""
    p, d = pd
    for engine in (p, d):
        nixl = engine.worker._connectors[engine.nixl_index]
        agent = nixl.connector_worker.nixl_wrapper
        assert isinstance(agent, nixl_agent), f"NIXL agent is {type(agent).__module__}.{type(agent).__name__}"
    print(pd_read_is_byte_exact(p, d, "pd-real-0", token_ids(3 * BLOCK + 5)))
