"""The files one cell owns while it runs: its log, lock, running marker and pytest reports."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvcompat.results import result_path, tail


@dataclasses.dataclass(frozen=True)
class CellFiles:
    """Where a cell keeps its working files (``work``) and its result (``results_dir``)."""

    work: Path
    results_dir: Path
    cell_id: str

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
