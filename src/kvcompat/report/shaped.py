"""Per square: the deployment shapes its shaped contracts ran in, and the known vLLM bug behind a red test.

A shaped contract runs in each deployment shape of :mod:`kvcompat.shapes`; :func:`shape_verdicts` adds
up what one grid cell's tests say per shape.  :func:`known_bug` and :func:`red_line` name the known bug
(:mod:`kvcompat.known_bugs`) that explains a red test in its release.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvcompat import known_bugs
from kvcompat.outcomes import Outcome, cell_outcome
from kvcompat.report.cells import BAD_TESTS, GridCell
from kvcompat.results import TestResult, count_tests
from kvcompat.shapes import BY_ID as SHAPES_BY_ID
from kvcompat.shapes import SHAPES


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
    return known_bugs.explaining(test.contract, test.shape, gc.result.cell.vllm)


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
