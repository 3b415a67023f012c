"""Scoring one mutant: the tests that reach it (kvcompat.mutation.covmap), the tests that killed earlier
mutants first, a suite run with its file swapped in, stopped at the first failure, and the verdict.

Our suite scores every mutant; in a cell that runs the upstream column (vLLM's own tests of the pair,
``suites = [..., "upstream"]``), :func:`upstream_scorer` scores every mutant ours saw (neither equivalent nor
absent) a second time against those tests, the same way (with their own baseline and coverage map):
``MutantVerdict.upstream`` holds that verdict, so the report can say, per release, how many mutants each
suite kills and which only one of them kills.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import covmap
from kvcompat.mutation import generate as gen
from kvcompat.mutation.baseline import baseline_record, measured
from kvcompat.mutation.context import MutationOptions, cell_context, cell_label, ours_run
from kvcompat.mutation.guard import Guard
from kvcompat.mutation.plan import Group, Planned
from kvcompat.mutation.record import (
    EQUIVALENT,
    KILLED,
    NOT_APPLICABLE,
    STILL_GREEN,
    SURVIVED,
    UNREACHED,
    MutantVerdict,
)
from kvcompat.outcomes import Outcome
from kvcompat.results import headline
from kvcompat.run import suites
from kvcompat.run.context import CellContext


class Killers:
    """The tests that killed mutants, the latest first: run first for the next mutant, so -x stops early."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.names: list[str] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def saw(self, nodeid: str) -> None:
        self.names = [nodeid] + [n for n in self.names if n != nodeid]
        self.path.write_text("\n".join(self.names) + "\n")


def base(p: Planned) -> dict:
    """The fields of ``p``'s verdict that say which mutant it is and where."""
    m = p.mutant
    return {
        "id": m.id,
        "contract": m.contract,
        "description": m.description,
        "origin": "generated" if isinstance(m, gen.GeneratedMutant) else "catalogue",
        "file": p.target,
        "line": p.line,
    }


def same_as(p: Planned, twin: MutantVerdict) -> MutantVerdict:
    """A mutant that makes the same program as one already run: that one's verdict."""
    why = "for two children" if p.target == cat.TARGET else "(a negated test is its flipped comparison)"
    return dataclasses.replace(
        twin,
        **base(p),
        detail=f"the same program as {twin.id} {why}: {twin.detail}"[:400],
        seconds=0.0,
    )


def select(lines: covmap.FileLines | None, p: Planned, passed: list[str]) -> covmap.Selection:
    """The tests green on the baseline that reach ``p`` (the whole suite without a coverage map)."""
    if lines is None or p.where is None:
        return covmap.Selection(None, "the whole suite")
    return covmap.select(lines, p.where, passed)


def unreached(p: Planned, chosen: covmap.Selection) -> MutantVerdict:
    lines = sorted(p.where.lines) if p.where else []
    span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}" if lines else "its lines"
    return MutantVerdict(
        **base(p),
        status=SURVIVED,
        how=UNREACHED,
        reason=covmap.NOT_REACHED,
        detail=f"no test green on the baseline executes {span} of {p.target.rsplit('/', 1)[-1]}",
        tests_run=0,
    )


def _only(ctx: CellContext, suite: str, chosen: covmap.Selection) -> list[str]:
    """pytest arguments that run only the chosen tests (none: the whole suite)."""
    if chosen.tests is None:
        return []
    path = ctx.files.work / f"only-{suite}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(chosen.tests) + "\n")
    return ["-p", covmap.PLUGIN, f"--kvcompat-only={path}"]


def score(
    ctx: CellContext,
    guard: Guard,
    p: Planned,
    passed: list[str],
    killers: Killers,
    lines: covmap.FileLines | None,
) -> MutantVerdict:
    """Our suite's verdict of ``p``: not applicable, equivalent, unreached, or a run (:func:`judge`)."""
    fields = base(p)
    if p.mutated is None:
        return MutantVerdict(**fields, status=NOT_APPLICABLE, detail=f"target code absent in {cell_label(ctx.cell)}")
    if p.mutant.equivalent:
        return MutantVerdict(**fields, status=EQUIVALENT, reason=p.mutant.equivalent)
    chosen = select(lines, p, passed)
    if not chosen.reached:
        return unreached(p, chosen)
    run = ours_run(ctx, "-x", f"--kvcompat-first={killers.path}", *_only(ctx, "ours", chosen))
    return judge(ctx, guard, p, passed, killers, "ours", run, chosen)


