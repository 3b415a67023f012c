"""vLLM bugs the suite knows, as data: which contract each turns red, in which releases and shapes.

``known-bugs.toml`` beside this module holds one ``[[bug]]`` table per bug, each attributed from the
release's own source (``where``: the file and line), with the upstream issue or PR where one exists.  The
report names the bug beside every red test it explains, so a known, attributed vLLM bug does not read
like a new regression; a red test that no entry explains is new.  An entry::

    [[bug]]
    id = "vllm-45330"                      # a short name, unique
    title = "..."                          # one line, as a user would describe the symptom
    contracts = ["test_..."]               # the contracts (test function names) it turns red; "*": every one
    shapes = ["hetero-tp-p1d4"]            # the deployment shapes it shows in (omitted: any, or unshaped tests)
    releases = ">=0.20.2,<0.24.0"          # the affected releases (a PEP 440 specifier; open-ended while unfixed)
    impact = "hang"                        # wrong-output | hang | leak | crash | fails-requests | refused | efficiency
    where = "nixl/worker.py 0.22.1 L1541"  # the release's file and line
    upstream = "https://github.com/vllm-project/vllm/issues/45330"
    fix = "https://github.com/vllm-project/vllm/pull/45879"   # omitted while unfixed

Results are judged against this file when they are read (:func:`judge`), never when a cell runs: editing an
entry changes the next report and the next run's exit status without rerunning a cell.  A red test that an
entry explains is a **known bug**; a red no entry explains is new; an entry whose contract ran green inside
its range **did not reproduce** (strict, like pytest's ``xfail(strict=True)``), so entries stay true.

Stdlib and ``packaging`` only: the harness reads it when it renders a report.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.results import CellResult, TestResult

DATA = Path(__file__).with_name("known-bugs.toml")
# Another known-bugs file to judge by (an entry tried before it is committed; the harness's own tests).
DATA_ENV = "KVCOMPAT_KNOWN_BUGS"
IMPACTS = ("wrong-output", "hang", "leak", "crash", "fails-requests", "refused", "efficiency")


@dataclasses.dataclass(frozen=True)
class KnownBug:
    id: str
    title: str
    contracts: tuple[str, ...]
    releases: SpecifierSet
    impact: str
    where: str
    shapes: tuple[str, ...] = ()
    upstream: str | None = None
    fix: str | None = None

    def explains(self, contract: str, shape: str | None, release: str) -> bool:
        """Whether this bug explains ``contract`` red in ``shape`` on ``release``."""
        if ("*" not in self.contracts and contract not in self.contracts) or (self.shapes and shape not in self.shapes):
            return False
        return self.applies_to(release)

    def applies_to(self, release: str) -> bool:
        """Whether ``release`` is inside this bug's range."""
        try:  # a candidate's dev or local version (0.34.1.dev3+g1a2b) is inside an open-ended range too
            return self.releases.contains(Version(release), prereleases=True)
        except InvalidVersion:
            return False

    @property
    def fixed_in(self) -> str | None:
        """The release the range ends before (``<0.34.0``: 0.34.0), None while the bug is open."""
        ends = [s.version for s in self.releases if s.operator == "<"]
        return min(ends, key=Version) if ends else None

    @property
    def link(self) -> str | None:
        """Where to read about it: the upstream issue, else the fix."""
        return self.upstream or self.fix

    def line(self) -> str:
        """One line for a report: the title, its impact, where, and the upstream links."""
        fixed = f"fixed by {_short(self.fix)}" if self.fix else (f"fixed in {self.fixed_in}" if self.fixed_in else "")
        links = ", ".join(x for x in (_short(self.upstream), fixed) if x)
        return f"known vLLM bug ({self.impact}): {self.title} ({self.where}{'; ' + links if links else ''})"


def _short(url: str | None) -> str:
    """``vllm#45330`` for a vLLM issue or PR URL, the URL otherwise."""
    if not url:
        return ""
    for kind in ("/issues/", "/pull/"):
        if "github.com/vllm-project/vllm" + kind in url:
            return "vllm#" + url.rsplit("/", 1)[-1]
    return url


class KnownBugsError(KvcompatError, ValueError):
    """The known-bugs file is malformed; the message names the entry and the field."""


