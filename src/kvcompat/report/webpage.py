"""reports/compat.html: one self-contained page (no network, no scripts needed), every section of compat.md.

This module lays out the page and its sections; :mod:`kvcompat.report.htmlstyle` is its look (the CSS,
colours and glyphs) and :mod:`kvcompat.report.drawer` each grid cell's drill-down.  The grid's squares
(and a history run's timeline) link each grid cell to its drawer; CSS ``:target`` shows it, so a click
(or opening ``compat.html#d-<cell>``) opens the drawer over the right half of the page.
"""

from __future__ import annotations

from html import escape

from kvcompat.outcomes import Outcome
from kvcompat.report import facts as cell_facts
from kvcompat.report import why
from kvcompat.report.cells import GridCell, panel_id, short_test
from kvcompat.report.drawer import bisect_html, bug_html, drawer, next_step
from kvcompat.report.drift import environment_pairs
from kvcompat.report.htmlstyle import (
    CSS,
    IMPACT_COLOUR,
    OUTCOME_GLYPH,
    SQUARE,
    impact_badge,
    outcome_style,
    test_style,
    verdict_tag,
)
from kvcompat.report.model import Report
from kvcompat.report.shaped import known_bug, red_line, shape_verdicts, shape_what
from kvcompat.report.timeline import SQUARE_OUTCOME, Timeline, timelines_of
from kvcompat.results import suite_tally

# "Why not green" shows this many red tests of a square (its drawer has them all).
WHY_TESTS = 5
# At most this many rows in the per-test breakdown (the rest counted); compat.json has every test.
BREAKDOWN_ROWS = 300


def _square(rep: Report, cells: list[GridCell]) -> str:
    if not cells:
        return f'<td class="blank">{why.BLANK}</td>'
    lead, rest = cells[0], cells[1:]
    impact = lead.impacts[0] if lead.outcome is Outcome.KNOWN_BUG and lead.impacts else None
    attrs = f' data-impact="{impact}" style="--impact:{IMPACT_COLOUR[impact]}"' if impact else ""
    name = "" if lead.is_plain else f"{escape(why.suite_mark(lead))} "
    notes = f"<sup>{','.join(map(str, rep.notes(lead)))}</sup>" if rep.notes(lead) else ""
    out = [
        f'<td class="cell" data-outcome="{lead.outcome.value}"{attrs}>'
        f'<a class="lead" href="#{panel_id(lead)}" style="{outcome_style(lead.outcome)}">{name}{escape(lead.text())}</a>'
    ]
    marks = []
    for gc in rest:
        tally = f"{gc.counts()['passed']}/{len(gc.tests)}" if gc.outcome is Outcome.PASS else gc.text()
        more = "".join(f"<sup>{n}</sup>" for n in rep.notes(gc) if n not in rep.notes(lead))
        marks.append(
            f'<a href="#{panel_id(gc)}" style="{outcome_style(gc.outcome)}" data-suite="{escape(gc.suite)}">'
            f"{escape(why.suite_mark(gc))} {OUTCOME_GLYPH[gc.outcome]} {escape(tally)}</a>{more}"
        )
    marks += [
        f'<span class="small">{escape(line)}</span>' for gc in cells if (line := why.shapes_line(gc, OUTCOME_GLYPH))
    ]
    if marks or notes:
        out.append(f'<div class="marks">{notes} {" ".join(marks)}</div>')
    return "".join(out) + "</td>"


def _grid(rep: Report) -> str:
    parts = [
        '<h2>Grid</h2><p class="small">Rows: releases; columns: torch. Each square is our connector suite\'s '
        "verdict; below it the same cell's other suites (vLLM's own upstream tests, real NIXL, e2e) and its "
        'deployment shapes. Click a verdict for its drawer.</p><table class="grid"><tr><th>vLLM \\ torch</th>'
        + "".join(f"<th>{escape(c)}</th>" for c in rep.columns)
        + "</tr>"
    ]
    for row in rep.rows:
        parts.append(f"<tr><th>{escape(row)}</th>")
        parts += [_square(rep, rep.square(row, col)) for col in rep.columns]
        parts.append("</tr>")
    parts.append("</table>")
    if rep.footnotes():
        parts.append(
            '<div class="notes">'
            + "".join(f"<p><sup>{n}</sup> {_code(text)}</p>" for n, text in enumerate(rep.footnotes(), 1))
            + "</div>"
        )
    used = {gc.outcome for gc in rep.cells} | {Outcome.PASS}
    parts.append(
        '<div class="legend">'
        + "".join(f'<span style="{outcome_style(o)}">{escape(o.label)}</span>' for o in Outcome if o in used)
        + "".join(
            f"<span>{impact_badge(i)} {escape(why.IMPACT_MEANING[i])}</span>"
            for i in dict.fromkeys(i for gc in rep.cells if gc.outcome is Outcome.KNOWN_BUG for i in gc.impacts)
        )
        + "</div>"
    )
    return "".join(parts)


