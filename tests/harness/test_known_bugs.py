"""Known vLLM bugs as data (kvcompat.known_bugs): the shipped file parses, and an entry explains exactly its
contracts, shapes and releases."""

from __future__ import annotations

import pytest

from kvcompat import known_bugs

ENTRY = """
[[bug]]
id = "b"
title = "a bug"
contracts = ["test_x"]
shapes = ["hybrid"]
releases = ">=0.20,<0.24"
impact = "hang"
where = "K/v1/nixl/worker.py 0.22.1 L1"
upstream = "https://github.com/vllm-project/vllm/issues/1"
fix = "https://github.com/vllm-project/vllm/pull/2"
"""


def test_the_shipped_known_bugs_parse_and_name_real_contracts():
    from pathlib import Path

    bugs = known_bugs.known()
    assert bugs, "known-bugs.toml is empty"
    tests = Path(__file__).parents[1]
    suite = "".join(p.read_text() for d in ("connectors", "e2e") for p in tests.joinpath(d).glob("test_*.py"))
    for bug in bugs:
        for contract in bug.contracts:
            if contract == "*":
                continue
            assert f"def {contract}(" in suite, (
                f"known bug {bug.id} names {contract}, which tests/connectors and tests/e2e lack"
            )


def test_an_entry_explains_its_contract_in_its_shapes_and_releases_only():
    (bug,) = known_bugs.parse(ENTRY)
    assert bug.explains("test_x", "hybrid", "0.22.1")
    assert not bug.explains("test_x", "hybrid", "0.24.0"), "fixed in 0.24: a red there is new"
    assert not bug.explains("test_x", "dense", "0.22.1"), "another shape: a red there is new"
    assert not bug.explains("test_y", "hybrid", "0.22.1")
    assert bug.line() == ("known vLLM bug (hang): a bug (K/v1/nixl/worker.py 0.22.1 L1; vllm#1, fixed by vllm#2)")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (ENTRY.replace('impact = "hang"', 'impact = "bad"'), "impact 'bad' is not one of"),
        (ENTRY.replace('releases = ">=0.20,<0.24"', 'releases = "soon"'), "is not a version range"),
        (ENTRY.replace('where = "K/v1/nixl/worker.py 0.22.1 L1"\n', ""), "lacks where"),
        (ENTRY + ENTRY, "listed twice"),
    ],
)
def test_a_malformed_entry_is_named(text, says):
    with pytest.raises(known_bugs.KnownBugsError, match=says):
        known_bugs.parse(text)


def _t(name: str, outcome: str, shape: str | None = "hybrid", **kw):
    from kvcompat.outcomes import TestOutcome
    from kvcompat.results import TestResult

    return TestResult(f"tests/connectors/t.py::{name}[{shape}]", TestOutcome(outcome), 0.1, "boom", shape=shape, **kw)


def test_a_red_every_entry_explains_is_a_known_bug_and_does_not_fail_the_run():
    from kvcompat.outcomes import Outcome

    bugs = known_bugs.parse(ENTRY)
    j = known_bugs.judge(Outcome.TEST_FAIL, [_t("test_x", "failed"), _t("test_y", "passed")], "0.22.1", bugs)
    assert j.outcome is Outcome.KNOWN_BUG and not j.fails_run
    assert [b.id for _, b in j.known] == ["b"] and not j.new and not j.gone
    assert "known vLLM bug b" in j.summary()


def test_a_red_no_entry_explains_is_new_and_keeps_its_outcome():
    from kvcompat.outcomes import Outcome

    bugs = known_bugs.parse(ENTRY)
    tests = [_t("test_x", "failed"), _t("test_y", "error")]
    j = known_bugs.judge(Outcome.TEST_FAIL, tests, "0.22.1", bugs)
    assert j.outcome is Outcome.TEST_FAIL and j.fails_run, "one new red among known ones: the cell stays red"
    assert [t.contract for t in j.new] == ["test_y"] and "1 new red: test_y" in j.summary()
    # Outside the entry's range, or in another shape, the same red is new.
    assert known_bugs.judge(Outcome.TEST_FAIL, [_t("test_x", "failed")], "0.24.0", bugs).new
    assert known_bugs.judge(Outcome.TEST_FAIL, [_t("test_x", "failed", "dense")], "0.22.1", bugs).new


def test_a_known_bug_whose_contract_passes_inside_its_range_did_not_reproduce_and_fails_the_run():
    from kvcompat.outcomes import Outcome

    bugs = known_bugs.parse(ENTRY)
    j = known_bugs.judge(Outcome.PASS, [_t("test_x", "passed")], "0.22.1", bugs)
    assert j.outcome is Outcome.KNOWN_BUG_GONE and j.fails_run and [b.id for b in j.gone] == ["b"]
    assert "did not reproduce" in j.summary() and "narrow its range" in j.summary()
    # Not run here, not applicable, or in a shape the entry does not name: nothing to say about the entry.
    for tests in ([], [_t("test_x", "not_applicable")], [_t("test_x", "passed", "dense")]):
        assert known_bugs.judge(Outcome.PASS, tests, "0.22.1", bugs).outcome is Outcome.PASS
    # Outside its range a pass is just a pass.
    assert known_bugs.judge(Outcome.PASS, [_t("test_x", "passed")], "0.24.0", bugs).outcome is Outcome.PASS


