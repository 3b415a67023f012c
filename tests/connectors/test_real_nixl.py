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


def _prep_outcomes(make_agent) -> list[bool]:
    """Which of seven descriptor lists an agent prepares (True) or refuses (False): its own registered
    DRAM; as VRAM; an unregistered buffer; a range past its region's end; another device id; the remote's
    registered DRAM; a remote region registered after the remote was added."""
    import ctypes

    d, p = make_agent("kvc-probe-d"), make_agent("kvc-probe-p")
    bufs = [(ctypes.c_uint8 * 4096)() for _ in range(4)]
    addr = [ctypes.addressof(b) for b in bufs]
    d.register_memory(d.get_reg_descs([(addr[0], 4096, 0, "")], "DRAM"))
    p.register_memory(p.get_reg_descs([(addr[1], 4096, 0, "")], "DRAM"))
    name = d.add_remote_agent(p.get_agent_metadata())
    p.register_memory(p.get_reg_descs([(addr[3], 4096, 0, "")], "DRAM"))
    cases = [
        ("NIXL_INIT_AGENT", [(addr[0], 1024, 0)], "DRAM"),
        ("NIXL_INIT_AGENT", [(addr[0], 1024, 0)], "VRAM"),
        ("NIXL_INIT_AGENT", [(addr[2], 1024, 0)], "DRAM"),
        ("NIXL_INIT_AGENT", [(addr[0] + 4000, 1024, 0)], "DRAM"),
        ("NIXL_INIT_AGENT", [(addr[0], 1024, 1)], "DRAM"),
        (name, [(addr[1], 1024, 0)], "DRAM"),
        (name, [(addr[3], 1024, 0)], "DRAM"),
    ]
    out = []
    for agent, descs, mem in cases:
        try:
            d.prep_xfer_dlist(agent, descs, mem)
            out.append(True)
        except Exception as e:  # real NIXL: nixlNotFoundError; the fake: RuntimeError, both NIXL_ERR_NOT_FOUND
            assert "NIXL_ERR_NOT_FOUND" in str(e), e
            out.append(False)
    return out


def test_real_nixl_refuses_a_dlist_outside_registered_memory(nixl_agent):
    """The reference for the fake's refusal (fake_nixl.py docstring): real NIXL prepares a descriptor list
    only over memory registered with its memory type and device id, the remote's as its metadata carried it
    when added; the fake answers the seven cases the same way."""
    from nixl._api import nixl_agent_config

    from kvcompat.testkit.fake_nixl import FakeNixlWrapper

    expected = [True, False, False, False, False, True, False]
    assert _prep_outcomes(lambda n: nixl_agent(n, nixl_agent_config(backends=["UCX"]))) == expected
    try:
        assert _prep_outcomes(lambda n: FakeNixlWrapper(n, None)) == expected
    finally:
        FakeNixlWrapper.instances[:] = [a for a in FakeNixlWrapper.instances if not a.name.startswith("kvc-probe")]
