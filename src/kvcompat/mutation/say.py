"""What a mutation session says: a line per mutant as it is decided, a group's closing line, and the run's
summary the nox session ends with."""

from __future__ import annotations

from pathlib import Path

from kvcompat.mutation.record import EQUIVALENT, KILLED, NOT_APPLICABLE, SURVIVED, UNREACHED, MutantVerdict, MutationRun

SUMMARY_NAMES = 12  # survivors named in the session's closing line (the report lists them all)


def verdict_line(v: MutantVerdict) -> str:
    """A mutant's verdict, our suite's then the upstream column's when it has one."""
    ours = ours_line(v)
    if v.upstream is None:
        return ours
    up = v.upstream
    if up["status"] == KILLED:
        theirs = (
            f"killed by {(up.get('killed_by') or '').split('::')[-1] if up.get('how') == 'test' else up.get('how')}"
        )
    elif up.get("how") == UNREACHED:
        theirs = "SURVIVED (no test reaches it)"
    else:
        theirs = "SURVIVED"
    return f"{ours}; upstream: {theirs} in {up.get('seconds', 0):.1f}s"


def ours_line(v: MutantVerdict) -> str:
    twin = f" (the same program as {v.detail.split()[4]})" if v.detail.startswith("the same program as ") else ""
    if v.status == KILLED:
        who = v.killed_by.split("::")[-1] if v.how == "test" else v.how
        ran = f" ({v.tests_run} tests picked)" if v.tests_run is not None else ""
        return f"killed by {who} in {v.seconds:.1f}s{ran}{twin}"
    why = f"; explained: {v.explained}" if v.explained else ""
    if v.status == SURVIVED and v.how == UNREACHED:
        return f"SURVIVED ({v.contract}): no test reaches it (not run){why}"
    if v.status == SURVIVED:
        return f"SURVIVED ({v.contract}) in {v.seconds:.1f}s{twin}{why}"
    if v.status == EQUIVALENT:
        return f"equivalent: {v.reason}"
    return f"not applicable ({v.detail})"


def group_line(run: MutationRun, wrote: Path) -> str:
    """A group's counts once every mutant of it is decided, and the file they were written to."""
    c = run.counts()
    absent = f" ({run.absent})" if run.absent else ""
    return (
        f"{'' if run.group == 'multi' else run.group + ': '}{c[KILLED]} killed, {c[SURVIVED]} survived"
        f"{f' ({run.not_reached} of them reached by no test)' if run.not_reached else ''}"
        f"{f' ({run.explained} of them explained)' if run.explained else ''}, "
        f"{c[NOT_APPLICABLE]} not applicable, {c[EQUIVALENT]} equivalent{absent}; wrote {wrote}"
    )


def summary(run: MutationRun) -> str:
    """A run's closing line: its counts and its survivors (the nox session's error when it is not ok)."""
    c = run.counts()
    who = run.id if run.group == "multi" else f"{run.id} --target {run.group}"
    if not run.scored:
        return f"{who}: baseline {run.baseline.get('outcome')} ({run.baseline.get('detail')}), mutants not scored"
    text = f"{who}: {c[KILLED]} killed, {c[SURVIVED]} survived"
    if run.not_reached:
        text += f" ({run.not_reached} reached by no test)"
    if run.explained:
        text += f" ({run.explained} explained)"
    names = [m.id for m in run.survivors]
    more = f" and {len(names) - SUMMARY_NAMES} more" if len(names) > SUMMARY_NAMES else ""
    text += f" ({', '.join(names[:SUMMARY_NAMES])}{more})" if names else ""
    return text + (f"; methods with no mutant and no reason: {', '.join(run.uncovered)}" if run.uncovered else "")
