"""The history matrix (one cell per vLLM minor, its last patch) and --prune, which lets it fit a small disk."""

from __future__ import annotations

import os

import pytest
from packaging.version import Version

from kvcompat import options
from kvcompat.cells import Cell
from kvcompat.commands import venvs
from kvcompat.matrix import load_matrix
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.lock import held

from helpers import REPO


def history():
    return load_matrix(REPO / "pyproject.toml", "history")


def test_history_is_one_cell_per_minor_from_0_11_in_order():
    entries = history()
    versions = [e.vllm for e in entries]
    assert all(isinstance(v, Version) for v in versions) and versions == sorted(versions)
    minors = [v.release[:2] for v in versions]
    assert minors[0] == (0, 11) and minors == [(0, m) for m in range(11, 11 + len(minors))]  # none skipped
    assert all(e.torch == ("pinned",) and e.dist == "vllm" and e.env == ("today",) for e in entries)
    newest = entries[-1]
    assert newest.vllm == load_matrix(REPO / "pyproject.toml", "default")[0].vllm
    assert newest.overrides == ("flashinfer-python==0.7.4",)  # as in the default matrix


@pytest.mark.slow  # asks the real index
def test_history_holds_the_last_patch_of_every_minor_up_to_the_newest(tmp_path):
    from kvcompat import index
    from kvcompat.option_table import PYPI

    released = [v for v in index.list_versions("vllm", cache_root=tmp_path, index_url=PYPI) if not v.is_prerelease]
    last_patch: dict[tuple[int, ...], Version] = {}
    for v in released:
        if v >= Version("0.11"):
            last_patch[v.release[:2]] = max(v, last_patch.get(v.release[:2], v))
    assert [e.vllm for e in history()] == [last_patch[m] for m in sorted(last_patch)], "a release came out"


def test_prune_option():
    values, _ = options.parse("matrix", ["--prune"], {})
    assert values.prune is True
    assert options.parse("matrix", [], {})[0].prune is False


def fake_venv(root, cell):
    venv = CellFiles.venv(root, cell)
    (venv / "lib").mkdir(parents=True)
    cache = root / "uv-cache"
    cache.mkdir()
    (cache / "torch.so").write_bytes(b"x" * 5000)
    os.link(cache / "torch.so", venv / "lib" / "torch.so")  # as uv installs: a hardlink into its cache
    (venv / "lib" / "torch.pyc").write_bytes(b"y" * 300)  # the venv's own bytes
    return venv, cache


def test_prune_frees_the_venvs_own_bytes_and_keeps_the_cache(tmp_path):
    cell = Cell(vllm="0.33.0", torch="2.14.0")
    venv, cache = fake_venv(tmp_path, cell)
    said = []
    assert venvs.prune_venv(tmp_path, cell, said.append) == 300
    assert not venv.exists() and (cache / "torch.so").stat().st_size == 5000
    assert said == [
        f"pruned .kvcompat/venvs/{cell.id}: 0.00 GiB freed (its wheels stay in uv's cache, its bytecode beside its lock)"
    ]
    assert venvs.prune_venv(tmp_path, cell, said.append) == 0  # nothing left to prune


def test_prune_leaves_a_venv_another_run_holds(tmp_path):
    cell = Cell(vllm="0.33.0", torch="2.14.0")
    venv, _ = fake_venv(tmp_path, cell)
    said = []
    with held(venv, cell.id):
        pid = os.fork()
        if pid == 0:  # another process: the lock is per open file, so try from a child
            os._exit(0 if venvs.prune_venv(tmp_path, cell, said.append) == 0 and venv.exists() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and venv.exists()
