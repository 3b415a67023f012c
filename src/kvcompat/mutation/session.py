"""A mutation session for one cell: its own venv, a green baseline, then one suite run per mutant.

    .kvcompat/mutants/venvs/<cell>            the session's venv, from the cell's lock (never the cell's venv)
    .kvcompat/mutants/venvs/<cell>.mutation/  journal.json, pristine.py, session.lock (kvcompat.mutation.guard)
    .kvcompat/mutants/cells/<cell>/           the session's log and pytest reports
    results/mutants-<cell>.json               the verdicts, rewritten (atomically) after every mutant

A mutant is *killed* when a test that passed on the baseline fails or errors with it
applied (pytest runs with -x, so the first such test is the killer), when the suite
crashes, or when the run exceeds the per-mutant timeout.  It *survived* when every
test still passes.  It is *not applicable* when its target code is absent from this
release's file, and *equivalent* when the catalogue says why no test can tell it apart.

In a cell that runs the upstream column (vLLM's own tests of the pair, ``suites = [..., "upstream"]``),
every mutant ours saw (neither equivalent nor absent) is scored a second time against those tests, the
same way: ``MutantVerdict.upstream`` holds that verdict, so the report can say, per release, how many
mutants each suite kills and which only one of them kills.
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

from kvcompat.atomic import write_atomic
from kvcompat.cells import Cell
from kvcompat.errors import KvcompatError
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import generate as gen
from kvcompat.mutation.guard import Guard, GuardError
from kvcompat.outcomes import Outcome
from kvcompat.results import headline
from kvcompat.run import install, suites
from kvcompat.run.context import CellContext, now
from kvcompat.run.options import RunOptions
from kvcompat.run.process import reap_leftover

SCHEMA = "kvcompat-mutants/1"
KILLED, SURVIVED, NOT_APPLICABLE, EQUIVALENT = "killed", "survived", "not_applicable", "equivalent"
STATUSES = (KILLED, SURVIVED, NOT_APPLICABLE, EQUIVALENT)
# A test that was green on the baseline and is not now (failed, error, unsupported, …) kills the mutant.
STILL_GREEN = ("passed", "not_applicable")


class MutationError(KvcompatError):
    """The mutation session cannot start for this cell; the message names the fix."""


def results_path(results_dir: Path, cell_id: str) -> Path:
    return results_dir / f"mutants-{cell_id}.json"


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
    # tests/mutants/equivalent.toml: why generated mutants are equivalent (per release), and methods with no site
    reasons: Path | None = None
    # Score the upstream column only, keeping our suite's verdicts from the previous scored run (ours takes
    # ~11 s a mutant, upstream ~50 s: the two need not be paid together).
    upstream_only: bool = False

    MIN_TIMEOUT_S = 120.0


@dataclasses.dataclass
class MutantVerdict:
    id: str
    contract: str
    description: str
    status: str
    killed_by: str | None = None  # a test node id, "timeout" or "crash"
    how: str | None = None  # test | timeout | crash
    detail: str = ""
    seconds: float = 0.0
    reason: str | None = None  # equivalent: why
    origin: str = "catalogue"  # or "generated" (kvcompat.mutation.generate)
    # The upstream column's verdict on the same mutant: {"status", "killed_by", "how", "detail", "seconds"};
    # None where the cell has no upstream column or the mutant was not run (equivalent, absent).
    upstream: dict | None = None


@dataclasses.dataclass
class MutationRun:
    cell: dict
    catalogue: str
    target: str
    started: str
    baseline: dict = dataclasses.field(default_factory=dict)
    upstream_baseline: dict = dataclasses.field(default_factory=dict)  # {} where the cell has no upstream column
    mutants: list[MutantVerdict] = dataclasses.field(default_factory=list)
    scored: bool = False
    finished: str | None = None
    planned: int = 0
    pytest_args: list[str] = dataclasses.field(default_factory=list)
    # per method of MultiConnector and its classes: "N mutants", or why it needs none, or "MISSING"
    coverage: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def uncovered(self) -> list[str]:
        return [m for m, how in self.coverage.items() if how == "MISSING"]

    @property
    def id(self) -> str:
        return self.cell["id"]

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for m in self.mutants if m.status == s) for s in STATUSES}

    @property
    def survivors(self) -> list[MutantVerdict]:
        return [m for m in self.mutants if m.status == SURVIVED]

    @property
    def ok(self) -> bool:
        """Baseline green, every mutant decided, none survived, every method covered or explained."""
        return self.scored and self.finished is not None and not self.survivors and not self.uncovered

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "id": self.id,
            "cell": self.cell,
            "catalogue": self.catalogue,
            "target": self.target,
            "started": self.started,
            "finished": self.finished,
            "scored": self.scored,
            "baseline": self.baseline,
            "upstream_baseline": self.upstream_baseline,
            "planned": self.planned,
            "pytest_args": self.pytest_args,
            "counts": self.counts(),
            "coverage": self.coverage,
            "mutants": [dataclasses.asdict(m) for m in self.mutants],
        }


def _kept_verdicts(out: Path, run: MutationRun, only: tuple[str, ...]) -> list[MutantVerdict]:
    """With ``only``: the previous run's verdicts, when it scored the same target with the same pytest
    arguments (else nothing is kept: a changed release or test selection is scored afresh)."""
    prev = read_run(out) if only else None
    if not prev or not prev.get("scored") or prev.get("target") != run.target:
        return []
    if prev.get("pytest_args", []) != run.pytest_args:
        return []
    fields = {f.name for f in dataclasses.fields(MutantVerdict)}
    return [MutantVerdict(**{k: v for k, v in m.items() if k in fields}) for m in prev.get("mutants", [])]


def _merge(kept: list[MutantVerdict], new: list[MutantVerdict]) -> list[MutantVerdict]:
    """The previous verdicts in their order, each replaced by its new one; new ids after them."""
    fresh = {v.id: v for v in new}
    merged = [fresh.pop(v.id, v) for v in kept]
    return merged + list(fresh.values())


def read_run(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def venv_for(home: Path, cell: Cell) -> Path:
    return home / "venvs" / cell.id


def guard_for(home: Path, cell: Cell) -> Guard:
    venv = venv_for(home, cell)
    return Guard(venv / "lib" / f"python{cell.python}" / "site-packages", venv.parent / f"{cell.id}.mutation")


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def run_mutants(cell: Cell, mo: MutationOptions, progress: Callable[[str], None] = print) -> MutationRun:
    """Run the catalogue against ``cell``; SIGTERM is handled like Ctrl-C (the file is restored either way)."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        return _run(cell, mo, progress)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


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


