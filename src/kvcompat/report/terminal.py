"""The grid printed at the end of a run, coloured when stdout is a terminal."""

from __future__ import annotations

import sys

from kvcompat.outcomes import Outcome
from kvcompat.report.model import Report

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
}


def render_terminal(rep: Report, color: bool = False) -> str:
    if not rep.results:
        return "no results yet: run `nox -s matrix`"
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
