"""Bisect over commits: a vLLM git checkout's history, each commit laid over its base release's wheel.

The fast tests build tiny git repositories in tmp_path (no vLLM, no network: the base wheel, its
sdist and the cells are fakes).  The slow test builds a history on the real 0.34.0 sdist and runs
real cells: it finds the commit that dropped a statement of MultiConnector.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from kvcompat import bisect_commits as bc
from kvcompat import bisection as bis
from kvcompat import options, vllm_git
from kvcompat.results import CellResult, check_result, result_path, write_result

from helpers import REPO, build_wheel, make_result, one_line_error

MC = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
GOOD_MC = "def get_finished():\n    return 1\n"
BASE_TREE = {
    "PKG-INFO": "Metadata-Version: 2.4\nName: vllm\nVersion: 0.34.0\n",
    "setup.py": "",
    "csrc/cache.cu": "__global__ void k() {}\n",
    "vllm/__init__.py": "",
    "vllm/old.py": "X = 1\n",
    MC: GOOD_MC,
    "docs/README.md": "docs\n",
}
RELEASES = [Version(v) for v in ("0.33.0", "0.34.0", "0.34.1")]


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_AUTHOR_DATE": "2026-12-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-12-01T00:00:00Z",
    }
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True)
    return proc.stdout.strip()


def commit(repo: Path, subject: str, files: dict[str, str | None]) -> str:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", subject)
    return git(repo, "rev-parse", "HEAD")


def make_repo(root: Path, changes: list[tuple[str, dict[str, str | None]]], base=BASE_TREE) -> tuple[Path, list[str]]:
    """A repository whose first commit is ``base`` (tagged v0.34.0), then one commit per change."""
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    shas = [commit(root, "v0.34.0 as released", dict(base))]
    git(root, "tag", "v0.34.0")
    shas += [commit(root, subject, files) for subject, files in changes]
    return root, shas


def make_sdist(path: Path, tree: dict[str, str], version: str = "0.34.0") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in tree.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def fakes(tmp_path: Path, sdists: dict[str, dict[str, str]] | None = None) -> bc.ReleaseFiles:
    """The base release's wheel and sdist, built here: 0.34.0's tree as BASE_TREE (and ``sdists``)."""
    folder = tmp_path / "index"
    folder.mkdir(parents=True, exist_ok=True)
    trees = {"0.34.0": BASE_TREE, **(sdists or {})}

    def wheel(v: str) -> Path:
        sub = folder / v
        sub.mkdir(exist_ok=True)
        files = {k: t for k, t in trees[v].items() if k.startswith("vllm/")}
        return build_wheel(sub, files, version=v)

    def sdist(v: str) -> Path:
        if v not in trees:
            raise AssertionError(f"no sdist of {v} in this test")
        return make_sdist(folder / f"vllm-{v}.tar.gz", trees[v], v)

    return bc.ReleaseFiles(listed=lambda: RELEASES, wheel=wheel, sdist=sdist)


class Cells:
    """Stands in for the cell run: test_get_finished passes while multi_connector.py returns 1."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.ran: list[bc.Overlay] = []

    def run(self, overlay: bc.Overlay) -> tuple[str, CellResult]:
        self.ran.append(overlay)
        with zipfile.ZipFile(overlay.wheel) as zf:
            ok = "return 1" in zf.read(MC).decode()
        outcome = "passed" if ok else "failed"
        result = make_result(
            vllm=overlay.wheel.name.split("-")[1],
            torch="2.14.0",
            tests=[("test_get_finished", outcome, None if ok else "assert 2 == 1")],
            wheel=overlay.wheel,
        )
        write_result(self.results, result)
        return result.id, result

    def load(self, cell: str) -> CellResult | None:
        found = check_result(result_path(self.results, cell))
        return found if isinstance(found, CellResult) else None


