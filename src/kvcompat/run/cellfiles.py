"""The files one cell owns: its venv and the venv's site-packages, and while it runs its log, lock,
running marker and pytest reports.  The one place that says where they are."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.results import result_path, tail

# Under the project's root: one venv per cell, named by the cell's id.
VENVS = Path(".kvcompat") / "venvs"


@dataclasses.dataclass(frozen=True)
class CellFiles:
    """Where a cell keeps its working files (``work``) and its result (``results_dir``)."""

    work: Path
    results_dir: Path
    cell_id: str

    @staticmethod
    def venv(root: Path, cell: Cell) -> Path:
        """The cell's one venv in the project at ``root``: .kvcompat/venvs/<cell id>."""
        return root / VENVS / cell.id

    @staticmethod
    def site_packages(venv: Path) -> Path | None:
        """The venv's site-packages (lib/python3.X/site-packages, whichever Python built it); None
        while the venv has none (not created yet, or removed)."""
        return next(iter(sorted(venv.glob("lib/python3.*/site-packages"))), None)

    @property
    def log(self) -> Path:
        return self.work / "cell.log"

    @property
    def lock(self) -> Path:
        return self.work / "lock.txt"

    @property
    def lock_inputs(self) -> Path:
        """A hash of what ``lock`` was resolved from: the same inputs within the TTL give the same lock."""
        return self.work / "lock.inputs"

    @property
    def bytecode(self) -> Path:
        """Where the cell's Python processes cache bytecode (PYTHONPYCACHEPREFIX): outside the venv,
        so ``--prune`` keeps it and a rerun from uv's hardlinks does not recompile vLLM and torch."""
        return self.work / "bytecode"

    @property
    def running(self) -> Path:
        """Who runs the cell's current command: lets a run after a SIGKILL reap what was left."""
        return self.work / "running.json"

    @property
    def result(self) -> Path:
        return result_path(self.results_dir, self.cell_id)

    def pytest_report(self, suite: str) -> Path:
        return self.work / f"pytest-{suite}.json"

    def start_log(self, header: str) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.log.write_text(header if header.endswith("\n") else header + "\n")

    def append_log(self, text: str) -> None:
        with self.log.open("a") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")

    def log_tail(self) -> str:
        try:
            return tail(self.log.read_text(errors="replace"))
        except OSError:
            return ""
