"""How a cell's outcome follows from its tests: PASS only from tests that ran and passed."""

import pytest

from kvcompat.outcomes import Outcome, TestOutcome, cell_outcome

P, F, E, NA = TestOutcome.PASSED, TestOutcome.FAILED, TestOutcome.ERROR, TestOutcome.NOT_APPLICABLE


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
    ],
)
def test_cell_outcome(tests, expected):
    assert cell_outcome(tests) is expected


def test_only_pass_and_not_applicable_are_green():
    assert {o for o in Outcome if o.is_green} == {Outcome.PASS, Outcome.NOT_APPLICABLE}


def test_all_eight_statuses_are_distinct():
    assert len({o.value for o in Outcome}) == 8
