"""pytest plugin run inside each cell: collects per-test results through hooks.

Enabled with ``-p kvcompat.testkit.pytest_plugin --kvcompat-json PATH``.  At session
end it writes PATH atomically with every test's outcome, duration and message,
plus collection errors and pytest's exit status.  The cell runner merges this
into results/<cell-id>.json; nothing here parses pytest's terminal output.

With ``--kvcompat-cell-process`` (the cell runner passes it; pytest owns the
interpreter) it also keeps two costs of a big heap out of the run, see
:class:`CellProcess`.

Outcome mapping (see :mod:`kvcompat.outcomes`):

* call passed (and setup/teardown clean)            -> passed
* call failed                                       -> failed
* failed with ``unsupported(...)`` (vLLM refused the
  user's configuration)                             -> unsupported
* failed inside ``setup_owned_by(contract)`` (a setup
  step another test owns)                           -> error, blocked by that contract
* setup/teardown failed, collection error           -> error
* skipped with ``not_applicable(reason)``           -> not_applicable
* an upstream test whose parametrization is empty
  on this platform ("got empty parameter set", e.g.
  offloading tests parametrized over GPU backends)  -> not_applicable, with pytest's reason
* any other skip, xfail or xpass                    -> error (a test may not hide)

A test that ran a deployment shape (the connector suite's ``shape`` fixture puts ``("shape", id)`` in its
user properties) carries that shape's id in its result (kvcompat.shapes).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest

from kvcompat.atomic import write_atomic
from kvcompat.outcomes import BLOCKED_PREFIX, NOT_APPLICABLE_PREFIX, UNSUPPORTED_PREFIX, TestOutcome

MESSAGE_CHARS = 3000
# pytest's skip reason for a parametrize whose argument list came out empty (its own probe: vLLM's
# tests build the list from what the platform supports, e.g. the attention backends of a GPU).
EMPTY_PARAMETER_SET = "got empty parameter set"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompat")
    group.addoption("--kvcompat-json", default=None, help="write per-test results to this JSON file")
    group.addoption("--kvcompat-suite", default="ours", help="suite name recorded with each test")
    group.addoption(
        "--kvcompat-first",
        default=None,
        help="a file of test node ids, one a line: run these first, in that order (a mutation run puts the "
        "tests that killed earlier mutants first, so -x stops early)",
    )
    group.addoption(
        "--kvcompat-cell-process",
        action="store_true",
        help="this pytest owns its process (a cell's run): collect garbage once per test, and exit without "
        "the interpreter's final collection",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--kvcompat-json")
    if path:
        config.pluginmanager.register(
            ResultCollector(Path(path), config.getoption("--kvcompat-suite")), "kvcompat-collector"
        )
    if config.getoption("--kvcompat-cell-process"):
        config.pluginmanager.register(CellProcess(), "kvcompat-cell-process")
    first = config.getoption("--kvcompat-first")
    if first:
        config.pluginmanager.register(RunFirst(Path(first)), "kvcompat-first")


class RunFirst:
    """Moves the listed tests to the front, in the listed order; the others keep theirs."""

    def __init__(self, path: Path) -> None:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        self.rank = {name: i for i, name in enumerate(names)}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: self.rank.get(item.nodeid, len(self.rank)))


class CellProcess:
    """What a big heap costs a cell's pytest, kept out of the run (measured on 0.33.0: ~4 s and ~6 s).

    Once vLLM and torch are imported the heap holds millions of objects, and each of
    CPython's automatic full collections walks all of them (13 such walks in one run of
    our suite), although nothing imported is ever garbage.  So automatic collection is
    off while a test runs; after it, one explicit collection frees that test's garbage
    (its finalizers run, as they would have) and the survivors, the imported modules,
    are frozen out of later walks.  Each test still starts from its own fixtures: only
    *when* garbage is collected changes, never what a test sees.

    At exit the interpreter walks the whole heap again while it tears modules down,
    with nothing left to write: the results file and pytest's summary are out by then.
    So the process ends with ``os._exit`` and pytest's exit status, after every other
    plugin's unconfigure.
    """

    def __init__(self) -> None:
        self.session: pytest.Session | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item):
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
            gc.collect()
            gc.freeze()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.session is None:  # never got as far as a session: let pytest report as usual
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(self.session.exitstatus))


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    if crash and crash not in text[-MESSAGE_CHARS:]:
        text = crash + "\n" + text
    return text if len(text) <= MESSAGE_CHARS else "…" + text[-MESSAGE_CHARS:]


def _unsupported(report: pytest.TestReport) -> str | None:
    """The release's refusal, when the test called ``unsupported(...)`` (pytest.fail without a traceback)."""
    text = getattr(report, "longreprtext", "") or ""
    return text.removeprefix(UNSUPPORTED_PREFIX)[:MESSAGE_CHARS] if text.startswith(UNSUPPORTED_PREFIX) else None


