"""The compatibility report: results/*.json -> reports/compat.{json,md,xml} and a terminal table.

Rows are vLLM releases, columns torch versions; each cell shows its status in
words (with a colour mark) and its test counts.  Below the grid, a per-test
breakdown and the reason for every red cell.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from packaging.version import InvalidVersion, Version

from kvcompat.atomic import write_atomic
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, load_results

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


def _version_key(text: str) -> tuple:
    try:
        return (1, Version(text))
    except InvalidVersion:
        return (0, Version("0"))


@dataclasses.dataclass
class Report:
    results: list[CellResult]
    generated: str

    @property
    def rows(self) -> list[str]:
        keys = {row_label(r): r.cell["vllm"] for r in self.results}
        return sorted(keys, key=lambda k: (_version_key(keys[k]), k), reverse=True)

    @property
    def columns(self) -> list[str]:
        keys = {column_label(r): r.cell["torch"] for r in self.results}
        return sorted(keys, key=lambda k: (_version_key(keys[k]), k), reverse=True)

    def at(self, row: str, column: str) -> CellResult | None:
        for r in self.results:
            if row_label(r) == row and column_label(r) == column:
                return r
        return None

    @property
    def test_ids(self) -> list[str]:
        return sorted({t.nodeid for r in self.results for t in r.tests})

    def totals(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        for r in self.results:
            counts[r.outcome.value] += 1
        return counts


def row_label(r: CellResult) -> str:
    c = r.cell
    label = c["vllm"] if c["dist"] == "vllm" else f"{c['dist']} {c['vllm']}"
    if c.get("wheel"):
        label += " (wheel)"
    return label


def column_label(r: CellResult) -> str:
    c = r.cell
    label = f"torch {c['torch']}" + (" (override)" if c.get("torch_override") else "")
    if c.get("nixl", "fake") != "fake":
        label += f", nixl {c['nixl']}"
    return label


def cell_text(r: CellResult) -> str:
    counts = r.counts()
    total = len(r.tests)
    text = f"{MARK[r.outcome]} {r.outcome.label}"
    if total:
        text += f" {counts['passed']}/{total}"
        if counts["not_applicable"]:
            text += f" ({counts['not_applicable']} n/a)"
    return text


def short_test(nodeid: str) -> str:
    return nodeid.split("/")[-1]


def build_report(dirs: list[Path]) -> Report:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return Report(results=load_results(*dirs), generated=now)


# -- writers ---------------------------------------------------------------------------


def render_json(rep: Report) -> str:
    return json.dumps(
        {
            "generated": rep.generated,
            "totals": rep.totals(),
            "rows": rep.rows,
            "columns": rep.columns,
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
        cells = [(cell_text(r) if (r := rep.at(row, col)) else "") for col in rep.columns]
        out.append(f"| **{row}** | " + " | ".join(cells) + " |")
    out += ["", "Legend: " + ", ".join(f"{m} {o.label}" for o, m in MARK.items()), ""]

    ran = [r for row in rep.rows for col in rep.columns if (r := rep.at(row, col)) and r.tests]
    if ran:
        out += ["## Per-test breakdown", ""]
        heads = [f"{row_label(r)} / {column_label(r)}" for r in ran]
        out += ["| test | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
        for tid in rep.test_ids:
            marks = []
            for r in ran:
                t = next((t for t in r.tests if t.nodeid == tid), None)
                marks.append(TEST_MARK[t.outcome] if t else "")
            out.append(f"| `{short_test(tid)}` | " + " | ".join(marks) + " |")
        out.append("")

    red = [r for r in rep.results if not r.outcome.is_green or any(t.outcome is TestOutcome.NOT_APPLICABLE for t in r.tests)]
    if red:
        out += ["## Details", ""]
    for r in red:
        out += [f"### {row_label(r)} / {column_label(r)}: {r.outcome.label}", "", f"{r.detail}", ""]
        for t in r.tests:
            if t.outcome is not TestOutcome.PASSED:
                first = (t.message or "").strip().splitlines()
                out.append(f"- `{short_test(t.nodeid)}` {t.outcome.value}: {first[-1] if first else ''}"[:400])
        if not r.tests and r.log_tail:
            out += ["", "<details><summary>log tail</summary>", "", "```", r.log_tail[-2000:], "```", "</details>"]
        out.append("")
    return "\n".join(out) + "\n"


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
            cases.append(f'<testcase classname={quoteattr(r.id)} name={quoteattr(t.nodeid)} time="{t.duration:.3f}">{body}</testcase>')
        if not r.tests:  # the cell never reached its tests: one synthetic case carries why
            tag = "skipped" if r.outcome is Outcome.NOT_APPLICABLE else "error"
            cases.append(
                f'<testcase classname={quoteattr(r.id)} name="cell">'
                f"<{tag} message={quoteattr(r.outcome.value + ': ' + r.detail)}>{escape(r.log_tail)}</{tag}></testcase>"
            )
        c = r.counts()
        failures = c["failed"]
        errors = c["error"] + (0 if r.tests or r.outcome is Outcome.NOT_APPLICABLE else 1)
        suites.append(
            f"<testsuite name={quoteattr(r.id)} tests=\"{max(len(r.tests), 1)}\" failures=\"{failures}\" errors=\"{errors}\" "
            f"skipped=\"{c['not_applicable']}\" time=\"{r.phases.get('test', 0):.2f}\">" + "".join(cases) + "</testsuite>"
        )
    return '<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="kvcompat">' + "".join(suites) + "</testsuites>\n"


def write_reports(rep: Report, out_dir: Path) -> list[Path]:
    md = render_markdown(rep)
    paths = {
        out_dir / "compat.json": render_json(rep),
        out_dir / "compat.md": md,
        out_dir / "compat.xml": render_junit(rep),
    }
    for path, text in paths.items():
        write_atomic(path, text)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        data = md.encode()
        if len(data) > SUMMARY_LIMIT:
            data = data[: SUMMARY_LIMIT - 200] + b"\n\n(truncated: see reports/compat.md)\n"
        with open(summary, "ab") as fh:
            fh.write(data.decode(errors="ignore").encode())
    return list(paths)


def render_terminal(rep: Report, color: bool = False) -> str:
    if not rep.results:
        return "no results yet: run `nox -s matrix`"
    texts = {(row, col): (r, cell_text(r).split(" ", 1)[1]) for row in rep.rows for col in rep.columns if (r := rep.at(row, col))}
    w0 = max(len("vLLM"), *(len(r) for r in rep.rows))
    widths = [max(len(col), *(len(texts[(row, col)][1]) for row in rep.rows if (row, col) in texts)) for col in rep.columns]
    lines = ["vLLM".ljust(w0) + "  " + "  ".join(c.ljust(w) for c, w in zip(rep.columns, widths))]
    for row in rep.rows:
        parts = []
        for col, w in zip(rep.columns, widths):
            r, text = texts.get((row, col), (None, ""))
            padded = text.ljust(w)
            parts.append(f"\033[{ANSI[r.outcome]}m{padded}\033[0m" if color and r else padded)
        lines.append(row.ljust(w0) + "  " + "  ".join(parts))
    return "\n".join(lines)


def print_table(rep: Report) -> None:
    print(render_terminal(rep, color=sys.stdout.isatty()))
