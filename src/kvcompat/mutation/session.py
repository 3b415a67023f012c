"""A mutation session for one cell: its own venv, a green baseline, then one suite run per mutant.

    .kvcompat/mutants/venvs/<cell>            the session's venv, from the cell's lock (never the cell's venv)
    .kvcompat/mutants/venvs/<cell>.mutation/  journals, pristine copies, session.lock (kvcompat.mutation.guard)
    .kvcompat/mutants/cells/<cell>/           the session's log and pytest reports
    results/mutants-<cell>.json               the verdicts of the ``multi`` group, rewritten (atomically)
                                              after every mutant
    results/mutants-<cell>--<group>.json      the verdicts of another group (``--target``, kvcompat.mutation.targets)
    results/mutants-<cell>.coverage-<group>.json  which test runs which line of the group's files (covmap)

``--target`` picks the groups of files to mutate (default ``multi``: multi_connector.py, with the
catalogue and MultiConnector's generator; the others get kvcompat.mutation.operators' mechanical
mutants).  The baseline runs once per session, whatever the groups; the files are swapped one at a time.

Each mutant runs against the tests that execute the lines it changes (kvcompat.mutation.covmap: the
baseline runs under coverage.py when the stored map is stale), the tests that killed earlier mutants
first, stopping at the first failure.  A mutant is *killed* when a test that passed on the baseline
fails or errors with it applied, when the suite crashes, or when the run exceeds the per-mutant timeout.
It *survived* when every test it ran still passes, or when no test reaches it (``how = "unreached"``,
reason "no test reaches it": nothing was run).  It is *not applicable* when its target code is absent
from this release's file, and *equivalent* when the catalogue (or tests/mutants/equivalent*.toml) says
why no test can tell it apart.

In a cell that runs the upstream column (vLLM's own tests of the pair, ``suites = [..., "upstream"]``),
every mutant ours saw (neither equivalent nor absent) is scored a second time against those tests, the
same way (with their own coverage map): ``MutantVerdict.upstream`` holds that verdict, so the report can
say, per release, how many mutants each suite kills and which only one of them kills.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcompat.atomic import write_atomic
from kvcompat.cells import Cell
from kvcompat.errors import KvcompatError
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import covmap, operators
from kvcompat.mutation import generate as gen
from kvcompat.mutation import guard as guards
from kvcompat.mutation import targets as tg
from kvcompat.mutation.guard import Guard, GuardError
from kvcompat.mutation.record import (
    EQUIVALENT,
    KILLED,
    NOT_APPLICABLE,
    STILL_GREEN,
    SURVIVED,
    UNREACHED,
    MutantVerdict,
    MutationRun,
    interrupted_verdicts,
    kept_verdicts,
    merge,
    read_run,
    results_path,
)
from kvcompat.outcomes import Outcome
from kvcompat.results import headline
from kvcompat.run import install, suites
from kvcompat.run.context import CellContext, now
from kvcompat.run.options import RunOptions
from kvcompat.run.process import reap_leftover

SUMMARY_NAMES = 12  # survivors named in the session's closing line (the report lists them all)


class MutationError(KvcompatError):
    """The mutation session cannot start for this cell; the message names the fix."""


@dataclasses.dataclass
class MutationOptions:
    """Knobs of a mutation session."""

    repo: Path
    catalogue: Path
    results_dir: Path
    home: Path  # .kvcompat/mutants: the session's venvs and work files
    cell_work: Path  # where the matrix keeps each cell's lock (.kvcompat/cells)
    suite: str = "tests/connectors"
    only: tuple[str, ...] = ()  # mutant ids; empty: the whole catalogue
    timeout_s: float | None = None  # per mutant; None: 5x the baseline run, at least MIN_TIMEOUT_S
    index_url: str = "https://pypi.org/simple"
    find_links: tuple[str, ...] = ()
    heartbeat_s: float = 30.0
    pytest_args: tuple[str, ...] = ()  # e.g. --deselect of a test that fails on the baseline; in every run
    # tests/mutants/equivalent.toml: why generated mutants are equivalent (per release), and methods with no site;
    # another group's reasons are read from equivalent-<group>.toml beside it, when there is one
    reasons: Path | None = None
    # Score the upstream column only, keeping our suite's verdicts from the previous scored run (ours takes
    # ~11 s a mutant, upstream ~50 s: the two need not be paid together).
    upstream_only: bool = False
    ours_only: bool = False  # the upstream column left out (scored later with upstream_only)
    # The groups of files to mutate (kvcompat.mutation.targets.GROUPS).
    targets: tuple[str, ...] = tg.DEFAULT_GROUPS
    # Coverage-based test selection (kvcompat.mutation.covmap); False: every mutant runs the whole suite.
    select_tests: bool = True
    # Score our suite in forked children of one pytest per batch (kvcompat.mutation.incell.forkrun).
    fork: bool = False
    fork_jobs: int = 16  # forked children in flight at once

    MIN_TIMEOUT_S = 120.0


def venv_for(home: Path, cell: Cell) -> Path:
    return home / "venvs" / cell.id


def site_for(home: Path, cell: Cell) -> Path:
    return venv_for(home, cell) / "lib" / f"python{cell.python}" / "site-packages"


def state_for(home: Path, cell: Cell) -> Path:
    return venv_for(home, cell).parent / f"{cell.id}.mutation"


def guard_for(home: Path, cell: Cell, target: str = cat.TARGET) -> Guard:
    return Guard(site_for(home, cell), state_for(home, cell), target)


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


def _without_known_bugs(cell: Cell, mo: MutationOptions, progress: Callable[[str], None]) -> MutationOptions:
    """``mo`` with the contracts the known vLLM bugs of the cell's release turn red deselected: they are red on
    the baseline by design (kvcompat.known_bugs), and a red test can tell no mutant apart."""
    from kvcompat import bisection, known_bugs

    known = known_bugs.deselections(bisection.suite_tests(mo.repo), cell.vllm)
    if not known:
        return mo
    progress(f"[{cell.id}] left out, red on a known vLLM bug of {cell.vllm}: {', '.join(known)}")
    return dataclasses.replace(mo, pytest_args=(*mo.pytest_args, *(f"--deselect={k}" for k in known)))


def run_mutants(cell: Cell, mo: MutationOptions, progress: Callable[[str], None] = print) -> MutationRun:
    """:func:`run_targets`' run of the first group (the only one by default: ``multi``)."""
    return run_targets(cell, mo, progress)[0]


