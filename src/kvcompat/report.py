"""The compatibility report: results/*.json -> reports/compat.{json,md,xml,html} and a terminal table.

Rows are vLLM releases; columns are torch versions (and, when more than one
suite ran, the suite: ours/fake, ours/real-nixl, upstream).  Every grid cell
shows its status in words beside its colour.  Below the grid: where each test
last passed and first failed, what changed since the previous report, a
per-test breakdown, and the reason for every red cell.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from packaging.version import InvalidVersion, Version

from kvcompat.atomic import write_atomic
from kvcompat.outcomes import Outcome, TestOutcome, cell_outcome
from kvcompat.results import CellResult, TestResult, count_tests, headline, load_results

MARK = {
    Outcome.PASS: "🟢",
    Outcome.NOT_APPLICABLE: "⚪",
    Outcome.TEST_FAIL: "🔴",
    Outcome.TEST_ERROR: "🟠",
    Outcome.TIMEOUT: "🟠",
    Outcome.IMPORT_ERROR: "🟣",
    Outcome.INSTALL_ERROR: "🟣",
    Outcome.UNRESOLVABLE: "⚫",
}
TEST_MARK = {TestOutcome.PASSED: "🟢 pass", TestOutcome.FAILED: "🔴 fail", TestOutcome.ERROR: "🟠 error", TestOutcome.NOT_APPLICABLE: "⚪ n/a"}
ANSI = {
    Outcome.PASS: "32", Outcome.NOT_APPLICABLE: "37", Outcome.TEST_FAIL: "31", Outcome.TEST_ERROR: "33",
    Outcome.TIMEOUT: "33", Outcome.IMPORT_ERROR: "35", Outcome.INSTALL_ERROR: "35", Outcome.UNRESOLVABLE: "90",
}
SUMMARY_LIMIT = 1024 * 1024  # GitHub's job-summary cap
BAD_TESTS = (TestOutcome.FAILED, TestOutcome.ERROR)


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

    @property
    def row(self) -> str:
        c = self.result.cell
        label = c["vllm"] if c["dist"] == "vllm" else f"{c['dist']} {c['vllm']}"
        return label + (" (wheel)" if c.get("wheel") else "")

    @property
    def torch_label(self) -> str:
        c = self.result.cell
        return f"torch {c['torch']}" + (" (override)" if c.get("torch_override") else "")

    @property
    def suite_label(self) -> str:
        nixl = self.result.cell.get("nixl", "fake")
        if self.suite == "ours":
            return "ours/fake" if nixl == "fake" else f"ours/real-nixl {nixl}"
        return self.suite

    @property
    def lane(self) -> tuple:
        """Cells comparable across releases: same dist, torch policy, NIXL and suite."""
        c = self.result.cell
        torch = c["torch"] if c.get("torch_override") else "pinned"
        return (c["dist"], torch, self.suite_label)

    @property
    def key(self) -> str:
        return f"{self.result.id}::{self.suite}"

    def counts(self) -> dict[str, int]:
        return count_tests(self.tests)

    def text(self) -> str:
        counts, total = self.counts(), len(self.tests)
        text = f"{self.outcome.label}"
        if total:
            text += f" {counts['passed']}/{total}"
            if counts["not_applicable"]:
                text += f" ({counts['not_applicable']} n/a)"
        return text


def grid_cells(result: CellResult) -> list[GridCell]:
    suites = list(result.suites) or sorted({t.suite for t in result.tests}) or ["ours"]
    out = []
    for suite in suites:
        tests = [t for t in result.tests if t.suite == suite]
        info = result.suites.get(suite)
        if info:
            outcome, detail = Outcome(info["outcome"]), info.get("detail", "")
        elif len(suites) == 1:
            outcome, detail = result.outcome, result.detail
        else:
            outcome, detail = cell_outcome(t.outcome for t in tests), ""
        out.append(GridCell(result, suite, outcome, detail, tests))
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
    previous: dict[str, str] = dataclasses.field(default_factory=dict)  # "gridkey::nodeid" -> outcome, from the last report

    def __post_init__(self) -> None:
        self.cells = [gc for r in self.results for gc in grid_cells(r)]
        self.multi_suite = len({gc.suite_label for gc in self.cells}) > 1

    def column(self, gc: GridCell) -> str:
        return f"{gc.torch_label} · {gc.suite_label}" if self.multi_suite else gc.torch_label

    @property
    def rows(self) -> list[str]:
        keys = {gc.row: gc.result.cell["vllm"] for gc in self.cells}
        return sorted(keys, key=lambda k: (_version_key(keys[k]), k), reverse=True)

    @property
    def columns(self) -> list[str]:
        keys = {self.column(gc): (gc.result.cell["torch"], gc.suite_label) for gc in self.cells}
        return sorted(keys, key=lambda k: (_version_key(keys[k][0]), k), reverse=True)

    def at(self, row: str, column: str) -> GridCell | None:
        return next((gc for gc in self.cells if gc.row == row and self.column(gc) == column), None)

    def ordered(self) -> list[GridCell]:
        """Grid cells in display order (rows, then columns)."""
        return [gc for row in self.rows for col in self.columns if (gc := self.at(row, col))]

    @property
    def test_ids(self) -> list[str]:
        return sorted({t.nodeid for gc in self.cells for t in gc.tests})

    def totals(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        for r in self.results:
            counts[r.outcome.value] += 1
        return counts

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

    def episodes(self) -> list[Episode]:
        """Per test and lane: where it last passed, first and last failed, and was fixed."""
        lanes: dict[tuple, list[GridCell]] = defaultdict(list)
        for gc in self.cells:
            lanes[gc.lane].append(gc)
        out = []
        for lane, cells in lanes.items():
            cells.sort(key=lambda gc: _version_key(gc.result.cell["vllm"]))
            lane_name = " / ".join(x for x in lane if x != "vllm")
            for test in sorted({t.nodeid for gc in cells for t in gc.tests}):
                last_pass: str | None = None
                open_ep: Episode | None = None
                for gc in cells:
                    t = next((t for t in gc.tests if t.nodeid == test), None)
                    if t is None or t.outcome is TestOutcome.NOT_APPLICABLE:
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


def short_test(nodeid: str) -> str:
    return nodeid.split("/")[-1]


def build_report(dirs: list[Path], previous: Path | None = None) -> Report:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    prev = {}
    if previous is not None and previous.is_file():
        try:
            prev = json.loads(previous.read_text()).get("outcomes", {})
        except ValueError:
            prev = {}
    return Report(results=load_results(*dirs), generated=now, previous=prev)


# -- writers ---------------------------------------------------------------------------


def render_json(rep: Report) -> str:
    return json.dumps(
        {
            "generated": rep.generated,
            "totals": rep.totals(),
            "rows": rep.rows,
            "columns": rep.columns,
            "grid": [{"row": gc.row, "column": rep.column(gc), "cell": gc.result.id, "suite": gc.suite,
                      "outcome": gc.outcome.value, "text": gc.text()} for gc in rep.ordered()],
            "episodes": [dataclasses.asdict(e) for e in rep.episodes()],
            "changes": rep.changes(),
            "outcomes": rep.outcomes(),
            "cells": [r.to_json() for r in rep.results],
        },
        indent=2,
        sort_keys=True,
    )


def render_markdown(rep: Report) -> str:
    out = ["# vLLM KV-connector compatibility: MultiConnector(NixlConnector + CPU offload)", ""]
    if not rep.results:
        return "\n".join(out + ["No results yet: run `nox -s matrix`.", ""])
    totals = ", ".join(f"{n} {Outcome(k).label}" for k, n in rep.totals().items() if n)
    out += [f"Generated {rep.generated} from {len(rep.results)} cells: {totals}.", ""]
    out += ["| vLLM \\ torch | " + " | ".join(rep.columns) + " |", "|---|" + "---|" * len(rep.columns)]
    for row in rep.rows:
        cells = [(f"{MARK[gc.outcome]} {gc.text()}" if (gc := rep.at(row, col)) else "") for col in rep.columns]
        out.append(f"| **{row}** | " + " | ".join(cells) + " |")
    out += ["", "Legend: " + ", ".join(f"{m} {o.label}" for o, m in MARK.items()), ""]

    disagreements = _disagreements(rep)
    if disagreements:
        out += ["## Suites disagree", ""] + [f"- {d}" for d in disagreements] + [""]

    episodes = rep.episodes()
    if episodes:
        out += ["## Regressions and fixes", "", "| test | lane | last passed | first failed | last failed | fixed in |", "|---|---|---|---|---|---|"]
        for e in episodes:
            out.append(f"| `{short_test(e.test)}` | {e.lane} | {e.last_passed or '—'} | {e.first_failed} | {e.last_failed} | {e.fixed_in or 'not yet'} |")
        out.append("")

    changes = rep.changes()
    if rep.previous:
        out += ["## Changes since the previous report", ""]
        if not changes["new_failures"] and not changes["new_passes"]:
            out.append("No test changed outcome.")
        for k in changes["new_failures"]:
            out.append(f"- 🔴 newly failing: `{k}`")
        for k in changes["new_passes"]:
            out.append(f"- 🟢 newly passing: `{k}`")
        out.append("")

    ran = [gc for gc in rep.ordered() if gc.tests]
    if ran:
        out += ["## Per-test breakdown", ""]
        heads = [f"{gc.row} / {rep.column(gc)}" for gc in ran]
        out += ["| test | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
        for tid in rep.test_ids:
            marks = []
            for gc in ran:
                t = next((t for t in gc.tests if t.nodeid == tid), None)
                marks.append(TEST_MARK[t.outcome] if t else "")
            if any(marks):
                out.append(f"| `{short_test(tid)}` | " + " | ".join(marks) + " |")
        out.append("")

    notable = [gc for gc in rep.ordered() if not gc.outcome.is_green or any(t.outcome is not TestOutcome.PASSED for t in gc.tests)]
    if notable:
        out += ["## Details", ""]
    for gc in notable:
        out += [f"### {gc.row} / {rep.column(gc)}: {gc.outcome.label}", "", gc.detail or gc.result.detail, ""]
        for t in gc.tests:
            if t.outcome is not TestOutcome.PASSED:
                out.append(f"- `{short_test(t.nodeid)}` {t.outcome.value}: {headline(t.message)}"[:400])
        if not gc.tests and gc.result.log_tail:
            out += ["", "<details><summary>log tail</summary>", "", "```", gc.result.log_tail[-2000:], "```", "</details>"]
        out.append("")
    return "\n".join(out) + "\n"


def _disagreements(rep: Report) -> list[str]:
    """Releases where our suite and vLLM's upstream suite disagree about the same cell."""
    by_cell: dict[str, dict[str, GridCell]] = defaultdict(dict)
    for gc in rep.cells:
        by_cell[gc.result.id][gc.suite] = gc
    out = []
    for by_suite in by_cell.values():
        ours, up = by_suite.get("ours"), by_suite.get("upstream")
        if ours and up and ours.outcome.is_green != up.outcome.is_green:
            out.append(f"{ours.row} ({ours.torch_label}): ours says **{ours.outcome.label}**, upstream says **{up.outcome.label}** ({up.text()})")
    return out


