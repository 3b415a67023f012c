"""``nox -s bisect`` and ``kvcompat bisect``: the first bad (or with --find-fix, fixed) release, or commit."""

from __future__ import annotations

import functools
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from kvcompat import bisect_commits, bisect_releases
from kvcompat import bisection as bis
from kvcompat.cells import Cell, resolve_entry
from kvcompat.commands.venvs import prune_venv
from kvcompat.matrix import Entry
from kvcompat.results import CellResult
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.options import RunOptions, run_options
from kvcompat.run.workflow import run_cell


def bisect(root: Path, values: Namespace, say: Callable[[str], None] = print) -> bis.BisectResult:
    """The first bad release between ``values.good`` and ``values.bad`` (with ``values.find_fix`` the first
    good one after the bad), or with ``values.repo`` the first bad commit of a vLLM git checkout: one search
    (:func:`kvcompat.bisection.run`) over the items a handler lists, each step a cell run as the matrix runs
    it.  Bad input raises, one line."""
    opts = run_options(root, values)  # bisect takes no --timeout or --upstream-index: their defaults

    def run(entry: Entry, opts: RunOptions, progress: Callable[[str], None]) -> tuple[Cell, CellResult]:
        cell = resolve_entry(root, entry, index_url=values.index_url, find_links=values.find_links)
        return cell, run_cell(cell, CellFiles.venv(root, cell), opts, progress=progress)

    cells = bis.Cells(
        opts, run, venv=functools.partial(CellFiles.venv, root), prune=functools.partial(prune_venv, root)
    )
    handler = bisect_commits.handler if values.repo is not None else bisect_releases.handler
    return bis.run(
        handler(root, values, cells, say), test=values.test, find_fix=bool(getattr(values, "find_fix", False)), say=say
    )
