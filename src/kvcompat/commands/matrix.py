"""``nox -s matrix`` and ``kvcompat list``: the cells of a matrix, one cell's run, the cells with their last verdicts."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from kvcompat import known_bugs
from kvcompat.cells import Cell, load_cells
from kvcompat.commands.venvs import prune_venv
from kvcompat.results import CellResult, UnreadableResult, check_result, result_path
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell


def matrix_cells(root: Path, values: Namespace) -> list[Cell]:
    """The cells of the matrix named by ``values.matrix``."""
    return load_cells(root, values.matrix, index_url=values.index_url, find_links=values.find_links)


def run_matrix_cell(
    root: Path, cell: Cell, opts: RunOptions, progress: Callable[[str], None], *, prune: bool = False
) -> CellResult:
    """Run one cell; with ``prune`` delete its venv afterwards (``--prune``: a long matrix on a small disk)."""
    result = run_cell(cell, CellFiles.venv(root, cell), opts, progress=progress)
    if prune:
        prune_venv(root, cell, progress)
    return result


def list_cells(root: Path, cells: list[Cell]) -> str:
    """The cells of a matrix: id, nox session, tags and the last verdict, one line each."""
    lines = []
    for cell in cells:
        result = check_result(result_path(root / "results", cell.id))
        status = known_bugs.judge_result(result).outcome.label if isinstance(result, CellResult) else "not run"
        status += " (unreadable result)" if isinstance(result, UnreadableResult) else ""
        lines.append(f'{cell.id:45} {status:14} nox -s "matrix({cell.nox_id})"   tags: {" ".join(cell.tags)}')
    return "\n".join(lines)
