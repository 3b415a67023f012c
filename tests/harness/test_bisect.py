"""Bisect: the search, skips that are never counted, endpoint checks, the answer, and the source diff."""

import dataclasses
import math
import re

import pytest
from packaging.version import Version

from kvcompat import bisect_releases as br
from kvcompat import bisection as bis
from kvcompat import options
from kvcompat.options import OptionError
from kvcompat.outcomes import Outcome

from helpers import make_result

VERSIONS = [f"0.{m}.0" for m in range(14, 34)]  # 20 releases


class Listed:
    """A handler over plain items (see kvcompat.bisection.Handler): ``evaluate`` gives each step's verdict."""

    def __init__(self, items, evaluate, *, check_older=False, name=str, resume=None, noun="release"):
        self.items, self.evaluate, self.check_older, self.name, self._resume = (
            items,
            evaluate,
            check_older,
            name,
            resume,
        )
        self.noun = noun

    def header(self):
        return f"{len(self.items)} {self.noun}s"

    def full(self, item):
        return item

    def resume(self, good, bad):
        return self._resume(good, bad) if self._resume else None

    def changes(self, older, newer):
        return None

    def link(self, older, newer):
        return f"compare: {br.compare_url(older, newer)}"


def bisect(versions, evaluate, *, say=print, find_fix=False, **handler):
    """The one bisect (kvcompat.bisection.run) over ``versions``; its lines go to ``say``."""
    return bis.run(Listed(versions, evaluate, **handler), test="t", find_fix=find_fix, say=say)


def steps(lines):
    return [line for line in lines if line.startswith("[")]


def fake(first_bad: str, skip=(), *, fixed=False):
    """Good up to ``first_bad``, bad from it on; ``fixed``: the other way round (a regression a later release
    fixed, ``first_bad`` being the first good one)."""
    calls = []
    old, new = (bis.Verdict.BAD, bis.Verdict.GOOD) if fixed else (bis.Verdict.GOOD, bis.Verdict.BAD)

    def evaluate(v):
        calls.append(v)
        if v in skip:
            return bis.Step(v, bis.Verdict.SKIP, "cell install error")
        return bis.Step(v, new if Version(v) >= Version(first_bad) else old, "x")

    return evaluate, calls


@pytest.mark.parametrize("first_bad", ["0.15.0", "0.21.0", "0.26.0", "0.33.0"])
def test_finds_first_bad_within_budget(first_bad):
    evaluate, calls = fake(first_bad)
    lines = []
    res = bisect(VERSIONS, evaluate, say=lines.append, resume=lambda g, b: f"--good {g} --bad {b}")
    assert res.first_bad == first_bad
    assert res.last_good == VERSIONS[VERSIONS.index(first_bad) - 1]
    assert res.cells_evaluated == len(calls) <= math.ceil(math.log2(len(VERSIONS))) + 1
    assert calls[0] == VERSIONS[-1]  # the bad end first: nothing to find unless it fails
    assert len(set(calls)) == len(calls)
    assert any("resume with: --good" in line for line in lines)
    assert all(line.endswith("s)") for line in lines if line.startswith("["))  # each step's wall time


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 16, 17, 20, 24, 33])
def test_every_boundary_within_ceil_log2_n_plus_one_cells(n):
    """The bound holds wherever the boundary lies, including a --good end that is in fact bad."""
    versions = [f"0.{m}.0" for m in range(n)]
    for first_bad in range(n):  # 0: the --good end is bad too
        evaluate, calls = fake(versions[first_bad])
        if first_bad == 0:
            with pytest.raises(bis.BisectError, match=f"--good {versions[0]} is not good"):
                bisect(versions, evaluate, say=lambda s: None)
        else:
            res = bisect(versions, evaluate, say=lambda s: None)
            assert (res.last_good, res.first_bad) == (versions[first_bad - 1], versions[first_bad])
        assert len(calls) <= bis.cell_budget(n) == math.ceil(math.log2(n)) + 1, (n, first_bad, calls)


