"""The noxfile as the front door: cells listed as sessions, bad matrices rejected in one line, each session's
--help printed without running anything."""

import json
import os

import pytest

from kvcompat import options

from helpers import REPO, build_project, run_nox

pytestmark = pytest.mark.slow  # lists sessions with real nox; resolving 0.33.0's torch pin asks the real index


def nox(*args, env=None):
    return run_nox(REPO, *args, env=env, timeout=300)


def test_list_json_has_one_session_per_cell(tmp_path):
    wheel = tmp_path / "vllm-0.0.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    (tmp_path / "m.toml").write_text(
        f'[matrix]\nqual = [{{ vllm = "{wheel}", torch = "2.14.0" }}, {{ vllm = "0.33.0", torch = ["2.13.0"] }}]\n'
    )
    proc = nox("-l", "--json", env={"KVCOMPAT_MATRIX": f"{tmp_path / 'm.toml'}:qual"})
    assert proc.returncode == 0, proc.stderr
    sessions = [s["session"] for s in json.loads(proc.stdout) if s["name"] == "matrix"]
    assert sessions == [
        "matrix(vllm='0.33.0', torch='2.13.0')",
        "matrix(vllm='vllm-0.0.1-py3-none-any.whl', torch='2.14.0')",
    ]
    tags = {s["session"]: s["tags"] for s in json.loads(proc.stdout)}
    assert "override" in tags["matrix(vllm='0.33.0', torch='2.13.0')"]


def test_malformed_matrix_is_one_line_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text("[matrix]\ndefault = [{ vllm = 'latest' }]\n")
    proc = nox("-l", env={"KVCOMPAT_MATRIX": str(tmp_path / "bad.toml")})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    err = [line for line in proc.stderr.splitlines() if "kvcompat: error" in line]
    assert len(err) == 1 and "'latest' is neither a version" in err[0]


def test_unknown_matrix_name(tmp_path):
    proc = nox("-l", env={"KVCOMPAT_MATRIX": "nightly"})
    assert (
        proc.returncode == 2
        and "choose one of: abi, default, e2e, environments, history, releases, suites" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_bisect_bad_input_is_one_line_exit_2():
    proc = nox("-s", "bisect", "--", "--test", "test_x", "--good", "0.33.0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "kvcompat: error: the following arguments are required: --bad" in proc.stderr


SESSIONS = ("matrix", "report", "bisect", "qualify", "mutants", "ci", "tests", "lint")


def files(root):
    """Every file and folder under ``root`` (not through links), with its size and modification time."""
    found = {}
    for base, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(base, name)
            st = os.lstat(path)
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("session", SESSIONS)
def test_help_after_the_dashes_prints_the_sessions_options_and_changes_nothing(tmp_path, monkeypatch, session):
    """`nox -s SESSION -- --help`: the session's options (kvcompat.options' text), exit 0, and no venv made,
    nothing installed, run or written (tests and lint, which have venvs of their own, included)."""
    project = build_project(tmp_path / "proj", "def test_first_wins():\n    pass\n")
    assert run_nox(project, "-l").returncode == 0  # listing the cells caches their resolution: before the snapshot
    before = files(project)
    monkeypatch.setenv("COLUMNS", "100")
    proc = run_nox(project, "-s", session, "--", "--help", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == options.help_text(session)
    assert "kvcompat: error" not in proc.stderr and "Traceback" not in proc.stderr
    assert files(project) == before
