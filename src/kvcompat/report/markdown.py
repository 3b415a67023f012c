"""reports/compat.md: what a PR comment or a job summary shows, the why first.

The grid (rows: releases, columns: torch; each square our suite's verdict with the other suites as small
marks), then right under it why each square that is not green is not (its red contracts with their
messages, the known bug's impact and link, and the next step), then the rest: deployment shapes, where
the suites disagree, regressions, how each cell ran, the tests that are not green everywhere, the
details.  A history run leads with the timeline.  The whole page stays under GitHub's comment limit:
:func:`render_markdown` cuts the longest sections last in the page first, each with a line saying where
the rest is (compat.html, compat.json).
"""

from __future__ import annotations

import dataclasses

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report import facts as cell_facts
from kvcompat.report import why
from kvcompat.report.cells import BAD_TESTS, GridCell, short_test
from kvcompat.report.drift import environment_pairs
from kvcompat.report.model import Report
from kvcompat.report.shaped import known_bug, red_line, shape_verdicts, shape_what
from kvcompat.report.timeline import Timeline, TimelineRow, timelines_of
from kvcompat.results import suite_tally

# GitHub refuses a comment over 65,536 characters; the page keeps under this, with room for a wrapper.
LIMIT = 60_000
# The "Why not green" section names at most this many squares, and this many red tests of each.
WHY_SQUARES = 12
# A section cut to fit the page keeps at least this many characters while cutting others can make room.
CUT_FLOOR = 1500
WHY_TESTS = 3

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
# A known bug's square carries its impact's mark beside 🔵: an efficiency bug never reads like wrong output.
IMPACT_MARK = {
    "wrong-output": "❌",
    "hang": "⏳",
    "crash": "💥",
    "fails-requests": "🚫",
    "refused": "⛔",
    "leak": "💧",
    "efficiency": "🐢",
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
SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def _md(text: str) -> str:
    """Text from a result, safe in a Markdown line or table cell (no HTML, no column breaks)."""
    return text.replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


def mark(gc: GridCell) -> str:
    """A square's mark: its outcome's, and for a known bug its impacts' too."""
    return MARK[gc.outcome] + ("".join(IMPACT_MARK[i] for i in gc.impacts) if gc.outcome is Outcome.KNOWN_BUG else "")


def _notes(rep: Report, gc: GridCell) -> str:
    return "".join(f" {str(n).translate(SUPERSCRIPT)}" for n in rep.notes(gc))


def square_text(rep: Report, cells: list[GridCell]) -> str:
    """One square of the grid: the lead verdict, then in small type the other suites and the shapes."""
    if not cells:
        return f"<sub>{why.BLANK}</sub>"
    lead, rest = cells[0], cells[1:]
    name = "" if lead.is_plain else f"{why.suite_mark(lead)} "
    text = f"{mark(lead)} {name}{lead.text()}{_notes(rep, lead)}"
    small = []
    for gc in rest:
        tally = f"{gc.counts()['passed']}/{len(gc.tests)}" if gc.outcome is Outcome.PASS else gc.text()
        small.append(
            f"{why.suite_mark(gc)} {mark(gc)} {tally}{_notes(rep, gc) if rep.notes(gc) != rep.notes(lead) else ''}"
        )
    small += [line for gc in cells if (line := why.shapes_line(gc, MARK))]
    return text + (f"<br><sub>{' · '.join(small)}</sub>" if small else "")


@dataclasses.dataclass
class Section:
    """Lines of the page; ``cut`` orders what is shortened when the page is too long (0: never, higher first)."""

    lines: list[str]
    cut: int = 0

    def size(self) -> int:
        return sum(len(line) + 1 for line in self.lines)


def fit(lines: list[str], limit: int, where: str = "compat.html and compat.json beside this file") -> list[str]:
    """``lines`` cut to about ``limit`` characters at a line, open ``<details>`` and code fences closed, and a
    last line saying how much was left out and where it is."""
    if sum(len(line) + 1 for line in lines) <= limit:
        return lines
    kept, size = [], 0
    for line in lines:
        if size + len(line) + 1 > max(limit - 200, 0):
            break
        kept.append(line)
        size += len(line) + 1
    if sum(line.startswith("```") for line in kept) % 2:
        kept.append("```")
    opened = sum(line.count("<details") for line in kept) - sum(line.count("</details>") for line in kept)
    kept += ["</details>"] * max(opened, 0)
    return kept + [
        "",
        f"… {len(lines) - len(kept)} more lines left out to keep this page short: see {where}.",
        "",
    ]


def render_markdown(rep: Report, limit: int = LIMIT) -> str:
    """The page, at most about ``limit`` characters (sections cut, latest and longest first, when it is more)."""
    out = ["# vLLM KV-connector compatibility: MultiConnector(NixlConnector + CPU offload)", ""]
    if not rep.results:
        return "\n".join(out + ["No results yet: run `nox -s matrix`.", ""])
    sections = [Section(out + [why.summary_line(rep, bold="**"), ""])]
    if rep.is_history:  # many releases: the timeline leads, the grid (every cell, overrides too) follows
        sections.append(Section(render_timelines(timelines_of(rep)), cut=3))
    sections.append(Section(render_grid(rep)))
    sections.append(Section(render_why(rep)))
    sections.append(Section(render_shapes(rep), cut=4))
    sections.append(Section(render_disagreements(rep), cut=5))
    sections.append(Section(render_drift(rep), cut=5))
    sections.append(Section(render_episodes(rep), cut=6))
    sections.append(Section(render_changes(rep), cut=6))
    sections.append(Section(render_how_ran(rep), cut=7))
    if not rep.is_history:  # a history run's timeline already is the per-test breakdown
        sections.append(Section(render_breakdown(rep), cut=8))
    sections.append(Section(render_not_applicable(rep), cut=9))
    sections.append(Section(render_details(rep), cut=10))
    for floor in (CUT_FLOOR, 0):  # first keep the start of every section, then only what must stay
        for level in sorted({s.cut for s in sections if s.cut}, reverse=True):
            for s in (s for s in sections if s.cut == level):
                over = sum(s.size() for s in sections) - limit
                if over > 0:
                    s.lines = fit(s.lines, max(s.size() - over, floor))
    return "\n".join(fit([line for s in sections for line in s.lines], limit)) + "\n"


def render_grid(rep: Report) -> list[str]:
    out = [
        "## Grid",
        "",
        "Rows: releases; columns: torch. Each square is our connector suite's verdict; in small type the "
        "same cell's other suites (vLLM's own upstream tests, real NIXL, e2e) and its deployment shapes.",
        "",
        "| vLLM \\ torch | " + " | ".join(rep.columns) + " |",
        "|---|" + "---|" * len(rep.columns),
    ]
    for row in rep.rows:
        out.append(f"| **{row}** | " + " | ".join(square_text(rep, rep.square(row, col)) for col in rep.columns) + " |")
    out.append("")
    out += [f"{str(n).translate(SUPERSCRIPT)} {text}" + "  " for n, text in enumerate(rep.footnotes(), 1)]
    out[-1:] = [out[-1].rstrip()] if rep.footnotes() else out[-1:]
    if rep.footnotes():
        out.append("")
    return out + [legend(rep), ""]


def legend(rep: Report) -> str:
    """The marks this grid uses, and what each known-bug impact means."""
    used = {gc.outcome for gc in rep.cells} | {Outcome.PASS}
    parts = [f"{m} {o.label}" for o, m in MARK.items() if o in used]
    impacts = list(dict.fromkeys(i for gc in rep.cells if gc.outcome is Outcome.KNOWN_BUG for i in gc.impacts))
    text = "Legend: " + ", ".join(parts)
    if impacts:
        text += "; known-bug impact: " + ", ".join(f"{IMPACT_MARK[i]} {why.impact_words(i)}" for i in impacts)
    return text + "."


def render_why(rep: Report) -> list[str]:
    """Each square that is not green: its red contracts with their messages (new first), the known bug's
    impact and link, and the next step (kvcompat show, the drawer, a ready bisect)."""
    found = why.findings(rep)
    if not found:
        return []
    out = ["## Why not green", ""]
    said: dict[tuple[str, str], str] = {}  # a red told once: (test, its bug or message) -> the square that told it
    for f in found[:WHY_SQUARES]:
        gc = f.gc
        runs = "fails the run" if f.fails_run else "does not fail the run"
        out += [f"**{f.name}**: {mark(gc)} {gc.outcome.label} ({runs})", ""]
        for r in f.reds[:WHY_TESTS]:
            key = (r.test.nodeid, r.bug.id if r.bug else r.message)
            if key in said and not r.bisect:
                out.append(f"- `{r.name}` {r.test.outcome.value}: as in {said[key]}")
                continue
            said.setdefault(key, f.name)
            out.append(f"- `{r.name}` {r.test.outcome.value}: {_md(r.message)}")
            if r.bug:
                out.append(f"  - {IMPACT_MARK[r.bug.impact]} {_md(why.bug_words(r.bug))}")
                out.append(f"    <sub>{_md(r.bug.title)}</sub>")
            out += [f"  - {why.bisect_words(c)}: `{c}`" for c in r.bisect]
            if any(why.OLDER in c for c in r.bisect):
                out.append(
                    f"    <sub>{why.OLDER}: a release where the test passes (no release of this report did)</sub>"
                )
        if len(f.reds) > WHY_TESTS:
            out.append(f"- and {len(f.reds) - WHY_TESTS} more red tests (under Details)")
        out += [f"- ❗ {_md(why.gone_words(bug))}" for bug in f.gone]
        if not f.reds and not f.gone:
            out.append(f"- {_md(f.reason)}")
        out.append(f"- more: `{f.show}` · compat.html{f.anchor}")
        out.append("")
    if len(found) > WHY_SQUARES:
        out += [f"And {len(found) - WHY_SQUARES} more squares that are not green: Details below, or compat.html.", ""]
    return out


def _untested(first: str, between: list[str]) -> str:
    return f"{first} (untested before it: {', '.join(between)})" if between else first


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
    """Contracts down, releases across (oldest first); each column header says its torch and suites.

    Only the contracts with a red square somewhere; the others are counted in one line (compat.html has them).
    """
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
        if not row.ever_red:
            continue
        marks = [TIMELINE_MARK[sq.status] if sq else TIMELINE_MARK["not run"] for sq in row.squares]
        out.append(f"| `{row.label}` | " + " | ".join(marks) + " | " + " | ".join(timeline_summary(row)) + " |")
    counts = tl.counts()
    quiet = sum(not row.ever_red for row in tl.rows)
    if quiet:
        out += [
            "",
            f"{quiet} more contracts were never red in these releases (pass, n/a or no verdict): compat.html has them.",
        ]
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
    out = [
        "## Deployment shapes",
        "",
        "Contracts about transfer, storage or block accounting run once per deployment shape (`--shapes`); "
        "a shape passes in a cell when every contract it ran there passed.",
        "",
        "| shape | " + " | ".join(rep.name(gc) for gc in cells) + " |",
        "|---|" + ":-:|" * len(cells),
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
                    f"- **{shape}** in {rep.name(gc)}: `{short_test(t.nodeid)}` {t.outcome.value}: "
                    f"{_md(red_line(gc, t))}"[:600]
                )
        out.append(f"| `{shape}` | " + " | ".join(marks) + " |")
    known = [(s, shape_what(s)) for s in rep.shapes() if shape_what(s)]
    out += [""] + red + ([""] if red else [])
    if known:
        out += ["<details><summary>What each shape deploys</summary>", ""]
        out += [f"- `{s}`: {what}" for s, what in known] + ["", "</details>", ""]
    return out


def render_disagreements(rep: Report) -> list[str]:
    out = []
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
            f"{e2e_gc.row} e2e says **{e2e_gc.outcome.label}** ({e2e_gc.text()}){_first_bad(e2e_gc)}"
            for ours, e2e_gc in e2e
        ] + [""]
    return out


