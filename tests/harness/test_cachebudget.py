"""--disk-budget (kvcompat.run.cachebudget): uv's cache kept under a size, never at a cell's expense."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome
from kvcompat.run import cachebudget
from kvcompat.run.lock import held
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell

from helpers import REPO, SMALL_CELL_GB


def unpacked(cache: Path, entry: str, name: str, version: str, size: int) -> Path:
    """One unpacked wheel as uv lays it out: archive-v0/<id>/<name>-<version>.dist-info and its files."""
    folder = cache / "archive-v0" / entry
    (folder / f"{name}-{version}.dist-info").mkdir(parents=True)
    (folder / f"{name}.so").write_bytes(b"x" * size)
    return folder


def test_evicts_the_largest_unpinned_entries_until_the_cache_fits(tmp_path):
    cache = tmp_path / "uv"
    torch_old = unpacked(cache, "a", "torch", "2.9.0", 400_000)
    cuda_old = unpacked(cache, "b", "nvidia_cublas_cu12", "12.8.1", 300_000)
    small_old = unpacked(cache, "c", "six", "1.16.0", 20_000)
    torch_new = unpacked(cache, "d", "torch", "2.14.0", 500_000)
    total = sum(cachebudget.disk_bytes(f) for f in (torch_old, cuda_old, small_old, torch_new))
    budget = total - 350_000  # the old torch alone is enough

    evicted, freed, left = cachebudget.evict(cache, budget, keep={("torch", "2.14.0")})
    assert (evicted, left) == (1, total - freed) and left <= budget
    assert not torch_old.exists() and cuda_old.exists() and small_old.exists() and torch_new.exists()

    # Pinned entries stay even when the cache cannot then fit: the cell needs them.
    evicted, _, left = cachebudget.evict(cache, 0, keep={("torch", "2.14.0"), ("six", "1.16.0")})
    assert evicted == 1 and not cuda_old.exists() and small_old.exists() and torch_new.exists() and left > 0

    # Under the budget nothing goes.
    assert cachebudget.evict(cache, 10**12, keep=set())[0] == 0 and small_old.exists()


def test_running_cells_are_those_whose_venv_lock_is_held(tmp_path):
    venvs = tmp_path / "venvs"
    venvs.mkdir()
    (venvs / "finished-cell.lock").write_text("{}")
    with held(venvs / "running-cell", "running-cell"):
        assert cachebudget.running_cells(venvs) == ["running-cell"]
    assert cachebudget.running_cells(venvs) == []


def test_needed_is_what_the_running_cells_locks_pin(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lock.txt").write_text("torch==2.14.0\nsix==1.16.0\n")
    assert cachebudget.needed(tmp_path, ["a", "no-lock-yet"]) == {("torch", "2.14.0"), ("six", "1.16.0")}


@pytest.mark.slow  # two real cells with uv
def test_a_budgeted_matrix_evicts_the_older_cells_wheels_and_a_rerun_fetches_them_again(
    tmp_path, fake_wheel, make_suite, monkeypatch
):
    """With a budget smaller than one cell, each install evicts what the previous cell alone
    pinned, the cell still passes, and a rerun of the first cell gets its wheel again from uv."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    suite = make_suite(test_ok="def test_ok():\n    import vllm\n")

    def run(version: str, **kw):
        cell = Cell(vllm=version, torch="none", wheel=fake_wheel(version=version))
        opts = RunOptions(
            repo=REPO,
            results_dir=tmp_path / "results",
            suite=str(suite),
            work_dir=tmp_path / "work",
            min_free_gb=float(SMALL_CELL_GB),
            disk_budget_gb=1e-9,
            **kw,
        )
        lines: list[str] = []
        result = run_cell(cell, tmp_path / "venvs" / cell.id, opts, progress=lines.append)
        return result, lines

    def cached_vllm() -> set[str]:
        return {d[1] for d, _ in cachebudget.unpacked_entries(tmp_path / "uv-cache") if d[0] == "vllm"}

    first, _ = run("0.0.1")
    assert first.outcome is Outcome.PASS and cached_vllm() == {"0.0.1"}
    second, lines = run("0.0.2")
    assert second.outcome is Outcome.PASS, second.log_tail
    assert cached_vllm() == {"0.0.2"}  # 0.0.1's wheel went; pytest, pinned by 0.0.2 too, stayed
    assert any("evicted" in line and "neither this cell nor a running one pins" in line for line in lines), lines
    assert any(d[0] == "pytest" for d, _ in cachebudget.unpacked_entries(tmp_path / "uv-cache"))
    shutil.rmtree(tmp_path / "venvs" / first.id)  # as --prune leaves it: reinstalled from uv's cache
    again, _ = run("0.0.1", force=True)
    assert again.outcome is Outcome.PASS and again.counts()["passed"] == 1
    assert cached_vllm() == {"0.0.1"}
