"""What a run prints last, coloured when stdout is a terminal: the grid (a history run's timeline above it),
then why each square that is not green is not, with the next step, and a line of counts."""

from __future__ import annotations

import sys

from kvcompat.outcomes import Outcome
from kvcompat.report import why
from kvcompat.report.cells import GridCell
from kvcompat.report.model import Report
from kvcompat.report.shaped import shape_verdicts
from kvcompat.report.timeline import SQUARE_OUTCOME, Timeline, timelines_of

ANSI = {
    Outcome.PASS: "32",
    Outcome.NOT_APPLICABLE: "37",
    Outcome.TEST_FAIL: "31",
    Outcome.UNSUPPORTED: "91",
    Outcome.TEST_ERROR: "33",
    Outcome.TIMEOUT: "33",
    Outcome.IMPORT_ERROR: "35",
    Outcome.INSTALL_ERROR: "35",
    Outcome.UNRESOLVABLE: "90",
    Outcome.KNOWN_BUG: "34",
    Outcome.KNOWN_BUG_GONE: "95",
}


# One character per timeline status, all distinct (coloured as timeline.SQUARE_OUTCOME says).
GLYPH = {
    "pass": "✓",
    "known bug": "K",
    "test fail": "F",
    "unsupported": "U",
    "test error": "E",
    "timeout": "T",
    "not applicable": "-",
    "import error": "I",
    "install error": "X",
    "unresolvable": "0",
    "not run": " ",
}


# One character per cell outcome, for the small marks of a square (the other suites of the cell).
OUTCOME_GLYPH = {
    Outcome.PASS: "✓",
    Outcome.NOT_APPLICABLE: "-",
    Outcome.TEST_FAIL: "F",
    Outcome.UNSUPPORTED: "U",
    Outcome.TEST_ERROR: "E",
    Outcome.TIMEOUT: "T",
    Outcome.IMPORT_ERROR: "I",
    Outcome.INSTALL_ERROR: "X",
    Outcome.UNRESOLVABLE: "0",
    Outcome.KNOWN_BUG: "K",
    Outcome.KNOWN_BUG_GONE: "!",
}


def render_timeline(tl: Timeline, color: bool = False) -> str:
    """Contracts down, releases across; the release versions are written top to bottom over their column."""
    from kvcompat.report.markdown import timeline_summary

    w0 = max(len("contract"), *(len(r.label) for r in tl.rows)) if tl.rows else len("contract")
    tall = max(len(c.release) for c in tl.columns)
    lines = []
    for i in range(tall):
        chars = [c.release.rjust(tall)[i] for c in tl.columns]
        tail = "  first fail / last pass / fixed in" if i == tall - 1 else ""
        lines.append((("contract" if i == tall - 1 else "").ljust(w0)) + "  " + " ".join(chars) + tail)
    for row in tl.rows:
        marks = []
        for sq in row.squares:
            status = sq.status if sq else "not run"
            glyph, outcome = GLYPH[status], SQUARE_OUTCOME[status]
            marks.append(f"\033[{ANSI[outcome]}m{glyph}\033[0m" if color and outcome else glyph)
        first, last, fixed = timeline_summary(row)
        lines.append(row.label.ljust(w0) + "  " + " ".join(marks) + f"  {first} / {last} / {fixed}")
    lines.append("  ".join(f"{g if g != ' ' else '(blank)'} {s}" for s, g in GLYPH.items()))
    return "\n".join(lines)


def render_terminal(rep: Report, color: bool = False, html: str = why.HTML) -> str:
    """The grid (a history run: the timeline above it), its footnotes and shapes, then pytest-like lines for
    every square that is not green (the failing contract and its message, a known bug's impact and link)
    with the next step (``kvcompat show``, the drawer in ``html``, a ready bisect), and a last line of counts."""
    if not rep.results:
        return "no results yet: run `nox -s matrix`"
    parts = []
    if rep.is_history:
        timelines = timelines_of(rep)
        parts += [(f"{tl.title}:\n" if len(timelines) > 1 else "") + render_timeline(tl, color) for tl in timelines]
    notes = "".join(f"\n{_sup(n)} {text.replace('`', '')}" for n, text in enumerate(rep.footnotes(), 1))
    parts.append(_grid(rep, color) + notes + _shape_lines(rep))
    found = why.findings(rep)
    if found:
        parts.append(_why(found, html, color))
    parts.append(_last_line(rep, found, html))
    return "\n\n".join(parts)


# The terminal says at most this many squares, and this many red tests of each (compat.md has them all).
WHY_SQUARES = 10
WHY_TESTS = 3


def _sup(n: int) -> str:
    return str(n).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))