def _code(text: str) -> str:
    """Markdown's `code` spans of a footnote as <code>."""
    pieces = escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _why(rep: Report, found: list[why.Finding]) -> str:
    if not found:
        return ""
    parts = ["<h2>Why not green</h2>"]
    for f in found:
        runs = "fails the run" if f.fails_run else "does not fail the run"
        items = []
        for r in f.reds[:WHY_TESTS]:
            bug = bug_html(r.bug) if r.bug else ""
            items.append(
                f"<li><code>{escape(r.name)}</code> {escape(r.test.outcome.value)}: {escape(r.message)}{bug}"
                f"{bisect_html(r)}</li>"
            )
        if len(f.reds) > WHY_TESTS:
            items.append(f'<li>and {len(f.reds) - WHY_TESTS} more red tests: <a href="{f.anchor}">the drawer</a></li>')
        items += [f"<li>{escape(why.gone_words(b))}</li>" for b in f.gone]
        if not f.reds and not f.gone:
            items.append(f"<li>{escape(f.reason)}</li>")
        parts.append(
            f'<div class="finding"><b><a href="{f.anchor}">{escape(f.name)}</a></b>: {verdict_tag(f.gc)} '
            f'<span class="small">({runs})</span><ul>{"".join(items)}</ul>{next_step(f)}</div>'
        )
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
        + "".join(f"<th>{escape(c.cell.result.cell.torch)}</th>" for c in cols)
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
                f'<td class="sq" data-status="{escape(status)}"><a href="#{panel_id(sq.cell)}" style="{outcome_style(outcome)}" '
                f'title="{escape(col.release)} · {escape(row.label)}: {escape(status)}{escape(why)}">{glyph}</a></td>'
            )
        first, last, fixed = timeline_summary(row)
        cells.append(f'<td class="when">{escape(first)}</td><td class="when">{escape(last)}</td>')
        cells.append(f'<td class="when{" open" if row.failing_now else ""}">{escape(fixed)}</td></tr>')
        body.append("".join(cells))
    counts = tl.counts()
    legend = '<div class="legend">' + "".join(
        f'<span style="{outcome_style(SQUARE_OUTCOME[s]) if SQUARE_OUTCOME[s] else "border:1px dashed #8c959f"}">'
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
        "<h2>Deployment shapes</h2><p>Contracts about transfer, storage or block accounting run once per "
        "deployment shape; a shape passes in a cell when every contract it ran there passed.</p>"
        '<table class="grid"><tr><th>shape</th>' + "".join(f"<th>{escape(rep.name(gc))}</th>" for gc in cells) + "</tr>"
    ]
    red: list[str] = []
    for shape in rep.shapes():
        what = shape_what(shape)
        parts.append(f'<tr><th title="{escape(what)}"><code>{escape(shape)}</code></th>')
        for gc, by_shape in zip(cells, verdicts, strict=True):
            v = by_shape.get(shape)
            if v is None:
                parts.append("<td></td>")
                continue
            first = v.red[0] if v.red else None
            title = f"{short_test(first.nodeid)}: {red_line(gc, first)}" if first else ""
            if first:
                red.append(f"<li><b>{escape(shape)}</b> in {escape(rep.name(gc))}: {escape(title)}</li>")
            parts.append(
                f'<td class="cell" data-outcome="{v.outcome.value}" title="{escape(title)}">'
                f'<a class="lead" href="#{panel_id(gc)}" style="{outcome_style(v.outcome)}">{escape(v.text())}</a></td>'
            )
        parts.append("</tr>")
    parts.append("</table>")
    if red:
        parts.append("<ul>" + "".join(red) + "</ul>")
    known = [(s, shape_what(s)) for s in rep.shapes() if shape_what(s)]
    if known:
        parts.append(
            "<details><summary class='small'>What each shape deploys</summary><ul>"
            + "".join(f"<li><code>{escape(s)}</code>: {escape(w)}</li>" for s, w in known)
            + "</ul></details>"
        )
    return "".join(parts)