def parse(text: str) -> tuple[KnownBug, ...]:
    """The entries of a known-bugs TOML document; :class:`KnownBugsError` naming what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KnownBugsError(f"known-bugs.toml is not valid TOML: {exc}") from None
    bugs, seen = [], set()
    for i, entry in enumerate(data.get("bug", [])):
        name = entry.get("id", f"entry {i + 1}")
        missing = [k for k in ("id", "title", "contracts", "releases", "impact", "where") if k not in entry]
        if missing:
            raise KnownBugsError(f"known bug {name!r} lacks {', '.join(missing)}")
        if entry["impact"] not in IMPACTS:
            raise KnownBugsError(f"known bug {name!r}: impact {entry['impact']!r} is not one of {', '.join(IMPACTS)}")
        if name in seen:
            raise KnownBugsError(f"known bug {name!r} is listed twice")
        seen.add(name)
        try:
            releases = SpecifierSet(entry["releases"])
        except InvalidSpecifier:
            raise KnownBugsError(f"known bug {name!r}: releases {entry['releases']!r} is not a version range") from None
        bugs.append(
            KnownBug(
                id=name,
                title=entry["title"],
                contracts=tuple(entry["contracts"]),
                releases=releases,
                impact=entry["impact"],
                where=entry["where"],
                shapes=tuple(entry.get("shapes", ())),
                upstream=entry.get("upstream"),
                fix=entry.get("fix"),
            )
        )
    return tuple(bugs)


@functools.cache
def known() -> tuple[KnownBug, ...]:
    """The known bugs kvcompat ships (``known-bugs.toml`` beside this module, or the file $KVCOMPAT_KNOWN_BUGS names)."""
    path = Path(os.environ.get(DATA_ENV) or DATA)
    try:
        return parse(path.read_text())
    except OSError as exc:
        raise KnownBugsError(
            f"${DATA_ENV} names {str(path)!r}, which cannot be read ({exc.strerror}); unset it or fix the path"
        ) from None


def explaining(contract: str, shape: str | None, release: str) -> KnownBug | None:
    """The known bug that explains ``contract`` red in ``shape`` on ``release``, if any."""
    return next((b for b in known() if b.explains(contract, shape, release)), None)


# A test's outcomes that are a verdict against the release (as in the report and bisect).
RED = (TestOutcome.FAILED, TestOutcome.ERROR, TestOutcome.UNSUPPORTED)
# Cell outcomes that come from red tests, and so can be explained by known bugs; the others (install,
# import, timeout, ...) say vLLM was never put to the test, and no entry explains them.
FROM_RED_TESTS = (Outcome.TEST_FAIL, Outcome.TEST_ERROR, Outcome.UNSUPPORTED)


@dataclasses.dataclass(frozen=True)
class Judgement:
    """A cell's (or one suite's) outcome read against the known bugs."""

    outcome: Outcome  # KNOWN_BUG when every red is known, KNOWN_BUG_GONE when an entry did not reproduce
    known: tuple[tuple[TestResult, KnownBug], ...] = ()  # red tests a known bug explains
    new: tuple[TestResult, ...] = ()  # red tests no entry explains
    gone: tuple[KnownBug, ...] = ()  # entries in range whose contracts ran here and none was red

    @property
    def fails_run(self) -> bool:
        """Whether this makes the run exit 1: a new red, an entry that did not reproduce, or no verdict."""
        return self.outcome.fails_run or bool(self.new) or bool(self.gone)

    def summary(self) -> str:
        """One line: what is new, what did not reproduce, what is known."""
        parts = []
        if self.new:
            parts.append(f"{len(self.new)} new red: " + ", ".join(sorted({t.contract for t in self.new})))
        for bug in self.gone:
            parts.append(
                f"known bug {bug.id} did not reproduce (its contract passed inside {bug.releases}): "
                "narrow its range in known-bugs.toml"
            )
        if self.known:
            ids = sorted({b.id for _, b in self.known})
            parts.append(
                f"{len(self.known)} red explained by known vLLM bug{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
            )
        return "; ".join(parts)


def judge_result(result: CellResult) -> Judgement:
    """A cell's result read against the known bugs of its release."""
    return judge(result.outcome, result.tests, result.cell.vllm)


def judge(
    outcome: Outcome, tests: Iterable[TestResult], release: str, bugs: tuple[KnownBug, ...] | None = None
) -> Judgement:
    """``outcome`` (a cell's or a suite's, from ``tests``) read against the known bugs of ``release``.

    Only tests with a verdict of their own count (a blocked test follows its blocker; not applicable is
    no verdict).  The outcome becomes KNOWN_BUG when it came from red tests and every one is explained,
    KNOWN_BUG_GONE when nothing is new and an entry's contract ran green in its range with none red.
    """
    bugs = known() if bugs is None else bugs
    tests = [t for t in tests if t.has_verdict]
    known_reds, new = [], []
    for t in tests:
        if t.outcome in RED:
            bug = next((b for b in bugs if b.explains(t.contract, t.shape, release)), None)
            (known_reds.append((t, bug)) if bug else new.append(t))
    gone = []
    for bug in bugs:
        if not bug.applies_to(release) or "*" in bug.contracts:
            continue
        ran = [t for t in tests if t.contract in bug.contracts and (not bug.shapes or t.shape in bug.shapes)]
        if ran and not any(t.outcome in RED for t in ran):
            gone.append(bug)
    judged = outcome
    if outcome in FROM_RED_TESTS and known_reds and not new:
        judged = Outcome.KNOWN_BUG_GONE if gone else Outcome.KNOWN_BUG
    elif outcome is Outcome.PASS and gone:
        judged = Outcome.KNOWN_BUG_GONE
    return Judgement(judged, tuple(known_reds), tuple(new), tuple(gone))


def deselections(node_ids: Iterable[str], release: str, bugs: tuple[KnownBug, ...] | None = None) -> list[str]:
    """pytest ``--deselect`` prefixes for the tests the known bugs of ``release`` turn red, from the suite's
    test functions (``node_ids``: ``file::test_name``): a run that needs a green baseline (mutation testing)
    leaves them out, since a test red by a vLLM bug can tell no mutant apart.  A shaped entry leaves out only its
    shapes' runs (``file::test[shape``)."""
    bugs = known() if bugs is None else bugs
    out: list[str] = []
    for bug in bugs:
        if not bug.applies_to(release) or "*" in bug.contracts:
            continue
        for node in node_ids:
            if node.rsplit("::", 1)[-1] in bug.contracts:
                out += [f"{node}[{shape}" for shape in bug.shapes] if bug.shapes else [node]
    return list(dict.fromkeys(out))
