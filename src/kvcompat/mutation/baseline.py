"""A mutation session's baseline: our suite's unmutated run, once per session whatever the groups, and the
coverage maps it measures (kvcompat.mutation.covmap) that pick each mutant's tests.

    results/mutants-<cell>.coverage-<group>.json  which test runs which line of the group's files (covmap)

The baseline runs under coverage.py only when a group's stored map is stale (its suite, arguments or files
changed); a green baseline stores the maps it measured.  A suite run's record keeps its verdict, its time,
the tests green on it and each test's time.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kvcompat import shapes
from kvcompat.mutation import covmap
from kvcompat.mutation.context import MutationOptions, ours_run
from kvcompat.mutation.plan import Group
from kvcompat.outcomes import Outcome
from kvcompat.run import suites
from kvcompat.run.context import CellContext


def selection_ready(ctx: CellContext, mo: MutationOptions) -> str | None:
    """None when coverage-based selection can run (coverage installed in the venv), else why not."""
    if not mo.select_tests:
        return "off (select_tests=False): every mutant runs the whole suite"
    failure = covmap.install(ctx)
    if failure is not None:
        ctx.say(
            f"could not install {covmap.COVERAGE} into the mutation venv ({failure}): every mutant runs the whole suite"
        )
        return f"off: {covmap.COVERAGE} could not be installed ({failure}): every mutant runs the whole suite"
    return None


def ours_fingerprint(ctx: CellContext, run: suites.SuiteRun) -> str:
    suite = Path(run.path) if Path(run.path).is_absolute() else ctx.opts.repo / run.path
    testkit = Path(__file__).resolve().parent.parent / "testkit"  # what the suite drives vLLM with
    return covmap.fingerprint([suite, testkit], [*run.args, *ctx.opts.pytest_args], selection_env(run.env))


def selection_env(env: dict[str, str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` and the shape selection the suite inherits from this process (``KVCOMPAT_SHAPES``): a map measured
    with some shapes left out misses the lines only they run, so it must not serve a run with every shape."""
    chosen = environ.get(shapes.SHAPES_ENV)
    return {**env, shapes.SHAPES_ENV: chosen} if chosen else dict(env)


def measured(
    ctx: CellContext,
    results_dir: Path,
    suite: str,
    run: suites.SuiteRun,
    groups: list[Group],
    selecting: str | None,
    print_: str,
) -> tuple[suites.SuiteRun, Callable[[bool], None]]:
    """``run`` made to measure coverage when a group's stored map of ``suite`` is stale, and what to do after it
    (store the maps when the run was green; else nothing is kept).  Sets each group's map and selection line."""
    if selecting is not None:
        for g in groups:
            g.maps[suite] = None
            g.run.selection = selecting
        return run, lambda green: None
    stale = []
    for g in groups:
        g.maps[suite] = covmap.load(covmap.map_path(results_dir, ctx.cell.id, g.name), suite, print_, g.hashes)
        if g.maps[suite] is None:
            stale.append(g)
        elif suite == "ours":
            g.run.selection = "coverage: the stored map (suite and files unchanged)"
    if not stale:
        return run, lambda green: None
    cover = sorted({path for g in stale for path in g.sources})
    out = ctx.files.work / f"coverage-{suite}.json"
    out.unlink(missing_ok=True)
    env = {**run.env, covmap.ENV_OUT: str(out), covmap.ENV_FILES: ":".join(cover)}
    measured_run = dataclasses.replace(run, args=[*run.args, "-p", covmap.PLUGIN], env=env)

    def after(green: bool) -> None:
        files = covmap.read_plugin_output(out) if green else None
        if not covmap.usable(files):
            why = "the baseline is not green" if not green else "coverage measured no line of the files"
            ctx.say(f"{suite}: no coverage map ({why}): every mutant runs the whole {suite} suite")
            if suite == "ours":
                for g in stale:
                    g.run.selection = f"off: {why}; every mutant runs the whole suite"
            return
        for g in stale:
            g.maps[suite] = {path: files.get(path, {}) for path in g.sources}
            path = covmap.map_path(results_dir, ctx.cell.id, g.name)
            covmap.save(path, ctx.cell.id, g.name, suite, print_, g.hashes, g.maps[suite])
            if suite == "ours":
                g.run.selection = "coverage: measured on this session's baseline"
        ctx.say(f"{suite}: coverage map of {len(cover)} files measured on the baseline")

    return measured_run, after


def baseline(ctx: CellContext, mo: MutationOptions, groups: list[Group], selecting: str | None) -> tuple[dict, bool]:
    """Our suite's unmutated run (under coverage when a group's map is stale): its record, and whether it is green."""
    run = ours_run(ctx)
    run, after = measured(ctx, mo.results_dir, "ours", run, groups, selecting, ours_fingerprint(ctx, run))
    t0 = time.monotonic()
    with ctx.timed("baseline"):
        verdict = suites.run_pytest(ctx, "ours", run)
    green = verdict.outcome is Outcome.PASS
    after(green)
    return baseline_record(verdict, time.monotonic() - t0), green


def baseline_record(verdict: suites.SuiteVerdict, seconds: float) -> dict:
    """What a run keeps of a suite's unmutated run: its verdict, its time, and the tests green on it."""
    return {
        "outcome": verdict.outcome.value,
        "detail": verdict.detail,
        "seconds": round(seconds, 2),
        "passed": sorted(t.nodeid for t in verdict.tests if t.outcome.value == "passed"),
        "tests": len(verdict.tests),
        # each test's time on the unmutated code: a forked mutant's time limit is measured from its own tests
        "durations": {t.nodeid: round(t.duration or 0.0, 2) for t in verdict.tests},
    }
