"""Options resolved in one place: which matrix, which cells, how to run them.

The noxfile (and bisect) call into here; nothing else reads the environment
or posargs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvcompat.cells import Cell, resolve_cells
from kvcompat.index import IndexError_
from kvcompat.matrix import MatrixError, load_matrix
from kvcompat.run.options import RunOptions

ENV_MATRIX = "KVCOMPAT_MATRIX"


def matrix_source(root: Path, value: str | None = None) -> tuple[Path, str]:
    """``$KVCOMPAT_MATRIX`` as (file, table): ``name``, ``file.toml`` or ``file.toml:name``."""
    value = value if value is not None else os.environ.get(ENV_MATRIX, "")
    if not value:
        return root / "pyproject.toml", "default"
    path, _, name = value.partition(":") if ".toml" in value else ("", "", value)
    if not path:
        return root / "pyproject.toml", name
    return (root / path if not Path(path).is_absolute() else Path(path)), name or "default"


def load_cells(root: Path, value: str | None = None) -> list[Cell]:
    source, name = matrix_source(root, value)
    entries = load_matrix(source, name)
    return resolve_cells(entries, constraints_dir=root / "constraints", cache_root=root)


def load_cells_or_exit(root: Path) -> list[Cell]:
    """For the noxfile: a bad matrix is one line on stderr and exit status 2, never a traceback."""
    try:
        return load_cells(root)
    except (MatrixError, IndexError_) as exc:
        print(f"kvcompat: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run_options(root: Path, posargs: list[str]) -> RunOptions:
    """``nox -s matrix -- [--force] [--timeout=SECONDS] [--min-free-gb=N] [pytest args…]``.

    A malformed number is one line on stderr and exit status 2, never a traceback.
    """
    opts = RunOptions(repo=root, results_dir=root / "results")
    rest = []
    for arg in posargs:
        if arg == "--force":
            opts.force = True
        elif arg.startswith("--timeout="):
            opts.timeout_s = _positive(arg, "seconds", "--timeout=900")
        elif arg.startswith("--min-free-gb="):
            opts.min_free_gb = _positive(arg, "GiB", "--min-free-gb=15")
        else:
            rest.append(arg)
    opts.pytest_args = tuple(rest)
    return opts


def _positive(arg: str, unit: str, example: str) -> float:
    flag, _, value = arg.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        print(f"kvcompat: error: {flag}={value!r} is not a positive number of {unit}; write e.g. {example}", file=sys.stderr)
        raise SystemExit(2)
    return number