def render_junit(rep: Report) -> str:
    suites = []
    for r in sorted(rep.results, key=lambda r: r.id):
        cases = []
        for t in r.tests:
            body = ""
            if t.outcome is TestOutcome.FAILED:
                body = f"<failure message={quoteattr((t.message or '')[:200])}>{escape(t.message or '')}</failure>"
            elif t.outcome is TestOutcome.ERROR:
                body = f"<error message={quoteattr((t.message or '')[:200])}>{escape(t.message or '')}</error>"
            elif t.outcome is TestOutcome.NOT_APPLICABLE:
                body = f"<skipped message={quoteattr('not applicable: ' + (t.message or ''))}/>"
            name = t.nodeid if t.suite == "ours" else f"[{t.suite}] {t.nodeid}"
            cases.append(f'<testcase classname={quoteattr(r.id)} name={quoteattr(name)} time="{t.duration:.3f}">{body}</testcase>')
        if not r.tests:  # the cell never reached its tests: one synthetic case carries why
            tag = "skipped" if r.outcome is Outcome.NOT_APPLICABLE else "error"
            cases.append(
                f'<testcase classname={quoteattr(r.id)} name="cell">'
                f"<{tag} message={quoteattr(r.outcome.value + ': ' + r.detail)}>{escape(r.log_tail)}</{tag}></testcase>"
            )
        c = r.counts()
        errors = c["error"] + (0 if r.tests or r.outcome is Outcome.NOT_APPLICABLE else 1)
        suites.append(
            f"<testsuite name={quoteattr(r.id)} tests=\"{max(len(r.tests), 1)}\" failures=\"{c['failed']}\" errors=\"{errors}\" "
            f"skipped=\"{c['not_applicable']}\" time=\"{sum(r.phases.values()):.2f}\">" + "".join(cases) + "</testsuite>"
        )
    return '<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="kvcompat">' + "".join(suites) + "</testsuites>\n"


