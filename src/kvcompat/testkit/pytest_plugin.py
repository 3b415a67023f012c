"""pytest plugin run inside each cell: collects per-test results through hooks.

Enabled with ``-p kvcompat.testkit.pytest_plugin --kvcompat-json PATH``.  At session
end it writes PATH atomically with every test's outcome, duration and message,
plus collection errors and pytest's exit status.  The cell runner merges this
into results/<cell-id>.json; nothing here parses pytest's terminal output.

Outcome mapping (see :mod:`kvcompat.outcomes`):

* call passed (and setup/teardown clean)            -> passed
* call failed                                       -> failed
* failed with ``unsupported(...)`` (vLLM refused the
  user's configuration)                             -> unsupported
* setup/teardown failed, collection error           -> error
* skipped with ``not_applicable(reason)``           -> not_applicable
* any other skip, xfail or xpass                    -> error (a test may not hide)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvcompat.atomic import write_atomic
from kvcompat.outcomes import NOT_APPLICABLE_PREFIX, UNSUPPORTED_PREFIX, TestOutcome

MESSAGE_CHARS = 3000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompat")
    group.addoption("--kvcompat-json", default=None, help="write per-test results to this JSON file")
    group.addoption("--kvcompat-suite", default="ours", help="suite name recorded with each test")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--kvcompat-json")
    if path:
        config.pluginmanager.register(
            ResultCollector(Path(path), config.getoption("--kvcompat-suite")), "kvcompat-collector"
        )


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

    def _record(self, nodeid: str, outcome: TestOutcome | None, message: str | None, duration: float) -> None:
        entry = self.tests.setdefault(
            nodeid, {"nodeid": nodeid, "outcome": None, "duration": 0.0, "message": None, "suite": self.suite}
        )
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
        d = report.duration
        if hasattr(report, "wasxfail"):
            self._record(report.nodeid, TestOutcome.ERROR, f"xfail/xpass is not a result ({report.wasxfail})", d)
        elif report.skipped:
            reason = _skip_reason(report)
            if reason.startswith(NOT_APPLICABLE_PREFIX):
                self._record(report.nodeid, TestOutcome.NOT_APPLICABLE, reason.removeprefix(NOT_APPLICABLE_PREFIX), d)
            else:
                self._record(report.nodeid, TestOutcome.ERROR, f"skipped without a capability probe: {reason}", d)
        elif report.failed and report.when == "call" and (refused := _unsupported(report)) is not None:
            self._record(report.nodeid, TestOutcome.UNSUPPORTED, refused, d)
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
        payload = {
            "exitstatus": int(exitstatus),
            "collected": self.collected,
            "deselected": self.deselected,
            "tests": tests,
            "python": sys.version.split()[0],
        }
        write_atomic(self.path, json.dumps(payload, indent=1))
