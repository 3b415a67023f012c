"""Why a square is not green, and what to do next: what every rendering shows first.

A :class:`Finding` is one grid cell that is not green: its red contracts (new ones first, then the ones a
known vLLM bug explains, each with its message's telling line and the bug's impact and link), the known
bugs that did not reproduce, or, for a cell that never reached its tests, the cell's own reason.  Each
comes with its next steps: ``kvcompat show CELL``, the cell's drawer in compat.html, and for a new red of
our suite a ready ``nox -s bisect`` command naming the contract and the releases of this report around it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvcompat.known_bugs import KnownBug
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.cells import BAD_TESTS, SEVERITY, GridCell, _version_key, panel_id, short_test
from kvcompat.report.model import Report
from kvcompat.report.shaped import known_bug, shape_verdicts
from kvcompat.results import TestResult, headline

# What each impact of a known bug (kvcompat.known_bugs.IMPACTS) means to a deployer, in a few words.
IMPACT_MEANING = {
    "wrong-output": "the output can be wrong",
    "hang": "requests can hang",
    "crash": "the engine can crash",
    "fails-requests": "requests can fail",
    "refused": "vLLM refuses the configuration",
    "leak": "memory or blocks leak",
    "efficiency": "the output is right; cache reuse or speed suffers",
}
# Where a report points for more (relative to the project; compat.md sits beside compat.html).
HTML = "reports/compat.html"
# A placeholder for the good end of a bisect when no release of this report passed the contract.
OLDER = "OLDER"
# What a square of the grid says where nothing of its release ran with its torch.
BLANK = "not in this matrix"


@dataclasses.dataclass
class Red:
    """One red test of a finding, and the known vLLM bug that explains it (None: it is new)."""

    test: TestResult
    bug: KnownBug | None
    bisect: list[str] = dataclasses.field(default_factory=list)  # ready commands for a new red of our suite

    @property
    def name(self) -> str:
        return short_test(self.test.nodeid)

    @property
    def message(self) -> str:
        """The telling line of the test's message (its outcome when it has none)."""
        line = headline(self.test.message).removeprefix("[call] ")  # the plugin's phase tag: call is the test
        return line or self.test.outcome.value.replace("_", " ")


@dataclasses.dataclass
class Finding:
    gc: GridCell
    name: str  # the grid cell's name in the report
    reds: list[Red]  # new first, then known
    gone: list[KnownBug]  # known bugs whose contract passed here, inside their range
    reason: str  # the cell's own one line (its detail), for a cell with no red test to show

    @property
    def new(self) -> list[Red]:
        return [r for r in self.reds if r.bug is None]

    @property
    def known(self) -> list[Red]:
        return [r for r in self.reds if r.bug is not None]

    @property
    def fails_run(self) -> bool:
        """Whether this square makes ``nox -s matrix`` exit 1 (anything but green or an explained red)."""
        return self.gc.outcome.fails_run

    @property
    def show(self) -> str:
        return f"kvcompat show {self.gc.result.id}"

    @property
    def anchor(self) -> str:
        """The cell's drawer in compat.html: ``#d-…``."""
        return f"#{panel_id(self.gc)}"

    @property
    def word(self) -> str:
        """pytest's word for the square: FAILED (a new red), KNOWN BUG, or the outcome's label."""
        if self.gc.outcome is Outcome.KNOWN_BUG:
            return "KNOWN BUG"
        if self.gc.outcome in (Outcome.TEST_FAIL, Outcome.UNSUPPORTED, Outcome.TEST_ERROR) and self.new:
            return "FAILED"
        return self.gc.outcome.label.upper()


def impact_words(impact: str) -> str:
    """``efficiency (the output is right; cache reuse or speed suffers)``."""
    return f"{impact} ({IMPACT_MEANING.get(impact, impact)})"


def bug_words(bug: KnownBug) -> str:
    """One line for a red a known bug explains: its impact in words, the bug, where it is fixed, its link."""
    fixed = f", fixed in {bug.fixed_in}" if bug.fixed_in else ", not fixed yet"
    link = f": {bug.link}" if bug.link else ""
    return f"{impact_words(bug.impact)}: known vLLM bug {bug.id}{fixed}{link}"


def bisect_words(command: str) -> str:
    """What a bisect command finds: ``find where it broke`` or ``find the fix``."""
    return "find the fix" if "--find-fix" in command else "find where it broke"


def gone_words(bug: KnownBug) -> str:
    return (
        f"known vLLM bug {bug.id} did not reproduce: its contract passed inside {bug.releases}; "
        "narrow its range in src/kvcompat/known-bugs.toml"
    )


def reds(gc: GridCell) -> list[Red]:
    """The square's red tests with a verdict of their own (new first, then the known ones, the worst impact
    first), each with the known bug behind it."""
    bad = [t for t in gc.tests if t.outcome in BAD_TESTS]
    own = [t for t in bad if t.blocked_by is None] or bad
    out = [Red(t, known_bug(gc, t)) for t in own]
    return sorted(out, key=lambda r: (r.bug is not None, SEVERITY.index(r.bug.impact) if r.bug else 0))