@dataclasses.dataclass
class Answer:
    """The one bisect's result over commits, with the handler that names them."""

    result: bis.BisectResult
    handler: bc.Commits

    @property
    def newer(self) -> vllm_git.Commit:
        return self.handler.commit(self.result.newer)

    @property
    def older(self) -> vllm_git.Commit:
        return self.handler.commit(self.result.older)

    @property
    def n(self) -> int:  # the commits of GOOD..BAD
        return len(self.handler.commits) - 1

    def text(self) -> str:
        return bis.render_answer(self.result, self.handler)


def bisect(tmp_path: Path, repo: Path, good: str, bad: str, *, releases=None, cells=None, find_fix=False, **kw):
    cells = cells or Cells(tmp_path / "results")
    lines: list[str] = []
    commits = bc.Commits(
        bc.Bases(repo, releases or fakes(tmp_path), tmp_path / "candidates"),
        good,
        bad,
        test="test_get_finished",
        run=cells.run,
        fingerprint=lambda base: f"suite x, base {base}",
        records=bc.Records(tmp_path / "records", cells.load),
        say=lines.append,
        resume=lambda good, bad: f"nox -s bisect -- --repo {repo} {good} {bad}",
        find_fix=find_fix,
        **kw,
    )
    result = bis.run(commits, test="test_get_finished", find_fix=find_fix, say=lines.append)
    return Answer(result, commits), cells, lines


def harmless(i: int) -> dict[str, str]:
    return {MC: GOOD_MC + f"# harmless {i}\n"}


BROKEN = {MC: "def get_finished():\n    return 2\n"}


@pytest.mark.parametrize("n, first_bad", [(1, 1), (2, 1), (2, 2), (5, 3), (6, 1), (6, 6), (9, 5)])
def test_finds_the_first_bad_commit_within_ceil_log2_n_plus_2_cells(tmp_path, n, first_bad):
    changes = [(f"harmless {i}", harmless(i)) for i in range(1, first_bad)]
    changes.append(("refactor: drop the scan", BROKEN))
    changes += [(f"later {i}", {MC: BROKEN[MC] + f"# later {i}\n"}) for i in range(first_bad + 1, n + 1)]
    repo, shas = make_repo(tmp_path / "repo", changes)
    answer, cells, lines = bisect(tmp_path, repo, "v0.34.0", "main")
    assert answer.newer.sha == shas[first_bad] and answer.newer.subject == "refactor: drop the scan"
    assert answer.older.sha == shas[first_bad - 1]
    assert answer.n == n
    assert answer.result.cells_evaluated == len(cells.ran) <= math.ceil(math.log2(n)) + 2
    # the bad end, then the good end, then the search
    assert [o.commit.sha for o in cells.ran[:2]] == [shas[-1], shas[0]]
    assert cells.ran[1].changed == ()  # the good end is 0.34.0 as released: nothing laid over
    assert all(o.base == "0.34.0" for o in cells.ran)
    text = answer.text()
    assert f"first bad commit: {shas[first_bad]} refactor: drop the scan" in text
    assert f"last good commit: {shas[first_bad - 1]} " in text
    assert "  modified +1 " in text and MC in text
    resumes = [line for line in lines if "resume with: nox -s bisect -- --repo" in line]
    assert resumes or n == 1
    assert all(len(line.split()[-1]) == 12 for line in resumes)  # the ends as short hashes


def test_a_compiled_change_in_the_middle_is_skipped_without_a_cell(tmp_path):
    changes = [
        ("harmless 1", harmless(1)),
        ("kernels: tweak", {"csrc/cache.cu": "__global__ void k2() {}\n"}),  # the middle: 2 of 0..4
        ("kernels: revert", {"csrc/cache.cu": BASE_TREE["csrc/cache.cu"], **harmless(2)}),
        ("refactor: drop the scan", BROKEN),
    ]
    repo, shas = make_repo(tmp_path / "repo", changes)
    answer, cells, lines = bisect(tmp_path, repo, "v0.34.0", "main")
    assert answer.newer.sha == shas[4] and answer.older.sha == shas[3]
    skip = next(s for s in answer.result.steps if s.item == shas[2])
    assert skip.verdict is bis.Verdict.SKIP and not skip.cell
    assert "changes compiled sources relative to vllm 0.34.0 (csrc/cache.cu)" in skip.why
    assert "no release contains it yet: build a wheel of the commit" in skip.why
    assert shas[2] not in [o.commit.sha for o in cells.ran]
    assert answer.result.cells_evaluated == len(cells.ran)
    assert any(line.startswith("[no cell] ") and "SKIP" in line for line in lines)
    # a step decided without a cell costs nothing: the bound is the one without skips
    assert f"cells evaluated: {len(cells.ran)} (at most 4: ceil(log2 4) + 2 for 4 commits)\n" in answer.text()


