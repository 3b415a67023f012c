"""``--fork``: our suite's verdicts of a group's mutants, from one pytest per batch of them (the in-cell
kvcompat.mutation.incell.forkrun) instead of a pytest per mutant."""

from __future__ import annotations

import json
from pathlib import Path

from kvcompat.mutation.context import MutationError, ours_run
from kvcompat.mutation.plan import Group
from kvcompat.mutation.record import KILLED, STILL_GREEN, SURVIVED, MutantVerdict
from kvcompat.mutation.score import base, select
from kvcompat.results import headline
from kvcompat.run import suites
from kvcompat.run.context import CellContext

PLUGIN = "kvcompat.mutation.incell.forkrun"


class Forked:
    """Our suite's verdicts of a group's mutants, scored in batches by kvcompat.mutation.incell.forkrun: one
    pytest imports the release once per batch and forks a child per mutant.  A mutant it cannot swap in (a
    change outside any function) gets no verdict here and is scored the usual way."""

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
    # A child out of time that used less CPU than this never got going: forked from a
    # parent whose other threads held a lock, or starved by other work on the machine (seen on 2 cores beside an
    # e2e run: 0 s of CPU in a 40 s limit, and 3 of the 5 such mutants survive a fresh pytest).  Not the mutant's
    # verdict: it is scored the usual way, as a crash is.  A mutant that really hangs still times out there.
    STALLED_CPU_S = 1.0

    def __init__(
        self, ctx: CellContext, g: Group, passed: list[str], site: Path, timeout: float, jobs: int = 1
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
            chosen = select(self.g.lines("ours", p), p, self.passed)
            self.batched.add(i)
            if not chosen.reached:
                continue  # decided without a run (score.score says so)
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
        run = ours_run(
            self.ctx,
            "-p",
            PLUGIN,
            f"--kvcompat-fork-plan={plan_path}",
            f"--kvcompat-fork-out={out}",
            f"--kvcompat-fork-jobs={self.jobs}",
        )
        cmd = suites.pytest_command(self.ctx, run, "-p", "no:cacheprovider", "-q")
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
        fields = {**base(p), "seconds": answer["seconds"]}
        tests = answer.get("tests", [])
        fields["tests_run"] = len(tests)
        if answer.get("timeout") and answer.get("cpu_s", 0.0) < self.STALLED_CPU_S:
            return None  # a child that stalled before it ran: no verdict here, the usual way decides
        if answer.get("timeout"):
            return MutantVerdict(
                **fields,
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
                **fields,
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
            **fields, status=SURVIVED, detail=f"{answer['why']}; {green_now}/{len(tests)} of them passed"
        )
