"""Statuses of tests and cells, and how a cell's status follows from its tests.

One vocabulary is used everywhere (results JSON, reports, bisect):

* a *test* ends ``passed``, ``failed``, ``error`` or ``not_applicable``;
* a *cell* ends in one of :class:`Outcome`.

PASS is only ever derived from tests that ran and asserted; there is no code
path that writes it directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# A test that finds a capability truly absent from the installed release calls
# ``kvcompat.testkit.not_applicable(reason)``; the pytest plugin recognises this prefix on the
# skip message.  Any other skip is reported as an error, so a test cannot hide
# behind ``pytest.skip``.
NOT_APPLICABLE_PREFIX = "kvcompat-not-applicable: "
# A test whose user configuration the release refuses to build calls
# ``kvcompat.testkit.unsupported(...)``: the plugin recognises this prefix on the failure.
UNSUPPORTED_PREFIX = "kvcompat-unsupported: "
# A test whose setup step failed where another test owns that step (its contract) calls
# ``kvcompat.testkit.setup_owned_by(contract)``: the plugin records it as an error *blocked by*
# that contract, so a timeline row's first fail is the row's own, never another contract's.
BLOCKED_PREFIX = "kvcompat-blocked-by: "
# MultiConnector's children in config order, a matrix dimension (an entry's ``order``): its
# first-wins load rule makes the two behave differently, and users deploy both.  "nixl-first" is
# the seed test's and the default.  The cell runner passes a cell's order to its suite in
# CHILD_ORDER_ENV; the testkit builds the children in that order.
CHILD_ORDERS = ("nixl-first", "offload-first")
CHILD_ORDER_ENV = "KVCOMPAT_CHILD_ORDER"


class Outcome(str, enum.Enum):
    """Status of one matrix cell, from worst-understood to best."""

    UNRESOLVABLE = "unresolvable"
    INSTALL_ERROR = "install_error"
    IMPORT_ERROR = "import_error"
    TEST_FAIL = "test_fail"
    UNSUPPORTED = "unsupported"
    TEST_ERROR = "test_error"
    TIMEOUT = "timeout"
    # Every red test is explained by a known vLLM bug (kvcompat.known_bugs) on this release: never
    # written by a cell, only derived when results are judged against the known bugs (judge()).
    KNOWN_BUG = "known_bug"
    # A known bug's contract ran green inside the bug's release range: the entry is no longer true
    # (pytest's strict xfail); derived like KNOWN_BUG.
    KNOWN_BUG_GONE = "known_bug_gone"
    NOT_APPLICABLE = "not_applicable"
    PASS = "pass"

    @property
    def label(self) -> str:
        return "known bug not reproduced" if self is Outcome.KNOWN_BUG_GONE else self.value.replace("_", " ")

    @property
    def is_green(self) -> bool:
        """True for outcomes that do not fail a run: pass, and honest not-applicable."""
        return self in (Outcome.PASS, Outcome.NOT_APPLICABLE)

    @property
    def fails_run(self) -> bool:
        """Whether a cell with this (judged) outcome makes the run exit 1: anything but green or known."""
        return not self.is_green and self is not Outcome.KNOWN_BUG


class TestOutcome(str, enum.Enum):
    """Status of one test inside a cell."""

    __test__ = False  # not a pytest test class

    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    UNSUPPORTED = "unsupported"
    NOT_APPLICABLE = "not_applicable"


def cell_outcome(test_outcomes: Iterable[TestOutcome | str]) -> Outcome:
    """Derive a cell's outcome from the outcomes of the tests that ran in it.

    No tests at all is an error: a cell that collected nothing asserted nothing.
    A failure outranks an unsupported configuration, which outranks an error (each is
    the more specific finding); a cell is not-applicable only when every test in it was.
    Unsupported is red: the user's configuration cannot be built in this release.
    """
    outcomes = [TestOutcome(o) for o in test_outcomes]
    if not outcomes:
        return Outcome.TEST_ERROR
    if TestOutcome.FAILED in outcomes:
        return Outcome.TEST_FAIL
    if TestOutcome.UNSUPPORTED in outcomes:
        return Outcome.UNSUPPORTED
    if TestOutcome.ERROR in outcomes:
        return Outcome.TEST_ERROR
    if all(o is TestOutcome.NOT_APPLICABLE for o in outcomes):
        return Outcome.NOT_APPLICABLE
    return Outcome.PASS
