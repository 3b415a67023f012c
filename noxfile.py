"""kvcompat: is vLLM's MultiConnector(NixlConnector + CPU offload) working, per vLLM and torch release?

Sessions:
  matrix   one session per cell: install with uv, run tests/connectors, write results/<cell>.json
  report   merge results/ into reports/compat.{json,md,xml,html} and print the table
  bisect   first vLLM release where a test breaks (--find-fix: where it is fixed)
  qualify  a candidate vLLM (wheel or source checkout) against its base release; fails on a regression
  mutants  mutation testing of the suite: mutants of multi_connector.py per cell, killed or survived
  ci       write a GitHub Actions / Buildkite pipeline with one job per cell
  tests    the harness's own tests (no vLLM needed)
  lint     ruff check and ruff format --check

Pick the matrix with KVCOMPAT_MATRIX (a table name in pyproject.toml, or path.toml[:name]),
cells with nox's -k / -t, e.g. `nox -s matrix -k vllm_0_33_0` or `nox -t vllm-0.32`.
`nox -s SESSION -- --help` prints a session's options (built from kvcompat.options, as docs/options.md is)
and runs nothing; an argument a session does not take is refused in one line, exit status 2, before
anything is installed or run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent.resolve()
sys.path.insert(0, str(ROOT / "src"))

from kvcompat import known_bugs, options  # noqa: E402
from kvcompat.cells import PYTHON  # noqa: E402
from kvcompat.commands.matrix import matrix_cells, run_matrix_cell  # noqa: E402
from kvcompat.commands.report import report_dirs, update_report  # noqa: E402
from kvcompat.errors import one_line_errors  # noqa: E402
from kvcompat.run.options import run_options  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["matrix"]

with one_line_errors():  # a bad matrix is one line on stderr and exit status 2, even for `nox -l`
    LISTING, _ = options.parse("matrix", [])  # nox lists sessions first: the cells come from the environment
    CELLS = {cell.id: cell for cell in matrix_cells(ROOT, LISTING)}

# What follows `--` on nox's command line.  nox builds a session's venv before its body runs, so the two
# sessions with a venv of their own (tests, lint) get none when the body will only print its help or
# refuse its arguments: `-- --help` installs nothing anywhere.
POSARGS = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []


# python=False: each cell's venv is kvcompat's own (.kvcompat/venvs/<cell>), built from its lock with uv,
# so the matrix, bisect and the kvcompat command share it.
@nox.session(python=False, allow_parallel=True)
# The parameter is the cell id (a string): nox -j hands parameters to worker processes as JSON.
@nox.parametrize("cell_id", [nox.param(c.id, id=c.nox_id, tags=c.tags) for c in CELLS.values()])
def matrix(session: nox.Session, cell_id: str) -> None:
    """Install one cell with uv, run the connector suite in it, write results/<cell-id>.json."""
    with one_line_errors():
        # Before anything is installed: --help, or an argument matrix does not take, ends the run in the
        # first cell (every cell has the same posargs); only the pytest options of option_table.PYTEST_OPTIONS pass.
        values, pytest_args = options.parse("matrix", session.posargs)
        opts = run_options(ROOT, values, pytest_args)
        if not session.parallel:  # under -j each cell updates the report itself (below)
            session.notify("report", posargs=[])  # the matrix's posargs are for the cells
        result = run_matrix_cell(ROOT, CELLS[cell_id], opts, progress=session.log, prune=values.prune)
        if session.parallel:
            update_report(ROOT, [opts.results_dir], if_any=True)
    judged = known_bugs.judge_result(result)  # a red every known vLLM bug explains does not fail the run
    if judged.known and not judged.fails_run:
        session.log(f"{judged.outcome.label}: {judged.summary()}")
    if judged.fails_run:
        session.error(f"{judged.outcome.label}: {judged.summary() or result.detail}")


# Not parametrized: a mutation run is many suite runs in one cell's own copy of its venv, and the cells
# are picked after -- (nox -s mutants -- -k vllm_0_33_0), so an expression matching no cell is an error.
@nox.session(python=False)
def mutants(session: nox.Session) -> None:
    """Mutate a cell's vLLM files (--target: multi_connector.py by default), run the suite, report killed/survived."""
    from kvcompat.commands import mutants as mutation

    with one_line_errors():
        values, pytest_args = options.parse("mutants", session.posargs)  # only --deselect passes to pytest
        runs = mutation.mutants(ROOT, list(CELLS.values()), values, pytest_args, progress=session.log)
    bad = mutation.failures(runs)
    if bad:
        session.error("; ".join(bad))


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Merge results/ (or the folders given after --, from any number of machines) into reports/compat.*."""
    from kvcompat.report.terminal import print_table

    with one_line_errors():
        values, dirs = options.parse("report", session.posargs)  # no result in the folders: one line, exit 2
        rep, paths = update_report(ROOT, report_dirs(ROOT, dirs), summary_file=values.summary_file)
    print_table(rep)
    session.log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in paths))


@nox.session(venv_backend="uv", python=False if options.wants_help(POSARGS) else PYTHON)
def tests(session: nox.Session) -> None:
    """The harness's own tests (tests/harness, tests/testkit): no vLLM needed. Fast loop: -- -m "not slow"."""
    if options.wants_help(session.posargs):  # everything else after -- is pytest's
        print(options.help_text("tests"), end="")
        return
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(venv_backend="uv", python=False if POSARGS else PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the project."""
    with one_line_errors():
        options.parse("lint", session.posargs)  # it takes none: --help, or one line and exit 2
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def bisect(session: nox.Session) -> None:
    """Find the first bad release: nox -s bisect -- --test T --good V1 --bad V2 [--dist D] [--torch pinned|X].

    With --find-fix --bad OLD --good NEW: the first good release after a bad one.
    With --repo PATH GOOD BAD: the first bad commit of a vLLM git checkout."""
    from kvcompat.commands.bisect import bisect as first_bad

    with one_line_errors():
        first_bad(ROOT, options.parse_bisect(session.posargs), say=session.log)


@nox.session(python=False)
def qualify(session: nox.Session) -> None:
    """A candidate vLLM against its base release: nox -s qualify -- CANDIDATE [--against RELEASE]."""
    from kvcompat.commands.qualify import qualify as against_base

    with one_line_errors():
        values, _ = options.parse("qualify", session.posargs)  # values.candidate: the one positional
        code, text = against_base(ROOT, values, say=session.log)
    print(text, end="")
    if code:
        session.error("the candidate regressed against its base release (see above)")


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """Write a CI pipeline that runs one job per cell: nox -s ci -- github|buildkite."""
    from kvcompat.commands.ci import ci as write_pipelines

    with one_line_errors():
        _, engines = options.parse("ci", session.posargs)
        write_pipelines(ROOT, engines, say=session.log)