def _disagreements(rep: Report) -> str:
    parts = []
    suites = rep.disagreements()
    if suites:
        parts.append("<h2>Suites disagree</h2><ul>")
        parts += [
            f'<li>{escape(ours.row)} ({escape(ours.torch_label)}): ours says <a href="#{panel_id(ours)}">'
            f'{escape(ours.outcome.label)}</a>, upstream says <a href="#{panel_id(up)}">{escape(up.outcome.label)}</a> '
            f"(ours {escape(suite_tally(ours.tests))} · upstream {escape(suite_tally(up.tests))})</li>"
            for ours, up in suites
        ]
        parts.append("</ul>")
    e2e = rep.e2e_disagreements()
    if e2e:
        parts.append(
            "<h2>End to end and the connector suite disagree</h2><p>The same release's connector code, run by "
            "real engines (e2e) and by our connector suite: where one is green and the other red, one of the two "
            "has a hole.</p><ul>"
        )
        parts += [
            f'<li>{escape(ours.row)}: the connector suite says <a href="#{panel_id(ours)}">{escape(ours.text())}</a>, '
            f'{escape(gc.row)} e2e says <a href="#{panel_id(gc)}">{escape(gc.text())}</a></li>'
            for ours, gc in e2e
        ]
        parts.append("</ul>")
    return "".join(parts)


def _drift(rep: Report) -> str:
    pairs = environment_pairs(rep)
    if not pairs:
        return ""
    parts = ["<h2>As released and today</h2><p>vLLM is the same in both cells; the packages around it are not.</p><ul>"]
    for d in pairs:
        old, new = d.as_released, d.today
        verdict = "<b>ecosystem drift</b>" if d.drifted else "same verdict"
        parts.append(
            f"<li><b>{escape(new.result.cell.vllm)}</b> ({escape(new.torch_label)}): {verdict}: as released "
            f'(index up to {escape(str(d.cutoff))}) <a href="#{panel_id(old)}">{escape(old.outcome.label)}</a>, today '
            f'<a href="#{panel_id(new)}">{escape(new.outcome.label)}</a>; {len(d.changed)} packages differ: '
            f"{escape(d.changes())}</li>"
        )
    return "".join(parts) + "</ul>"


def _episodes(rep: Report) -> str:
    episodes = rep.episodes()
    if not episodes:
        return ""
    parts = [
        "<h2>Regressions and fixes</h2><table><tr><th>test</th><th>lane</th><th>last passed</th>"
        "<th>first failed</th><th>last failed</th><th>fixed in</th></tr>"
    ]
    for e in episodes:
        cells = [e.last_passed or "—", e.first_failed, e.last_failed, e.fixed_in or "not yet"]
        parts.append(
            f"<tr><td><code>{escape(short_test(e.test))}</code></td><td>{escape(e.lane)}</td>"
            + "".join(f"<td>{escape(c)}</td>" for c in cells)
            + "</tr>"
        )
    return "".join(parts) + "</table>"


def _changes(rep: Report) -> str:
    if not rep.previous:
        return ""
    changes = rep.changes()
    parts = ["<h2>Changes since the previous report</h2><ul>"]
    parts += [f"<li>newly failing: <code>{escape(k)}</code></li>" for k in changes["new_failures"]]
    parts += [f"<li>newly passing: <code>{escape(k)}</code></li>" for k in changes["new_passes"]]
    if not changes["new_failures"] and not changes["new_passes"]:
        parts.append("<li>no test changed outcome</li>")
    return "".join(parts) + "</ul>"


def _how_ran(rep: Report) -> str:
    suites = cell_facts.by_suite(rep)
    if not suites:
        return ""
    parts = [
        "<h2>How each cell ran</h2><p class='small'>What each suite used to run the releases on this CPU (which "
        "CPU-offload worker: the release's own, with only its CUDA transport replaced, or scripted transfers where "
        "it cannot run so; what the engines did end to end).</p>"
    ]
    for sf in suites:
        rows = []
        for name, values in sf.facts:
            if len(values) == 1 and len(values[0][1]) == len(sf.cells):
                rows.append(f"<tr><th>{escape(name)}</th><td>{escape(values[0][0])}</td></tr>")
            else:
                said = "<br>".join(
                    f"{escape(v)} <span class='small'>({', '.join(escape(rep.name(gc)) for gc in cells)})</span>"
                    for v, cells in values
                )
                rows.append(f"<tr><th>{escape(name)}</th><td>{said}</td></tr>")
        where = rep.name(sf.cells[0]) if len(sf.cells) == 1 else f"{len(sf.cells)} cells"
        parts.append(
            f"<details><summary><b>{escape(sf.suite)}</b> ({escape(where)}): {escape(sf.summary())}</summary>"
            f"<table>{''.join(rows)}</table></details>"
        )
    return "".join(parts)


