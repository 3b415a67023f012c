"""Per-cell results: the JSON each cell leaves in results/<cell-id>.json.

A result file is written once, atomically, when the cell reaches a final
status; a cell without one has not finished and is redone on the next run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvcompat.atomic import write_atomic
from kvcompat.outcomes import Outcome, TestOutcome

SCHEMA = 1
LOG_TAIL_CHARS = 4000


@dataclasses.dataclass
class TestResult:
    """One test as the pytest plugin saw it."""

    __test__ = False

    nodeid: str
    outcome: TestOutcome
    duration: float
    message: str | None = None  # failure/error text, or the not-applicable reason
    suite: str = "ours"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "outcome": self.outcome.value}

    @classmethod
    def from_json(cls, d: dict) -> TestResult:
        return cls(**{**d, "outcome": TestOutcome(d["outcome"])})


@dataclasses.dataclass
class CellResult:
    """Everything known about one cell run."""

    cell: dict  # Cell.to_json()
    outcome: Outcome
    detail: str  # one line: why this outcome
    tests: list[TestResult] = dataclasses.field(default_factory=list)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)  # `uv pip freeze`
    python: str | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per phase
    log_tail: str = ""
    cache_key: str | None = None
    resolved_at: float | None = None  # epoch seconds of the online resolution behind cache_key
    suites: dict[str, dict] = dataclasses.field(default_factory=dict)  # suite -> {"outcome", "detail", "seconds"}
    # {"mode": "today" | "as-released", "exclude_newer": ISO timestamp or None}
    environment: dict = dataclasses.field(default_factory=dict)
    abi: dict = dataclasses.field(default_factory=dict)  # kvcompat.abi.AbiVerdict.to_json(); {} when not checked
    started: str | None = None
    finished: str | None = None
    schema: int = SCHEMA

    @property
    def id(self) -> str:
        return self.cell["id"]

    def counts(self) -> dict[str, int]:
        return count_tests(self.tests)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["outcome"] = self.outcome.value
        d["tests"] = [t.to_json() for t in self.tests]
        d["counts"] = self.counts()
        return d

    @classmethod
    def from_json(cls, d: dict) -> CellResult:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["outcome"] = Outcome(d["outcome"])
        kw["tests"] = [TestResult.from_json(t) for t in d.get("tests", [])]
        return cls(**kw)


def count_tests(tests: list[TestResult]) -> dict[str, int]:
    """Number of tests per outcome, every outcome present (0 when none)."""
    counts = {o.value: 0 for o in TestOutcome}
    for t in tests:
        counts[t.outcome.value] += 1
    return counts


def result_path(results_dir: Path, cell_id: str) -> Path:
    return results_dir / f"{cell_id}.json"


def write_result(results_dir: Path, result: CellResult) -> Path:
    path = result_path(results_dir, result.id)
    write_atomic(path, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def read_result(path: Path) -> CellResult | None:
    """The result at ``path``, or None if it is absent or not a complete result file."""
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            return None
        return CellResult.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_results(*dirs: Path) -> list[CellResult]:
    """Every complete result under ``dirs`` (searched recursively, so artifacts from many machines merge).

    When the same cell appears twice, the most recently finished result wins.
    """
    by_id: dict[str, CellResult] = {}
    for d in dirs:
        for path in sorted(d.rglob("*.json")) if d.is_dir() else []:
            result = read_result(path)
            if result is None:
                continue
            old = by_id.get(result.id)
            if old is None or (result.finished or "") >= (old.finished or ""):
                by_id[result.id] = result
    return list(by_id.values())


def tail(text: str, chars: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def headline(message: str | None) -> str:
    """The telling line of a failure message: the first '...Error: ...' line, else the last line."""
    lines = [ln.strip().removeprefix("E").strip() for ln in (message or "").strip().splitlines() if ln.strip()]
    for line in lines:
        if "Error:" in line or "Exception:" in line:
            return line[:200]
    return lines[-1][:200] if lines else ""