def _context(cell: Cell, mo: MutationOptions, progress: Callable[[str], None], timeout_s: float) -> CellContext:
    opts = RunOptions(
        repo=mo.repo,
        # record.finish is never called here: the cell's own result file is not ours to write.
        results_dir=mo.home / "cells" / cell.id,
        suite=mo.suite,
        timeout_s=timeout_s,
        work_dir=mo.home / "cells",
        heartbeat_s=mo.heartbeat_s,
        index_url=mo.index_url,
        find_links=mo.find_links,
        pytest_args=mo.pytest_args,
    )
    # In-tree bytecode: the guard deletes the mutated file's .pyc on every swap, and a prefix tree
    # would keep serving the other version's.
    return CellContext(cell, venv_for(mo.home, cell), opts, progress, bytecode_outside_venv=False)


# -- what a session mutates --------------------------------------------------------------------------


@dataclasses.dataclass
class _Planned:
    """One mutant with the mutated text of its file, and where it sits there."""

    mutant: Any  # cat.Mutant | gen.GeneratedMutant
    mutated: str | None  # None: not applicable to this release
    target: str  # the file, inside site-packages
    line: int | None
    where: covmap.Where | None


@dataclasses.dataclass
class _Group:
    name: str
    resolved: tg.Resolved
    sources: dict[str, str]  # path -> pristine text
    mutants: list[tuple[Any, str]]  # (mutant, its file), before --mutant picks
    run: MutationRun
    out: Path
    planned: list[_Planned] = dataclasses.field(default_factory=list)
    kept: list[MutantVerdict] = dataclasses.field(default_factory=list)
    ours_before: dict[str, MutantVerdict] = dataclasses.field(default_factory=dict)
    maps: dict[str, dict[str, covmap.FileLines] | None] = dataclasses.field(default_factory=dict)  # per suite
    reasons: gen.Reasons = dataclasses.field(default_factory=lambda: gen.Reasons((), {}))
    release: str = ""

    def explain(self, v: MutantVerdict) -> MutantVerdict:
        """``v`` with its [[explained]] reason when it survived (none otherwise, or when none is given now)."""
        v.explained = self.reasons.explanation_for(v.id, self.release) if v.status == SURVIVED else None
        return v

    @property
    def hashes(self) -> dict[str, str]:
        return {path: covmap.file_hash(text.encode()) for path, text in self.sources.items()}


def _reasons_path(mo: MutationOptions, group: str) -> Path | None:
    if mo.reasons is None:
        return None
    return mo.reasons if group == "multi" else mo.reasons.with_name(f"{mo.reasons.stem}-{group}.toml")


