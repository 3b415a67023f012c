"""reports/compat.xml: merged JUnit, one testsuite per cell, for CI dashboards.

A red test a known vLLM bug explains is ``skipped`` with type ``known-bug`` (as pytest writes an xfail), and a
known bug that did not reproduce is a failing case of its own (as pytest's strict xpass): the XML fails a CI
dashboard exactly when ``nox -s matrix`` exits 1.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from kvcompat import known_bugs
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.model import Report


def render_junit(rep: Report) -> str:
    suites = []
    for r in sorted(rep.results, key=lambda r: r.id):
        cases = []
        judged = known_bugs.judge_result(r)
        explained = {id(t): bug for t, bug in judged.known}
        for t in r.tests:
            body = ""
            if id(t) in explained:
                message = explained[id(t)].line()
                body = f'<skipped type="known-bug" message={quoteattr(message)}>{escape(t.message or "")}</skipped>'
            elif t.outcome is TestOutcome.FAILED:
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
        for bug in judged.gone:
            message = (
                f"known bug {bug.id} did not reproduce: its contract passed inside {bug.releases}; narrow its range"
            )
            cases.append(
                f"<testcase classname={quoteattr(r.id)} name={quoteattr('known bug ' + bug.id)}>"
                f'<failure type="known-bug-not-reproduced" message={quoteattr(message)}/></testcase>'
            )
        body = "".join(cases)
        failures, errors, skipped = (body.count(f"<{tag} ") for tag in ("failure", "error", "skipped"))
        suites.append(
            f'<testsuite name={quoteattr(r.id)} tests="{len(cases)}" failures="{failures}" errors="{errors}" '
            f'skipped="{skipped}" time="{sum(r.phases.values()):.2f}">' + body + "</testsuite>"
        )
    return '<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="kvcompat">' + "".join(suites) + "</testsuites>\n"
