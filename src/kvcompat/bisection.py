"""One bisect: the first item of an ordered list where a test stops passing, or (``find_fix``) passes again.

The items are vLLM releases (:mod:`kvcompat.bisect_releases`) or the commits of a git checkout
(:mod:`kvcompat.bisect_commits`).  A *handler* knows its items: it lists them, puts one to the test
(a :class:`Step`: good, bad or skip, and why) and names them; everything else is here, once:

- :func:`search`, the binary search over the list's indexes: good, bad or skip, no I/O.
- :func:`cell_budget`, the most cells it takes; each step skipped after its cell ran adds one.
- :func:`verdict_for`, what a cell's result says about ``--test``, and :func:`check_test`, which
  refuses a name no test of the suite has.
- :func:`run`, a handler's list through the search with a line per step, and :func:`render_answer`.

An item that cannot be resolved, built, installed or imported, or where the test is not applicable, is
*skipped*: never counted as good or bad.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import math
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, headline

if TYPE_CHECKING:
    from kvcompat.cells import Cell
    from kvcompat.matrix import Entry
    from kvcompat.run.options import RunOptions

# Outcomes that say nothing about the test: the item could not be put to it.
INFRASTRUCTURE = (Outcome.UNRESOLVABLE, Outcome.INSTALL_ERROR, Outcome.IMPORT_ERROR, Outcome.TIMEOUT)
# The connector sources a bisect's answer lists the changes of.
CONNECTOR_DIRS = ("vllm/distributed/kv_transfer/", "vllm/v1/simple_kv_offload/", "vllm/v1/kv_offload/")


class BisectError(KvcompatError):
    """Bad bisect input or an inconsistent answer; one line naming the fix."""


class Verdict(str, enum.Enum):
    GOOD = "good"
    BAD = "bad"
    SKIP = "skip"


@dataclasses.dataclass
class Step:
    item: str  # the release or the commit (its full hash)
    verdict: Verdict
    why: str  # one line: the test's outcome or the cell's status
    seconds: float = 0.0  # the step's wall time (set by run)
    cell: bool = True  # False: decided without a cell (a commit refused before building), never counted as one


@dataclasses.dataclass
class BisectResult:
    """The boundary: ``older`` has the old verdict (good, or bad with ``find_fix``), ``newer`` the new one."""

    older: str
    newer: str
    steps: list[Step]
    untested_between: list[str]  # skipped items that may hold the boundary
    find_fix: bool = False
    n: int = 0  # the items searched, both ends included
    check_older: bool = False

    @property
    def cells_evaluated(self) -> int:
        return sum(s.cell for s in self.steps)

    @property
    def skipped_cells(self) -> int:
        return skipped_cells(self.steps)

    @property
    def last_good(self) -> str | None:
        return None if self.find_fix else self.older

    @property
    def first_bad(self) -> str | None:
        return None if self.find_fix else self.newer

    @property
    def last_bad(self) -> str | None:
        return self.older if self.find_fix else None

    @property
    def first_good(self) -> str | None:
        return self.newer if self.find_fix else None


@dataclasses.dataclass(frozen=True)
class FileChange:
    path: str
    added: int
    removed: int
    status: str  # modified | added | removed


# -- the test: which tests a bisect can name, and what a cell says of one ---------------------------

SUITE = "tests/connectors"  # what a bisect step runs (release and commit cells alike: our suite only)


def suite_tests(root: Path, suite: str = SUITE) -> list[str]:
    """The node ids of the suite's tests as pytest writes them (``tests/connectors/test_x.py::test_y``, a
    class's as ``…::TestX::test_y``), read from the source: what ``--test`` can name, known before any cell."""
    ids = []
    for path in sorted((root / suite).rglob("test_*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        rel = path.relative_to(root).as_posix()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                ids.append(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                ids += [
                    f"{rel}::{node.name}::{m.name}"
                    for m in node.body
                    if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and m.name.startswith("test")
                ]
    return ids


def can_match(test: str, ids: list[str]) -> bool:
    """Whether ``test`` can match a test of ``ids`` as :func:`verdict_for` matches (a node id or a part of one:
    a test's name, its file, a shape's id inside its [parameters])."""
    from kvcompat import shapes

    head, bracket, _ = test.partition("[")
    if bracket:  # NAME[PARAMS] or a node id with its parameters: the part before [ ends a test's id
        return not head or any(i.endswith(head) for i in ids)
    return any(test in i for i in ids) or any(test in shape for shape in shapes.BY_ID)


def check_test(test: str, root: Path, suite: str = SUITE) -> None:
    """Refuse, before the first cell, a ``--test`` that names no test of the suite, naming the close ones."""
    ids = suite_tests(root, suite)
    if not ids or can_match(test, ids):
        return
    names = sorted({i.rsplit("::", 1)[-1] for i in ids})
    name = test.partition("[")[0].rsplit("::", 1)[-1]
    words = set(name.split("_")) - {"test", "a", "an", "the", "of", "is", "to", ""}

    def likeness(other: str) -> tuple[int, float]:  # the words it shares with the name given, then spelling
        return len(words & set(other.split("_"))), difflib.SequenceMatcher(None, name, other).ratio()

    close = sorted(names, key=likeness, reverse=True)[:3]
    raise BisectError(
        f"--test {test!r} names no test of {suite} (bisect runs that suite, {len(ids)} test function{'s' if len(ids) != 1 else ''}, not "
        "vLLM's own tests); "
        f"close: {', '.join(close)}; give a test's name, a part of one, or its node id ({suite}/FILE.py::NAME)"
    )


def verdict_for(result: CellResult, test: str) -> Step:
    """What a cell result says about ``test``: good, bad, or skip (and why)."""
    item = result.cell.vllm
    if not result.tests or result.outcome in INFRASTRUCTURE:
        return Step(item, Verdict.SKIP, f"cell {result.outcome.label}: {result.detail}")
    matched = [t for t in result.tests if t.nodeid == test or test in t.nodeid]
    collection_errors = [t for t in result.tests if "::" not in t.nodeid and t.outcome is TestOutcome.ERROR]
    if not matched and collection_errors:
        return Step(item, Verdict.BAD, f"suite failed to collect: {(collection_errors[0].message or '').strip()[:160]}")
    if not matched:
        names = ", ".join(sorted({t.nodeid.split("::")[-1] for t in result.tests})[:8])
        raise BisectError(f"--test {test!r} matches no test in {result.id}; use a node id or keyword such as: {names}")
    blocked = [t for t in matched if t.blocked_by is not None]
    matched = [t for t in matched if t.blocked_by is None]
    if blocked and not matched:  # a setup step another contract owns failed: no verdict on this test
        return Step(item, Verdict.SKIP, f"blocked by {blocked[0].blocked_by}: {headline(blocked[0].message)}")
    outcomes = {t.outcome for t in matched}
    bad = (TestOutcome.FAILED, TestOutcome.UNSUPPORTED, TestOutcome.ERROR)  # unsupported is a verdict, like fail
    names = ", ".join(t.nodeid.split("::")[-1] for t in matched if t.outcome in bad)
    if outcomes & set(bad):
        first = next(t for t in matched if t.outcome in bad)
        return Step(item, Verdict.BAD, f"{names}: {first.outcome.value}: {headline(first.message)}")
    if outcomes == {TestOutcome.PASSED}:
        return Step(item, Verdict.GOOD, f"{len(matched)} matching test(s) passed")
    return Step(item, Verdict.SKIP, "test not applicable to this release")


# -- the search ------------------------------------------------------------------------------------


class Side(enum.Enum):
    """What a step showed, in the search's terms: the older end's verdict, the newer end's, or neither."""

    OLD = "old"
    NEW = "new"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class Probe:
    """The index the search asks about next, and what it knows: ``lo`` is the newest index shown old (-1:
    none yet, the older end taken on the user's word), ``hi`` the oldest shown new."""

    index: int
    lo: int
    hi: int
    end: bool  # an end checked before the search proper


@dataclasses.dataclass(frozen=True)
class Bracket:
    lo: int
    hi: int
    skipped: tuple[int, ...]  # skipped indexes between lo and hi: the boundary may be at any of them


class WrongEnd(Exception):
    """An end of the range did not show the verdict the user gave it (``index`` is 0 or n - 1)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def search(n: int, *, check_older: bool = False) -> Generator[Probe, Side, Bracket]:
    """The binary search over indexes ``0 .. n-1``: it yields each :class:`Probe` and is sent what it showed.

    The newer end (``n - 1``) first: it must be new, or there is nothing to find.  The older end is the
    search's first candidate (with ``check_older``, checked second instead).  Then the median of the
    untested indexes between the two narrowest verdicts, the older of two medians: a verdict halves the
    candidates, a skip removes one, so each skip costs at most one cell more than :func:`cell_budget`.
    Raises :class:`WrongEnd` when an end is not as given; returns the :class:`Bracket`.
    """
    if (yield Probe(n - 1, -1, n - 1, end=True)) is not Side.NEW:
        raise WrongEnd(n - 1)
    lo, hi, skipped = -1, n - 1, set()
    if check_older:
        if (yield Probe(0, lo, hi, end=True)) is not Side.OLD:
            raise WrongEnd(0)
        lo = 0
    while untested := [i for i in range(lo + 1, hi) if i not in skipped]:
        mid = untested[(len(untested) - 1) // 2]
        side = yield Probe(mid, lo, hi, end=False)
        if side is Side.OLD:
            lo = mid
        elif side is Side.NEW:
            hi = mid
        else:
            skipped.add(mid)
    if lo < 0:  # the older end showed the new verdict, or could not be put to the test
        raise WrongEnd(0)
    return Bracket(lo, hi, tuple(i for i in sorted(skipped) if lo < i < hi))


def cell_budget(n: int, *, check_older: bool = False) -> int:
    """Most cells a bisect over ``n`` items evaluates when no step is skipped after its cell ran.

    The newer end is checked first (it must show the new verdict, or there is nothing to
    find).  The older end is not checked up front: it is the search's first candidate, so
    the boundary is one of ``n`` places (after the older end ... or before it, which means
    the older end was not as the user said), found in ceil(log2 n) cells.

    With ``check_older`` (commits: ``git bisect`` trusts neither end) the older end is the
    second cell, and the boundary is one of the ``n - 1`` places after it: ceil(log2 (n-1)) + 2,
    that is at most ceil(log2 N) + 2 for the N commits of GOOD..BAD.

    A skipped step whose cell ran narrows nothing: the bound grows by one for each (see :func:`search`);
    a step decided without a cell costs nothing.
    """
    if check_older:
        return math.ceil(math.log2(max(n - 1, 1))) + 2
    return math.ceil(math.log2(n)) + 1


def skipped_cells(steps: list[Step]) -> int:
    return sum(s.cell and s.verdict is Verdict.SKIP for s in steps)


def formula(n: int, noun: str, *, check_older: bool = False) -> str:
    """How :func:`cell_budget` counts ``n`` items: ``ceil(log2 4) + 2 for 4 commits``."""
    places, extra = (n - 1, 2) if check_older else (n, 1)
    return f"ceil(log2 {places}) + {extra} for {places} {noun}{'s' if places != 1 else ''}"


# -- one bisect, whatever the items ------------------------------------------------------------------


class Handler(Protocol):
    """What a kind of item brings to :func:`run`."""

    noun: str  # "release" or "commit"
    items: list[str]  # oldest first, both ends included
    check_older: bool  # check the older end before searching (else take it on the user's word until a step shows it)

    def header(self) -> str: ...  # the range, for the first line: "4 commits of REPO after X up to Y"

    def name(self, item: str) -> str: ...  # in a step's line

    def full(self, item: str) -> str: ...  # in the answer

    def evaluate(self, item: str) -> Step: ...

    def resume(self, good: str, bad: str) -> str | None: ...  # the command that goes on from there

    def changes(self, older: str, newer: str) -> tuple[str, list[FileChange]] | None: ...  # (what, files)

    def link(self, older: str, newer: str) -> str: ...  # the answer's last line: where to read the change


@dataclasses.dataclass(frozen=True)
class Cells:
    """How a step runs its cell, as the matrix does (:mod:`kvcompat.commands.bisect` fills it in)."""

    opts: RunOptions
    run: Callable[[Entry, RunOptions, Callable[[str], None]], tuple[Cell, CellResult]]
    venv: Callable[[Cell], Path]  # the cell's one venv
    prune: Callable[[Cell, Callable[[str], None]], int]  # delete the cell's venv


def run(handler: Handler, *, test: str, find_fix: bool = False, say: Callable[[str], None] = print) -> BisectResult:
    """Find the first item with the new verdict (bad; with ``find_fix``, good) after the older end.

    Says the range and the bound, a line per step (its cell count against the bound, its verdict and why,
    its wall time) and the resume command, then the answer.  Bad input raises :class:`BisectError`.
    """
    items, noun = handler.items, handler.noun
    if len(items) < 2:
        raise BisectError(f"need at least two {noun}s between --good and --bad")
    n = len(items)
    old, new = (Verdict.BAD, Verdict.GOOD) if find_fix else (Verdict.GOOD, Verdict.BAD)
    old_flag, new_flag = ("--bad", "--good") if find_fix else ("--good", "--bad")
    budget = cell_budget(n, check_older=handler.check_older)
    goal = f"the fix of {test!r}" if find_fix else repr(test)
    say(
        f"bisecting {handler.header()} for {goal}; at most {budget} cells "
        f"({formula(n, noun, check_older=handler.check_older)}), one more for each cell whose step is skipped"
    )
    steps: list[Step] = []

    def step_at(probe: Probe) -> Side:
        item = items[probe.index]
        t0 = time.monotonic()
        step = dataclasses.replace(handler.evaluate(item), item=item)
        step.seconds = time.monotonic() - t0
        steps.append(step)
        counter = f"{sum(s.cell for s in steps)}/≤{budget + skipped_cells(steps)}" if step.cell else "no cell"
        if probe.index == 0:
            role = f"{old_flag} endpoint"
        elif probe.index == n - 1:
            role = f"{new_flag} endpoint"
        else:
            between = f"{handler.name(items[max(probe.lo, 0)])} and {handler.name(items[probe.hi])}"
            role = f"{probe.hi - probe.lo - 1} left between {between}"
        verdict = f"{step.verdict.value.upper()} - {step.why}"
        say(f"[{counter}] {handler.name(item)} ({role}): {verdict} ({step.seconds:.0f}s)")
        return Side.OLD if step.verdict is old else Side.NEW if step.verdict is new else Side.SKIP

    def wrong_end(index: int) -> BisectError:
        step = next(s for s in steps if s.item == items[index])
        if index == n - 1:
            fix = f"pick a newer {noun} where the test passes" if find_fix else f"pick a {noun} where the test fails"
            flag, want = new_flag, new
        else:
            fix = f"pick a {noun} where the test fails" if find_fix else f"pick an older {noun} where the test passes"
            flag, want = old_flag, old
        return BisectError(
            f"{flag} {handler.name(items[index])} is not {want.value} ({step.verdict.value}: {step.why}); {fix}"
        )

    walk = search(n, check_older=handler.check_older)
    probe = next(walk)
    while True:
        side = step_at(probe)
        try:
            after: Probe | Bracket = walk.send(side)
        except StopIteration as stop:
            after = stop.value
        except WrongEnd as exc:
            raise wrong_end(exc.index) from None
        if not probe.end and after.lo >= 0:
            good, bad = (items[after.hi], items[after.lo]) if find_fix else (items[after.lo], items[after.hi])
            resume = handler.resume(good, bad)
            if resume:
                say("  resume with: " + resume)
        if isinstance(after, Bracket):
            break
        probe = after
    result = BisectResult(
        items[after.lo],
        items[after.hi],
        steps,
        [items[i] for i in after.skipped],
        find_fix=find_fix,
        n=n,
        check_older=handler.check_older,
    )
    say(render_answer(result, handler))
    return result


def render_answer(res: BisectResult, handler: Handler) -> str:
    """The answer: the boundary's two items, the untested ones that may hold it, the cells against the bound,
    the connector sources changed across it, and where to read the change."""
    noun = handler.noun
    (first, newer), (last, older) = (
        (("first good", res.newer), ("last bad", res.older))
        if res.find_fix
        else (("first bad", res.newer), ("last good", res.older))
    )
    width = max(len(first), len(last)) + len(noun) + 2
    lines = ["", f"{first} {noun}:".ljust(width) + " " + handler.full(newer)]
    lines.append(f"{last} {noun}:".ljust(width) + " " + handler.full(older))
    if res.untested_between:
        skipped = ", ".join(handler.name(s) for s in res.untested_between)
        lines.append(f"  (could not test {skipped} in between: the {first} {noun} may be one of them)")
    skips = res.skipped_cells
    more = f", + {skips} for the cell{'s' if skips != 1 else ''} skipped" if skips else ""
    bound = cell_budget(res.n, check_older=res.check_older) + skips
    lines.append(
        f"cells evaluated: {res.cells_evaluated} (at most {bound}: "
        f"{formula(res.n, noun, check_older=res.check_older)}{more})"
    )
    changes = handler.changes(res.older, res.newer)
    if changes is not None:
        what, files = changes
        lines.append(f"connector sources changed between {what}: {len(files)} file(s)")
        lines += [f"  {c.status:8} +{c.added:<5} -{c.removed:<5} {c.path}" for c in files]
    lines.append(handler.link(res.older, res.newer))
    return "\n".join(lines)