def test_skipped_releases_are_never_counted():
    evaluate, calls = fake("0.24.0", skip={"0.23.0", "0.24.0"})
    res = bisect(VERSIONS, evaluate, say=lambda s: None)
    # 0.23 and 0.24 could not be tested: the answer brackets them honestly.
    assert (res.last_good, res.first_bad) == ("0.22.0", "0.25.0")
    assert res.untested_between == ["0.23.0", "0.24.0"]


def test_endpoints_must_be_good_and_bad():
    evaluate, _ = fake("0.14.0")
    with pytest.raises(bis.BisectError, match="--good 0.14.0 is not good"):
        bisect(VERSIONS, evaluate, say=lambda s: None)
    evaluate, _ = fake("0.99.0")
    with pytest.raises(bis.BisectError, match="--bad 0.33.0 is not bad"):
        bisect(VERSIONS, evaluate, say=lambda s: None)


def test_releases_between():
    avail = [Version(v) for v in ["0.30.0", "0.31.0rc1", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]]
    assert br.releases_between(avail, "0.30.0", "0.33.0", pre=False) == ["0.30.0", "0.31.0", "0.32.0", "0.33.0"]
    assert "0.31.0rc1" in br.releases_between(avail, "0.30.0", "0.33.0", pre=True)
    with pytest.raises(bis.BisectError, match="not a known release; nearest on the index: 0.33.0"):
        br.releases_between(avail, "0.30.0", "0.33.5", pre=False)
    with pytest.raises(bis.BisectError, match="must be older"):
        br.releases_between(avail, "0.33.0", "0.30.0", pre=False)


def cell_result(outcome, tests):
    return make_result(outcome=outcome, tests=tests, detail="d", prefix="")


def test_verdicts():
    tests = [
        ("tests/connectors/test_a.py::test_load", "passed", None),
        ("tests/connectors/test_a.py::test_store", "failed", "E  assert 0 > 0"),
    ]
    assert bis.verdict_for(cell_result(Outcome.TEST_FAIL, tests), "test_load").verdict is bis.Verdict.GOOD
    bad = bis.verdict_for(cell_result(Outcome.TEST_FAIL, tests), "tests/connectors/test_a.py::test_store")
    assert bad.verdict is bis.Verdict.BAD and "assert 0 > 0" in bad.why
    na = [("tests/connectors/test_a.py::test_load", "not_applicable", "absent")]
    assert bis.verdict_for(cell_result(Outcome.NOT_APPLICABLE, na), "test_load").verdict is bis.Verdict.SKIP
    for outcome in (Outcome.UNRESOLVABLE, Outcome.INSTALL_ERROR, Outcome.IMPORT_ERROR, Outcome.TIMEOUT):
        assert bis.verdict_for(cell_result(outcome, []), "test_load").verdict is bis.Verdict.SKIP
    with pytest.raises(bis.BisectError, match="matches no test"):
        bis.verdict_for(cell_result(Outcome.TEST_FAIL, tests), "test_nothing_like_this")


def test_bisect_options_and_resume_command():
    with pytest.raises(OptionError, match="required: --test"):
        options.parse("bisect", ["--good", "0.1.0", "--bad", "0.2.0"], {})
    with pytest.raises(OptionError, match="is not a folder"):
        options.parse(
            "bisect", ["--test", "t", "--good", "0.1.0", "--bad", "0.2.0", "--wheelhouse", "/no/such/dir"], {}
        )
    values, _ = options.parse("bisect", ["--test", "t", "--good", "0.1.0", "--bad", "0.2.0", "--torch", "2.13.0"], {})
    resume = options.command_line("bisect", {**vars(values), "good": "0.1.5"})
    assert resume == "nox -s bisect -- --test t --good 0.1.5 --bad 0.2.0 --torch 2.13.0"
    again, _ = options.parse("bisect", resume.split(" -- ")[1].split(), {})
    assert vars(again) == {**vars(values), "good": "0.1.5"}  # the resume command round-trips