def _why(found: list[why.Finding], html: str, color: bool) -> str:
    lines = []
    for f in found[:WHY_SQUARES]:
        word = f"\033[{ANSI[f.gc.outcome]}m{f.word}\033[0m" if color else f.word
        for r in f.reds[:WHY_TESTS]:
            lines.append(f"{word} {f.name}: {r.name} - {r.message}")
            if r.bug:
                lines.append(f"    {why.bug_words(r.bug)}")
            lines += [f"    {why.bisect_words(c)}: {c}" for c in r.bisect]
        if len(f.reds) > WHY_TESTS:
            lines.append(f"    and {len(f.reds) - WHY_TESTS} more red tests")
        lines += [f"{word} {f.name}: {why.gone_words(bug)}" for bug in f.gone]
        if not f.reds and not f.gone:
            lines.append(f"{word} {f.name}: {f.reason}")
        lines.append(f"    more: {f.show} · {html}{f.anchor}")
    if len(found) > WHY_SQUARES:
        lines.append(f"and {len(found) - WHY_SQUARES} more squares that are not green: see compat.md or {html}")
    return "\n".join(lines)


def _last_line(rep: Report, found: list[why.Finding], html: str) -> str:
    totals = ", ".join(f"{n} {Outcome(k).label}" for k, n in rep.totals().items() if n)
    failing = sum(f.fails_run for f in found)
    verdict = (
        f"{failing} square{'s fail' if failing != 1 else ' fails'} the run" if failing else "no new red: the run passes"
    )
    return f"== {totals}: {verdict} ({html}) =="


def _shape_lines(rep: Report) -> str:
    """Under the grid, per cell that ran deployment shapes: the shapes that are not green, or that all passed."""
    lines = []
    for gc in rep.shaped_cells():
        by_shape = shape_verdicts(gc)
        bad = [f"{s} {v.outcome.label} ({v.text()})" for s, v in by_shape.items() if not v.outcome.is_green]
        ok = sum(v.outcome is Outcome.PASS for v in by_shape.values())
        say = "; ".join(bad) if bad else f"all {ok} pass"
        lines.append(f"shapes {rep.name(gc)}: {say}")
    return ("\n" + "\n".join(lines)) if lines else ""


BLANK = "(not in this matrix)"
# A grid wider than this says a blank square with one character, explained under the grid.
WIDE = 160
BLANK_MARK = "·"


def _square(rep: Report, cells: list[GridCell], blank: str = BLANK) -> tuple[str, str]:
    """A square's two lines: the lead verdict with its footnote marks, and the other suites in short."""
    if not cells:
        return blank, ""
    lead, rest = cells[0], cells[1:]
    name = "" if lead.is_plain else f"{why.suite_mark(lead)} "
    first = f"{name}{lead.text()}" + "".join(_sup(n) for n in rep.notes(lead))
    marks = []
    for gc in rest:
        tally = f"{gc.counts()['passed']}/{len(gc.tests)}" if gc.outcome is Outcome.PASS else gc.text()
        marks.append(f"{why.suite_mark(gc)} {OUTCOME_GLYPH[gc.outcome]} {tally}")
    return first, " · ".join(marks)


def _grid(rep: Report, color: bool, blank: str = BLANK) -> str:
    """Releases down, torch across, each square in two lines; a blank square says it is not in this matrix
    (in a grid too wide for that, with one character explained under it)."""
    squares = {(row, col): _square(rep, rep.square(row, col), blank) for row in rep.rows for col in rep.columns}
    leads = {(row, col): rep.at(row, col) for row in rep.rows for col in rep.columns}
    w0 = max(len("vLLM"), *(len(r) for r in rep.rows))
    widths = [max(len(col), *(len(x) for row in rep.rows for x in squares[(row, col)])) for col in rep.columns]
    lines = ["vLLM".ljust(w0) + "  " + "  ".join(c.ljust(w) for c, w in zip(rep.columns, widths, strict=True))]
    for row in rep.rows:
        first, second = [], []
        for col, w in zip(rep.columns, widths, strict=True):
            text, small = squares[(row, col)]
            gc = leads[(row, col)]
            padded = text.ljust(w)
            first.append(f"\033[{ANSI[gc.outcome]}m{padded}\033[0m" if color and gc else padded)
            second.append(small.ljust(w))
        lines.append(row.ljust(w0) + "  " + "  ".join(first).rstrip())
        if any(x.strip() for x in second):
            lines.append(" " * w0 + "  " + "  ".join(second).rstrip())
    if blank == BLANK and w0 + sum(w + 2 for w in widths) > WIDE and any(BLANK in s for s, _ in squares.values()):
        return _grid(rep, color, BLANK_MARK) + f"\n{BLANK_MARK} {BLANK.strip('()')}"
    return "\n".join(lines)


def print_table(rep: Report, html: str = why.HTML) -> None:
    print(render_terminal(rep, color=sys.stdout.isatty(), html=html))