def findings(rep: Report) -> list[Finding]:
    """Every grid cell that is not green, in display order: the run's failures first, then the known bugs."""
    return rep.memo("findings", lambda: _findings(rep))


def _findings(rep: Report) -> list[Finding]:
    out = []
    for gc in rep.ordered():
        if gc.outcome.is_green:
            continue
        red = reds(gc)
        for r in red:
            r.bisect = [] if r.bug else bisect_commands(rep, gc, r.test)
        gone = list(gc.judgement.gone) if gc.judgement else []
        out.append(Finding(gc, rep.name(gc), red, gone, gc.detail or gc.result.detail))
    return sorted(out, key=lambda f: not f.fails_run)


def bisect_commands(rep: Report, gc: GridCell, test: TestResult) -> list[str]:
    """A ready ``nox -s bisect`` for a new red of our suite: from the newest older release of this report
    where the contract passed (``--good``) to this one; and, where a newer release passed it,
    ``--find-fix`` up to the oldest such.  Other suites (upstream, e2e) and wheels have none."""
    c = gc.result.cell
    if gc.suite != "ours" or c.wheel is not None or test.outcome not in BAD_TESTS:
        return []
    passed, ambiguous = rep.memo("bisect index", lambda: _bisect_index(rep))
    here = _version_key(c.vllm)
    green = passed.get((c.dist, gc.order, test.contract, test.shape), set())
    older = [v for v in green if _version_key(v) < here]
    newer = [v for v in green if _version_key(v) > here]
    name = test.nodeid if test.contract in ambiguous else test.contract
    flags = f" --dist {c.dist}" if c.dist != "vllm" else ""
    flags += f" --torch {c.torch}" if c.torch_override else ""
    flags += f" --shapes {test.shape}" if test.shape else ""
    out = []
    if older or not newer:
        good = max(older, key=_version_key) if older else OLDER
        out.append(f"nox -s bisect -- --test {name} --good {good} --bad {c.vllm}{flags}")
    if newer:
        fix = min(newer, key=_version_key)
        out.append(f"nox -s bisect -- --find-fix --test {name} --bad {c.vllm} --good {fix}{flags}")
    return out


def _bisect_index(rep: Report) -> tuple[dict[tuple, set[str]], set[str]]:
    """Where each contract of our suite passed: (dist, order, contract, shape) -> the releases of this report
    where every run of it in a cell passed; and the contracts whose name alone would also match another
    contract's node id (bisect matches ``--test`` as a part of one: those get their node id)."""
    passed: dict[tuple, set[str]] = defaultdict(set)
    for gc in rep.cells:
        c = gc.result.cell
        if gc.suite != "ours" or c.wheel is not None:
            continue
        runs: dict[tuple, list[TestResult]] = defaultdict(list)
        for t in gc.tests:
            if t.has_verdict:
                runs[(c.dist, gc.order, t.contract, t.shape)].append(t)
        for key, tests in runs.items():
            if all(t.outcome is TestOutcome.PASSED for t in tests):
                passed[key].add(c.vllm)
    nodeids = {t.nodeid: t.contract for gc in rep.cells for t in gc.tests}
    contracts = set(nodeids.values())
    ambiguous = {c for c in contracts if any(c in n and other != c for n, other in nodeids.items())}
    return passed, ambiguous


def suite_mark(gc: GridCell) -> str:
    """The short name of a suite beside the square's lead: upstream, e2e, real NIXL 1.5.1."""
    nixl = gc.result.cell.nixl
    if gc.suite == "ours":
        return "ours" if nixl == "fake" else f"real NIXL {nixl}"
    return gc.suite


def shapes_line(gc: GridCell, marks: dict[Outcome, str]) -> str:
    """``shapes 🟢 15/15``, or ``shapes 🔴 13/15: hetero-tp-p1d4, mla``: the deployment shapes of a square."""
    verdicts = shape_verdicts(gc)
    if not verdicts:
        return ""
    ok = [s for s, v in verdicts.items() if v.outcome.is_green]
    bad = [s for s in verdicts if s not in ok]
    worst = next((v.outcome for v in verdicts.values() if not v.outcome.is_green), Outcome.PASS)
    names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return f"shapes {marks[worst]} {len(ok)}/{len(verdicts)}" + (f": {names}" if bad else "")


def summary_line(rep: Report, bold: str = "") -> str:
    """When, from how many cells, each outcome's count, and whether the run passes (``bold``: Markdown's ``**``)."""
    totals = ", ".join(f"{n} {Outcome(k).label}" for k, n in rep.totals().items() if n)
    failing = sum(f.fails_run for f in findings(rep))
    verdict = (
        f"{failing} square{'s' if failing != 1 else ''} fail{'s' if failing == 1 else ''} the run."
        if failing
        else "No new red: the run passes."
    )
    return f"Generated {rep.generated} from {len(rep.results)} cells: {totals}. {bold}{verdict}{bold}"