def _first_bad(gc: GridCell) -> str:
    """The first red test of a square, with its message's first line."""
    bad = next((t for t in gc.tests if t.outcome in BAD_TESTS), None)
    first = (bad.message or "").strip().splitlines()[0][:200] if bad and (bad.message or "").strip() else ""
    return f": `{short_test(bad.nodeid)}`: {_md(first)}" if bad else ""


def render_drift(rep: Report) -> list[str]:
    pairs = environment_pairs(rep)
    if not pairs:
        return []
    out = ["## As released and today", "", "vLLM is the same in both cells; the packages around it are not.", ""]
    for d in pairs:
        old, new = d.as_released, d.today
        verdict = "**ecosystem drift**" if d.drifted else "same verdict"
        out.append(
            f"- **{new.result.cell.vllm}** ({new.torch_label}): {verdict}: as released (index up to {d.cutoff}) "
            f"**{old.outcome.label}**, today **{new.outcome.label}**; {len(d.changed)} packages differ: {d.changes()}"
        )
    return out + [""]


def render_episodes(rep: Report) -> list[str]:
    episodes = rep.episodes()
    if not episodes:
        return []
    out = [
        "## Regressions and fixes",
        "",
        "| test | lane | last passed | first failed | last failed | fixed in |",
        "|---|---|---|---|---|---|",
    ]
    for e in episodes:
        out.append(
            f"| `{short_test(e.test)}` | {e.lane} | {e.last_passed or '—'} | {e.first_failed} | {e.last_failed} "
            f"| {e.fixed_in or 'not yet'} |"
        )
    return out + [""]