def _run(cell: Cell, mo: MutationOptions, progress: Callable[[str], None]) -> MutationRun:
    lock = mo.cell_work / cell.id / "lock.txt"
    if not lock.is_file():
        raise MutationError(
            f"cell {cell.id} has no lock ({lock}); run the cell once first: nox -s matrix -k {cell.tags[3]}"
        )
    written = cat.load(mo.catalogue)
    reasons = gen.load_reasons(mo.reasons)
    ctx = _context(cell, mo, progress, timeout_s=3600.0)
    guard = guard_for(mo.home, cell)
    held = guard.lock()
    try:
        ctx.files.start_log(f"# kvcompat mutation session {cell.id} started {ctx.started}")
        reap_leftover(ctx.files, ctx.say)  # a pytest left running by a SIGKILLed session
        _prepare_venv(ctx, guard, lock)
        source = guard.save_pristine().decode()
        mutants = select_mutants(written + gen.mutants_for(source, cell.vllm, reasons), mo.only)
        plan = [(m, m.apply(source)) for m in mutants]  # an ambiguous or broken mutant stops us before any run
        run = MutationRun(
            cell=cell.to_json(),
            catalogue=str(_rel(mo.catalogue, mo.repo)),
            target=guard.target,
            started=ctx.started,
            planned=len(plan),
            pytest_args=list(mo.pytest_args),
            coverage=gen.coverage(source, reasons),
        )
        out = results_path(mo.results_dir, cell.id)
        # --mutant ID reruns those mutants only: the previous full run's other verdicts are kept, so a
        # rerun of a few (a new test, a new equivalence reason) never loses the rest of the score.
        kept = _kept_verdicts(out, run, mo.only or (("*",) if mo.upstream_only else ()))
        ours_before = {v.id: v for v in kept} if mo.upstream_only else {}
        if mo.upstream_only:
            prev = read_run(out) or {}
            if not ours_before or "upstream" not in cell.suites:
                raise MutationError(
                    f"--upstream-only keeps our suite's verdicts of a previous scored run of {cell.id} with the "
                    "upstream column; run `nox -s mutants` on that cell without --upstream-only first"
                )
            kept = [v for v in kept if v.id not in {m.id for m, _ in plan}]
            run.baseline, run.scored = prev["baseline"], True
        run.planned += len(kept)
        if not mo.upstream_only:
            _baseline(ctx, run)
        write_atomic(out, json.dumps(run.to_json(), indent=1))
        if not run.scored:
            ctx.say(f"baseline is {run.baseline['outcome']}: {run.baseline['detail']}; mutants not scored")
            run.finished = now()
            write_atomic(out, json.dumps(run.to_json(), indent=1))
            return run
        timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * run.baseline["seconds"])
        ctx = _context(cell, mo, progress, timeout_s=timeout)
        passed = set(run.baseline["passed"])
        killers = Killers(ctx.files.work / "killers.txt")
        upstream = _upstream_scorer(cell, mo, progress, run)
        decided: dict[str, MutantVerdict] = {}
        for n, (mutant, mutated) in enumerate(plan, 1):
            twin = decided.get(getattr(mutant, "same_as", None) or "")
            if twin is not None:
                verdict = _same_as(mutant, twin)
            else:
                verdict = ours_before.get(mutant.id) or _score(ctx, guard, mutant, mutated, passed, killers)
                if upstream is not None and verdict.status in (KILLED, SURVIVED):
                    verdict.upstream = upstream(guard, mutant, mutated)
            decided[mutant.id] = verdict
            run.mutants = _merge(kept, list(decided.values()))
            ctx.say(f"mutant {n}/{len(plan)} {mutant.id}: {_say(verdict)}")
            write_atomic(out, json.dumps(run.to_json(), indent=1))
        run.finished = now()
        write_atomic(out, json.dumps(run.to_json(), indent=1))
        if kept:
            ctx.say(
                f"kept the previous run's verdicts of {len([k for k in kept if k.id not in decided])} other mutants"
            )
        c = run.counts()
        ctx.say(
            f"{c[KILLED]} killed, {c[SURVIVED]} survived, {c[NOT_APPLICABLE]} not applicable, "
            f"{c[EQUIVALENT]} equivalent; wrote {_rel(out, mo.repo)}"
        )
        return run
    finally:
        held.close()


