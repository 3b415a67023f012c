"""What a mutation session works with: its options, its paths, its cell context and its venv.

.kvcompat/mutants/venvs/<cell>            the session's venv, from the cell's lock (never the cell's venv)
.kvcompat/mutants/venvs/<cell>.mutation/  journals, pristine copies, session.lock (kvcompat.mutation.guard)
.kvcompat/mutants/cells/<cell>/           the session's log and pytest reports
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.errors import KvcompatError
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import guard as guards
from kvcompat.mutation import targets as tg
from kvcompat.mutation.guard import Guard, GuardError
from kvcompat.run import install, suites
from kvcompat.run.context import CellContext
from kvcompat.run.options import run_options


class MutationError(KvcompatError):
    """The mutation session cannot start for this cell; the message names the fix."""


@dataclasses.dataclass
class MutationOptions:
    """Knobs of a mutation session."""

    repo: Path
    catalogue: Path
    results_dir: Path
    home: Path  # .kvcompat/mutants: the session's venvs and work files
    cell_work: Path  # where the matrix keeps each cell's lock (.kvcompat/cells)
    suite: str = "tests/connectors"
    only: tuple[str, ...] = ()  # mutant ids; empty: the whole catalogue
    timeout_s: float | None = None  # per mutant; None: 5x the baseline run, at least MIN_TIMEOUT_S
    index_url: str = "https://pypi.org/simple"
    find_links: tuple[str, ...] = ()
    heartbeat_s: float = 30.0
    pytest_args: tuple[str, ...] = ()  # e.g. --deselect of a test that fails on the baseline; in every run
    # tests/mutants/equivalent.toml: why generated mutants are equivalent (per release), and methods with no site;
    # another group's reasons are read from equivalent-<group>.toml beside it, when there is one
    reasons: Path | None = None
    # Score the upstream column only, keeping our suite's verdicts from the previous scored run (ours takes
    # ~11 s a mutant, upstream ~50 s: the two need not be paid together).
    upstream_only: bool = False
    ours_only: bool = False  # the upstream column left out (scored later with upstream_only)
    # The groups of files to mutate (kvcompat.mutation.targets.GROUPS).
    targets: tuple[str, ...] = tg.DEFAULT_GROUPS
    # Coverage-based test selection (kvcompat.mutation.covmap); False: every mutant runs the whole suite.
    select_tests: bool = True
    # Score our suite in forked children of one pytest per batch (kvcompat.mutation.incell.forkrun).
    fork: bool = False
    fork_jobs: int = 16  # forked children in flight at once

    MIN_TIMEOUT_S = 120.0


def venv_for(home: Path, cell: Cell) -> Path:
    return home / "venvs" / cell.id


def site_for(home: Path, cell: Cell) -> Path:
    return venv_for(home, cell) / "lib" / f"python{cell.python}" / "site-packages"


def state_for(home: Path, cell: Cell) -> Path:
    return venv_for(home, cell).parent / f"{cell.id}.mutation"


def guard_for(home: Path, cell: Cell, target: str = cat.TARGET) -> Guard:
    return Guard(site_for(home, cell), state_for(home, cell), target)


def reasons_path(mo: MutationOptions, group: str) -> Path | None:
    if mo.reasons is None:
        return None
    return mo.reasons if group == "multi" else mo.reasons.with_name(f"{mo.reasons.stem}-{group}.toml")


def cell_label(cell: Cell) -> str:
    return f"{cell.dist} {cell.vllm}"


def rel(path: Path, root: Path) -> Path:
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return path


def cell_context(cell: Cell, mo: MutationOptions, progress: Callable[[str], None], timeout_s: float) -> CellContext:
    opts = run_options(
        mo.repo,
        None,
        mo.pytest_args,
        # record.finish is never called here: the cell's own result file is not ours to write.
        results_dir=mo.home / "cells" / cell.id,
        suite=mo.suite,
        timeout_s=timeout_s,
        work_dir=mo.home / "cells",
        heartbeat_s=mo.heartbeat_s,
        index_url=mo.index_url,
        find_links=mo.find_links,
    )
    # In-tree bytecode: the guard deletes the mutated file's .pyc on every swap, and a prefix tree
    # would keep serving the other version's.
    return CellContext(cell, venv_for(mo.home, cell), opts, progress, bytecode_outside_venv=False)


def ours_run(ctx: CellContext, *extra: str) -> suites.SuiteRun:
    """Our suite's run in this cell, as a matrix cell runs it, with ``extra`` pytest arguments after its own
    (RunOptions.pytest_args, the session's extra arguments, come after these)."""
    run = suites.suite_run(ctx, "ours")
    return dataclasses.replace(run, args=[*run.args, *extra])


def prepare_venv(ctx: CellContext, mo: MutationOptions, lock: Path, groups: tuple[str, ...]) -> None:
    """Build (or re-sync) the session's venv from the cell's lock, after undoing what a killed session left.

    Every file with a journal is put back (whichever group the killed session ran), and every file of this
    session's groups is checked against RECORD: one that differs with no pristine copy to restore it from
    means the venv is rebuilt."""
    site, state = site_for(mo.home, ctx.cell), state_for(mo.home, ctx.cell)
    if site.is_dir():
        check = [*guards.journaled(state), cat.TARGET]
        for group in groups:
            check += [f.path for f in tg.resolve(site, group).files]
        for target in dict.fromkeys(check):
            guard = Guard(site, state, target)
            if not guard.path.exists():
                continue
            try:
                done = guard.recover()
            except GuardError as exc:
                ctx.say(f"{exc}: rebuilding the mutation venv")
                shutil.rmtree(ctx.venv)
                break
            if done:
                ctx.say(done)
    ctx.files.work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lock, ctx.files.lock)
    with ctx.timed("install"):
        failure = install._install(ctx)  # the cell's own recipe: uv venv, uv pip sync of the lock, the harness .pth
    if failure is not None:
        raise MutationError(f"could not build the mutation venv {ctx.venv}: {failure}; see {ctx.files.log}")
    if "multi" in groups and not guard_for(mo.home, ctx.cell).path.is_file():
        raise MutationError(f"{cat.TARGET} is not in {cell_label(ctx.cell)}; there is nothing to mutate")
