"""``--prune`` (the matrix, bisect): a finished cell's venv removed under its lock; where it is, CellFiles says."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.lock import CellBusyError, held


def prune_venv(root: Path, cell: Cell, say: Callable[[str], None]) -> int:
    """Delete a finished cell's venv under its lock; return the bytes freed (files not shared with uv's cache).

    A venv is mostly hardlinks into uv's cache, so removing it frees only what is its own (bytecode,
    entry points, metadata); the cache keeps every wheel for the next cell or rerun.  A venv another
    run holds is left alone.
    """
    venv = CellFiles.venv(root, cell)
    if not venv.is_dir():
        return 0
    try:
        with held(venv, cell.id):
            own = 0
            for base, _dirs, files in os.walk(venv):
                for name in files:
                    st = os.lstat(os.path.join(base, name))
                    own += st.st_size if st.st_nlink == 1 else 0
            shutil.rmtree(venv)
    except CellBusyError as exc:
        say(f"kept {venv.name}: {exc}")
        return 0
    say(
        f"pruned {venv.relative_to(root)}: {own / 2**30:.2f} GiB freed (its wheels stay in uv's cache, its bytecode beside its lock)"
    )
    return own