def _group(cell: Cell, mo: MutationOptions, ctx: CellContext, group: str, written: list) -> _Group:
    """A group's files in this release (pristine copies kept by their guards) and all their mutants."""
    site, state = site_for(mo.home, cell), state_for(mo.home, cell)
    resolved = tg.resolve(site, group)
    sources = {f.path: Guard(site, state, f.path).save_pristine().decode() for f in resolved.files}
    reasons = gen.load_reasons(_reasons_path(mo, group))
    mutants: list[tuple[Any, str]] = []
    files: list[dict] = []
    if group == "multi":
        if cat.TARGET not in sources:
            raise MutationError(f"{cat.TARGET} is not in {cell_label(cell)}; there is nothing to mutate")
        source = sources[cat.TARGET]
        made = written + gen.mutants_for(source, cell.vllm, reasons)
        mutants = [(m, cat.TARGET) for m in made]
        coverage = gen.coverage(source, reasons)
        files.append(
            {
                "path": cat.TARGET,
                "slug": tg.file_slug(cat.TARGET),
                "scope": "the catalogue (tests/mutants/multi_connector.toml) and MultiConnector's generator",
                "functions": [m.contract for m in gen.methods(source)],
                "mutants": len(made),
            }
        )
    else:
        coverage = {}
        for f in resolved.files:
            source = sources[f.path]
            made = [m.with_reason(reasons.reason_for(m.id, cell.vllm)) for m in operators.generate(source, f)]
            mutants += [(m, f.path) for m in made]
            coverage |= operators.per_function(source, f, made)
            files.append(
                {
                    "path": f.path,
                    "slug": f.slug,
                    "scope": f.scope.describe(),
                    "functions": [fn.contract for fn in operators.functions(source, f.scope)],
                    "mutants": len(made),
                }
            )
    run = MutationRun(
        cell=cell.to_json(),
        catalogue=str(_rel(mo.catalogue, mo.repo)) if group == "multi" else "kvcompat.mutation.operators",
        target=cat.TARGET if group == "multi" else " ".join(f.path for f in resolved.files),
        started=ctx.started,
        pytest_args=list(mo.pytest_args),
        coverage=coverage,
        group=group,
        files=files,
        replaced=list(resolved.replaced),
        absent=resolved.absent,
    )
    out = results_path(mo.results_dir, cell.id, group)
    return _Group(group, resolved, sources, mutants, run, out, reasons=reasons, release=cell.vllm)


def _plan(g: _Group, only: tuple[str, ...]) -> None:
    """Apply the picked mutants in memory (an ambiguous or broken one stops us before any run) and place them."""
    picked = set(only) if only else None  # ids of every group (checked by _check_only)
    locators = {path: covmap.Locator(text) for path, text in g.sources.items()}
    for mutant, path in g.mutants:
        if picked is not None and mutant.id not in picked:
            continue
        source = g.sources[path]
        mutated = mutant.apply(source)
        span = _span_of(mutant, source)
        loc = locators[path]
        where = loc.where(*span) if span is not None else None
        line = loc.line_of(loc.strip(*span)[0]) if span is not None else None
        g.planned.append(_Planned(mutant, mutated, path, line, where))


def _span_of(mutant, source: str) -> tuple[int, int] | None:
    if isinstance(mutant, gen.GeneratedMutant):
        return mutant.start, mutant.end
    found = mutant.locate(source)
    return found[1] if found else None


def _check_only(groups: list[_Group], only: tuple[str, ...]) -> None:
    known = {m.id for g in groups for m, _ in g.mutants}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise cat.CatalogueError(
            f"no mutant {', '.join(unknown)} for this release; see results/mutants-<cell>.json for ids"
        )


# -- the session -------------------------------------------------------------------------------------


def _run(cell: Cell, mo: MutationOptions, progress: Callable[[str], None]) -> list[MutationRun]:
    lock = mo.cell_work / cell.id / "lock.txt"
    if not lock.is_file():
        raise MutationError(
            f"cell {cell.id} has no lock ({lock}); run the cell once first: nox -s matrix -k {cell.tags[3]}"
        )
    mo = _without_known_bugs(cell, mo, progress)
    names = tg.check_groups(tuple(mo.targets))
    written = cat.load(mo.catalogue) if "multi" in names else []
    ctx = _context(cell, mo, progress, timeout_s=3600.0)
    held = guard_for(mo.home, cell).lock()
    t_session = time.monotonic()
    try:
        ctx.files.start_log(f"# kvcompat mutation session {cell.id} started {ctx.started}")
        reap_leftover(ctx.files, ctx.say)  # a pytest left running by a SIGKILLed session
        _prepare_venv(ctx, mo, lock, names)
        groups = [_group(cell, mo, ctx, name, written) for name in names]
        _check_only(groups, mo.only)
        if mo.only:  # a group none of whose mutants is picked is left as it is
            groups = [g for g in groups if any(m.id in mo.only for m, _ in g.mutants)]
        for g in groups:
            _plan(g, mo.only)
        selecting = _selection_ready(ctx, mo)
        suite = _ours_fingerprint(ctx, _suite_run(ctx))
        for g in groups:
            g.run.suite = suite
            _keep_previous(g, cell, mo)
            if g.kept and not mo.only and not mo.upstream_only:
                ctx.say(
                    f"{g.name}: resuming an interrupted run: {len(g.kept)} verdicts kept, {len(g.planned)} to score"
                )
        t0 = time.monotonic()
        if not mo.upstream_only:
            baseline, scored = _baseline(ctx, mo, groups, selecting)
            for g in groups:
                g.run.baseline, g.run.scored = baseline, scored
        # A group's results file is first written with its first verdict (a session stopped before then leaves
        # the previous run's verdicts as they were), or below, when no mutant can be scored.
        if not all(g.run.scored for g in groups):
            base = groups[0].run.baseline
            ctx.say(f"baseline is {base['outcome']}: {base['detail']}; mutants not scored")
            for g in groups:
                g.run.finished = now()
                write_atomic(g.out, json.dumps(g.run.to_json(), indent=1))
            return [g.run for g in groups]
        upstream = _upstream_scorer(cell, mo, progress, groups, selecting)
        baseline_s = round(time.monotonic() - t0, 2)
        for g in groups:
            _score_group(cell, mo, progress, g, upstream, baseline_s)
        ctx.say(f"session done in {time.monotonic() - t_session:.0f}s")
        return [g.run for g in groups]
    finally:
        held.close()


