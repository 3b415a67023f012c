"""Bisect end to end: real nox and the kvcompat command over a wheelhouse of fake releases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import build_project, one_line_error, run_nox

pytestmark = pytest.mark.slow  # each step builds a cell venv with uv

SUITE = """
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

def test_first_wins():
    assert first_wins([0, 3, 5]) == 1
"""
MULTI = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
BROKEN = "def first_wins(children):\n    return len(children) - 1  # a refactor lost the scan\n"


def test_bisect_names_the_first_bad_release_and_the_changed_connector_file(tmp_path):
    versions = ("0.0.1", "0.0.2", "0.0.3", "0.0.4")
    project = build_project(tmp_path / "proj", SUITE, versions, files={v: {MULTI: BROKEN} for v in versions[2:]})
    args = ("--test", "test_first_wins", "--good", "0.0.1", "--bad", "0.0.4", "--wheelhouse", "wheels/house")
    proc = run_nox(project, "-s", "bisect", "--", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "first bad release: 0.0.3\nlast good release: 0.0.2\n" in out, out
    # the bad end, then two steps (0.0.2 good, 0.0.3 bad): ceil(log2 4) + 1, the good end taken on trust
    assert "cells evaluated: 3 (at most 3: ceil(log2 4) + 1 for 4 releases)" in out and "[3/≤3]" in out
    assert "0.0.1 (" not in out
    assert f"modified +1     -1     {MULTI}" in out
    # steps 2 and 3 say what they had from the steps before them (fake wheels have no torch)
    assert out.count(" of 5 pins were installed by earlier steps (hardlinked from uv's cache") == 2, out
    assert (
        "resume with: nox -s bisect -- --min-free-gb 0.1 --test test_first_wins --good 0.0.2 --bad 0.0.3 "
        "--wheelhouse wheels/house" in out  # KVCOMPAT_MIN_FREE_GB (tests/harness/conftest.py) is resumed too
    )

    # The kvcompat command runs the same engine, over the same cells: answered from their results.
    cli = subprocess.run(
        [sys.executable, "-m", "kvcompat.cli", "bisect", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "first bad release: 0.0.3" in cli.stdout and cli.stdout.count("unchanged (lock, suite and Python match") == 3


def test_find_fix_names_the_first_good_release_after_a_bad_one(tmp_path):
    """0.0.1 and 0.0.2 carry the broken scan, 0.0.3 fixed it: --find-fix answers 0.0.3 in ceil(log2 4) + 1 cells."""
    versions = ("0.0.1", "0.0.2", "0.0.3", "0.0.4")
    project = build_project(tmp_path / "proj", SUITE, versions, files={v: {MULTI: BROKEN} for v in versions[:2]})
    args = (
        "--find-fix",
        "--test",
        "test_first_wins",
        "--bad",
        "0.0.1",
        "--good",
        "0.0.4",
        "--wheelhouse",
        "wheels/house",
    )
    proc = run_nox(project, "-s", "bisect", "--", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "first good release: 0.0.3\nlast bad release:   0.0.2\n" in out, out
    assert "last good" not in out and "first bad" not in out
    assert "0.0.4 (--good endpoint): GOOD" in out and "0.0.2 (3 left between 0.0.1 and 0.0.4): BAD" in out
    assert "cells evaluated: 3" in out and "[3/≤3]" in out
    assert "compare: https://github.com/vllm-project/vllm/compare/v0.0.2...v0.0.3" in out
    assert f"modified +1     -1     {MULTI}" in out  # the connector source that carries the fix
    assert "--good 0.0.3 --bad 0.0.2 --find-fix --wheelhouse wheels/house" in out  # resumable as a fix search

    # the wrong way round is one line, exit 2
    swapped = run_nox(
        project,
        "-s",
        "bisect",
        "--",
        "--find-fix",
        "--test",
        "test_first_wins",
        "--bad",
        "0.0.4",
        "--good",
        "0.0.1",
        "--wheelhouse",
        "wheels/house",
    )
    assert one_line_error(swapped).startswith(
        "kvcompat: error: with --find-fix, --bad 0.0.4 must be older than --good 0.0.1"
    )
