"""reports/compat.xml: merged JUnit, one testsuite per cell, for CI dashboards."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.model import Report


def render_junit(rep: Report) -> str:
    suites = []
    for r in sorted(rep.results, key=lambda r: r.id):
        cases = []
        for t in r.tests:
            body = ""
            if t.outcome is TestOutcome.FAILED:
                body = f"<failure message={quoteattr((t.message or '')[:200])}>{escape(t.message or '')}</failure>"
            elif t.outcome is TestOutcome.UNSUPPORTED:  # a verdict on the release, like a failure
                message = "unsupported: " + (t.message or "")
                body = f'<failure type="unsupported" message={quoteattr(message[:200])}>{escape(message)}</failure>'
            elif t.outcome is TestOutcome.ERROR:
                body = f"<error message={quoteattr((t.message or '')[:200])}>{escape(t.message or '')}</error>"
            elif t.outcome is TestOutcome.NOT_APPLICABLE:
                body = f"<skipped message={quoteattr('not applicable: ' + (t.message or ''))}/>"
            name = t.nodeid if t.suite == "ours" else f"[{t.suite}] {t.nodeid}"
            cases.append(
                f'<testcase classname={quoteattr(r.id)} name={quoteattr(name)} time="{t.duration:.3f}">{body}</testcase>'
            )
        if not r.tests:  # the cell never reached its tests: one synthetic case carries why
            tag = "skipped" if r.outcome is Outcome.NOT_APPLICABLE else "error"
            cases.append(
                f'<testcase classname={quoteattr(r.id)} name="cell">'
                f"<{tag} message={quoteattr(r.outcome.value + ': ' + r.detail)}>{escape(r.log_tail)}</{tag}></testcase>"
            )
        c = r.counts()
        errors = c["error"] + (0 if r.tests or r.outcome is Outcome.NOT_APPLICABLE else 1)
        suites.append(
            f'<testsuite name={quoteattr(r.id)} tests="{max(len(r.tests), 1)}" failures="{c["failed"] + c["unsupported"]}" errors="{errors}" '
            f'skipped="{c["not_applicable"]}" time="{sum(r.phases.values()):.2f}">' + "".join(cases) + "</testsuite>"
        )
    return '<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="kvcompat">' + "".join(suites) + "</testsuites>\n"
