"""What every phase of a cell run gets: the cell, its venv, the options, its files, and a voice."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.run import process
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.options import RunOptions


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass
class CellContext:
    """State shared by the phases of one cell run; phases hand their results to the next one."""

    cell: Cell
    venv: Path
    opts: RunOptions
    progress: Callable[[str], None] = print
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per finished phase
    started: str = dataclasses.field(default_factory=now)
    # Bytecode in files.bytecode, not the venv's __pycache__ (see CellFiles.bytecode).  False where
    # in-tree .pyc files are managed by hand (the mutation guard deletes them on every swap).
    bytecode_outside_venv: bool = True

    @property
    def files(self) -> CellFiles:
        return CellFiles(self.opts.work_root / self.cell.id, self.opts.results_dir, self.cell.id)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def site_packages(self) -> Path | None:
        """The venv's site-packages (see :meth:`CellFiles.site_packages`); None before it is created."""
        return CellFiles.site_packages(self.venv)

    def say(self, msg: str) -> None:
        self.progress(f"[{self.cell.id}] {msg}")

    def sh(
        self, cmd: list, *, timeout: float, env: dict | None = None, phase: str, cwd: Path | None = None
    ) -> tuple[int | None, str]:
        """Run one command of the cell (see :func:`kvcompat.run.process.run_command`)."""
        return process.run_command(
            cmd,
            self.files,
            timeout=timeout,
            heartbeat_s=self.opts.heartbeat_s,
            say=self.say,
            phase=phase,
            cwd=cwd or self.opts.repo,
            env={**self.bytecode_env(), **(env or {})},
        )

    def bytecode_env(self) -> dict[str, str]:
        # An empty value is no prefix at all (so a caller's own prefix cannot hide the in-tree files either).
        return {"PYTHONPYCACHEPREFIX": str(self.files.bytecode) if self.bytecode_outside_venv else ""}

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Time a phase into ``phases`` and tell the user it started and how long it took."""
        self.say(f"{phase} …")
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases[phase] = round(time.monotonic() - t0, 2)
            self.say(f"{phase} done in {self.phases[phase]:.1f}s")