def judge(
    ctx: CellContext,
    guard: Guard,
    p: Planned,
    passed: list[str],
    killers: Killers,
    suite: str,
    run: suites.SuiteRun,
    chosen: covmap.Selection,
) -> MutantVerdict:
    """Run ``suite`` with the mutant applied: killed (by a test green on the baseline, a timeout, a crash) or survived."""
    fields = {**base(p), "tests_run": None if chosen.tests is None else len(chosen.tests)}
    green = set(passed)
    t0 = time.monotonic()
    guard.apply(p.mutant.id, p.mutated)
    try:
        verdict = suites.run_pytest(ctx, suite, run)
    finally:
        guard.restore()
    seconds = round(time.monotonic() - t0, 2)
    if verdict.outcome is Outcome.TIMEOUT:
        return MutantVerdict(
            **fields, status=KILLED, killed_by="timeout", how="timeout", detail=verdict.detail, seconds=seconds
        )
    killed = [t for t in verdict.tests if t.nodeid in green and t.outcome.value not in STILL_GREEN]
    if killed:
        t = killed[0]
        killers.saw(t.nodeid)
        return MutantVerdict(
            **fields,
            status=KILLED,
            killed_by=t.nodeid,
            how="test",
            detail=f"{t.outcome.value}: {headline(t.message)}"[:400],
            seconds=seconds,
        )
    if verdict.outcome is Outcome.TEST_ERROR:
        # pytest itself failed (a crash, a collection error, an exit status its tests do not explain):
        # the suite noticed, without naming a test
        return MutantVerdict(
            **fields, status=KILLED, killed_by="crash", how="crash", detail=verdict.detail, seconds=seconds
        )
    if chosen.tests is None:
        detail = verdict.detail
    else:  # the suite's own line would count the others as "not run here (-m …)"
        green_now = sum(1 for t in verdict.tests if t.outcome.value in STILL_GREEN)
        detail = f"{chosen.why}; {green_now}/{len(verdict.tests)} of them passed"
    return MutantVerdict(**fields, status=SURVIVED, detail=detail, seconds=seconds)


def upstream_scorer(
    cell: Cell, mo: MutationOptions, progress: Callable[[str], None], groups: list[Group], selecting: str | None
) -> Callable[[Guard, Planned, covmap.FileLines | None], dict] | None:
    """Score mutants against the upstream column too, when the cell has one and it is green on the baseline."""
    if "upstream" not in cell.suites:
        return None
    ctx = cell_context(cell, mo, progress, timeout_s=3600.0)
    t0 = time.monotonic()
    with ctx.timed("upstream baseline"):
        prepared = suites.prepare_suite(ctx, "upstream")
        if isinstance(prepared, suites.SuiteVerdict):  # it could not be prepared, or this release has none of it
            verdict, prepared = prepared, None
        else:
            print_ = covmap.fingerprint([Path(prepared.path)], [*prepared.args, *ctx.opts.pytest_args], prepared.env)
            measured_run, after = measured(ctx, mo.results_dir, "upstream", prepared, groups, selecting, print_)
            verdict = suites.run_prepared(ctx, "upstream", measured_run)
            after(verdict.outcome is Outcome.PASS)
    record = baseline_record(verdict, time.monotonic() - t0)
    for g in groups:
        g.run.upstream_baseline = record
    passed = list(record["passed"])
    if verdict.outcome is not Outcome.PASS or prepared is None:
        ctx.say(f"upstream baseline is {verdict.outcome.value}: {verdict.detail}; mutants scored by ours only")
        return None
    timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * record["seconds"])
    ctx = cell_context(cell, mo, progress, timeout_s=timeout)
    killers = Killers(ctx.files.work / "killers-upstream.txt")

    def scorer(guard: Guard, p: Planned, lines: covmap.FileLines | None) -> dict:
        chosen = select(lines, p, passed)
        if not chosen.reached:
            v = unreached(p, chosen)
        else:
            extra = ["-x", f"--kvcompat-first={killers.path}", *_only(ctx, "upstream", chosen)]
            run_ = dataclasses.replace(prepared, args=[*prepared.args, *extra])
            v = judge(ctx, guard, p, passed, killers, "upstream", run_, chosen)
        return {k: getattr(v, k) for k in ("status", "killed_by", "how", "detail", "seconds")}

    return scorer