def _keep_previous(g: _Group, cell: Cell, mo: MutationOptions) -> None:
    """--mutant ID reruns those mutants only: the previous full run's other verdicts are kept, so a rerun of
    a few (a new test, a new equivalence reason) never loses the rest of the score.  --upstream-only keeps
    ours' verdicts of every mutant."""
    run = g.run
    run.planned = len(g.planned)
    resuming = not mo.only and not mo.upstream_only
    if resuming:
        previous = interrupted_verdicts(g.out, run)
        done = {v.id for v in previous}
        g.planned = [p for p in g.planned if p.mutant.id not in done]
        run.planned = len(g.planned)
    else:
        previous = kept_verdicts(g.out, run, mo.only or ("*",))
    g.kept = [g.explain(v) for v in previous]
    g.ours_before = {v.id: v for v in g.kept} if mo.upstream_only else {}
    if mo.upstream_only:
        prev = read_run(g.out) or {}
        if not g.ours_before or "upstream" not in cell.suites:
            raise MutationError(
                f"--upstream-only keeps our suite's verdicts of a previous scored run of {cell.id} with the "
                "upstream column; run `nox -s mutants` on that cell without --upstream-only first"
            )
        g.kept = [v for v in g.kept if v.id not in {p.mutant.id for p in g.planned}]
        run.baseline, run.scored = prev["baseline"], True
    run.planned += len(g.kept)
    # Every write of the results file from here on holds the kept verdicts: a rerun of a few mutants that is
    # stopped before its first verdict leaves the previous run's score as it was, not emptied.
    run.mutants = list(g.kept)


def _score_group(
    cell: Cell, mo: MutationOptions, progress: Callable[[str], None], g: _Group, upstream, baseline_s: float
) -> None:
    run = g.run
    timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * run.baseline["seconds"])
    ctx = _context(cell, mo, progress, timeout_s=timeout)
    passed = list(run.baseline["passed"])
    killers = Killers(ctx.files.work / "killers.txt")
    site, state = site_for(mo.home, cell), state_for(mo.home, cell)
    decided: dict[str, MutantVerdict] = {}
    t0, runs = time.monotonic(), 0
    spent = {"ours": 0.0, "upstream": 0.0}  # wall time of each suite's scoring, apart
    if len(g.planned) and g.name != "multi":
        ctx.say(f"{g.name}: {len(g.planned)} mutants in {len(g.sources)} files ({run.selection or 'whole suite'})")
    forked = _Forked(ctx, g, passed, site, timeout, mo.fork_jobs) if mo.fork else None
    for n, p in enumerate(g.planned, 1):
        twin = decided.get(getattr(p.mutant, "same_as", None) or "")
        guard = Guard(site, state, p.target)
        if twin is not None:
            verdict = _same_as(p, twin)
        else:
            before = g.ours_before.get(p.mutant.id)
            t_ours = time.monotonic()
            verdict = before or (forked and forked.verdict(n - 1))
            verdict = verdict or _score(ctx, guard, p, passed, killers, _lines(g, "ours", p))
            spent["ours"] += time.monotonic() - t_ours
            runs += before is None and verdict.status in (KILLED, SURVIVED) and verdict.how != UNREACHED
            if upstream is not None and verdict.status in (KILLED, SURVIVED):
                t_up = time.monotonic()
                verdict.upstream = upstream(guard, p, _lines(g, "upstream", p))
                spent["upstream"] += time.monotonic() - t_up
        decided[p.mutant.id] = g.explain(verdict)
        run.mutants = merge(g.kept, list(decided.values()))
        ctx.say(f"mutant {n}/{len(g.planned)} {p.mutant.id}: {_say(verdict)}")
        run.timing = _timing(baseline_s, time.monotonic() - t0, len(decided), runs, spent)
        write_atomic(g.out, json.dumps(run.to_json(), indent=1))
    run.finished = now()
    run.timing = _timing(baseline_s, time.monotonic() - t0, len(decided), runs, spent)
    write_atomic(g.out, json.dumps(run.to_json(), indent=1))
    if g.kept:
        ctx.say(f"kept the previous run's verdicts of {len([k for k in g.kept if k.id not in decided])} other mutants")
    c = run.counts()
    absent = f" ({run.absent})" if run.absent else ""
    ctx.say(
        f"{'' if g.name == 'multi' else g.name + ': '}{c[KILLED]} killed, {c[SURVIVED]} survived"
        f"{f' ({run.not_reached} of them reached by no test)' if run.not_reached else ''}"
        f"{f' ({run.explained} of them explained)' if run.explained else ''}, "
        f"{c[NOT_APPLICABLE]} not applicable, {c[EQUIVALENT]} equivalent{absent}; wrote {_rel(g.out, mo.repo)}"
    )


