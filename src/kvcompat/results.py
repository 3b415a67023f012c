"""Per-cell results: the JSON each cell leaves in results/<cell-id>.json.

A result file is written once, atomically, when the cell reaches a final
status; a cell without one has not finished and is redone on the next run.
A file this kvcompat cannot read (truncated, not JSON, another schema, not a
result at all) is an :class:`UnreadableResult`: its cell counts as not run,
and the report names the file instead of dropping it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvcompat.atomic import write_atomic
from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome, TestOutcome

# The result format.  2: every verdict comes from a venv whose vLLM connector files matched their
# RECORD hashes (``integrity``); a schema-1 result carries no such guarantee, so it counts as not run.
SCHEMA = 2
LOG_TAIL_CHARS = 4000
REQUIRED = ("cell", "outcome", "detail")  # what a result cannot do without
# Files that share results/ with the cells' results but are not one (cell ids start with the dist's name):
# kvcompat.mutation's verdicts.
NOT_CELL_RESULTS = ("mutants-*.json",)
# Where `kvcompat qualify` writes a candidate's result, under the results folder: out of the matrix's report.
CANDIDATES_DIR = "qualify"


@dataclasses.dataclass
class TestResult:
    """One test as the pytest plugin saw it."""

    __test__ = False

    nodeid: str
    outcome: TestOutcome
    duration: float
    message: str | None = None  # failure/error text, or the not-applicable reason
    suite: str = "ours"
    # An error in a setup step another test owns: that test's name (its contract).  The test has
    # no verdict of its own here: the timeline and the bisect step over it.
    blocked_by: str | None = None
    # The deployment shape this run of a shaped contract deployed (kvcompat.shapes); None for a test that
    # is not shaped (the suite's own dense construction, or another suite's test).
    shape: str | None = None

    @property
    def contract(self) -> str:
        """The test function's name: the contract, whatever shape or parameters it ran with."""
        return self.nodeid.split("::")[-1].split("[", 1)[0]

    @property
    def has_verdict(self) -> bool:
        """Whether this result says anything about the test's own contract."""
        return self.outcome is not TestOutcome.NOT_APPLICABLE and self.blocked_by is None

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "outcome": self.outcome.value}

    @classmethod
    def from_json(cls, d: dict) -> TestResult:
        return cls(**{**d, "outcome": TestOutcome(d["outcome"])})


@dataclasses.dataclass
class CellResult:
    """Everything known about one cell run."""

    cell: Cell  # written as Cell.to_json()
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
    # kvcompat.run.integrity: {"dist", "files"} of vLLM's connector files checked against RECORD before the
    # tests ran; {} when the cell never reached its tests
    integrity: dict = dataclasses.field(default_factory=dict)
    started: str | None = None
    finished: str | None = None
    schema: int = SCHEMA

    @property
    def id(self) -> str:
        return self.cell.id

    def counts(self) -> dict[str, int]:
        return count_tests(self.tests)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["cell"] = self.cell.to_json()
        d["outcome"] = self.outcome.value
        d["tests"] = [t.to_json() for t in self.tests]
        d["counts"] = self.counts()
        return d

    @classmethod
    def from_json(cls, d: dict) -> CellResult:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["cell"] = Cell.from_json(d["cell"])
        kw["outcome"] = Outcome(d["outcome"])
        kw["tests"] = [TestResult.from_json(t) for t in d.get("tests", [])]
        return cls(**kw)


def count_tests(tests: list[TestResult]) -> dict[str, int]:
    """Number of tests per outcome, every outcome present (0 when none)."""
    counts = {o.value: 0 for o in TestOutcome}
    for t in tests:
        counts[t.outcome.value] += 1
    return counts


# A suite's tally: passed out of all its tests, then each other outcome it had, in these words.
TALLY_WORDS = {"failed": "failed", "error": "error", "unsupported": "unsupported", "not_applicable": "n/a"}


def suite_tally(tests: list[TestResult]) -> str:
    """``49/53 passed, 4 n/a``: one suite's tests (n/a counted among them, never as red)."""
    if not tests:
        return "no tests ran"
    counts = count_tests(tests)
    others = [f"{counts[k]} {word}" for k, word in TALLY_WORDS.items() if counts[k]]
    return ", ".join([f"{counts['passed']}/{len(tests)} passed", *others])


def suite_tallies(result: CellResult) -> str:
    """``ours 49/53 passed · upstream 99/102 passed, 3 n/a``: each suite's counts on their own, never summed.

    A cell's verdict is our suite's; the upstream column (vLLM's own tests of the pair) is counted beside
    it.  Suites in the order the cell ran them; a suite that ran no test says so.  "" for a cell without
    suites or tests (it never reached them).
    """
    parts = []
    for suite in dict.fromkeys([*result.suites, *(t.suite for t in result.tests)]):
        parts.append(f"{suite} {suite_tally([t for t in result.tests if t.suite == suite])}")
    return " · ".join(parts)


def result_path(results_dir: Path, cell_id: str) -> Path:
    return results_dir / f"{cell_id}.json"