def _rel(path: Path, root: Path) -> Path:
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return path


def _prepare_venv(ctx: CellContext, guard: Guard, lock: Path) -> None:
    """Build (or re-sync) the session's venv from the cell's lock, after undoing what a killed session left."""
    if guard.path.exists():
        try:
            done = guard.recover()
        except GuardError as exc:
            ctx.say(f"{exc}: rebuilding the mutation venv")
            shutil.rmtree(ctx.venv)
            done = None
        if done:
            ctx.say(done)
    ctx.files.work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lock, ctx.files.lock)
    with ctx.timed("install"):
        failure = install._install(ctx)  # the cell's own recipe: uv venv, uv pip sync of the lock, the harness .pth
    if failure is not None:
        raise MutationError(f"could not build the mutation venv {ctx.venv}: {failure}; see {ctx.files.log}")
    if not guard.path.is_file():
        raise MutationError(f"{guard.target} is not in {cell_label(ctx.cell)}; there is nothing to mutate")


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


def _upstream_scorer(
    cell: Cell, mo: MutationOptions, progress: Callable[[str], None], run: MutationRun
) -> Callable[[Guard, object, str], dict] | None:
    """Score mutants against the upstream column too, when the cell has one and it is green on the baseline."""
    if "upstream" not in cell.suites:
        return None
    ctx = _context(cell, mo, progress, timeout_s=3600.0)
    t0 = time.monotonic()
    with ctx.timed("upstream baseline"):
        verdict = suites.run_suite(ctx, "upstream")
    run.upstream_baseline = _baseline_record(verdict, time.monotonic() - t0)
    passed = set(run.upstream_baseline["passed"])
    if verdict.outcome is not Outcome.PASS:
        ctx.say(f"upstream baseline is {verdict.outcome.value}: {verdict.detail}; mutants scored by ours only")
        return None
    timeout = mo.timeout_s or max(MutationOptions.MIN_TIMEOUT_S, 5 * run.upstream_baseline["seconds"])
    ctx = _context(cell, mo, progress, timeout_s=timeout)
    killers = Killers(ctx.files.work / "killers-upstream.txt")
    prepared = suites.suite_run(ctx, "upstream")

    def score(guard: Guard, mutant, mutated: str) -> dict:
        run_ = dataclasses.replace(prepared, args=[*prepared.args, "-x", f"--kvcompat-first={killers.path}"])
        v = _judge(ctx, guard, mutant, mutated, passed, killers, "upstream", run_)
        return {k: getattr(v, k) for k in ("status", "killed_by", "how", "detail", "seconds")}

    return score


