"""``nox -s mutants``: the cells ``-k`` picks, the session's options from the command line, one mutation run
per picked cell and target group, then the report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.commands.report import update_report
from kvcompat.mutation import say
from kvcompat.mutation import session as mutation
from kvcompat.mutation import targets as tg
from kvcompat.mutation.context import MutationError, MutationOptions
from kvcompat.mutation.record import MutationRun


class _Keywords(dict):
    """nox's -k semantics: a name is true when it is a substring of one of the cell's keywords."""

    def __init__(self, keywords: list[str]) -> None:
        super().__init__()
        self.keywords = keywords

    def __missing__(self, name: str) -> bool:
        return any(name in k for k in self.keywords)


def select_cells(cells: list[Cell], expression: str | None) -> list[Cell]:
    """The cells whose tags (and id) match ``expression``, as ``nox -k`` matches the matrix sessions.

    Only cells that run our connector suite: mutants are scored by it (an e2e-only cell has no
    baseline to score against)."""
    ours = [c for c in cells if "ours" in c.suites]
    if not ours:
        raise MutationError(
            'no cell of this matrix runs the connector suite (suites = ["ours"]), which scores the mutants; '
            "pick a matrix that does with KVCOMPAT_MATRIX=… (e.g. history)"
        )
    cells = ours
    if not expression:
        return list(cells)
    try:
        code = compile(expression, "-k", "eval")
    except SyntaxError:
        raise MutationError(f"-k {expression!r} is not a Python expression; write e.g. -k vllm_0_33_0") from None
    chosen = [c for c in cells if eval(code, {"__builtins__": {}}, _Keywords([*c.tags, c.id]))]  # noqa: S307
    if not chosen:
        known = ", ".join(c.tags[3] for c in cells) or "none"
        raise MutationError(
            f"-k {expression!r} matches no cell of the matrix (its cells: {known}); "
            "pick another matrix with KVCOMPAT_MATRIX=… or list the cells with `nox -l -s matrix`"
        )
    return chosen


def options_for(root: Path, values, pytest_args: list[str] = ()) -> MutationOptions:
    return MutationOptions(
        repo=root,
        catalogue=root / "tests" / "mutants" / "multi_connector.toml",
        reasons=root / "tests" / "mutants" / "equivalent.toml",
        results_dir=root / "results",
        home=root / ".kvcompat" / "mutants",
        cell_work=root / ".kvcompat" / "cells",
        only=tuple(values.mutant),
        timeout_s=values.mutant_timeout,
        index_url=values.index_url,
        find_links=tuple(values.find_links),
        pytest_args=tuple(pytest_args),
        upstream_only=bool(values.upstream_only),
        ours_only=bool(getattr(values, "ours_only", False)),
        fork=bool(getattr(values, "fork", False)),
        fork_jobs=int(getattr(values, "fork_jobs", None) or MutationOptions.fork_jobs),
        targets=tg.check_groups(tuple(getattr(values, "target", ()) or tg.DEFAULT_GROUPS)),
    )


def mutants(
    root: Path, cells: list[Cell], values, pytest_args: list[str], progress: Callable[[str], None]
) -> list[MutationRun]:
    """A mutation run of each target group in each cell ``values.k`` picks, then reports/ updated; the runs."""
    runs: list[MutationRun] = []
    for cell in select_cells(cells, values.k):
        mo = options_for(root, values, pytest_args)
        runs += mutation.run_targets(cell, mo, progress=progress)
    update_report(root, [root / "results"], if_any=True)
    return runs


def failures(runs: list[MutationRun]) -> list[str]:
    """One summary line per run that did not pass (a survivor, an error)."""
    return [say.summary(r) for r in runs if not r.ok]
