"""reports/compat.md: the timeline (a history run) or the grid, regressions and fixes, changes, per-test breakdown,
and every red cell's reason."""

from __future__ import annotations

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.drift import environment_pairs
from kvcompat.report.model import (
    BAD_TESTS,
    Report,
    Timeline,
    TimelineRow,
    red_line,
    shape_verdicts,
    shape_what,
    short_test,
    suite_tally,
)

MARK = {
    Outcome.PASS: "🟢",
    Outcome.NOT_APPLICABLE: "⚪",
    Outcome.TEST_FAIL: "🔴",
    Outcome.UNSUPPORTED: "🟤",
    Outcome.TEST_ERROR: "🟠",
    Outcome.TIMEOUT: "🟠",
    Outcome.IMPORT_ERROR: "🟣",
    Outcome.INSTALL_ERROR: "🟣",
    Outcome.UNRESOLVABLE: "⚫",
    Outcome.KNOWN_BUG: "🔵",
    Outcome.KNOWN_BUG_GONE: "❗",
}
TEST_MARK = {
    TestOutcome.PASSED: "🟢 pass",
    TestOutcome.FAILED: "🔴 fail",
    TestOutcome.ERROR: "🟠 error",
    TestOutcome.UNSUPPORTED: "🟤 unsupported",
    TestOutcome.NOT_APPLICABLE: "⚪ n/a",
}
# One mark per timeline status, all distinct (the grid's MARK shares colours between kinds of red).
TIMELINE_MARK = {
    "pass": "🟢",
    "known bug": "🔵",
    "test fail": "🔴",
    "unsupported": "🟤",
    "test error": "🟠",
    "timeout": "⏱️",
    "not applicable": "⚪",
    "import error": "🟣",
    "install error": "🔧",
    "unresolvable": "⚫",
    "not run": "·",
}


def _untested(first: str, between: list[str]) -> str:
    return f"{first} (untested before it: {', '.join(between)})" if between else first


def _first_bad(gc) -> str:
    """The first red test of a square, with its message's first line."""
    bad = next((t for t in gc.tests if t.outcome in BAD_TESTS), None)
    if bad is None:
        return ""
    return f": `{short_test(bad.nodeid)}`: {(bad.message or '').splitlines()[0][:200] if bad.message else ''}"


def timeline_summary(row: TimelineRow) -> tuple[str, str, str]:
    """first fail, last pass, fixed in: as the timeline's last three columns say them."""
    if row.first_fail is None:
        return "—", row.last_pass or "never ran", "—"
    first = _untested(row.first_fail, row.untested_break)
    if row.earlier:
        first += f"; {row.earlier} earlier run{'s' if row.earlier > 1 else ''} fixed"
    fixed = _untested(row.fixed_in, row.untested_fix) if row.fixed_in else "not yet"
    return first, row.last_pass or "never", fixed


def render_timelines(timelines: list[Timeline]) -> list[str]:
    """The timeline section: one timeline per order of MultiConnector's children, each under its title."""
    out = ["## Timeline", ""]
    for tl in timelines:
        out += ([f"### {tl.title[0].upper()}{tl.title[1:]}", ""] if len(timelines) > 1 else []) + render_timeline(tl)
    return out


def render_timeline(tl: Timeline) -> list[str]:
    """Contracts down, releases across (oldest first); each column header says its torch and suites."""
    heads = []
    for col in tl.columns:
        extra = " · ".join([col.torch, *col.suites, *col.notes])
        heads.append(f"{col.release}<br><sub>{extra}</sub>")
    out = [
        f"{len(tl.rows)} contracts × {len(tl.columns)} releases, oldest first, {tl.title}. "
        "First fail, last pass and fixed in describe each contract's newest failing run; "
        "releases without a verdict (n/a, could not install or import) are stepped over and named.",
        "",
        "| contract | " + " | ".join(heads) + " | first fail | last pass | fixed in |",
        "|---|" + ":-:|" * len(heads) + "---|---|---|",
    ]
    for row in tl.rows:
        marks = [TIMELINE_MARK[sq.status] if sq else TIMELINE_MARK["not run"] for sq in row.squares]
        out.append(f"| `{row.label}` | " + " | ".join(marks) + " | " + " | ".join(timeline_summary(row)) + " |")
    counts = tl.counts()
    out += [
        "",
        "Legend: " + ", ".join(f"{m} {s} ({counts[s]})" for s, m in TIMELINE_MARK.items()),
        "",
    ]
    return out


def render_shapes(rep: Report) -> list[str]:
    """Which deployment shapes pass per cell: shapes down, cells across; each square the shape's contracts
    passed out of those that ran, and under the table every red shape's first failing contract."""
    cells = rep.shaped_cells()
    if not cells:
        return []
    heads = [f"{gc.row} / {rep.column(gc)}" for gc in cells]
    out = [
        "## Deployment shapes",
        "",
        "Each contract about transfer, storage or block accounting runs once per deployment shape "
        "(`--shapes` picks them); a shape passes in a cell when every contract it ran there passed.",
        "",
        "| shape | " + " | ".join(heads) + " |",
        "|---|" + ":-:|" * len(heads),
    ]
    verdicts = [shape_verdicts(gc) for gc in cells]
    red: list[str] = []
    for shape in rep.shapes():
        marks = []
        for gc, by_shape in zip(cells, verdicts, strict=True):
            v = by_shape.get(shape)
            marks.append(f"{MARK[v.outcome]} {v.text()}" if v else "")
            if v and v.red:
                t = v.red[0]
                red.append(
                    f"- **{shape}** in {gc.row} / {rep.column(gc)}: `{short_test(t.nodeid)}` {t.outcome.value}: "
                    f"{red_line(gc, t)}"[:600]
                )
        what = shape_what(shape)
        out.append(f"| `{shape}`" + (f"<br><sub>{what}</sub>" if what else "") + " | " + " | ".join(marks) + " |")
    return out + [""] + red + ([""] if red else [])


