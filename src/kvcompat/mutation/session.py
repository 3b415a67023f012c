"""A mutation session for one cell: its own venv, a green baseline, then one suite run per mutant.

The session composes the mutation package's parts:

* kvcompat.mutation.context: the options, the session's paths and venv (built from the cell's lock);
* kvcompat.mutation.plan: each target group's files and mutants (``--target``), placed and picked;
* kvcompat.mutation.baseline: our suite's unmutated run, once per session whatever the groups, and the
  coverage maps (kvcompat.mutation.covmap) that give each mutant the tests that execute its lines;
* kvcompat.mutation.score: a mutant's run with its file swapped in (the tests that killed earlier mutants
  first, stopping at the first failure), ours and the upstream column's; kvcompat.mutation.forked the same
  for our suite in forked children (``--fork``);
* kvcompat.mutation.record: results/mutants-<cell>[--<group>].json, rewritten after every mutant; a rerun
  of a few mutants keeps the other verdicts, a full run resumes after an interrupted one's.

The files are swapped one at a time (kvcompat.mutation.guard), and put back on every exit.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from collections.abc import Callable

from kvcompat.atomic import write_atomic
from kvcompat.cells import Cell
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import plan
from kvcompat.mutation import targets as tg
from kvcompat.mutation.baseline import baseline, ours_fingerprint, selection_ready
from kvcompat.mutation.context import (
    MutationError,
    MutationOptions,
    cell_context,
    guard_for,
    ours_run,
    prepare_venv,
    rel,
    site_for,
    state_for,
)
from kvcompat.mutation.forked import Forked
from kvcompat.mutation.guard import Guard
from kvcompat.mutation.record import KILLED, SURVIVED, UNREACHED, MutantVerdict, MutationRun, merge
from kvcompat.mutation.say import group_line, verdict_line
from kvcompat.mutation.score import Killers, same_as, score, upstream_scorer
from kvcompat.run.context import now
from kvcompat.run.process import reap_leftover


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def run_targets(cell: Cell, mo: MutationOptions, progress: Callable[[str], None] = print) -> list[MutationRun]:
    """Mutate ``mo.targets``' files in ``cell``, one run per group; SIGTERM is handled like Ctrl-C (the file
    is restored either way)."""
    if mo.ours_only and mo.upstream_only:
        raise MutationError("--ours-only and --upstream-only exclude each other; pick one")
    if mo.ours_only:
        cell = dataclasses.replace(cell, suites=tuple(s for s in cell.suites if s != "upstream"))
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        return _run(cell, mo, progress)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def run_mutants(cell: Cell, mo: MutationOptions, progress: Callable[[str], None] = print) -> MutationRun:
    """:func:`run_targets`' run of the first group (the only one by default: ``multi``)."""
    return run_targets(cell, mo, progress)[0]


def _without_known_bugs(cell: Cell, mo: MutationOptions, progress: Callable[[str], None]) -> MutationOptions:
    """``mo`` with the contracts the known vLLM bugs of the cell's release turn red deselected: they are red on
    the baseline by design (kvcompat.known_bugs), and a red test can tell no mutant apart."""
    from kvcompat import bisection, known_bugs

    known = known_bugs.deselections(bisection.suite_tests(mo.repo), cell.vllm)
    if not known:
        return mo
    progress(f"[{cell.id}] left out, red on a known vLLM bug of {cell.vllm}: {', '.join(known)}")
    return dataclasses.replace(mo, pytest_args=(*mo.pytest_args, *(f"--deselect={k}" for k in known)))


