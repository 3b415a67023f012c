"""Faults at the matrix level: killed runs resume, parallel cells don't corrupt results, writes are atomic.

Each test builds a throwaway project (our noxfile + src, a matrix of fake vLLM wheels,
and a tiny suite) and drives real `nox` in a subprocess.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvcompat.atomic import write_atomic

from helpers import build_project, nox_command

pytestmark = pytest.mark.slow  # drives real nox runs that build venvs with uv

SUITE = """
import os, time
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins


def test_first_wins():
    hang_in = os.environ.get("KVCOMPAT_TEST_HANG_VERSION", "0.0.1")
    if os.environ.get("KVCOMPAT_TEST_HANG") and __import__("vllm").__version__ == hang_in:
        open(os.environ["KVCOMPAT_TEST_HANG"], "w").write(str(os.getpid()))
        time.sleep(600)
    assert first_wins([0, 3]) == 1
"""


@pytest.fixture
def project(tmp_path):
    return build_project(tmp_path / "proj", SUITE)


def _sigint_default() -> None:
    # A shell without job control (CI, nohup, `cmd &`) starts children with SIGINT ignored,
    # and Python then never raises KeyboardInterrupt. Give nox the disposition a terminal
    # gives it, so the test sees what a user pressing Ctrl-C sees.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def nox(root, *args, env=None, stdout=subprocess.PIPE):
    return subprocess.Popen(
        nox_command(root, *args),
        cwd=root,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=_sigint_default,
    )


def wait_for(pred, timeout=180):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.2)
    return False


def results(root):
    return {p.name: json.loads(p.read_text()) for p in (root / "results").glob("*.json")}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its dead parent) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_matrix_resumes_only_unfinished_cells(project, sig):
    finished, hung = "vllm-0.0.2-wheel__torch-pinned", "vllm-0.0.1-wheel__torch-pinned"
    out_path = project / "killed-run.log"
    with out_path.open("w") as out:  # a file, not a pipe: nobody reads while we wait
        pidfile = project / "hung.pid"
        proc = nox(project, "-s", "matrix", env={"KVCOMPAT_TEST_HANG": str(pidfile)}, stdout=out)
    # Cells run newest first: 0.0.2 finishes, then 0.0.1 hangs inside pytest.
    assert wait_for(lambda: pidfile.exists() and pidfile.read_text())
    hung_pytest = int(pidfile.read_text())
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"nox did not exit within 120 s of {sig.name}:\n{out_path.read_text()[-3000:]}")
    if sig is signal.SIGKILL:  # nothing cleans up at SIGKILL: the cell's pytest (its own session) survives it
        assert alive(hung_pytest)
    else:  # Ctrl-C and SIGTERM take the cell's pytest (its own session) down too
        assert wait_for(lambda: not alive(hung_pytest), timeout=20), f"cell pytest {hung_pytest} survived {sig.name}"
    assert sorted(results(project)) == [f"{finished}.json"]  # the finished cell, whole; nothing for the killed one
    assert list((project / "results").glob(".*")) == []  # no half-written temp files left behind

    rerun = nox(project, "-s", "matrix")
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    assert out.count("unchanged (lock, suite and Python match") == 1, out  # only the unfinished cell ran again
    # ... and after SIGKILL the rerun first reaps the pytest the killed run left behind
    assert ("left running by an earlier run of this cell that was killed" in out) == (sig is signal.SIGKILL), out
    assert not alive(hung_pytest)
    got = results(project)
    assert got[f"{finished}.json"]["outcome"] == got[f"{hung}.json"]["outcome"] == "pass"


def test_hanging_cell_times_out_and_the_matrix_goes_on(project):
    pidfile = project / "hung.pid"
    # Cells run newest first: 0.0.2 hangs inside pytest and is killed at the per-cell timeout;
    # 0.0.1 still runs, and the report has both.
    proc = nox(
        project,
        "-s",
        "matrix",
        "--",
        "--timeout=20",
        env={"KVCOMPAT_TEST_HANG": str(pidfile), "KVCOMPAT_TEST_HANG_VERSION": "0.0.2"},
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out  # nox: one session failed
    got = results(project)
    assert got["vllm-0.0.2-wheel__torch-pinned.json"]["outcome"] == "timeout", out
    assert "pytest did not finish in 20s (process group killed)" in got["vllm-0.0.2-wheel__torch-pinned.json"]["detail"]
    assert got["vllm-0.0.1-wheel__torch-pinned.json"]["outcome"] == "pass", out
    assert wait_for(lambda: not alive(int(pidfile.read_text())), timeout=20)  # the hung pytest is gone
    report = (project / "reports" / "compat.md").read_text()
    assert "timeout" in report and "pass 1/1" in report


def test_full_disk_refuses_before_building(project):
    """A full disk is the user's to fix: one line naming the space needed, exit 2, nothing half-built."""
    proc = nox(project, "-s", "matrix", "--", "--min-free-gb=1000000")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "Traceback" not in out, out
    refusals = [line for line in out.splitlines() if line.startswith("kvcompat: error: ")]
    assert len(refusals) == 1, out
    assert (
        "GiB free under" in refusals[0]
        and "a new cell needs about 1000000 GiB (--min-free-gb): free space" in refusals[0]
    )
    assert not list((project / "results").glob("*.json"))  # nothing half-done to resume from
    assert not list((project / ".kvcompat" / "venvs").glob("*/lib/python*/site-packages/vllm*.dist-info"))


def test_rerun_answers_finished_cells_from_cache(project):
    first = nox(project, "-s", "matrix")
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out
    again = nox(project, "-s", "matrix")
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0
    assert out.count("unchanged (lock, suite and Python match") == 2, out
    assert "test …" not in out


def test_parallel_cells_write_results_without_corruption(project):
    proc = nox(project, "-s", "matrix", "-j", "2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    got = results(project)
    assert sorted(got) == ["vllm-0.0.1-wheel__torch-pinned.json", "vllm-0.0.2-wheel__torch-pinned.json"]
    assert all(r["outcome"] == "pass" and r["counts"]["passed"] == 1 for r in got.values())
    assert "pass 1/1" in (project / "reports" / "compat.md").read_text()


def _hammer(path: str, n: int, tag: int) -> None:
    for i in range(n):
        write_atomic(Path(path), json.dumps({"writer": tag, "i": i, "pad": "x" * 20000}))


def test_concurrent_atomic_writes_never_expose_partial_files(tmp_path):
    target = tmp_path / "cell.json"
    write_atomic(target, json.dumps({"writer": -1, "i": 0, "pad": ""}))
    procs = [mp.get_context("spawn").Process(target=_hammer, args=(str(target), 200, k)) for k in range(2)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        json.loads(target.read_text())  # must always parse: readers see an old or a new file, never half
        reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reads > 0 and json.loads(target.read_text())["i"] == 199
    assert list(tmp_path.glob(".*.tmp")) == []