def _baseline(ctx: CellContext, run: MutationRun) -> None:
    t0 = time.monotonic()
    with ctx.timed("baseline"):
        verdict = suites.run_pytest(ctx, "ours", _suite_run(ctx))
    run.baseline = _baseline_record(verdict, time.monotonic() - t0)
    run.scored = verdict.outcome is Outcome.PASS


def _baseline_record(verdict: suites.SuiteVerdict, seconds: float) -> dict:
    """What a run keeps of a suite's unmutated run: its verdict, its time, and the tests green on it."""
    return {
        "outcome": verdict.outcome.value,
        "detail": verdict.detail,
        "seconds": round(seconds, 2),
        "passed": sorted(t.nodeid for t in verdict.tests if t.outcome.value == "passed"),
        "tests": len(verdict.tests),
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


def _same_as(mutant, twin: MutantVerdict) -> MutantVerdict:
    """A mutant that makes the same program as one already run (two children): that one's verdict."""
    return dataclasses.replace(
        twin,
        id=mutant.id,
        contract=mutant.contract,
        description=mutant.description,
        origin=_origin(mutant),
        detail=f"the same program as {twin.id} for two children: {twin.detail}"[:400],
        seconds=0.0,
    )


def _score(
    ctx: CellContext, guard: Guard, mutant, mutated: str | None, passed: set[str], killers: Killers
) -> MutantVerdict:
    base = {"id": mutant.id, "contract": mutant.contract, "description": mutant.description, "origin": _origin(mutant)}
    if mutated is None:
        return MutantVerdict(**base, status=NOT_APPLICABLE, detail=f"target code absent in {cell_label(ctx.cell)}")
    if mutant.equivalent:
        return MutantVerdict(**base, status=EQUIVALENT, reason=mutant.equivalent)
    run = _suite_run(ctx, "-x", f"--kvcompat-first={killers.path}")
    return _judge(ctx, guard, mutant, mutated, passed, killers, "ours", run)


def _judge(
    ctx: CellContext,
    guard: Guard,
    mutant,
    mutated: str,
    passed: set[str],
    killers: Killers,
    suite: str,
    run: suites.SuiteRun,
) -> MutantVerdict:
    """Run ``suite`` with the mutant applied: killed (by a test green on the baseline, a timeout, a crash) or survived."""
    base = {"id": mutant.id, "contract": mutant.contract, "description": mutant.description, "origin": _origin(mutant)}
    t0 = time.monotonic()
    guard.apply(mutant.id, mutated)
    try:
        verdict = suites.run_pytest(ctx, suite, run)
    finally:
        guard.restore()
    seconds = round(time.monotonic() - t0, 2)
    if verdict.outcome is Outcome.TIMEOUT:
        return MutantVerdict(
            **base, status=KILLED, killed_by="timeout", how="timeout", detail=verdict.detail, seconds=seconds
        )
    killed = [t for t in verdict.tests if t.nodeid in passed and t.outcome.value not in STILL_GREEN]
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
    return MutantVerdict(**base, status=SURVIVED, detail=verdict.detail, seconds=seconds)


def _say(v: MutantVerdict) -> str:
    ours = _say_ours(v)
    if v.upstream is None:
        return ours
    up = v.upstream
    theirs = (
        f"killed by {(up.get('killed_by') or '').split('::')[-1] if up.get('how') == 'test' else up.get('how')}"
        if up["status"] == KILLED
        else "SURVIVED"
    )
    return f"{ours}; upstream: {theirs} in {up.get('seconds', 0):.1f}s"


def _say_ours(v: MutantVerdict) -> str:
    if v.status == KILLED:
        who = v.killed_by.split("::")[-1] if v.how == "test" else v.how
        return f"killed by {who} in {v.seconds:.1f}s"
    if v.status == SURVIVED:
        return f"SURVIVED ({v.contract}) in {v.seconds:.1f}s"
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
    )


def summary(run: MutationRun) -> str:
    c = run.counts()
    if not run.scored:
        return f"{run.id}: baseline {run.baseline.get('outcome')} ({run.baseline.get('detail')}), mutants not scored"
    text = f"{run.id}: {c[KILLED]} killed, {c[SURVIVED]} survived"
    text += f" ({', '.join(m.id for m in run.survivors)})" if run.survivors else ""
    return text + (f"; methods with no mutant and no reason: {', '.join(run.uncovered)}" if run.uncovered else "")