def _blocked(report: pytest.TestReport) -> tuple[str, str] | None:
    """(owning contract, message) when the test failed in a setup step another test owns."""
    text = getattr(report, "longreprtext", "") or ""
    if not text.startswith(BLOCKED_PREFIX):
        return None
    owner, _, message = text.removeprefix(BLOCKED_PREFIX).partition("\n")
    return owner.strip(), message[:MESSAGE_CHARS]


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr or "")


class ResultCollector:
    def __init__(self, path: Path, suite: str) -> None:
        self.path = path
        self.suite = suite
        self.tests: dict[str, dict] = {}
        self.collected = 0
        self.deselected: list[str] = []

    def _entry(self, nodeid: str) -> dict:
        return self.tests.setdefault(
            nodeid,
            {
                "nodeid": nodeid,
                "outcome": None,
                "duration": 0.0,
                "message": None,
                "suite": self.suite,
                "blocked_by": None,
                "shape": None,
            },
        )

    def _record(
        self,
        nodeid: str,
        outcome: TestOutcome | None,
        message: str | None,
        duration: float,
        blocked_by: str | None = None,
    ) -> None:
        entry = self._entry(nodeid)
        entry["duration"] += duration
        # A later phase can only make a test worse (teardown error after a pass), never better.
        rank = {
            None: -1,
            TestOutcome.PASSED: 0,
            TestOutcome.NOT_APPLICABLE: 1,
            TestOutcome.UNSUPPORTED: 2,
            TestOutcome.FAILED: 3,
            TestOutcome.ERROR: 4,
        }
        if rank[outcome] >= rank[entry["outcome"]]:
            entry["outcome"] = outcome
            entry["blocked_by"] = blocked_by
            if message is not None:
                entry["message"] = message

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.collected = len(items)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += [item.nodeid for item in items]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._record(
                report.nodeid or "<collection>", TestOutcome.ERROR, "collection error: " + _message(report), 0.0
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        shape = dict(report.user_properties).get("shape")  # the conftest's `shape` fixture records it
        if shape is not None:
            self._entry(report.nodeid)["shape"] = shape
        d = report.duration
        if hasattr(report, "wasxfail"):
            self._record(report.nodeid, TestOutcome.ERROR, f"xfail/xpass is not a result ({report.wasxfail})", d)
        elif report.skipped:
            reason = _skip_reason(report)
            if reason.startswith(NOT_APPLICABLE_PREFIX):
                self._record(report.nodeid, TestOutcome.NOT_APPLICABLE, reason.removeprefix(NOT_APPLICABLE_PREFIX), d)
            elif self.suite != "ours" and reason.startswith(EMPTY_PARAMETER_SET):
                # our own tests never parametrize over the platform; vLLM's may, and on a CPU cell the list is empty
                why = f"the release's test has no case for this platform (pytest: {reason})"
                self._record(report.nodeid, TestOutcome.NOT_APPLICABLE, why, d)
            else:
                self._record(report.nodeid, TestOutcome.ERROR, f"skipped without a capability probe: {reason}", d)
        elif report.failed and report.when == "call" and (refused := _unsupported(report)) is not None:
            self._record(report.nodeid, TestOutcome.UNSUPPORTED, refused, d)
        elif report.failed and (blocked := _blocked(report)) is not None:
            owner, message = blocked
            self._record(report.nodeid, TestOutcome.ERROR, f"setup step of {owner} failed: {message}", d, owner)
        elif report.failed:
            outcome = TestOutcome.FAILED if report.when == "call" else TestOutcome.ERROR
            self._record(report.nodeid, outcome, f"[{report.when}] " + _message(report), d)
        elif report.when == "call":
            self._record(report.nodeid, TestOutcome.PASSED, None, d)
        else:  # a clean setup or teardown: adds time; a test with only a clean setup ends as an error
            self._record(report.nodeid, None, None, d)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        tests = []
        for entry in self.tests.values():
            if entry["outcome"] is None:  # setup passed but the call never reported (e.g. interrupted)
                entry["outcome"] = TestOutcome.ERROR
                entry["message"] = entry["message"] or "test did not run to completion"
            tests.append({**entry, "outcome": TestOutcome(entry["outcome"]).value})
        from kvcompat.testkit import FACTS

        payload = {
            "exitstatus": int(exitstatus),
            "collected": self.collected,
            "deselected": self.deselected,
            "tests": tests,
            "python": sys.version.split()[0],
            "facts": dict(FACTS),
        }
        write_atomic(self.path, json.dumps(payload, indent=1))