def test_blocked_tests_and_cells_that_never_ran_their_tests_are_not_judged():
    from kvcompat.outcomes import Outcome

    bugs = known_bugs.parse(ENTRY)
    blocked = _t("test_y", "error", blocked_by="tests/connectors/t.py::test_x")
    j = known_bugs.judge(Outcome.TEST_FAIL, [_t("test_x", "failed"), blocked], "0.22.1", bugs)
    assert j.outcome is Outcome.KNOWN_BUG, "a test blocked by a known red follows its blocker"
    assert known_bugs.judge(Outcome.INSTALL_ERROR, [], "0.22.1", bugs).outcome is Outcome.INSTALL_ERROR
    assert known_bugs.judge(Outcome.TIMEOUT, [_t("test_x", "failed")], "0.22.1", bugs).fails_run


def test_the_fix_release_is_read_off_the_range():
    (bug,) = known_bugs.parse(ENTRY.replace('fix = "https://github.com/vllm-project/vllm/pull/2"\n', ""))
    assert bug.fixed_in == "0.24" and "fixed in 0.24" in bug.line()
    (open_bug,) = known_bugs.parse(ENTRY.replace('">=0.20,<0.24"', '">=0.20"'))
    assert open_bug.fixed_in is None


def test_another_known_bugs_file_is_named_by_the_environment_and_a_missing_one_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "bugs.toml"
    path.write_text(ENTRY)
    monkeypatch.setenv(known_bugs.DATA_ENV, str(path))
    known_bugs.known.cache_clear()
    try:
        assert [b.id for b in known_bugs.known()] == ["b"]
        monkeypatch.setenv(known_bugs.DATA_ENV, str(tmp_path / "absent.toml"))
        known_bugs.known.cache_clear()
        with pytest.raises(known_bugs.KnownBugsError, match="cannot be read"):
            known_bugs.known()
    finally:
        known_bugs.known.cache_clear()


def test_the_junit_skips_a_known_red_as_pytest_does_an_xfail_and_fails_an_entry_that_did_not_reproduce(
    tmp_path, monkeypatch
):
    import xml.etree.ElementTree as ET

    from kvcompat.cells import Cell
    from kvcompat.outcomes import Outcome
    from kvcompat.report.junit import render_junit
    from kvcompat.report.model import Report
    from kvcompat.results import CellResult

    bugs = tmp_path / "bugs.toml"
    bugs.write_text(ENTRY + ENTRY.replace('id = "b"', 'id = "gone"').replace('"test_x"', '"test_y"'))
    monkeypatch.setenv(known_bugs.DATA_ENV, str(bugs))
    known_bugs.known.cache_clear()
    try:
        tests = [_t("test_x", "failed"), _t("test_y", "passed")]
        result = CellResult(Cell(vllm="0.22.1", torch="2.9.0"), Outcome.TEST_FAIL, "d", tests)
        root = ET.fromstring(render_junit(Report([result], generated="2026-12-07")))
    finally:
        known_bugs.known.cache_clear()
    (suite,) = root
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    (skipped,) = suite.iter("skipped")
    assert skipped.get("type") == "known-bug" and "known vLLM bug (hang)" in skipped.get("message")
    (failure,) = suite.iter("failure")
    assert failure.get("type") == "known-bug-not-reproduced" and "gone" in failure.get("message")


def test_kvcompat_show_and_list_give_the_judged_status_with_the_bug_beside_its_test(tmp_path):
    from kvcompat.cells import Cell
    from kvcompat.commands.show import show
    from kvcompat.outcomes import Outcome
    from kvcompat.results import CellResult

    lru = "test_a_prompt_in_use_from_the_device_cache_is_evicted_from_the_cpu_tier_after_an_unused_one"
    result = CellResult(Cell(vllm="0.33.0", torch="2.14.0"), Outcome.TEST_FAIL, "1 failed", [_t(lru, "failed", None)])
    text = show(result)
    first, *rest = text.splitlines()
    assert first.startswith(
        "vllm-0.33.0__torch-2.14.0: KNOWN BUG: 1 red explained by known vLLM bug cpu-tier-lru-ignores-device-hits"
    )
    assert any("known vLLM bug (efficiency)" in line and "fixed in 0.34.0" in line for line in rest)


def test_the_tests_a_known_bug_turns_red_are_deselected_from_runs_that_need_a_green_baseline():
    bugs = known_bugs.parse(ENTRY + ENTRY.replace('id = "b"', 'id = "any"').replace('shapes = ["hybrid"]\n', ""))
    ids = ["tests/connectors/t.py::test_x", "tests/connectors/t.py::test_y"]
    assert known_bugs.deselections(ids, "0.22.1", bugs) == ["tests/connectors/t.py::test_x[hybrid", ids[0]]
    assert known_bugs.deselections(ids, "0.24.0", bugs) == []


def test_a_mutation_run_leaves_out_the_known_bugs_of_its_release():
    from pathlib import Path

    from kvcompat.cells import Cell
    from kvcompat.mutation import context, session

    said = []
    root = Path(__file__).parents[2]
    here = dict(results_dir=root / "results", home=root / "h", cell_work=root / "w")
    mo = context.MutationOptions(repo=root, catalogue=root / "x.toml", pytest_args=("-x",), **here)
    out = session._without_known_bugs(Cell("0.33.0", "2.14.0"), mo, said.append)
    lru = (
        "test_cpu_tier.py::test_a_prompt_in_use_from_the_device_cache_is_evicted_from_the_cpu_tier_after_an_unused_one"
    )
    assert out.pytest_args[0] == "-x" and f"--deselect=tests/connectors/{lru}" in out.pytest_args
    assert said and "known vLLM bug of 0.33.0" in said[0]
    assert session._without_known_bugs(Cell("0.34.0", "2.14.0"), mo, said.append).pytest_args != mo.pytest_args