class _Forked:
    """Our suite's verdicts of a group's mutants, scored in batches by kvcompat.mutation.incell.forkrun: one pytest
    imports the release once per batch and forks a child per mutant.  A mutant it cannot swap in (a change
    outside any function) gets no verdict here and is scored the usual way."""

    # Mutants a pytest: its import is paid once per batch, and a batch ends with its slowest child (a mutant
    # that hangs asleep holds the machine idle until its time is up), so batches are large; a pytest killed
    # from outside loses one batch, and the session resumes after the verdicts it wrote.
    BATCH = 160

    MIN_TIMEOUT_S = 30.0  # a child's own start (the session's fixtures) and a loaded machine's slack
    # A child shuts each test's engines down in line (testkit/shutdowns.py INLINE), the baseline beside the
    # next tests, so a test's baseline time lacks its shutdowns: about a second asleep per engine with a Nixl
    # listener.  Measured on 0.33.0: the 51 tests that reach nixl/pull_scheduler.py L248 take 7.4 s in the
    # baseline and 50 s of wall (5 s of CPU) in a pristine child.  Each test's limit gets this much more.
    INLINE_SHUTDOWN_S = 2.0

    def __init__(
        self, ctx: CellContext, g: _Group, passed: list[str], site: Path, timeout: float, jobs: int = 1
    ) -> None:
        self.ctx, self.g, self.passed, self.site, self.timeout, self.jobs = ctx, g, passed, site, timeout, jobs
        self.durations: dict[str, float] = g.run.baseline.get("durations") or {}
        self.answers: dict[str, dict] = {}
        self.batched: set[int] = set()

    def _limit(self, tests: list[str] | None) -> float:
        """A mutant's time limit: 5 times its tests' unmutated time (at least MIN_TIMEOUT_S) plus
        INLINE_SHUTDOWN_S a test, never more than the whole suite's limit; the whole suite's limit when it
        runs every test or the times are unknown."""
        if tests is None or not self.durations:
            return self.timeout
        own = max(self.MIN_TIMEOUT_S, 5 * sum(self.durations.get(t, 5.0) for t in tests))
        return min(self.timeout, own + self.INLINE_SHUTDOWN_S * len(tests))

    def _module(self, target: str) -> str:
        return target.removesuffix(".py").removesuffix("/__init__").replace("/", ".")

    def _runnable(self, i: int) -> bool:
        p = self.g.planned[i]
        return p.mutated is not None and not p.mutant.equivalent and not getattr(p.mutant, "same_as", None)

    def _batch_from(self, start: int) -> None:
        plan, picked = [], []
        for i in range(start, len(self.g.planned)):
            if len(plan) >= self.BATCH:
                break
            if i in self.batched or not self._runnable(i):
                continue
            p = self.g.planned[i]
            chosen = _select(_lines(self.g, "ours", p), p, self.passed)
            self.batched.add(i)
            if not chosen.reached:
                continue  # decided without a run (_score says so)
            tests = None if chosen.tests is None else list(chosen.tests)
            plan.append(
                {
                    "id": p.mutant.id,
                    "module": self._module(p.target),
                    "source": p.mutated,
                    "tests": tests,
                    "timeout": self._limit(tests),
                    "why": chosen.why,
                }
            )
            picked.append(i)
        if not plan:
            return
        work = self.ctx.files.work
        work.mkdir(parents=True, exist_ok=True)
        plan_path, out = work / "fork-plan.json", work / "fork-out.jsonl"
        plan_path.write_text(json.dumps(plan))
        out.unlink(missing_ok=True)
        run = _suite_run(
            self.ctx,
            "-p",
            "kvcompat.mutation.incell.forkrun",
            f"--kvcompat-fork-plan={plan_path}",
            f"--kvcompat-fork-out={out}",
            f"--kvcompat-fork-jobs={self.jobs}",
        )
        cmd = [
            self.ctx.python,
            "-m",
            "pytest",
            run.path,
            "-p",
            "no:cacheprovider",
            "-q",
            f"--rootdir={run.cwd}",
            *run.args,
            *self.ctx.opts.pytest_args,
        ]
        self.ctx.say(
            f"fork: {len(plan)} mutants in one pytest (the release imported once, {self.jobs} children at a time)"
        )
        self.ctx.sh(cmd, timeout=60.0 + sum(m["timeout"] for m in plan), phase="test", env=run.env, cwd=run.cwd)
        whys = {m["id"]: m["why"] for m in plan}
        for line in out.read_text().splitlines() if out.exists() else []:
            answer = json.loads(line)
            answer["why"] = whys.get(answer["id"], "")
            self.answers[answer["id"]] = answer

    def verdict(self, i: int) -> MutantVerdict | None:
        """Our suite's verdict of planned mutant ``i``, or None: score it the usual way."""
        if not self._runnable(i):
            return None
        if i not in self.batched:
            self._batch_from(i)
        p = self.g.planned[i]
        answer = self.answers.get(p.mutant.id)
        if answer is not None and "missing" in answer:
            raise MutationError(
                f"the suite changed during the session: {len(answer['missing'])} tests the baseline ran are not "
                f"collected now (e.g. {answer['missing'][0]}); rerun `nox -s mutants` (it resumes)"
            )
        if answer is None or "unswappable" in answer:
            return None
        base = {**_base(p), "seconds": answer["seconds"]}
        tests = answer.get("tests", [])
        base["tests_run"] = len(tests)
        if answer.get("timeout"):
            return MutantVerdict(
                **base,
                status=KILLED,
                killed_by="timeout",
                how="timeout",
                detail=(
                    f"the forked child ran past its {answer.get('limit', self.timeout):.0f}s "
                    f"({answer.get('cpu_s', 0):.0f}s of CPU)"
                ),
            )
        green = set(self.passed)
        killed = [t for t in tests if t["nodeid"] in green and t["outcome"] not in STILL_GREEN]
        if killed:
            t = killed[0]
            return MutantVerdict(
                **base,
                status=KILLED,
                killed_by=t["nodeid"],
                how="test",
                detail=f"{t['outcome']}: {headline(t['message'])}"[:400],
            )
        if "crash" in answer:
            # A forked child can die for reasons of its own (a library's state after fork): the usual way,
            # a fresh pytest with the mutated file, decides whether the mutant itself crashes the suite.
            return None
        green_now = sum(1 for t in tests if t["outcome"] in STILL_GREEN)
        return MutantVerdict(
            **base, status=SURVIVED, detail=f"{answer['why']}; {green_now}/{len(tests)} of them passed"
        )


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


