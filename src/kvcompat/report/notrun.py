"""The cells whose result file could not be read, in every format: shown as not run, never dropped, never green.

The other renderers draw the grid from readable results only; :mod:`kvcompat.report.write`
adds these sections beside what they render, so an unreadable file is visible in
every report and in CI (a JUnit error), whatever the grid shows.
"""

from __future__ import annotations

from html import escape as html_escape
from xml.sax.saxutils import quoteattr

from kvcompat.report.model import Report

TITLE = "Not run: unreadable result files"
WHY = (
    "These cells have a result file this kvcompat cannot read, so they count as not run "
    "(neither green nor red) until they are rerun."
)


def markdown(rep: Report) -> str:
    if not rep.not_run:
        return ""
    lines = [f"## {TITLE}", "", WHY, ""]
    lines += [f"- ⛔ **{u.cell_id}**: `{u.path}` {u.reason}" for u in rep.not_run]
    return "\n".join(lines) + "\n\n"


def html(rep: Report) -> str:
    if not rep.not_run:
        return ""
    items = "".join(
        f"<li><b>{html_escape(u.cell_id)}</b>: <code>{html_escape(str(u.path))}</code> {html_escape(u.reason)}</li>"
        for u in rep.not_run
    )
    return (
        f'<section class="not-run" style="border:2px solid #b00;padding:0 1em;margin:1em 0">'
        f"<h2>{html_escape(TITLE)}</h2><p>{html_escape(WHY)}</p><ul>{items}</ul></section>"
    )


def junit(rep: Report) -> str:
    """One testsuite with an error per cell not run: a CI dashboard shows it red, not missing."""
    if not rep.not_run:
        return ""
    cases = "".join(
        f'<testcase classname={quoteattr(u.cell_id)} name="result file">'
        f"<error message={quoteattr('not run: ' + str(u.path) + ' ' + u.reason)}/></testcase>"
        for u in rep.not_run
    )
    n = len(rep.not_run)
    return f'<testsuite name="not run" tests="{n}" failures="0" errors="{n}" skipped="0">{cases}</testsuite>'


def data(rep: Report) -> list[dict]:
    return [{"cell": u.cell_id, "file": str(u.path), "reason": u.reason} for u in rep.not_run]