def test_a_skipped_commit_next_to_the_boundary_is_named_in_the_answer(tmp_path):
    changes = [
        ("harmless 1", harmless(1)),
        ("kernels and the scan", {"csrc/cache.cu": "__global__ void k2() {}\n", **BROKEN}),
        ("kernels: revert", {"csrc/cache.cu": BASE_TREE["csrc/cache.cu"]}),
    ]
    repo, shas = make_repo(tmp_path / "repo", changes)
    answer, _, _ = bisect(tmp_path, repo, "v0.34.0", "main")
    assert (answer.older.sha, answer.newer.sha) == (shas[1], shas[3])
    assert answer.result.untested_between == [shas[2]]
    assert "could not test " + shas[2][:10] in answer.text()


def test_a_compiled_change_at_an_end_is_refused_before_any_cell(tmp_path):
    repo, shas = make_repo(
        tmp_path / "repo", [("harmless", harmless(1)), ("kernels: tweak", {"csrc/cache.cu": "// edit\n"})]
    )
    with pytest.raises(bis.BisectError) as err:
        bisect(tmp_path, repo, "v0.34.0", "main")
    message = str(err.value)
    assert message.startswith(f'BAD main: {shas[2][:10]} "kernels: tweak" changes compiled sources relative to ')
    assert "(csrc/cache.cu)" in message and "no release contains it yet" in message and "\n" not in message


def test_the_first_release_that_contains_a_compiled_change_is_its_base(tmp_path):
    """A commit with 0.34.1's kernels is laid over 0.34.1's wheel; the refusal names the release needed."""
    new_kernel = {"csrc/cache.cu": "__global__ void k2() {}\n"}
    repo, shas = make_repo(tmp_path / "repo", [("kernels: tweak", new_kernel), ("release 0.34.1", {"x.txt": "1"})])
    git(repo, "tag", "v0.34.1")
    history = bc.Bases(repo, fakes(tmp_path, {"0.34.1": {**BASE_TREE, **new_kernel}}), tmp_path / "c")
    (tweak,) = [c for c in vllm_git.commits_between(repo, "v0.34.0", "main") if c.sha == shas[1]]
    assert history.base_sharing_compiled(tweak) == "0.34.1"
    other = bc.Bases(repo, fakes(tmp_path / "o", {"0.34.1": BASE_TREE}), tmp_path / "c")
    with pytest.raises(bc.Refused, match="vllm 0.34.1, the first release that contains it, has other compiled"):
        other.base_sharing_compiled(tweak)


def test_files_the_build_does_not_compile_are_no_compiled_change(tmp_path):
    repo, _ = make_repo(tmp_path / "repo", [("bench", {"benchmarks/k.cu": "x\n", "tests/t.cu": "y\n"}), ("b", BROKEN)])
    answer, _, _ = bisect(tmp_path, repo, "v0.34.0", "main")
    assert answer.newer.subject == "b"


def test_the_base_comes_from_a_release_tag_when_the_tree_says_no_version(tmp_path):
    base = {k: v for k, v in BASE_TREE.items() if k != "PKG-INFO"}
    repo, shas = make_repo(tmp_path / "repo", [("b", BROKEN)], base=base)
    history = bc.Bases(repo, fakes(tmp_path), tmp_path / "c")
    first, last = vllm_git.commits_between(repo, "v0.34.0", "main")
    assert history.version_of(last) == ("0.34.0", "tag v0.34.0 in its history")
    git(repo, "tag", "-d", "v0.34.0")
    with pytest.raises(bc.Refused, match=r"says no version .*: fetch vLLM's tags"):
        history.base_of(first)