def write_result(results_dir: Path, result: CellResult) -> Path:
    path = result_path(results_dir, result.id)
    write_atomic(path, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return path


class UnreadableResultError(ValueError):
    """Why a file is not a result this kvcompat can read; the message completes "results/x.json …"."""


@dataclasses.dataclass(frozen=True)
class UnreadableResult:
    """A file where a cell's result should be that this kvcompat cannot read: its cell counts as not run."""

    path: Path
    reason: str  # completes "<path> …", e.g. "was written by an older kvcompat (result schema 1; …)"

    @property
    def cell_id(self) -> str:
        return self.path.stem

    def line(self) -> str:
        """One line naming the file, what is wrong with it, and the fix."""
        fix = (
            "update kvcompat, or rerun the cell"
            if "newer kvcompat" in self.reason
            else "rerun the cell (`nox -s matrix`) or delete the file"
        )
        return f"{self.path} {self.reason}; cell {self.cell_id} counts as not run: {fix}"


def parse_result(text: str) -> CellResult:
    """The result in ``text``; :class:`UnreadableResultError` saying why when it is not one this kvcompat reads."""
    if not text.strip():
        raise UnreadableResultError("is empty")
    try:
        data = json.loads(text)
    except ValueError as exc:
        body = text.strip()
        if body.startswith("{") and not body.endswith("}"):  # a result is one JSON object: this one stops early
            raise UnreadableResultError(f"is truncated (its JSON stops mid-value after {len(text)} bytes)") from None
        raise UnreadableResultError(f"is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UnreadableResultError(f"is not a kvcompat result (its JSON is a {type(data).__name__}, not an object)")
    if "schema" not in data:
        missing = [k for k in ("cell", "outcome") if k not in data]
        if missing:
            raise UnreadableResultError(f"is not a kvcompat result (no {', '.join(map(repr, ['schema', *missing]))})")
        raise UnreadableResultError("has no result schema version (written by a kvcompat from before result schemas)")
    schema = data["schema"]
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise UnreadableResultError(f"has result schema {schema!r}, which is not a schema version number")
    if schema < SCHEMA:
        raise UnreadableResultError(
            f"was written by an older kvcompat (result schema {schema}; this kvcompat reads schema {SCHEMA})"
        )
    if schema > SCHEMA:
        raise UnreadableResultError(
            f"was written by a newer kvcompat (result schema {schema}; this kvcompat reads schema {SCHEMA})"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise UnreadableResultError(f"is not a complete result (no {', '.join(map(repr, missing))})")
    if not isinstance(data["cell"], dict) or not isinstance(data["cell"].get("id"), str):
        raise UnreadableResultError("is not a complete result (its 'cell' has no id)")
    try:
        return CellResult.from_json(data)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:  # e.g. an outcome this kvcompat does not know
        raise UnreadableResultError(f"is not a complete result ({exc})") from None


def check_result(path: Path) -> CellResult | UnreadableResult | None:
    """The result at ``path``; what is wrong with it when it is unreadable; None when it is absent."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        return UnreadableResult(path, f"cannot be read ({exc.strerror or exc})")
    try:
        return parse_result(text)
    except UnreadableResultError as exc:
        return UnreadableResult(path, str(exc))


def read_result(path: Path) -> CellResult | None:
    """The result at ``path``, or None if it is absent or not a complete result file."""
    found = check_result(path)
    return found if isinstance(found, CellResult) else None


def scan_results(*dirs: Path) -> tuple[list[CellResult], list[UnreadableResult]]:
    """Every complete result under ``dirs`` (searched recursively, so artifacts from many machines merge),
    and every ``*.json`` there that is not one.

    When the same cell appears twice, the most recently finished result wins.
    """
    by_id: dict[str, CellResult] = {}
    unreadable: list[UnreadableResult] = []
    for d in dirs:
        for path in sorted(d.rglob("*.json")) if d.is_dir() else []:
            if any(path.match(pattern) for pattern in NOT_CELL_RESULTS):
                continue
            if path.relative_to(d).parts[0] == CANDIDATES_DIR:  # a qualified candidate, not a matrix cell
                continue
            if path.name.startswith("mutants-"):  # a mutation session's verdicts (kvcompat.report.mutants reads them)
                continue
            found = check_result(path)
            if isinstance(found, UnreadableResult):
                unreadable.append(found)
                continue
            if found is None:  # removed while we looked
                continue
            old = by_id.get(found.id)
            if old is None or (found.finished or "") >= (old.finished or ""):
                by_id[found.id] = found
    return list(by_id.values()), unreadable


def load_results(*dirs: Path) -> list[CellResult]:
    """Every complete result under ``dirs`` (see :func:`scan_results`)."""
    return scan_results(*dirs)[0]


def tail(text: str, chars: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def headline(message: str | None) -> str:
    """The telling line of a failure message: the first '...Error: ...' line, else the last line."""
    lines = [ln.strip().removeprefix("E").strip() for ln in (message or "").strip().splitlines() if ln.strip()]
    for line in lines:
        if "Error:" in line or "Exception:" in line:
            return line[:200]
    return lines[-1][:200] if lines else ""