def write_reports(rep: Report, out_dir: Path) -> list[Path]:
    from kvcompat.html import render_html

    md = render_markdown(rep)
    paths = {
        out_dir / "compat.json": render_json(rep),
        out_dir / "compat.md": md,
        out_dir / "compat.xml": render_junit(rep),
        out_dir / "compat.html": render_html(rep),
    }
    for path, text in paths.items():
        write_atomic(path, text)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        data = md.encode()
        if len(data) > SUMMARY_LIMIT:
            note = b"\n\n(truncated to GitHub's 1 MiB job-summary limit: see reports/compat.md)\n"
            data = data[: SUMMARY_LIMIT - len(note) - 4].decode(errors="ignore").encode() + note
        with open(summary, "ab") as fh:
            fh.write(data)
    return list(paths)


def render_terminal(rep: Report, color: bool = False) -> str:
    if not rep.results:
        return "no results yet: run `nox -s matrix`"
    texts = {(row, col): gc for row in rep.rows for col in rep.columns if (gc := rep.at(row, col))}
    w0 = max(len("vLLM"), *(len(r) for r in rep.rows))
    widths = [max(len(col), *(len(texts[(row, col)].text()) for row in rep.rows if (row, col) in texts)) for col in rep.columns]
    lines = ["vLLM".ljust(w0) + "  " + "  ".join(c.ljust(w) for c, w in zip(rep.columns, widths))]
    for row in rep.rows:
        parts = []
        for col, w in zip(rep.columns, widths):
            gc = texts.get((row, col))
            padded = (gc.text() if gc else "").ljust(w)
            parts.append(f"\033[{ANSI[gc.outcome]}m{padded}\033[0m" if color and gc else padded)
        lines.append(row.ljust(w0) + "  " + "  ".join(parts))
    return "\n".join(lines)


def print_table(rep: Report) -> None:
    print(render_terminal(rep, color=sys.stdout.isatty()))