def test_python_changes_and_deletions_are_laid_over_the_base_wheel(tmp_path):
    repo, _ = make_repo(tmp_path / "repo", [("b", {**BROKEN, "vllm/old.py": None, "vllm/new.py": "Y = 2\n"})])
    history = bc.Bases(repo, fakes(tmp_path), tmp_path / "c")
    first, last = vllm_git.commits_between(repo, "v0.34.0", "main")
    overlay = bc.overlay(history, last, since=first)
    assert overlay.changed == (MC, "vllm/new.py", "vllm/old.py")
    assert overlay.wheel.name.startswith("vllm-0.34.0+src.")
    with zipfile.ZipFile(overlay.wheel) as zf:
        assert zf.read(MC).decode() == BROKEN[MC] and zf.read("vllm/new.py") == b"Y = 2\n"
        assert b"ModuleNotFoundError" in zf.read("vllm/old.py")  # deleted by the commit: importing it fails
    assert subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True).stdout == b""


def test_an_evaluated_tree_is_answered_from_its_result(tmp_path):
    repo, shas = make_repo(tmp_path / "repo", [("h", harmless(1)), ("b", BROKEN), ("h2", {MC: BROKEN[MC] + "#\n"})])
    first, cells, _ = bisect(tmp_path, repo, "v0.34.0", "main")
    again, cells2, lines = bisect(tmp_path, repo, "v0.34.0", "main")
    assert again.newer.sha == first.newer.sha == shas[2]
    assert cells2.ran == [] and sum("answered from" in line for line in lines) == first.result.cells_evaluated
    forced, cells3, _ = bisect(tmp_path, repo, "v0.34.0", "main", force=True)
    assert len(cells3.ran) == forced.result.cells_evaluated


def test_find_fix_over_commits(tmp_path):
    repo, shas = make_repo(
        tmp_path / "repo", [("break", BROKEN), ("b2", {MC: BROKEN[MC] + "#\n"}), ("fix", harmless(3))]
    )
    answer, _, _ = bisect(tmp_path, repo, "main", shas[1], find_fix=True)
    assert (answer.older.sha, answer.newer.sha) == (shas[2], shas[3])
    assert "first good commit: " + shas[3] in answer.text()


def test_a_good_end_that_fails_is_one_line(tmp_path):
    repo, shas = make_repo(tmp_path / "repo", [("b", BROKEN), ("b2", {MC: BROKEN[MC] + "#\n"})])
    with pytest.raises(bis.BisectError, match=rf'--good {shas[1][:10]} "b" is not good \(bad: test_get_finished'):
        bisect(tmp_path, repo, shas[1], "main")


# -- bad input: one line, exit 2 ------------------------------------------------------------------