def render_markdown(rep: Report) -> str:
    out = ["# vLLM KV-connector compatibility: MultiConnector(NixlConnector + CPU offload)", ""]
    if not rep.results:
        return "\n".join(out + ["No results yet: run `nox -s matrix`.", ""])
    totals = ", ".join(f"{n} {Outcome(k).label}" for k, n in rep.totals().items() if n)
    out += [f"Generated {rep.generated} from {len(rep.results)} cells: {totals}.", ""]
    if rep.is_history:  # many releases: the timeline leads, the grid (every cell, overrides too) follows
        out += render_timelines(rep.timelines()) + ["## Grid", ""]
    out += ["| vLLM \\ torch | " + " | ".join(rep.columns) + " |", "|---|" + "---|" * len(rep.columns)]
    for row in rep.rows:
        cells = [(f"{MARK[gc.outcome]} {gc.text()}" if (gc := rep.at(row, col)) else "") for col in rep.columns]
        out.append(f"| **{row}** | " + " | ".join(cells) + " |")
    out += ["", "Legend: " + ", ".join(f"{m} {o.label}" for o, m in MARK.items()), ""]

    out += render_shapes(rep)

    ran_how = [gc for gc in rep.ordered() if gc.facts]
    if ran_how:
        names = list(dict.fromkeys(k for gc in ran_how for k in gc.facts if k != "platform"))
        out += [
            "## How each cell ran",
            "",
            "What the suite used to run each release on this CPU (the CPU-offload child's worker: its own code with only "
            "its CUDA transport replaced, or scripted transfers where it cannot run so).",
            "",
            "| cell | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        out += [
            f"| {gc.row} / {rep.column(gc)} | " + " | ".join(gc.facts.get(n, "—") for n in names) + " |"
            for gc in ran_how
        ]
        out.append("")

    disagreements = rep.disagreements()
    if disagreements:
        out += ["## Suites disagree", ""]
        out += [
            f"- {ours.row} ({ours.torch_label}): ours says **{ours.outcome.label}**, upstream says "
            f"**{up.outcome.label}** (ours {suite_tally(ours.tests)} · upstream {suite_tally(up.tests)})"
            for ours, up in disagreements
        ] + [""]

    e2e = rep.e2e_disagreements()
    if e2e:
        out += [
            "## End to end and the connector suite disagree",
            "",
            "The same release's connector code, run by real engines (e2e) and by our connector suite: where one "
            "is green and the other red, one of the two has a hole.",
            "",
        ]
        out += [
            f"- {ours.row}: the connector suite says **{ours.outcome.label}** ({ours.text()}){_first_bad(ours)}; "
            f"e2e says **{e2e_gc.outcome.label}** ({e2e_gc.text()}){_first_bad(e2e_gc)}"
            for ours, e2e_gc in e2e
        ] + [""]

    pairs = environment_pairs(rep)
    if pairs:
        out += ["## As released and today", "", "vLLM is the same in both cells; the packages around it are not.", ""]
        for d in pairs:
            old, new = d.as_released, d.today
            cutoff = (old.result.environment or {}).get("exclude_newer") or old.result.cell.get("exclude_newer")
            changes = ", ".join(f"{n} {a or '—'} → {b or '—'}" for n, a, b in d.changed[:12])
            more = f" and {len(d.changed) - 12} more" if len(d.changed) > 12 else ""
            verdict = "**ecosystem drift**" if d.drifted else "same verdict"
            out.append(
                f"- **{new.result.cell['vllm']}** ({new.torch_label}): {verdict}: as released (index up to {cutoff}) "
                f"**{old.outcome.label}**, today **{new.outcome.label}**; {len(d.changed)} packages differ: {changes}{more}"
            )
        out.append("")

    episodes = rep.episodes()
    if episodes:
        out += [
            "## Regressions and fixes",
            "",
            "| test | lane | last passed | first failed | last failed | fixed in |",
            "|---|---|---|---|---|---|",
        ]
        for e in episodes:
            out.append(
                f"| `{short_test(e.test)}` | {e.lane} | {e.last_passed or '—'} | {e.first_failed} | {e.last_failed} | {e.fixed_in or 'not yet'} |"
            )
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
    if ran and not rep.is_history:  # a history run's timeline already is the per-test breakdown
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

    notable = [
        gc
        for gc in rep.ordered()
        if not gc.outcome.is_green or any(t.outcome is not TestOutcome.PASSED for t in gc.tests)
    ]
    if notable:
        out += ["## Details", ""]
    for gc in notable:
        out += [f"### {gc.row} / {rep.column(gc)}: {gc.outcome.label}", "", gc.detail or gc.result.detail, ""]
        for t in gc.tests:
            if t.outcome is not TestOutcome.PASSED:
                out.append(f"- `{short_test(t.nodeid)}` {t.outcome.value}: {red_line(gc, t)}"[:600])
        if not gc.tests and gc.result.log_tail:
            out += [
                "",
                "<details><summary>log tail</summary>",
                "",
                "```",
                gc.result.log_tail[-2000:],
                "```",
                "</details>",
            ]
        out.append("")
    return "\n".join(out) + "\n"