def _run(cell: Cell, mo: MutationOptions, progress: Callable[[str], None]) -> list[MutationRun]:
    lock = mo.cell_work / cell.id / "lock.txt"
    if not lock.is_file():
        raise MutationError(
            f"cell {cell.id} has no lock ({lock}); run the cell once first: nox -s matrix -k {cell.tags[3]}"
        )
    mo = _without_known_bugs(cell, mo, progress)
    names = tg.check_groups(tuple(mo.targets))
    written = cat.load(mo.catalogue) if "multi" in names else []
    ctx = cell_context(cell, mo, progress, timeout_s=3600.0)
    held = guard_for(mo.home, cell).lock()
    t_session = time.monotonic()
    try:
        ctx.files.start_log(f"# kvcompat mutation session {cell.id} started {ctx.started}")
        reap_leftover(ctx.files, ctx.say)  # a pytest left running by a SIGKILLed session
        prepare_venv(ctx, mo, lock, names)
        groups = [plan.group(cell, mo, ctx, name, written) for name in names]
        plan.check_only(groups, mo.only)
        if mo.only:  # a group none of whose mutants is picked is left as it is
            groups = [g for g in groups if any(m.id in mo.only for m, _ in g.mutants)]
        for g in groups:
            plan.place(g, mo.only)
        selecting = selection_ready(ctx, mo)
        suite = ours_fingerprint(ctx, ours_run(ctx))
        for g in groups:
            g.run.suite = suite
            plan.keep_previous(g, cell, mo, ctx.say)
            if g.kept and not mo.only and not mo.upstream_only:
                ctx.say(
                    f"{g.name}: resuming an interrupted run: {len(g.kept)} verdicts kept, {len(g.planned)} to score"
                )
        t0 = time.monotonic()
        if not mo.upstream_only:
            base, scored = baseline(ctx, mo, groups, selecting)
            for g in groups:
                g.run.baseline, g.run.scored = base, scored
        # A group's results file is first written with its first verdict (a session stopped before then leaves
        # the previous run's verdicts as they were), or below, when no mutant can be scored.
        if not all(g.run.scored for g in groups):
            base = groups[0].run.baseline
            ctx.say(f"baseline is {base['outcome']}: {base['detail']}; mutants not scored")
            for g in groups:
                if mo.only and g.kept:  # a rerun of a few: the previous scored record stays as it was
                    continue
                g.run.finished = now()
                write_atomic(g.out, json.dumps(g.run.to_json(), indent=1))
            return [g.run for g in groups]
        upstream = upstream_scorer(cell, mo, progress, groups, selecting)
        baseline_s = round(time.monotonic() - t0, 2)
        for g in groups:
            _score_group(cell, mo, progress, g, upstream, baseline_s)
        ctx.say(f"session done in {time.monotonic() - t_session:.0f}s")
        return [g.run for g in groups]
    finally:
        held.close()


def _score_group(
    cell: Cell, mo: MutationOptions, progress: Callable[[str], None], g: plan.Group, upstream, baseline_s: float
) -> None:
    """Decide each planned mutant of ``g`` and write the group's results file after every verdict."""
    run = g.run
    timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * run.baseline["seconds"])
    ctx = cell_context(cell, mo, progress, timeout_s=timeout)
    passed = list(run.baseline["passed"])
    killers = Killers(ctx.files.work / "killers.txt")
    site, state = site_for(mo.home, cell), state_for(mo.home, cell)
    decided: dict[str, MutantVerdict] = {}
    t0, runs = time.monotonic(), 0
    spent = {"ours": 0.0, "upstream": 0.0}  # wall time of each suite's scoring, apart
    if len(g.planned) and g.name != "multi":
        ctx.say(f"{g.name}: {len(g.planned)} mutants in {len(g.sources)} files ({run.selection or 'whole suite'})")
    forked = Forked(ctx, g, passed, site, timeout, mo.fork_jobs) if mo.fork else None
    for n, p in enumerate(g.planned, 1):
        twin = decided.get(getattr(p.mutant, "same_as", None) or "")
        guard = Guard(site, state, p.target)
        if twin is not None:
            verdict = same_as(p, twin)
        else:
            before = g.ours_before.get(p.mutant.id)
            t_ours = time.monotonic()
            verdict = before or (forked and forked.verdict(n - 1))
            verdict = verdict or score(ctx, guard, p, passed, killers, g.lines("ours", p))
            spent["ours"] += time.monotonic() - t_ours
            runs += before is None and verdict.status in (KILLED, SURVIVED) and verdict.how != UNREACHED
            if upstream is not None and verdict.status in (KILLED, SURVIVED):
                t_up = time.monotonic()
                verdict.upstream = upstream(guard, p, g.lines("upstream", p))
                spent["upstream"] += time.monotonic() - t_up
        decided[p.mutant.id] = g.explain(verdict)
        run.mutants = merge(g.kept, list(decided.values()))
        ctx.say(f"mutant {n}/{len(g.planned)} {p.mutant.id}: {verdict_line(verdict)}")
        run.timing = _timing(baseline_s, time.monotonic() - t0, len(decided), runs, spent)
        write_atomic(g.out, json.dumps(run.to_json(), indent=1))
    run.finished = now()
    run.timing = _timing(baseline_s, time.monotonic() - t0, len(decided), runs, spent)
    write_atomic(g.out, json.dumps(run.to_json(), indent=1))
    if g.kept:
        ctx.say(f"kept the previous run's verdicts of {len([k for k in g.kept if k.id not in decided])} other mutants")
    ctx.say(group_line(run, rel(g.out, mo.repo)))


def _timing(baseline_s: float, mutants_s: float, decided: int, runs: int, spent: dict[str, float]) -> dict:
    """What the mutants' loop cost: in all and a mutant, and (``ours_s``, ``upstream_s``) each suite's part."""
    return {
        "baseline_s": baseline_s,
        "mutants_s": round(mutants_s, 2),
        "decided": decided,
        "runs": runs,
        "per_mutant_s": round(mutants_s / decided, 2) if decided else None,
        **{f"{suite}_s": round(seconds, 2) for suite, seconds in spent.items()},
    }