def render_changes(rep: Report) -> list[str]:
    if not rep.previous:
        return []
    changes = rep.changes()
    out = ["## Changes since the previous report", ""]
    if not changes["new_failures"] and not changes["new_passes"]:
        out.append("No test changed outcome.")
    out += [f"- 🔴 newly failing: `{k}`" for k in changes["new_failures"]]
    out += [f"- 🟢 newly passing: `{k}`" for k in changes["new_passes"]]
    return out + [""]


def render_how_ran(rep: Report) -> list[str]:
    """Per suite, what it used to run each release (kvcompat.testkit.record_fact), in words, folded."""
    suites = cell_facts.by_suite(rep)
    if not suites:
        return []
    out = [
        "## How each cell ran",
        "",
        "What each suite used to run the releases on this CPU (which CPU-offload worker: the release's own, with "
        "only its CUDA transport replaced, or scripted transfers where it cannot run so; what the engines did end to end).",
        "",
    ]
    for sf in suites:
        where = _where(rep, sf.cells) if len(sf.cells) == 1 else f"{len(sf.cells)} cells"
        out += [f"<details><summary><b>{sf.suite}</b> ({_md(where)}): {_md(sf.summary())}</summary>", ""]
        for name, values in sf.facts:
            if len(values) == 1 and len(values[0][1]) == len(sf.cells):
                out.append(f"- {_md(name)}: {_md(values[0][0])}")
            else:
                out.append(
                    f"- {_md(name)}: " + "; ".join(f"{_md(v)} ({_md(_where(rep, cells))})" for v, cells in values)
                )
        out += ["", "</details>", ""]
    return out