def _lines(g: _Group, suite: str, p: _Planned) -> covmap.FileLines | None:
    files = g.maps.get(suite)
    return None if files is None else files.get(p.target, {})


def _rel(path: Path, root: Path) -> Path:
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return path


def _prepare_venv(ctx: CellContext, mo: MutationOptions, lock: Path, groups: tuple[str, ...]) -> None:
    """Build (or re-sync) the session's venv from the cell's lock, after undoing what a killed session left.

    Every file with a journal is put back (whichever group the killed session ran), and every file of this
    session's groups is checked against RECORD: one that differs with no pristine copy to restore it from
    means the venv is rebuilt."""
    site, state = site_for(mo.home, ctx.cell), state_for(mo.home, ctx.cell)
    if site.is_dir():
        check = [*guards.journaled(state), cat.TARGET]
        for group in groups:
            check += [f.path for f in tg.resolve(site, group).files]
        for target in dict.fromkeys(check):
            guard = Guard(site, state, target)
            if not guard.path.exists():
                continue
            try:
                done = guard.recover()
            except GuardError as exc:
                ctx.say(f"{exc}: rebuilding the mutation venv")
                shutil.rmtree(ctx.venv)
                break
            if done:
                ctx.say(done)
    ctx.files.work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lock, ctx.files.lock)
    with ctx.timed("install"):
        failure = install._install(ctx)  # the cell's own recipe: uv venv, uv pip sync of the lock, the harness .pth
    if failure is not None:
        raise MutationError(f"could not build the mutation venv {ctx.venv}: {failure}; see {ctx.files.log}")
    if "multi" in groups and not guard_for(mo.home, ctx.cell).path.is_file():
        raise MutationError(f"{cat.TARGET} is not in {cell_label(ctx.cell)}; there is nothing to mutate")


def _selection_ready(ctx: CellContext, mo: MutationOptions) -> str | None:
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


def cell_label(cell: Cell) -> str:
    return f"{cell.dist} {cell.vllm}"


def _suite_run(ctx: CellContext, *extra: str) -> suites.SuiteRun:
    # RunOptions.pytest_args (the session's extra arguments) come after these, as in a matrix cell
    return suites.SuiteRun(
        path=ctx.opts.suite,
        cwd=ctx.opts.repo,
        args=["-m", suites.suite_marker(ctx.cell), *extra],
        env=suites.suite_env(ctx.cell),
    )


def _ours_fingerprint(ctx: CellContext, run: suites.SuiteRun) -> str:
    suite = Path(run.path) if Path(run.path).is_absolute() else ctx.opts.repo / run.path
    testkit = Path(__file__).resolve().parent.parent / "testkit"  # what the suite drives vLLM with
    return covmap.fingerprint([suite, testkit], [*run.args, *ctx.opts.pytest_args], run.env)