def test_diff_trees(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        (root / "vllm/distributed/kv_transfer").mkdir(parents=True)
        (root / "vllm/other").mkdir(parents=True)
    (old / "vllm/distributed/kv_transfer/multi.py").write_text("a\nb\nc\n")
    (new / "vllm/distributed/kv_transfer/multi.py").write_text("a\nB\nc\nd\n")
    (old / "vllm/distributed/kv_transfer/gone.py").write_text("x\n")
    (new / "vllm/other/ignored.py").write_text("zzz\n")
    changes = {c.path: c for c in br.diff_trees(old, new)}
    assert set(changes) == {"vllm/distributed/kv_transfer/multi.py", "vllm/distributed/kv_transfer/gone.py"}
    m = changes["vllm/distributed/kv_transfer/multi.py"]
    assert (m.added, m.removed, m.status) == (2, 1, "modified")
    assert changes["vllm/distributed/kv_transfer/gone.py"].status == "removed"
    assert br.compare_url("0.25.1", "0.26.0") == "https://github.com/vllm-project/vllm/compare/v0.25.1...v0.26.0"


def fake_fix(first_good: str, skip=()):
    """Bad up to ``first_good``, good from it on (a regression that a later release fixed)."""
    return fake(first_good, skip, fixed=True)


@pytest.mark.parametrize("first_good", ["0.15.0", "0.22.0", "0.27.0", "0.33.0"])
def test_find_fix_finds_first_good_within_the_same_budget(first_good):
    evaluate, calls = fake_fix(first_good)
    lines = []
    res = bisect(VERSIONS, evaluate, say=lines.append, resume=lambda g, b: f"--bad {b} --good {g}", find_fix=True)
    assert (res.first_good, res.last_bad) == (first_good, VERSIONS[VERSIONS.index(first_good) - 1])
    assert res.last_good is None and res.first_bad is None  # a fix answer never poses as a break answer
    assert res.cells_evaluated == len(calls) <= bis.cell_budget(len(VERSIONS)) == math.ceil(math.log2(20)) + 1
    assert calls[0] == VERSIONS[-1] and len(set(calls)) == len(calls)
    assert lines[0].startswith("bisecting 20 releases for the fix of 't'; at most 6 cells (ceil(log2 20) + 1 for 20")
    assert steps(lines)[0].startswith(f"[1/≤{bis.cell_budget(20)}] 0.33.0 (--good endpoint): GOOD")
    # resume hands the narrowed ends back as --good/--bad: the newer one is still --good
    resumes = [line for line in lines if "resume with" in line]
    assert not resumes or resumes[-1].endswith(f"--bad {res.last_bad} --good {res.first_good}")
    answer = bis.render_answer(res, Listed(VERSIONS, evaluate))
    assert [f"first good release: {first_good}", f"last bad release:   {res.last_bad}"] == answer.splitlines()[1:3]
    assert f"compare: https://github.com/vllm-project/vllm/compare/v{res.last_bad}...v{first_good}" in answer
    assert "first bad" not in answer and "last good" not in answer


def test_find_fix_skips_are_never_counted():
    evaluate, _ = fake_fix("0.24.0", skip={"0.23.0", "0.24.0"})
    res = bisect(VERSIONS, evaluate, say=lambda s: None, find_fix=True)
    assert (res.last_bad, res.first_good) == ("0.22.0", "0.25.0")
    assert res.untested_between == ["0.23.0", "0.24.0"]
    assert "the first good release may be one of them" in bis.render_answer(res, Listed(VERSIONS, evaluate))


def test_find_fix_endpoints_must_be_bad_then_good():
    evaluate, _ = fake_fix("0.14.0")  # good everywhere: nothing was broken at --bad
    with pytest.raises(bis.BisectError, match="--bad 0.14.0 is not bad"):
        bisect(VERSIONS, evaluate, say=lambda s: None, find_fix=True)
    evaluate, _ = fake_fix("0.99.0")  # never fixed
    with pytest.raises(bis.BisectError, match="--good 0.33.0 is not good .*pick a newer release"):
        bisect(VERSIONS, evaluate, say=lambda s: None, find_fix=True)
    # a break-shaped history is not a fix: the newer end, checked first, must pass
    evaluate, _ = fake("0.20.0")
    with pytest.raises(bis.BisectError, match="--good 0.33.0 is not good"):
        bisect(VERSIONS, evaluate, say=lambda s: None, find_fix=True)


def test_find_fix_releases_run_from_bad_to_good():
    avail = [Version(v) for v in ["0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.26.0"]]
    got = br.releases_between(avail, "0.26.0", "0.19.1", pre=False, find_fix=True)
    assert got == ["0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.26.0"]
    with pytest.raises(bis.BisectError, match="with --find-fix, --bad 0.26.0 must be older than --good 0.19.1"):
        br.releases_between(avail, "0.19.1", "0.26.0", pre=False, find_fix=True)
    with pytest.raises(bis.BisectError, match="or add --find-fix"):
        br.releases_between(avail, "0.26.0", "0.19.1", pre=False)


def test_find_fix_option_and_its_resume_command():
    argv = ["--find-fix", "--test", "t", "--bad", "0.19.1", "--good", "0.26.0"]
    values, _ = options.parse("bisect", argv, {})
    assert values.find_fix is True
    resume = options.command_line("bisect", {**vars(values), "bad": "0.21.0"})
    assert resume == "nox -s bisect -- --test t --good 0.26.0 --bad 0.21.0 --find-fix"
    again, _ = options.parse("bisect", resume.split(" -- ")[1].split(), {})
    assert vars(again) == {**vars(values), "bad": "0.21.0"}
    plain, _ = options.parse("bisect", argv[1:], {})
    assert plain.find_fix is False


def test_bisect_takes_the_disk_floor_of_the_cells_it_installs():
    values, _ = options.parse("bisect", ["--test", "t", "--good", "0.1.0", "--bad", "0.2.0", "--min-free-gb", "8"], {})
    assert values.min_free_gb == 8.0
    assert (
        options.parse("bisect", ["--test", "t", "--good", "0.1.0", "--bad", "0.2.0"], {})[0].min_free_gb is None
    )  # estimated from the lock


@pytest.mark.parametrize("budget", [None, 40.0])
def test_a_step_says_which_pins_and_which_torch_it_had_from_earlier_steps(tmp_path, budget):
    from kvcompat.bisect_releases import shared_with_earlier_steps
    from kvcompat.cells import Cell
    from kvcompat.run.options import RunOptions

    opts = RunOptions(repo=tmp_path, results_dir=tmp_path / "results", disk_budget_gb=budget)
    locks = {
        "0.20.2": "torch==2.11.0\nnumpy==2.2.0\nsix==1.16.0\n",
        "0.26.0": "torch==2.11.0\nnumpy==2.3.0\nsix==1.16.0\nvllm==0.26.0\n",
        "0.33.0": "torch==2.14.0\nnumpy==2.3.0\n",
    }
    cells = {v: Cell(vllm=v, torch="pinned") for v in locks}
    for v, text in locks.items():
        (opts.work_root / cells[v].id).mkdir(parents=True)
        (opts.work_root / cells[v].id / "lock.txt").write_text(text)
    assert shared_with_earlier_steps(opts, cells["0.20.2"], []) is None  # the first step had nothing before it
    how = "unless --disk-budget evicted them" if budget else "not downloaded again"
    first = shared_with_earlier_steps(opts, cells["0.33.0"], [cells["0.20.2"]])
    assert first.startswith("reuse: 0 of 2 pins were installed by earlier steps (hardlinked from uv's cache")
    assert how in first and first.endswith("; torch 2.14.0 is new to this bisect")
    later = shared_with_earlier_steps(opts, cells["0.26.0"], [cells["0.33.0"], cells["0.20.2"]])
    assert later.startswith("reuse: 3 of 4 pins") and later.endswith("; torch 2.11.0 as in 0.20.2's cell")


def test_a_blocked_test_is_skipped_never_bad():
    blocked = make_result(outcome=Outcome.TEST_FAIL, tests=[("t.py::test_hs", "error", "boom")], detail="d", prefix="")
    blocked.tests[0].blocked_by = "test_register"
    step = bis.verdict_for(blocked, "test_hs")
    assert step.verdict is bis.Verdict.SKIP and step.why.startswith("blocked by test_register")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
def test_checking_both_ends_takes_at_most_ceil_log2_n_plus_2_cells(n):
    """Commits: GOOD is checked too (second, after BAD); N = n - 1 commits after it, ceil(log2 N) + 2 cells."""
    versions = [f"0.{m}.0" for m in range(n)]
    for first_bad in range(n):
        evaluate, calls = fake(versions[first_bad])
        if first_bad == 0:
            with pytest.raises(bis.BisectError, match=f"--good {versions[0]} is not good"):
                bisect(versions, evaluate, say=lambda s: None, check_older=True)
            assert calls == [versions[-1], versions[0]]  # refused at the second cell, before any search
            continue
        res = bisect(versions, evaluate, say=lambda s: None, check_older=True)
        assert (res.last_good, res.first_bad) == (versions[first_bad - 1], versions[first_bad])
        assert calls[:2] == [versions[-1], versions[0]]
        assert len(calls) <= bis.cell_budget(n, check_older=True) == math.ceil(math.log2(n - 1)) + 2


def test_a_step_without_a_cell_is_skipped_and_not_counted():
    """A commit refused before building (compiled sources changed) costs no cell and no budget."""
    versions = [f"0.{m}.0" for m in range(9)]
    evaluate, calls = fake("0.5.0", skip={"0.4.0"})

    def no_cell(v):
        step = evaluate(v)
        return dataclasses.replace(step, cell=False) if step.verdict is bis.Verdict.SKIP else step

    lines = []
    res = bisect(versions, no_cell, say=lines.append, check_older=True, name=lambda v: f"v{v}")
    assert (res.older, res.newer) == ("0.3.0", "0.5.0") and res.untested_between == ["0.4.0"]
    assert res.cells_evaluated == len(calls) - 1
    assert any(line.startswith("[no cell] v0.4.0 (") for line in lines)
    assert [line.split("]")[0] for line in steps(lines) if not line.startswith("[no")][-1] == f"[{len(calls) - 1}/≤5"
    assert f"cells evaluated: {len(calls) - 1} (at most 5: ceil(log2 8) + 2 for 8 releases)" in lines[-1]


SUITE = """
import pytest

def test_first_wins():
    pass

@pytest.mark.parametrize("shape", ["dense", "hetero-tp-p1d4"])
def test_read_fills_each_rank(shape):
    pass

class TestGroup:
    def test_in_a_class(self):
        pass

def helper_not_a_test():
    pass
"""


def suite(tmp_path):
    (tmp_path / "tests" / "connectors").mkdir(parents=True)
    (tmp_path / "tests" / "connectors" / "test_a.py").write_text(SUITE)
    (tmp_path / "tests" / "connectors" / "conftest.py").write_text("def test_not_collected_here(): pass\n")
    return tmp_path


def test_the_suites_tests_are_read_from_its_source(tmp_path):
    assert bis.suite_tests(suite(tmp_path)) == [
        "tests/connectors/test_a.py::test_first_wins",
        "tests/connectors/test_a.py::test_read_fills_each_rank",
        "tests/connectors/test_a.py::TestGroup::test_in_a_class",
    ]


@pytest.mark.parametrize(
    "test, ok",
    [
        ("test_first_wins", True),
        ("first_wins", True),  # a part of a name, as verdict_for matches
        ("tests/connectors/test_a.py::test_read_fills_each_rank", True),
        ("tests/connectors/test_a.py", True),
        ("test_read_fills_each_rank[dense]", True),  # with its parameters
        ("tests/connectors/test_a.py::test_read_fills_each_rank[hetero-tp-p1d4]", True),
        ("p1d4", True),  # a shape's id is in each shaped test's id
        ("TestGroup::test_in_a_class", True),
        ("test_load_delegation", False),
        ("test_first_win[x]", False),
        ("helper_not_a_test", False),
        ("test_not_collected_here", False),
    ],
)
def test_a_test_name_is_checked_against_the_suite(tmp_path, test, ok):
    root = suite(tmp_path)
    assert bis.can_match(test, bis.suite_tests(root)) is ok
    if not ok:
        with pytest.raises(bis.BisectError, match=re.escape(f"--test '{test}' names no test of tests/connectors")):
            bis.check_test(test, root)


def test_a_name_no_test_has_is_refused_before_the_index_is_asked(tmp_path, monkeypatch):
    """commands.bisect checks --test first: nothing is listed, resolved or installed for a name no test has."""
    from kvcompat import index
    from kvcompat.commands.bisect import bisect

    def no_index(*args, **kwargs):
        raise AssertionError("the index was asked")

    monkeypatch.setattr(index, "list_versions", no_index)
    values, _ = options.parse("bisect", ["--test", "test_frist_wins", "--good", "0.0.1", "--bad", "0.0.2"], {})
    with pytest.raises(bis.BisectError) as err:
        bisect(suite(tmp_path), values, say=lambda line: None)
    assert str(err.value).startswith("--test 'test_frist_wins' names no test of tests/connectors (bisect runs that")
    assert "close: test_first_wins," in str(err.value)


def test_a_commit_bisect_checks_the_name_before_reading_the_checkout(tmp_path):
    from kvcompat.commands.bisect import bisect

    ns = options.parse_bisect(["--repo", str(tmp_path / "no-repo"), "a", "b", "--test", "test_nope"], {})
    with pytest.raises(bis.BisectError, match="--test 'test_nope' names no test of tests/connectors"):
        bisect(suite(tmp_path), ns, say=lambda line: None)


def _step_counters(lines):
    """(cells so far, bound shown) of each step line that ran a cell: ``[k/≤b] …``."""
    return [
        tuple(map(int, re.match(r"\[(\d+)/≤(\d+)\]", line).groups()))
        for line in lines
        if line.startswith("[") and not line.startswith("[no")
    ]


@pytest.mark.parametrize("check_older", [False, True])
def test_a_skipped_cell_extends_the_bound_every_line_shows(check_older):
    """Every boundary and every set of skipped items over up to 9 items: no step's count passes its bound,
    the bound without skips plus one for each skipped cell (the last step's, and the answer's)."""
    import itertools

    for n in range(2, 10):
        versions = [f"0.{m}.0" for m in range(n)]
        for first_bad in range(1, n):
            for r in range(n - 1):
                for skip in itertools.combinations(versions[1:-1], r):
                    evaluate, calls = fake(versions[first_bad], skip=set(skip))
                    lines = []
                    res = bisect(versions, evaluate, say=lines.append, check_older=check_older)
                    counters = _step_counters(lines)
                    assert all(k <= b for k, b in counters), (n, first_bad, skip, lines)
                    bound = bis.cell_budget(n, check_older=check_older) + res.skipped_cells
                    assert res.cells_evaluated == len(calls) == counters[-1][0] <= bound == counters[-1][1]