def _breakdown(rep: Report) -> str:
    if not rep.test_ids:
        return ""
    red = rep.red_test_ids
    green = len(rep.test_ids) - len(red)
    if not red:
        return (
            f"<h2>Per-test breakdown</h2><p>All {green} tests were green (pass or n/a) in every cell that ran them.</p>"
        )
    ran = [gc for gc in rep.ordered() if any(rep.test(gc, tid) for tid in red)]
    parts = [
        f"<h2>Per-test breakdown</h2><p>The {len(red)} tests that are not green everywhere; the other {green} were "
        "green (pass or n/a) in every cell that ran them (each cell's drawer lists its own).</p>"
        '<div class="scroll"><table><tr><th>test</th>'
        + "".join(f'<th><a href="#{panel_id(gc)}">{escape(rep.name(gc))}</a></th>' for gc in ran)
        + "</tr>"
    ]
    for tid in red[:BREAKDOWN_ROWS]:
        parts.append(f"<tr><td><code>{escape(short_test(tid))}</code></td>")
        for gc in ran:
            t = rep.test(gc, tid)
            if t is None:
                parts.append('<td class="small">·</td>')
                continue
            bug = known_bug(gc, t)
            style = outcome_style(Outcome.KNOWN_BUG) if bug else test_style(t.outcome)
            word = f"known bug ({bug.impact})" if bug else t.outcome.value.replace("_", " ")
            parts.append(f'<td><span class="tag" style="{style}">{escape(word)}</span></td>')
        parts.append("</tr>")
    parts.append("</table></div>")
    if len(red) > BREAKDOWN_ROWS:
        parts.append(f"<p>and {len(red) - BREAKDOWN_ROWS} more: compat.json has every test.</p>")
    return "".join(parts)


def _not_applicable(rep: Report) -> str:
    groups = rep.not_applicable()
    if not groups:
        return ""
    n = sum(len(v) for v in groups.values())
    cells = len({gc.key for v in groups.values() for gc, _ in v})
    items = []
    for (reason, contract), where in groups.items():
        names = ", ".join(escape(x) for x in dict.fromkeys(rep.name(gc) for gc, _ in where))
        runs = len({nodeid for _, nodeid in where})
        times = f" ({runs} parameters)" if runs > 1 else ""
        items.append(f"<li><code>{escape(contract)}</code>{times}: {escape(reason)} — in {names}</li>")
    return (
        f"<h2>Not applicable</h2><details><summary>{n} tests in {cells} cells found their capability absent from the "
        f"release (green: n/a)</summary><ul>{''.join(items)}</ul></details>"
    )


def _details(rep: Report) -> str:
    notable = [gc for gc in rep.ordered() if not gc.outcome.is_green]
    if not notable:
        return ""
    parts = ["<h2>Details</h2><p class='small'>Every square that is not green; each opens its drawer.</p><ul>"]
    for gc in notable:
        reds = "".join(
            f"<li><code>{escape(r.name)}</code> {escape(r.test.outcome.value)}: {escape(red_line(gc, r.test))}</li>"
            for r in why.reds(gc)
        )
        parts.append(
            f'<li><a href="#{panel_id(gc)}">{escape(rep.name(gc))}</a>: {verdict_tag(gc)} {escape(gc.detail or gc.result.detail)}'
            + (f"<ul>{reds}</ul>" if reds else "")
            + "</li>"
        )
    return "".join(parts) + "</ul>"


def render_html(rep: Report) -> str:
    head = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>kvcompat report</title>'
        f"<style>{CSS}</style></head><body>"
    )
    body = ["<h1>vLLM KV-connector compatibility: MultiConnector(NixlConnector + CPU offload)</h1>"]
    if not rep.results:
        return head + "".join(body) + "<p>No results yet: run <code>nox -s matrix</code>.</p></body></html>\n"
    found = why.findings(rep)
    summary = escape(why.summary_line(rep))
    body.append(f'<div class="meta">{summary} Click a square for its drawer.</div>')
    if rep.is_history:
        body.append(_timelines(timelines_of(rep)))
    body.append(_grid(rep))
    body.append(_why(rep, found))
    body.append(_shapes(rep))
    body.append(_disagreements(rep))
    body.append(_drift(rep))
    body.append(_episodes(rep))
    body.append(_changes(rep))
    body.append(_how_ran(rep))
    if not rep.is_history:
        body.append(_breakdown(rep))
    body.append(_not_applicable(rep))
    body.append(_details(rep))
    by_cell = {f.gc.key: f for f in found}
    body.extend(drawer(rep, gc, by_cell.get(gc.key)) for gc in rep.ordered())
    return head + "".join(body) + "</body></html>\n"