def _measured(
    ctx: CellContext,
    results_dir: Path,
    suite: str,
    run: suites.SuiteRun,
    groups: list[_Group],
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


def _baseline(ctx: CellContext, mo: MutationOptions, groups: list[_Group], selecting: str | None) -> tuple[dict, bool]:
    """Our suite's unmutated run (under coverage when a group's map is stale): its record, and whether it is green."""
    run = _suite_run(ctx)
    run, after = _measured(ctx, mo.results_dir, "ours", run, groups, selecting, _ours_fingerprint(ctx, run))
    t0 = time.monotonic()
    with ctx.timed("baseline"):
        verdict = suites.run_pytest(ctx, "ours", run)
    green = verdict.outcome is Outcome.PASS
    after(green)
    return _baseline_record(verdict, time.monotonic() - t0), green


def _upstream_scorer(
    cell: Cell, mo: MutationOptions, progress: Callable[[str], None], groups: list[_Group], selecting: str | None
) -> Callable[[Guard, _Planned, covmap.FileLines | None], dict] | None:
    """Score mutants against the upstream column too, when the cell has one and it is green on the baseline."""
    if "upstream" not in cell.suites:
        return None
    ctx = _context(cell, mo, progress, timeout_s=3600.0)
    t0 = time.monotonic()
    with ctx.timed("upstream baseline"):
        try:
            prepared = suites.suite_run(ctx, "upstream")
        except Exception as exc:  # e.g. the sdist cannot be fetched: as suites.run_suite says it
            verdict = suites.SuiteVerdict(Outcome.TEST_ERROR, f"could not prepare the upstream suite: {exc}", [])
            prepared = None
        if prepared is not None and not prepared.path:
            verdict = suites.run_suite(ctx, "upstream")  # nothing of it in this release: its not-applicable verdict
            prepared = None
        if prepared is not None:
            print_ = covmap.fingerprint([Path(prepared.path)], [*prepared.args, *ctx.opts.pytest_args], prepared.env)
            measured, after = _measured(ctx, mo.results_dir, "upstream", prepared, groups, selecting, print_)
            verdict = suites.run_pytest(ctx, "upstream", measured)
            if prepared.not_applicable:  # as suites.run_suite records them
                verdict.tests += prepared.not_applicable
                verdict.detail += "; not applicable here: " + ", ".join(
                    t.message or "" for t in prepared.not_applicable
                )
            after(verdict.outcome is Outcome.PASS)
    record = _baseline_record(verdict, time.monotonic() - t0)
    for g in groups:
        g.run.upstream_baseline = record
    passed = list(record["passed"])
    if verdict.outcome is not Outcome.PASS or prepared is None:
        ctx.say(f"upstream baseline is {verdict.outcome.value}: {verdict.detail}; mutants scored by ours only")
        return None
    timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * record["seconds"])
    ctx = _context(cell, mo, progress, timeout_s=timeout)
    killers = Killers(ctx.files.work / "killers-upstream.txt")

    def score(guard: Guard, p: _Planned, lines: covmap.FileLines | None) -> dict:
        chosen = _select(lines, p, passed)
        if not chosen.reached:
            v = _unreached(p, chosen)
        else:
            extra = ["-x", f"--kvcompat-first={killers.path}", *_only(ctx, "upstream", chosen)]
            run_ = dataclasses.replace(prepared, args=[*prepared.args, *extra])
            v = _judge(ctx, guard, p, passed, killers, "upstream", run_, chosen)
        return {k: getattr(v, k) for k in ("status", "killed_by", "how", "detail", "seconds")}

    return score


def _baseline_record(verdict: suites.SuiteVerdict, seconds: float) -> dict:
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


def select_mutants(mutants: list, only: tuple[str, ...]) -> list:
    """The mutants named in ``only`` (all when empty), written and generated alike; an unknown id is bad input."""
    if not only:
        return mutants
    known = {m.id for m in mutants}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise cat.CatalogueError(
            f"no mutant {', '.join(unknown)} for this release; see results/mutants-<cell>.json for ids"
        )
    return [m for m in mutants if m.id in only]


def _origin(mutant) -> str:
    return "generated" if isinstance(mutant, gen.GeneratedMutant) else "catalogue"


def _base(p: _Planned) -> dict:
    m = p.mutant
    return {
        "id": m.id,
        "contract": m.contract,
        "description": m.description,
        "origin": _origin(m),
        "file": p.target,
        "line": p.line,
    }


def _same_as(p: _Planned, twin: MutantVerdict) -> MutantVerdict:
    """A mutant that makes the same program as one already run: that one's verdict."""
    why = "for two children" if p.target == cat.TARGET else "(a negated test is its flipped comparison)"
    return dataclasses.replace(
        twin,
        **_base(p),
        detail=f"the same program as {twin.id} {why}: {twin.detail}"[:400],
        seconds=0.0,
    )


def _select(lines: covmap.FileLines | None, p: _Planned, passed: list[str]) -> covmap.Selection:
    if lines is None or p.where is None:
        return covmap.Selection(None, "the whole suite")
    return covmap.select(lines, p.where, passed)


