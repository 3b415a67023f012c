"""Find the first vLLM release where a test stops passing, or (``--find-fix``) passes again.

``nox -s bisect -- --test T --good V1 --bad V2`` lists the releases between V1
and V2 (index or wheelhouse), checks both ends, then binary-searches.  With
``--find-fix --bad OLD --good NEW`` the ends swap places: OLD fails, NEW passes,
and the search finds the first good release after the bad one.  Each
release is a normal matrix cell (same venv, same result cache), so a cell the
matrix already ran costs only its resolve.  A release that cannot be resolved,
installed or imported, or where the test is not applicable, is *skipped*:
never counted as good or bad.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import math
import time
from collections.abc import Callable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvcompat import index
from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, headline

# Outcomes that say nothing about the test: the release could not be put to it.
INFRASTRUCTURE = (Outcome.UNRESOLVABLE, Outcome.INSTALL_ERROR, Outcome.IMPORT_ERROR, Outcome.TIMEOUT)


class BisectError(KvcompatError):
    """Bad bisect input or an inconsistent answer; one line naming the fix."""


class Verdict(str, enum.Enum):
    GOOD = "good"
    BAD = "bad"
    SKIP = "skip"


@dataclasses.dataclass
class Step:
    version: str
    verdict: Verdict
    why: str  # one line: the test's outcome or the cell's status
    seconds: float = 0.0  # the step's wall time (set by bisect)
    cell: bool = True  # False: decided without a cell (a commit refused before building), never counted as one


@dataclasses.dataclass
class BisectResult:
    """The boundary: ``older`` has the old verdict (good, or bad with ``find_fix``), ``newer`` the new one."""

    older: str
    newer: str
    steps: list[Step]
    untested_between: list[str]  # skipped releases that may hold the boundary
    find_fix: bool = False
    n: int = 0  # the items searched, both ends included

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


def releases_between(available: list[Version], good: str, bad: str, *, pre: bool, find_fix: bool = False) -> list[str]:
    """The releases from ``good`` to ``bad`` (with ``find_fix``: ``bad`` to ``good``) inclusive, in packaging order."""
    known = {str(v) for v in available}
    for flag, value in (("--good", good), ("--bad", bad)):
        try:
            Version(value)
        except InvalidVersion:
            raise BisectError(f"{flag} {value!r} is not a version; give a release such as 0.26.0") from None
        if value not in known:
            raise BisectError(
                f"{flag} {value} is not a known release; nearest on the index: "
                f"{index.nearest_versions(available, Version(value))}"
            )
    if find_fix:
        lo, hi = Version(bad), Version(good)
        if lo >= hi:
            raise BisectError(
                f"with --find-fix, --bad {bad} must be older than --good {good} (the fix comes after the break); "
                "swap them, or drop --find-fix to find where the test broke"
            )
    else:
        lo, hi = Version(good), Version(bad)
        if lo >= hi:
            raise BisectError(
                f"--good {good} must be older than --bad {bad}; swap them to find where the test broke, "
                "or add --find-fix to find the release that fixed it"
            )
    out = [v for v in sorted(available) if lo <= v <= hi and (pre or not v.is_prerelease or v in (lo, hi))]
    return [str(v) for v in out]


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
    version = result.cell["vllm"]
    if not result.tests or result.outcome in INFRASTRUCTURE:
        return Step(version, Verdict.SKIP, f"cell {result.outcome.label}: {result.detail}")
    matched = [t for t in result.tests if t.nodeid == test or test in t.nodeid]
    collection_errors = [t for t in result.tests if "::" not in t.nodeid and t.outcome is TestOutcome.ERROR]
    if not matched and collection_errors:
        return Step(
            version, Verdict.BAD, f"suite failed to collect: {(collection_errors[0].message or '').strip()[:160]}"
        )
    if not matched:
        names = ", ".join(sorted({t.nodeid.split("::")[-1] for t in result.tests})[:8])
        raise BisectError(f"--test {test!r} matches no test in {result.id}; use a node id or keyword such as: {names}")
    blocked = [t for t in matched if t.blocked_by is not None]
    matched = [t for t in matched if t.blocked_by is None]
    if blocked and not matched:  # a setup step another contract owns failed: no verdict on this test
        return Step(version, Verdict.SKIP, f"blocked by {blocked[0].blocked_by}: {headline(blocked[0].message)}")
    outcomes = {t.outcome for t in matched}
    bad = (TestOutcome.FAILED, TestOutcome.UNSUPPORTED, TestOutcome.ERROR)  # unsupported is a verdict, like fail
    names = ", ".join(t.nodeid.split("::")[-1] for t in matched if t.outcome in bad)
    if outcomes & set(bad):
        first = next(t for t in matched if t.outcome in bad)
        return Step(version, Verdict.BAD, f"{names}: {first.outcome.value}: {headline(first.message)}")
    if outcomes == {TestOutcome.PASSED}:
        return Step(version, Verdict.GOOD, f"{len(matched)} matching test(s) passed")
    return Step(version, Verdict.SKIP, "test not applicable to this release")


def cell_budget(n: int, *, check_older: bool = False) -> int:
    """Most cells a bisect over ``n`` releases evaluates when none is skipped.

    The newer end is checked first (it must show the new verdict, or there is nothing to
    find).  The older end is not checked up front: it is the search's first candidate, so
    the boundary is one of ``n`` places (after the older end ... or before it, which means
    the older end was not as the user said), found in ceil(log2 n) cells.

    With ``check_older`` (commits: ``git bisect`` trusts neither end) the older end is the
    second cell, and the boundary is one of the ``n - 1`` places after it: ceil(log2 (n-1)) + 2,
    that is at most ceil(log2 N) + 2 for the N commits of GOOD..BAD.

    A step skipped after its cell ran narrows nothing: the bound grows by one for each (the search
    takes the median of the candidates left, so a verdict halves them and a skip removes one); a step
    decided without a cell costs nothing.
    """
    if check_older:
        return math.ceil(math.log2(max(n - 1, 1))) + 2
    return math.ceil(math.log2(n)) + 1


def skipped_cells(steps: list[Step]) -> int:
    """The steps that ran a cell and were skipped: each adds one to :func:`cell_budget`."""
    return sum(s.cell and s.verdict is Verdict.SKIP for s in steps)


def bisect(
    versions: list[str],
    evaluate: Callable[[str], Step],
    *,
    say: Callable[[str], None] = print,
    resume: Callable[[str, str], str] | None = None,
    find_fix: bool = False,
    check_older: bool = False,
    name: Callable[[str], str] = str,
    noun: str = "release",
) -> BisectResult:
    """Binary search for the first bad release; ``versions[0]`` must be good and ``versions[-1]`` bad.

    With ``find_fix`` the verdicts swap: ``versions[0]`` must be bad, ``versions[-1]`` good, and the
    answer is the first good release.  Both ways the same skip rules and the same budget hold, and
    ``resume`` gets (good, bad) as the options of the resumed command take them.  Each step's
    line gives its wall time.  ``check_older`` checks the older end second instead of trusting it
    (see :func:`cell_budget`); ``name`` is how a step's line shows an item (a commit's hash and subject),
    ``noun`` what the items are in the errors' fixes.
    A step whose ``cell`` is False costs no cell: it is listed, skipped, and not counted.
    """
    if len(versions) < 2:
        raise BisectError("need at least two releases between --good and --bad")
    old, new = (Verdict.BAD, Verdict.GOOD) if find_fix else (Verdict.GOOD, Verdict.BAD)
    old_flag, new_flag = ("--bad", "--good") if find_fix else ("--good", "--bad")
    n = len(versions)
    budget = cell_budget(n, check_older=check_older)
    steps: list[Step] = []

    def run(i: int, role: str) -> Step:
        t0 = time.monotonic()
        step = evaluate(versions[i])
        step.seconds = time.monotonic() - t0
        steps.append(step)
        counter = f"{sum(s.cell for s in steps)}/≤{budget + skipped_cells(steps)}" if step.cell else "no cell"
        say(
            f"[{counter}] {name(versions[i])} ({role}): {step.verdict.value.upper()} - {step.why} ({step.seconds:.0f}s)"
        )
        return step

    def not_old(first: Step) -> BisectError:
        fix = f"pick a {noun} where the test fails" if find_fix else f"pick an older {noun} where the test passes"
        return BisectError(
            f"{old_flag} {name(versions[0])} is not {old.value} ({first.verdict.value}: {first.why}); {fix}"
        )

    step = run(n - 1, f"{new_flag} endpoint")
    if step.verdict is not new:
        fix = f"pick a newer {noun} where the test passes" if find_fix else f"pick a {noun} where the test fails"
        raise BisectError(
            f"{new_flag} {name(versions[-1])} is not {new.value} ({step.verdict.value}: {step.why}); {fix}"
        )

    # lo = -1: the older end, taken on the user's word until a cell shows it (or, with check_older, now).
    lo, hi, skipped = -1, n - 1, set()
    if check_older:
        step = run(0, f"{old_flag} endpoint")
        if step.verdict is not old:
            raise not_old(step)
        lo = 0
    while True:
        untested = [i for i in range(lo + 1, hi) if i not in skipped]
        if not untested:
            break
        mid = untested[(len(untested) - 1) // 2]  # the older median: a verdict halves, a skip removes one
        role = (
            f"{old_flag} endpoint"
            if mid == 0
            else f"{hi - lo - 1} left between {name(versions[max(lo, 0)])} and {name(versions[hi])}"
        )
        step = run(mid, role)
        if step.verdict is old:
            lo = mid
        elif step.verdict is new:
            hi = mid
        else:
            skipped.add(mid)
        if lo >= 0 and resume is not None:
            good, bad = (versions[hi], versions[lo]) if find_fix else (versions[lo], versions[hi])
            say("  resume with: " + resume(good, bad))
    if lo < 0:  # the older end showed the new verdict, or could not be put to the test
        raise not_old(next(s for s in steps if s.version == versions[0]))
    untested = [versions[i] for i in sorted(skipped) if lo < i < hi]
    return BisectResult(versions[lo], versions[hi], steps, untested, find_fix=find_fix, n=n)


# -- what changed between the two wheels -------------------------------------------------

CONNECTOR_DIRS = ("vllm/distributed/kv_transfer/", "vllm/v1/simple_kv_offload/", "vllm/v1/kv_offload/")


@dataclasses.dataclass
class FileChange:
    path: str
    added: int
    removed: int
    status: str  # modified | added | removed


def diff_trees(old_root: Path, new_root: Path, prefixes: tuple[str, ...] = CONNECTOR_DIRS) -> list[FileChange]:
    """+/- line counts per changed .py file under ``prefixes`` between two site-packages trees."""

    def files(root: Path) -> dict[str, Path]:
        out = {}
        for prefix in prefixes:
            base = root / prefix
            for p in base.rglob("*.py") if base.is_dir() else []:
                out[str(p.relative_to(root))] = p
        return out

    old, new = files(old_root), files(new_root)
    changes = []
    for path in sorted(old.keys() | new.keys()):
        a = old[path].read_text(errors="replace").splitlines() if path in old else []
        b = new[path].read_text(errors="replace").splitlines() if path in new else []
        if a == b:
            continue
        added = removed = 0
        for line in difflib.unified_diff(a, b, lineterm="", n=0):
            if line.startswith("+") and not line.startswith("+++"):
                added += 1
            elif line.startswith("-") and not line.startswith("---"):
                removed += 1
        status = "added" if path not in old else "removed" if path not in new else "modified"
        changes.append(FileChange(path, added, removed, status))
    return changes


def compare_url(older: str, newer: str) -> str:
    return f"https://github.com/vllm-project/vllm/compare/v{older}...v{newer}"


def render_answer(res: BisectResult, changes: list[FileChange] | None) -> str:
    if res.find_fix:
        lines = ["", f"first good: {res.first_good} (last bad: {res.last_bad})"]
        boundary = "first good"
    else:
        lines = ["", f"last good: {res.last_good}", f"first bad: {res.first_bad}"]
        boundary = "first bad"
    if res.untested_between:
        lines.append(
            f"  (could not test {', '.join(res.untested_between)} in between: the {boundary} release may be one of them)"
        )
    skips = f", + {res.skipped_cells} for the cells skipped" if res.skipped_cells else ""
    bound = cell_budget(res.n) + res.skipped_cells
    lines.append(
        f"cells evaluated: {res.cells_evaluated} (at most {bound}: ceil(log2 {res.n}) + 1 for {res.n} releases{skips})"
    )
    lines.append(f"compare: {compare_url(res.older, res.newer)}")
    if changes is not None:
        lines.append(f"connector sources changed between {res.older} and {res.newer}: {len(changes)} file(s)")
        for c in changes:
            lines.append(f"  {c.status:8} +{c.added:<5} -{c.removed:<5} {c.path}")
    return "\n".join(lines)