def _where(rep: Report, cells: list[GridCell]) -> str:
    """The releases of ``cells`` (``0.34.0, 0.33.0``), each with its torch where a release has several."""
    rows = [gc.row for gc in cells]
    return ", ".join(
        dict.fromkeys(gc.row if rows.count(gc.row) == 1 else f"{gc.row} / {gc.torch_label}" for gc in cells)
    )


def render_breakdown(rep: Report) -> list[str]:
    """The tests that are not green in every cell that ran them, one column per cell that ran one; the
    others counted in one line."""
    red = rep.red_test_ids
    if not rep.test_ids:
        return []
    out = ["## Per-test breakdown", ""]
    green = len(rep.test_ids) - len(red)
    if not red:
        return out + [f"All {green} tests were green (pass or n/a) in every cell that ran them.", ""]
    ran = [gc for gc in rep.ordered() if any(rep.test(gc, tid) for tid in red)]
    out += [
        f"The {len(red)} tests that are not green everywhere; the other {green} were green (pass or n/a) in every "
        "cell that ran them.",
        "",
        "| test | " + " | ".join(rep.name(gc) for gc in ran) + " |",
        "|---|" + "---|" * len(ran),
    ]
    for tid in red:
        marks = []
        for gc in ran:
            t = rep.test(gc, tid)
            bug = known_bug(gc, t) if t else None
            marks.append(f"🔵 known bug ({bug.impact})" if bug else TEST_MARK[t.outcome] if t else "·")
        out.append(f"| `{short_test(tid)}` | " + " | ".join(marks) + " |")
    return out + ["", "· the cell did not run the test.", ""]


def render_not_applicable(rep: Report) -> list[str]:
    """The tests that found their capability absent, grouped by reason and contract, folded."""
    groups = rep.not_applicable()
    if not groups:
        return []
    n = sum(len(v) for v in groups.values())
    cells = len({gc.key for v in groups.values() for gc, _ in v})
    out = [
        "## Not applicable",
        "",
        f"<details><summary>{n} tests in {cells} cells found their capability absent from the release "
        "(green: n/a)</summary>",
        "",
    ]
    for (reason, contract), where in groups.items():
        names = list(dict.fromkeys(rep.name(gc) for gc, _ in where))
        runs = len({nodeid for _, nodeid in where})
        times = f" ({runs} parameters)" if runs > 1 else ""
        out.append(f"- `{contract}`{times}: {_md(reason)} — in {', '.join(_md(x) for x in names)}")
    return out + ["", "</details>", ""]


def render_details(rep: Report) -> list[str]:
    """Every square that is not green: its reason, and each red test "Why not green" did not name with its
    message's telling line and the known bug's source line."""
    notable = [gc for gc in rep.ordered() if not gc.outcome.is_green]
    if not notable:
        return []
    told = {(f.gc.key, r.test.nodeid) for f in why.findings(rep)[:WHY_SQUARES] for r in f.reds[:WHY_TESTS]}
    out = ["## Details", ""]
    for gc in notable:
        out += [f"### {rep.name(gc)}: {gc.outcome.label}", "", _md(gc.detail or gc.result.detail), ""]
        for r in why.reds(gc):
            if (gc.key, r.test.nodeid) not in told:
                out.append(f"- `{r.name}` {r.test.outcome.value}: {_md(red_line(gc, r.test))}"[:600])
        if gc.judgement:
            out += [f"- ❗ {_md(why.gone_words(bug))}" for bug in gc.judgement.gone]
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
    return out
