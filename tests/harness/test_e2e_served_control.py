"""The served e2e suite's negative controls run inside the suite (tests/e2e/test_served.py), on its one
deployment: the servers start once per cell, and a control needs no server of its own.

Each proxy fault (kvcompat.testkit.e2e.served.PROXY_FAULTS, the release's ``toy_proxy_server.py`` with one
edit) runs as a second proxy in front of the same prefill and decode, and a control test runs the check of
the contract the fault breaks through it, on fresh prompts, and passes only when that check is red for the
contract's own reason:

* ``drop-kv-transfer-params``: the decode is never handed the prefill's kv_transfer_params and computes the
  prompt itself: the reference tokens, but its own /metrics show no KV transfer (the transfer contract red);
* ``reverse-remote-blocks``: the decode is handed the prefill's blocks in reverse order and reads KV of other
  positions than its prompt's (the tokens contract red);
* ``cut-stream``: the proxy fails after relaying the decode's first chunk, its 200 already sent: the client
  gets a body cut off mid-stream (the first-requests contract red);

and the late-decode contract's verdict is 'other tokens' for a decode handed another prompt's blocks.  The
e2e cell (``nox -s matrix -k vllm_0_32_0``, CI's e2e phase) runs them with the contracts; a control whose
contract stays green fails the cell.  This checks, without vLLM, that every fault has its control there.
"""

from __future__ import annotations

import ast

from kvcompat.testkit.e2e import served

from helpers import REPO

SUITE = REPO / "tests/e2e/test_served.py"
# The contract each control turns red, by the name of the check it runs (the contract test calls the same one).
CONTROLS = {
    "test_served_control_a_proxy_dropping_kv_transfer_params_turns_the_transfer_contract_red": (
        "drop-kv-transfer-params",
        "_transfer_through",
        "test_served_decode_uses_the_kv_transferred_over_nixl",
    ),
    "test_served_control_a_proxy_reversing_remote_blocks_turns_the_tokens_contract_red": (
        "reverse-remote-blocks",
        "_tokens_through",
        "test_served_completions_through_the_proxy_equal_the_reference",
    ),
    "test_served_control_a_proxy_cutting_the_stream_turns_the_first_requests_contract_red": (
        "cut-stream",
        "_complete_or_a_clear_error",
        "test_served_first_requests_after_start_are_complete_or_a_clear_error",
    ),
    "test_served_control_a_decode_reading_other_kv_turns_the_late_decode_verdict_red": (
        None,
        "late_decode_verdict",
        "test_served_a_late_decode_never_returns_tokens_from_released_kv",
    ),
}


def _functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(SUITE.read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_every_proxy_fault_has_a_control_in_the_served_suite_running_its_contract_s_own_check():
    fns = _functions()
    controls = {name for name in fns if name.startswith("test_served_control_")}
    assert controls == set(CONTROLS), controls ^ set(CONTROLS)
    assert {fault for fault, _, _ in CONTROLS.values() if fault} == set(served.PROXY_FAULTS)
    for control, (fault, check, contract) in CONTROLS.items():
        assert contract in fns, f"{control}: no contract {contract}"
        assert check in _calls(fns[control]), f"{control} does not run {check}"
        assert check in _calls(fns[contract]), f"{contract} does not run {check}: the control checks something else"
        if fault:
            assert fault in ast.unparse(fns[control]), f"{control} does not use the {fault} proxy"
