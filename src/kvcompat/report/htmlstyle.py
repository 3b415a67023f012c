"""compat.html's look: the stylesheet, each outcome's and known-bug impact's colours and glyphs, and the
small styled pieces (a verdict's tag, an impact's badge) every part of the page uses."""

from __future__ import annotations

from html import escape

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.cells import GridCell

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
# A known bug's square has its impact's colour as a thick left border and a badge: an efficiency bug
# (grey) never looks like wrong output (red).
IMPACT_COLOUR = {
    "wrong-output": "#cf222e",
    "hang": "#bc4c00",
    "crash": "#bc4c00",
    "fails-requests": "#bc4c00",
    "refused": "#953800",
    "leak": "#8250df",
    "efficiency": "#57606a",
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
# One glyph per cell outcome, for a square's small marks (the cell's other suites).
OUTCOME_GLYPH = {
    Outcome.PASS: "✓",
    Outcome.NOT_APPLICABLE: "–",
    Outcome.TEST_FAIL: "✗",
    Outcome.UNSUPPORTED: "U",
    Outcome.TEST_ERROR: "E",
    Outcome.TIMEOUT: "T",
    Outcome.IMPORT_ERROR: "I",
    Outcome.INSTALL_ERROR: "⬇",
    Outcome.UNRESOLVABLE: "∅",
    Outcome.KNOWN_BUG: "K",
    Outcome.KNOWN_BUG_GONE: "!",
}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#24292f}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
.meta{color:#57606a;margin-bottom:16px}
table{border-collapse:collapse} th,td{border:1px solid #d0d7de;padding:6px 10px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
table.grid td.cell{padding:0;min-width:150px} table.grid td.cell a.lead{display:block;padding:8px 12px;text-decoration:none;font-weight:600}
table.grid td.cell a:hover{outline:2px solid #0969da}
table.grid td.cell .marks{padding:2px 12px 6px;font-size:12px} table.grid td.cell .marks a{text-decoration:none;margin-right:6px;
  padding:0 4px;border-radius:3px}
table.grid td.blank{color:#8c959f;font-size:12px;border-style:dashed;vertical-align:middle}
table.grid td.cell[data-impact] a.lead{border-left:6px solid var(--impact)}
.impact{display:inline-block;padding:0 6px;border-radius:4px;font-size:12px;font-weight:600;color:#fff;background:var(--impact)}
.legend span{display:inline-block;margin-right:12px;padding:2px 8px;border-radius:4px;font-size:12px}
.notes{font-size:12px;color:#57606a;margin:6px 0} .notes p{margin:2px 0}
.panel{display:none;border:2px solid #0969da;border-radius:6px;padding:12px 16px;background:#fff}
/* a drawer over the right half: the grid stays in view beside the drill-down */
.panel:target{display:block;position:fixed;top:12px;right:12px;width:min(760px,55vw);max-height:calc(100vh - 24px);
  overflow:auto;box-shadow:0 8px 24px rgba(0,0,0,.25);z-index:10}
.panel h3{margin:0 0 8px;font-size:15px}
.panel .red{border-left:4px solid #cf222e;padding:2px 0 2px 10px;margin:8px 0}
.panel .red.known{border-left-color:#0969da} .panel .red h4{margin:0 0 4px} .panel .red h4 code{word-break:break-all}
.panel .red .headline{font-weight:600;margin:0 0 4px} .panel .red pre{max-height:220px}
.panel .next code{background:#f6f8fa;padding:1px 4px;border-radius:3px;user-select:all}
pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:320px;font-size:12px;white-space:pre-wrap}
.tag{display:inline-block;padding:1px 6px;border-radius:4px;font-size:12px;font-weight:600}
.small{font-size:12px;color:#57606a} a.close{float:right}
.panel table{width:100%} .panel td code{word-break:break-all}
.scroll{overflow-x:auto;max-width:100%}
.finding{margin:10px 0} .finding ul{margin:4px 0}
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


def outcome_style(outcome: Outcome) -> str:
    fg, bg = COLOURS[outcome]
    return f"color:{fg};background:{bg}"


def test_style(outcome: TestOutcome) -> str:
    return outcome_style(
        {
            TestOutcome.PASSED: Outcome.PASS,
            TestOutcome.FAILED: Outcome.TEST_FAIL,
            TestOutcome.ERROR: Outcome.TEST_ERROR,
            TestOutcome.UNSUPPORTED: Outcome.UNSUPPORTED,
            TestOutcome.NOT_APPLICABLE: Outcome.NOT_APPLICABLE,
        }[outcome]
    )


def impact_badge(impact: str) -> str:
    return f'<span class="impact" style="--impact:{IMPACT_COLOUR[impact]}">{escape(impact)}</span>'


def verdict_tag(gc: GridCell) -> str:
    impacts = "".join(" " + impact_badge(i) for i in gc.impacts) if gc.outcome is Outcome.KNOWN_BUG else ""
    return f'<span class="tag" style="{outcome_style(gc.outcome)}">{escape(gc.outcome.label)}</span>{impacts}'