def test_bad_refs_and_orders_are_one_line(tmp_path):
    repo, shas = make_repo(tmp_path / "repo", [("a", harmless(1)), ("b", BROKEN)])
    git(repo, "checkout", "-q", "-b", "side", shas[0])
    side = commit(repo, "side", harmless(9))
    cases = {
        ("v0.34.0", "nope"): "BAD 'nope' names no commit in",
        ("main", "v0.34.0"): "GOOD main (" + shas[2][:10] + ") is newer than BAD v0.34.0",
        (side, "main"): f"GOOD {side} ({side[:10]}) is not an ancestor of BAD main",
        ("main", shas[2]): "are the same commit",
    }
    for (good, bad), message in cases.items():
        with pytest.raises(bis.BisectError) as err:
            vllm_git.commits_between(repo, good, bad)
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(bis.BisectError, match="is not a git repository"):
        vllm_git.open_repo(tmp_path)
    with pytest.raises(bis.BisectError, match="is not a folder"):
        vllm_git.open_repo(tmp_path / "missing")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repo", "{tmp}", "a", "b"], "is not a git repository"),
        (["--repo", "{repo}", "v0.34.0", "nope"], "BAD 'nope' names no commit in"),
        (["--repo", "{repo}", "main", "v0.34.0"], "is newer than BAD v0.34.0 ("),
        (["--repo", "{repo}", "v0.34.0"], "--repo takes two commits, GOOD BAD, got 1"),
        (["v0.34.0", "main"], "bisect takes positional GOOD BAD only with --repo PATH"),
        (["--repo", "{repo}", "--wheelhouse", "{tmp}", "v0.34.0", "main"], "--wheelhouse does not go with --repo"),
        (["--repo", "{repo}", "--good", "v0.34.0", "v0.34.0", "main"], "either as the two positional arguments"),
    ],
)
def test_bad_input_through_the_kvcompat_command_is_one_line_and_exit_2(tmp_path, args, message):
    repo, _ = make_repo(tmp_path / "repo", [("b", BROKEN)])
    (tmp_path / "plain").mkdir()
    argv = [a.format(tmp=tmp_path / "plain", repo=repo) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompat.cli", "bisect", "--test", "t", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert message in one_line_error(proc)


def test_nox_posargs_take_the_commits_after_repo():
    ns = options.parse_bisect(["--repo", "/r", "v1", "--test", "t", "HEAD"], environ={})
    assert (ns.repo, ns.good, ns.bad, ns.test) == ("/r", "v1", "HEAD", "t")
    ns = options.parse_bisect(["--test", "t", "--good", "0.30.0", "--bad", "0.33.0"], environ={})
    assert (ns.repo, ns.good, ns.bad) == (None, "0.30.0", "0.33.0")
    with pytest.raises(options.OptionError, match="positional GOOD BAD only with --repo"):
        options.parse_bisect(["--test", "t", "a", "b"], environ={})
    line = options.command_line("bisect", {**vars(ns), "repo": "/r", "good": "abc", "bad": "def"})
    assert line == "nox -s bisect -- --test t --good abc --bad def --repo /r"


# -- the real thing ---------------------------------------------------------------------------------

# A history after the 0.34.0 sdist: harmless Python edits around the commit that drops the statement
# of MultiConnector.get_block_ids_with_load_errors that gathers its children's block ids (as in
# docs/evidence/qualify-0.34.x.md), then a kernel edit.
DROP = "            agg_block_ids |= c.get_block_ids_with_load_errors()\n"
TEST = "test_load_errors_of_either_child_reach_the_scheduler"
OFFLOAD = "vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py"
BAD_SUBJECT = "multi_connector: simplify get_block_ids_with_load_errors"
EDITS = (  # (subject, file, text replaced or None to append, new text)
    (
        "multi_connector: say what the aggregate is",
        MC,
        "        agg_block_ids: set[int] = set()\n",
        "        # the union of every child's\n        agg_block_ids: set[int] = set()\n",
    ),
    ("offload: a comment", OFFLOAD, None, "\n# kvcompat: a harmless edit\n"),
    (BAD_SUBJECT, MC, DROP, "            pass\n"),
    ("multi_connector: a comment after", MC, None, "\n# kvcompat: harmless\n"),
)


def _edit(repo: Path, rel: str, old: str | None, new: str) -> dict[str, str]:
    text = (repo / rel).read_text()
    if old is None:
        return {rel: text + new}
    assert text.count(old) == 1, (rel, old)
    return {rel: text.replace(old, new)}


@pytest.mark.slow
def test_real_history_on_the_0_34_0_sdist(tmp_path):
    """Four commits after v0.34.0 (the sdist as released), the third drops a statement; then a kernel edit."""
    from kvcompat import upstream
    from kvcompat.run.resolve import suite_hash

    sdist = upstream.download_sdist_cached("0.34.0", REPO / ".kvcompat" / "sdists")  # hash-checked, builds nothing
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    repo = tmp_path / "vllm"
    (tmp_path / "vllm-0.34.0").rename(repo)
    git(repo, "init", "-q", "-b", "main")
    shas = [commit(repo, "vllm 0.34.0 as released (sdist)", {})]
    git(repo, "tag", "v0.34.0")
    for subject, rel, old, text in EDITS:  # each edit on the tree its predecessor left
        shas.append(commit(repo, subject, _edit(repo, rel, old, text)))
    kernel = next(p for p in sorted((repo / "csrc").rglob("*.cu")))
    shas.append(commit(repo, "kernels: a comment", {str(kernel.relative_to(repo)): kernel.read_text() + "// x\n"}))

    def kvcompat(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvcompat.cli", "bisect", "--repo", str(repo), *args, "--test", TEST],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1800,
        )

    suite = suite_hash(REPO, "tests/connectors")  # what the records are kept under
    t0 = time.monotonic()
    proc = kvcompat("v0.34.0", shas[4])
    out = proc.stdout + proc.stderr
    print(out[-6000:], f"\n({time.monotonic() - t0:.0f}s)")
    assert proc.returncode == 0, out
    assert f"first bad commit: {shas[3]} {BAD_SUBJECT}" in out
    assert f"last good commit: {shas[2]} offload: a comment" in out
    assert "cells evaluated: 4 (at most 4: ceil(log2 4) + 2 for 4 commits)" in out
    assert f"modified +1     -1     {MC}" in out

    if suite_hash(REPO, "tests/connectors") == suite:  # else someone edited the suite meanwhile: cells run again
        t0 = time.monotonic()
        again = kvcompat("v0.34.0", shas[4])
        assert again.returncode == 0 and f"first bad commit: {shas[3]}" in again.stdout, again.stdout + again.stderr
        assert again.stdout.count("answered from") == 4  # every step from its result: nothing built or run
        print(f"again, answered from the records: {time.monotonic() - t0:.0f}s")

    refused = kvcompat("v0.34.0", shas[5])
    line = one_line_error(refused)
    assert (
        f'BAD {shas[5]}: {shas[5][:10]} "kernels: a comment" changes compiled sources relative to vllm 0.34.0' in line
    )
    assert str(kernel.relative_to(repo)) in line and "no release contains it yet" in line
    shutil.rmtree(repo)


def test_a_cell_whose_pytest_died_of_a_signal_is_a_crash_not_a_verdict():
    """A commit's cell whose pytest was killed by a signal (exit -11) is run once more before its step is skipped;
    a failing test or pytest's own error is a verdict and is not retried."""
    from kvcompat.outcomes import Outcome

    crash = make_result(outcome=Outcome.TEST_ERROR, detail="pytest exited -11 without writing results: ....")
    error = make_result(outcome=Outcome.TEST_ERROR, detail="pytest exit status 4 (usage error): no tests ran")
    failed = make_result(outcome=Outcome.TEST_FAIL, tests=[("t", "failed", "assert 1 == 2")])
    assert [bc.crashed(r) for r in (crash, error, failed)] == [True, False, False]


def test_only_what_builds_the_extensions_is_a_compiled_change(tmp_path):
    """A C file the sdist ships outside the build (.buildkite/) may change; a kernel in csrc/ may not."""
    base = {**BASE_TREE, ".buildkite/scripts/fault_trap.c": "int main(void) { return 0; }\n"}
    ci = {".buildkite/scripts/fault_trap.c": "int main(void) { return 1; }\n"}
    repo, shas = make_repo(tmp_path / "repo", [("ci: a fault trap", ci), ("b", BROKEN)], base=base)
    answer, _, _ = bisect(tmp_path, repo, "v0.34.0", "main", releases=fakes(tmp_path, {"0.34.0": base}))
    assert answer.newer.subject == "b" and answer.older.subject == "ci: a fault trap"

    kernel = {"csrc/x.cu": "__global__ void x() {}\n"}
    repo, shas = make_repo(tmp_path / "repo2", [("kernels: x", kernel), ("b", BROKEN)], base=base)
    with pytest.raises(bis.BisectError, match=r"\"kernels: x\" changed relative to vllm 0\.34\.0 \(csrc/x\.cu\)"):
        bisect(tmp_path / "2", repo, "v0.34.0", "main", releases=fakes(tmp_path / "2", {"0.34.0": base}))


def test_a_refusal_names_the_commit_that_changed_the_compiled_sources(tmp_path):
    """BAD carries a kernel edit made two commits before it: the refusal names that commit and its subject."""
    changes = [("harmless", harmless(1)), ("kernels: tweak", {"csrc/cache.cu": "// edit\n"}), ("later", harmless(2))]
    repo, shas = make_repo(tmp_path / "repo", changes)
    with pytest.raises(bis.BisectError) as err:
        bisect(tmp_path, repo, "v0.34.0", "main")
    message = str(err.value)
    assert message.startswith(f'BAD main: {shas[3][:10]} "later" has the compiled sources that ')
    assert f'{shas[2][:10]} "kernels: tweak" changed relative to vllm 0.34.0 (csrc/cache.cu)' in message
    assert f"pick a BAD older than {shas[2][:10]}, or one whose compiled sources match" in message
    assert "\n" not in message


@pytest.mark.slow  # a real cell per step (fake wheels, venvs built with uv)
def test_a_commit_whose_offload_child_cannot_import_is_skipped_not_named_first_bad(tmp_path):
    """Commits 1-2 break the offload child's import (the suite's fixtures error, one test still passes),
    3 mends it, 4 drops the scan: the bisect lands on 2, which is skipped (an import error), and answers 4."""
    from test_import_probe import BROKEN_CHILD, RELEASE, V1, fake_cell_options, run_fake_cell

    from kvcompat.outcomes import Outcome

    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_children.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef children():\n"
        "    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "    return [KVConnectorFactory._registry[n]() for n in ('NixlConnector', 'SimpleCPUOffloadConnector')]\n\n"
        "def test_get_finished(children):\n"
        f"    from {MC[:-3].replace('/', '.')} import get_finished\n"
        "    assert get_finished() == 1\n\n"
        "def test_needs_no_child():\n    pass\n"
    )
    tree = {**RELEASE, "PKG-INFO": BASE_TREE["PKG-INFO"], "setup.py": "", MC: GOOD_MC}
    offload = f"{V1}/simple_cpu_offload_connector.py"
    changes = [
        ("offload: import the new copy", {offload: BROKEN_CHILD}),
        ("offload: a comment", {offload: BROKEN_CHILD + "# more\n"}),
        ("offload: mend the import", {offload: RELEASE[offload]}),
        ("refactor: drop the scan", BROKEN),
        ("later", {MC: BROKEN[MC] + "# later\n"}),
    ]
    repo, shas = make_repo(tmp_path / "repo", changes, base=tree)
    opts = fake_cell_options(tmp_path, suite)
    outcomes = {}

    class RealCells(Cells):
        def run(self, overlay):
            self.ran.append(overlay)
            result = run_fake_cell(overlay.wheel, overlay.wheel.name.split("-")[1], tmp_path, opts)
            outcomes[overlay.commit.sha] = result.outcome
            return result.id, result

    releases = fakes(tmp_path, {"0.34.0": tree})
    answer, cells, lines = bisect(
        tmp_path, repo, "v0.34.0", "main", releases=releases, cells=RealCells(opts.results_dir)
    )
    assert outcomes[shas[2]] is Outcome.IMPORT_ERROR, "\n".join(lines)
    assert (answer.older.sha, answer.newer.sha) == (shas[3], shas[4]), "\n".join(lines)
    skip = next(s for s in answer.result.steps if s.item == shas[2])
    assert skip.verdict is bis.Verdict.SKIP and "the CPU-offload child SimpleCPUOffloadConnector" in skip.why
    # the skipped cell ran: it extends the bound by one, in its step's line and in the answer
    assert any(line.startswith(f"[3/≤6] {shas[2][:10]} ") for line in lines), "\n".join(lines)
    assert "cells evaluated: 5 (at most 6: ceil(log2 5) + 2 for 5 commits, + 1 for the cell skipped)" in answer.text()
