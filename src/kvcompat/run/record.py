"""The last phase of every cell run, whatever ended it: write results/<cell>.json and say the verdict."""

from __future__ import annotations

from kvcompat.outcomes import Outcome
from kvcompat.results import CellResult, suite_tallies, write_result
from kvcompat.run.context import CellContext, now


def finish(ctx: CellContext, outcome: Outcome, detail: str, **kw) -> CellResult:
    """Build the cell's result from what the phases found, write it atomically, and report it."""
    result = CellResult(
        cell=ctx.cell,
        outcome=outcome,
        detail=detail,
        phases=ctx.phases,
        log_tail=ctx.files.log_tail(),
        started=ctx.started,
        finished=now(),
        environment={"mode": ctx.cell.env, "exclude_newer": ctx.cell.exclude_newer},
        **kw,
    )
    write_result(ctx.opts.results_dir, result)
    # each suite's counts on their own (ours, then the upstream column), never one sum of both
    summary = suite_tallies(result)
    ctx.say(
        f"{outcome.label.upper()}: {detail}"
        + (f" ({summary})" if summary else "")
        + f" in {sum(ctx.phases.values()):.0f}s"
    )
    return result


def reuse(ctx: CellContext, cached: CellResult) -> CellResult:
    """An unchanged cell: its cached result stands."""
    ctx.say(
        f"unchanged (lock, suite and Python match {cached.cache_key}); "
        f"cached {cached.outcome.label.upper()} from {cached.finished}"
    )
    return cached
