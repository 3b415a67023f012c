"""kvcompat: is vLLM's MultiConnector(NixlConnector + CPU offload) working, per vLLM and torch release?

Sessions:
  matrix   one session per cell: install with uv, run tests/connectors, write results/<cell>.json
  report   merge results/ into reports/compat.{json,md,xml} and print the table
  bisect   first vLLM release where a test breaks
  ci       write a GitHub Actions / Buildkite pipeline with one job per cell
  tests    the harness's own tests (no vLLM needed)

Pick the matrix with KVCOMPAT_MATRIX (a table name in pyproject.toml, or path.toml[:name]),
cells with nox's -k / -t, e.g. `nox -s matrix -k vllm_0_33_0` or `nox -t vllm-0.32`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent.resolve()
sys.path.insert(0, str(ROOT / "src"))

from kvcompat import settings  # noqa: E402
from kvcompat.cells import PYTHON  # noqa: E402
from kvcompat.sessions import update_report  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"  # cell venvs are big; `uv pip sync` makes a reused one exact
nox.options.sessions = ["matrix"]

CELLS = {cell.id: cell for cell in settings.load_cells_or_exit(ROOT)}


@nox.session(venv_backend="uv", python=PYTHON, allow_parallel=True)
# The parameter is the cell id (a string): nox -j hands parameters to worker processes as JSON.
@nox.parametrize("cell_id", [nox.param(c.id, id=c.nox_id, tags=c.tags) for c in CELLS.values()])
def matrix(session: nox.Session, cell_id: str) -> None:
    """Install one cell with uv, run the connector suite in it, write results/<cell-id>.json."""
    from kvcompat.run.install import DiskFullError
    from kvcompat.run.workflow import run_cell

    cell = CELLS[cell_id]
    opts = settings.run_options(ROOT, session.posargs)
    try:
        session.notify("report")
        parallel = False
    except ValueError:  # nox -j runs sessions without dependencies: update the report ourselves
        parallel = True
    try:
        result = run_cell(cell, Path(session.virtualenv.location), opts, progress=session.log)
    except DiskFullError as exc:
        session.error(str(exc))
    if parallel:
        update_report(ROOT, [opts.results_dir])
    if not result.outcome.is_green:
        session.error(f"{result.outcome.label}: {result.detail}")


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Merge results/ (or the folders given after --, from any number of machines) into reports/compat.*."""
    from kvcompat.report.terminal import print_table

    # Posargs meant for the matrix cells (--force, pytest options) reach a notified report too:
    # only existing folders count as result folders.
    dirs = [Path(p) for p in session.posargs if Path(p).is_dir()]
    rep, paths = update_report(ROOT, dirs or [ROOT / "results"])
    print_table(rep)
    session.log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in paths))


@nox.session(venv_backend="uv", python=PYTHON)
def tests(session: nox.Session) -> None:
    """The harness's own tests: matrix parsing, cells, runner, plugin, report. No vLLM needed."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=False)
def bisect(session: nox.Session) -> None:
    """Find the first bad release: nox -s bisect -- --test T --good V1 --bad V2 [--dist D] [--torch pinned|X]."""
    from kvcompat.sessions import bisect_main

    code = bisect_main(ROOT, session.posargs, say=session.log)
    if code:
        raise SystemExit(code)  # bad input: one line on stderr, exit status 2, no traceback


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """Write a CI pipeline that runs one job per cell: nox -s ci -- github|buildkite."""
    from kvcompat.ci import write

    engines = session.posargs or ["github"]
    for engine in engines:
        try:
            path = write(engine, ROOT)
        except ValueError as exc:
            session.error(str(exc))
        session.log(f"wrote {path.relative_to(ROOT)}")
