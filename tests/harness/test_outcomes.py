"""How a cell's outcome follows from its tests: PASS only from tests that ran and passed."""

import pytest

from kvcompat.outcomes import Outcome, TestOutcome, cell_outcome

P, F, E, NA = TestOutcome.PASSED, TestOutcome.FAILED, TestOutcome.ERROR, TestOutcome.NOT_APPLICABLE
U = TestOutcome.UNSUPPORTED


@pytest.mark.parametrize(
    "tests, expected",
    [
        ([], Outcome.TEST_ERROR),  # nothing ran: never a pass
        ([P, P], Outcome.PASS),
        ([P, NA], Outcome.PASS),
        ([NA, NA], Outcome.NOT_APPLICABLE),
        ([P, F], Outcome.TEST_FAIL),
        ([P, E], Outcome.TEST_ERROR),
        ([E, F, P], Outcome.TEST_FAIL),
        ([NA, E], Outcome.TEST_ERROR),
        ([P, U], Outcome.UNSUPPORTED),  # red: the user's configuration cannot be built
        ([U, E], Outcome.UNSUPPORTED),
        ([U, F], Outcome.TEST_FAIL),
        ([NA, U], Outcome.UNSUPPORTED),
    ],
)
def test_cell_outcome(tests, expected):
    assert cell_outcome(tests) is expected


def test_only_pass_and_not_applicable_are_green():
    assert {o for o in Outcome if o.is_green} == {Outcome.PASS, Outcome.NOT_APPLICABLE}


def test_a_known_bug_is_neither_green_nor_a_failed_run_and_one_that_did_not_reproduce_fails_it():
    assert not Outcome.KNOWN_BUG.is_green and not Outcome.KNOWN_BUG.fails_run
    assert not Outcome.KNOWN_BUG_GONE.is_green and Outcome.KNOWN_BUG_GONE.fails_run
    assert {o for o in Outcome if not o.fails_run} == {Outcome.PASS, Outcome.NOT_APPLICABLE, Outcome.KNOWN_BUG}


def test_all_eleven_statuses_are_distinct():
    assert len({o.value for o in Outcome}) == len({o.label for o in Outcome}) == 11
    assert Outcome.UNSUPPORTED.label == "unsupported" and not Outcome.UNSUPPORTED.is_green


def test_unsupported_is_a_verdict_in_the_bisect_the_junit_and_every_renderer():
    from kvcompat.bisection import Verdict, verdict_for
    from kvcompat.report.htmlstyle import COLOURS
    from kvcompat.report.junit import render_junit
    from kvcompat.report.markdown import MARK, TEST_MARK
    from kvcompat.report.model import Report
    from kvcompat.report.terminal import ANSI

    from helpers import make_result

    refused = "MultiConnector(Nixl, CPU offload) with HMA: ValueError: no HMA (vllm/config.py:3)"
    result = make_result("0.20.0", outcome=Outcome.UNSUPPORTED, tests=[("test_hma", "unsupported", refused)])
    step = verdict_for(result, "test_hma")
    assert step.verdict is Verdict.BAD and "unsupported" in step.why
    xml = render_junit(Report([result], generated="2026-12-03"))
    assert 'failures="1"' in xml and 'type="unsupported"' in xml and "no HMA" in xml
    for table in (MARK, ANSI, COLOURS):
        assert Outcome.UNSUPPORTED in table and len(set(map(str, table.values()))) >= 7
    assert TEST_MARK[TestOutcome.UNSUPPORTED] == "🟤 unsupported"
