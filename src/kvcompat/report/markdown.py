"""reports/compat.md: the grid, regressions and fixes, changes, per-test breakdown, and every red cell's reason."""

from __future__ import annotations

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.drift import environment_pairs
from kvcompat.report.model import Report, short_test
from kvcompat.results import headline

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
}
TEST_MARK = {
    TestOutcome.PASSED: "🟢 pass",
    TestOutcome.FAILED: "🔴 fail",
    TestOutcome.ERROR: "🟠 error",
    TestOutcome.UNSUPPORTED: "🟤 unsupported",
    TestOutcome.NOT_APPLICABLE: "⚪ n/a",
}


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

    disagreements = rep.disagreements()
    if disagreements:
        out += ["## Suites disagree", ""]
        out += [
            f"- {ours.row} ({ours.torch_label}): ours says **{ours.outcome.label}**, upstream says "
            f"**{up.outcome.label}** ({up.text()})"
            for ours, up in disagreements
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
                out.append(f"- `{short_test(t.nodeid)}` {t.outcome.value}: {headline(t.message)}"[:400])
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
