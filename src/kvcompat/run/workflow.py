"""A cell run as a list of phases: each takes the previous one's result; a CellResult ends the run.

    begin → resolve → install → integrity → suites

Every phase that fails ends the run with its own outcome (unresolvable, install
error, import error, timeout, test error/fail) through :func:`record.finish`, so a
cell always ends with a result file.
"""

from __future__ import annotations

import errno
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.results import CellResult, UnreadableResult, check_result
from kvcompat.run import install, integrity, lock, record, resolve, suites
from kvcompat.run.context import CellContext
from kvcompat.run.options import RunOptions
from kvcompat.run.process import reap_leftover


class _Begun:
    """What ``begin`` hands to the resolve phase: the previous result of this cell, if any."""

    def __init__(self, cached: CellResult | None) -> None:
        self.cached = cached


def begin(ctx: CellContext, _: None) -> _Begun | CellResult:
    """Answer an unchanged cell from its result file; otherwise start the log (and check --min-free-gb)."""
    found = check_result(ctx.files.result)
    if isinstance(found, UnreadableResult):  # never an answer: the cell runs and its result replaces the file
        ctx.say(f"{found.path} {found.reason}: running the cell")
    cached = found if isinstance(found, CellResult) else None
    if resolve.unchanged(ctx, cached):
        return record.reuse(ctx, cached)
    ctx.files.start_log(f"# kvcompat cell {ctx.cell.id} started {ctx.started}")
    reap_leftover(ctx.files, ctx.say)
    install.check_floor(ctx)
    return _Begun(cached)


def _resolve(ctx: CellContext, begun: _Begun) -> resolve.Resolved | CellResult:
    return resolve.phase(ctx, begun.cached)


PHASES: tuple[Callable, ...] = (begin, _resolve, install.phase, integrity.phase, suites.phase)


def run_phases(ctx: CellContext) -> CellResult:
    value = None
    for phase in PHASES:
        value = phase(ctx, value)
        if isinstance(value, CellResult):
            return value
    raise AssertionError("the last phase always returns a CellResult")


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def run_cell(cell: Cell, venv: Path, opts: RunOptions, progress: Callable[[str], None] = print) -> CellResult:
    """Run ``cell`` in ``venv`` (created if missing) and write results/<cell-id>.json.

    Another live run of the same venv makes this one refuse (kvcompat.run.lock.CellBusyError).
    SIGTERM is handled like Ctrl-C while the cell runs: the cell's process group (its own
    session, so the terminal's signals miss it) is killed instead of left running.
    """
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        with lock.held(venv, cell.id):  # one run per venv: never two installs into one
            return run_phases(CellContext(cell, venv, opts, progress))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # The log, the lock or the result file could not be written: results are atomic, so none is half-written.
        raise install.DiskFullError(
            f"no space left on the disk for {exc.filename or 'a file of the cell'} while running cell {cell.id}; "
            "free space (e.g. `rm -rf .kvcompat/venvs/<old cell>`, or `uv cache prune`) and rerun"
        ) from None
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
