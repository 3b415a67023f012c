"""Negative control: the CPU stand-in of the CPU-offload worker's CUDA transport can fail the suite.

The suite runs SimpleCPUOffload's own worker with only its CUDA transport replaced
(kvcompat.testkit.cuda_transport).  A replacement that could not fail a test would make every green
cell meaningless, so this runs the suite's transfer tests in a real cell's venv (the newest release
of the default matrix, built by ``nox -s matrix`` when it is missing) three times: with the stand-in
as it is (green), with loads that copy nothing, and with loads that copy the wrong blocks (both red).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, default_cell_venv

pytestmark = pytest.mark.slow
TESTS = "round_trip or decode_reads"  # what moves KV through the CPU tier, and a P/D read beside it


def _suite(venv: Path, tmp_path: Path, fault: str | None) -> dict[str, str]:
    report = tmp_path / f"report-{fault or 'none'}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPAT_CUDA_TRANSPORT")}
    if fault:
        env["KVCOMPAT_CUDA_TRANSPORT_FAULT"] = fault
    env["PYTHONPATH"] = str(REPO / "src")
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "tests/connectors",
            "-p",
            "kvcompat.testkit.pytest_plugin",
            f"--kvcompat-json={report}",
            "-p",
            "no:cacheprovider",
            "-q",
            "-m",
            "not real_nixl and not gpu",
            "-k",
            TESTS,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    data = json.loads(report.read_text())
    return {t["nodeid"].split("::")[-1]: t["outcome"] for t in data["tests"]}


def test_a_broken_cuda_transport_turns_the_suite_red(tmp_path):
    venv = default_cell_venv(lambda entry: True)  # the newest release: the first entry
    clean = _suite(venv, tmp_path, None)
    assert clean and set(clean.values()) == {"passed"}, f"the suite is not green with the stand-in as it is: {clean}"
    for fault in ("drop-loads", "wrong-blocks"):
        got = _suite(venv, tmp_path, fault)
        assert got["test_cpu_tier_round_trip_is_byte_exact"] == "failed", f"{fault}: the suite stayed green: {got}"
        assert got["test_decode_reads_exactly_the_kv_the_prefill_side_computed"] == "passed", (
            f"{fault} touches only the CPU-offload transport, yet NIXL's read failed: {got}"
        )
