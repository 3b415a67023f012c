"""The grid printed at the end of a run, coloured when stdout is a terminal; a history run's timeline above it."""

from __future__ import annotations

import sys

from kvcompat.outcomes import Outcome
from kvcompat.report.model import SQUARE_OUTCOME, Report, Timeline, shape_verdicts

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


# One character per timeline status, all distinct (coloured as model.SQUARE_OUTCOME says).
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


def render_terminal(rep: Report, color: bool = False) -> str:
    if not rep.results:
        return "no results yet: run `nox -s matrix`"
    if rep.is_history:
        timelines = rep.timelines()
        parts = [(f"{tl.title}:\n" if len(timelines) > 1 else "") + render_timeline(tl, color) for tl in timelines]
        return "\n\n".join(parts) + "\n\n" + _grid(rep, color) + _shape_lines(rep)
    return _grid(rep, color) + _shape_lines(rep)


def _shape_lines(rep: Report) -> str:
    """Under the grid, per cell that ran deployment shapes: the shapes that are not green, or that all passed."""
    lines = []
    for gc in rep.shaped_cells():
        by_shape = shape_verdicts(gc)
        bad = [f"{s} {v.outcome.label} ({v.text()})" for s, v in by_shape.items() if not v.outcome.is_green]
        ok = sum(v.outcome is Outcome.PASS for v in by_shape.values())
        say = "; ".join(bad) if bad else f"all {ok} pass"
        lines.append(f"shapes {gc.row} / {rep.column(gc)}: {say}")
    return ("\n" + "\n".join(lines)) if lines else ""


def _grid(rep: Report, color: bool) -> str:
    texts = {(row, col): gc for row in rep.rows for col in rep.columns if (gc := rep.at(row, col))}
    w0 = max(len("vLLM"), *(len(r) for r in rep.rows))
    widths = [
        max(len(col), *(len(texts[(row, col)].text()) for row in rep.rows if (row, col) in texts))
        for col in rep.columns
    ]
    lines = ["vLLM".ljust(w0) + "  " + "  ".join(c.ljust(w) for c, w in zip(rep.columns, widths, strict=True))]
    for row in rep.rows:
        parts = []
        for col, w in zip(rep.columns, widths, strict=True):
            gc = texts.get((row, col))
            padded = (gc.text() if gc else "").ljust(w)
            parts.append(f"\033[{ANSI[gc.outcome]}m{padded}\033[0m" if color and gc else padded)
        lines.append(row.ljust(w0) + "  " + "  ".join(parts))
    return "\n".join(lines)


def print_table(rep: Report) -> None:
    print(render_terminal(rep, color=sys.stdout.isatty()))