def _unreached(p: _Planned, chosen: covmap.Selection) -> MutantVerdict:
    lines = sorted(p.where.lines) if p.where else []
    span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}" if lines else "its lines"
    return MutantVerdict(
        **_base(p),
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


def _score(
    ctx: CellContext,
    guard: Guard,
    p: _Planned,
    passed: list[str],
    killers: Killers,
    lines: covmap.FileLines | None,
) -> MutantVerdict:
    base = _base(p)
    if p.mutated is None:
        return MutantVerdict(**base, status=NOT_APPLICABLE, detail=f"target code absent in {cell_label(ctx.cell)}")
    if p.mutant.equivalent:
        return MutantVerdict(**base, status=EQUIVALENT, reason=p.mutant.equivalent)
    chosen = _select(lines, p, passed)
    if not chosen.reached:
        return _unreached(p, chosen)
    run = _suite_run(ctx, "-x", f"--kvcompat-first={killers.path}", *_only(ctx, "ours", chosen))
    return _judge(ctx, guard, p, passed, killers, "ours", run, chosen)


def _judge(
    ctx: CellContext,
    guard: Guard,
    p: _Planned,
    passed: list[str],
    killers: Killers,
    suite: str,
    run: suites.SuiteRun,
    chosen: covmap.Selection,
) -> MutantVerdict:
    """Run ``suite`` with the mutant applied: killed (by a test green on the baseline, a timeout, a crash) or survived."""
    base = {**_base(p), "tests_run": None if chosen.tests is None else len(chosen.tests)}
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
            **base, status=KILLED, killed_by="timeout", how="timeout", detail=verdict.detail, seconds=seconds
        )
    killed = [t for t in verdict.tests if t.nodeid in green and t.outcome.value not in STILL_GREEN]
    if killed:
        t = killed[0]
        killers.saw(t.nodeid)
        return MutantVerdict(
            **base,
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
            **base, status=KILLED, killed_by="crash", how="crash", detail=verdict.detail, seconds=seconds
        )
    if chosen.tests is None:
        detail = verdict.detail
    else:  # the suite's own line would count the others as "not run here (-m …)"
        green_now = sum(1 for t in verdict.tests if t.outcome.value in STILL_GREEN)
        detail = f"{chosen.why}; {green_now}/{len(verdict.tests)} of them passed"
    return MutantVerdict(**base, status=SURVIVED, detail=detail, seconds=seconds)


def _say(v: MutantVerdict) -> str:
    ours = _say_ours(v)
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


def _say_ours(v: MutantVerdict) -> str:
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


# -- the nox session's front --------------------------------------------------------------


class _Keywords(dict):
    """nox's -k semantics: a name is true when it is a substring of one of the cell's keywords."""

    def __init__(self, keywords: list[str]) -> None:
        super().__init__()
        self.keywords = keywords

    def __missing__(self, name: str) -> bool:
        return any(name in k for k in self.keywords)


def select_cells(cells: list[Cell], expression: str | None) -> list[Cell]:
    """The cells whose tags (and id) match ``expression``, as ``nox -k`` matches the matrix sessions.

    Only cells that run our connector suite: mutants are scored by it (an e2e-only cell has no
    baseline to score against)."""
    ours = [c for c in cells if "ours" in c.suites]
    if not ours:
        raise MutationError(
            'no cell of this matrix runs the connector suite (suites = ["ours"]), which scores the mutants; '
            "pick a matrix that does with KVCOMPAT_MATRIX=… (e.g. history)"
        )
    cells = ours
    if not expression:
        return list(cells)
    try:
        code = compile(expression, "-k", "eval")
    except SyntaxError:
        raise MutationError(f"-k {expression!r} is not a Python expression; write e.g. -k vllm_0_33_0") from None
    chosen = [c for c in cells if eval(code, {"__builtins__": {}}, _Keywords([*c.tags, c.id]))]  # noqa: S307
    if not chosen:
        known = ", ".join(c.tags[3] for c in cells) or "none"
        raise MutationError(
            f"-k {expression!r} matches no cell of the matrix (its cells: {known}); "
            "pick another matrix with KVCOMPAT_MATRIX=… or list the cells with `nox -l -s matrix`"
        )
    return chosen


def options_for(root: Path, values, pytest_args: list[str] = ()) -> MutationOptions:
    return MutationOptions(
        repo=root,
        catalogue=root / "tests" / "mutants" / "multi_connector.toml",
        reasons=root / "tests" / "mutants" / "equivalent.toml",
        results_dir=root / "results",
        home=root / ".kvcompat" / "mutants",
        cell_work=root / ".kvcompat" / "cells",
        only=tuple(values.mutant),
        timeout_s=values.mutant_timeout,
        index_url=values.index_url,
        find_links=tuple(values.find_links),
        pytest_args=tuple(pytest_args),
        upstream_only=bool(values.upstream_only),
        ours_only=bool(getattr(values, "ours_only", False)),
        fork=bool(getattr(values, "fork", False)),
        fork_jobs=int(getattr(values, "fork_jobs", None) or MutationOptions.fork_jobs),
        targets=tg.check_groups(tuple(getattr(values, "target", ()) or tg.DEFAULT_GROUPS)),
    )


def summary(run: MutationRun) -> str:
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
