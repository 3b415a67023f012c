"""The import probe: a cell whose vLLM code cannot import is an import error, never a test verdict.

The probe imports what every test of the suite builds on, MultiConnector's two children included, as the
release resolves them (KVConnectorFactory's registry).  Fast tests run the probe against a fake vLLM put
on the path with its RECORD; the slow one runs a whole cell with a fake wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompat.cells import Cell
from kvcompat.outcomes import Outcome
from kvcompat.results import CellResult
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell

from helpers import FAKE_CONNECTOR_FILES, REPO, SMALL_CELL_GB, build_wheel

V1 = "vllm/distributed/kv_transfer/kv_connector/v1"
FACTORY = """
import importlib

class KVConnectorFactory:
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name):
        def loader():
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

KVConnectorFactory.register_connector("NixlConnector", "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlConnector")
KVConnectorFactory.register_connector(
    "SimpleCPUOffloadConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
    "SimpleCPUOffloadConnector",
)
"""
BROKEN_CHILD = "from vllm.v1.simple_kv_offload.transfer import DmaCopy  # a name this tree no longer has\n"
# A release with a factory and both children: the CPU-offload child as 0.34's (SimpleCPUOffload).
RELEASE = {
    **FAKE_CONNECTOR_FILES,
    "vllm/distributed/kv_transfer/kv_connector/factory.py": FACTORY,
    f"{V1}/nixl_connector.py": "print('KVCOMPAT-TEST nixl child imported')\nclass NixlConnector: pass\n",
    f"{V1}/simple_cpu_offload_connector.py": (
        "print('KVCOMPAT-TEST offload child imported')\nclass SimpleCPUOffloadConnector: pass\n"
    ),
    "vllm/v1/__init__.py": "",
    "vllm/v1/simple_kv_offload/__init__.py": "",
    "vllm/v1/simple_kv_offload/transfer.py": "class Copy: pass\n",
}


def site_with(tmp_path: Path, files: dict[str, str]) -> Path:
    """A site-packages folder holding ``files`` as an installed vllm (its RECORD is what the probe reads)."""
    import zipfile

    wheel = build_wheel(tmp_path, files, version="0.34.0")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def probe(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcompat.testkit.import_probe"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO / 'src'}"},
    )


def test_the_probe_imports_both_children_through_the_releases_registry(tmp_path):
    proc = probe(site_with(tmp_path, RELEASE))
    assert proc.returncode == 0, proc.stderr
    assert "KVCOMPAT-PROBE vllm imported" in proc.stdout.splitlines()
    assert "KVCOMPAT-TEST nixl child imported" in proc.stdout
    assert "KVCOMPAT-TEST offload child imported" in proc.stdout


def test_a_child_that_cannot_import_fails_the_probe_naming_it(tmp_path):
    proc = probe(site_with(tmp_path, {**RELEASE, f"{V1}/simple_cpu_offload_connector.py": BROKEN_CHILD}))
    assert proc.returncode != 0 and "KVCOMPAT-PROBE vllm imported" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the CPU-offload child SimpleCPUOffloadConnector does not import"), last
    assert "cannot import name 'DmaCopy'" in last


# A suite as the connector suite is: most tests build both children in a fixture, a few need neither.
SUITE = """
import pytest

@pytest.fixture
def children():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return [KVConnectorFactory._registry[name]() for name in ("NixlConnector", "SimpleCPUOffloadConnector")]

def test_first_wins():
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import first_wins

    assert first_wins([0, 3]) == 1

def test_store(children):
    assert len(children) == 2

def test_load():
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    assert SimpleCPUOffloadConnector
"""


def fake_cell_options(tmp_path: Path, suite: Path) -> RunOptions:
    """A fake cell's run: ``suite`` as our suite, its results and work under ``tmp_path``."""
    results, work = tmp_path / "results", tmp_path / "work"
    return RunOptions(repo=REPO, results_dir=results, suite=str(suite), work_dir=work, min_free_gb=float(SMALL_CELL_GB))


def run_fake_cell(wheel: Path, version: str, tmp_path: Path, opts: RunOptions) -> CellResult:
    """The wheel as a cell without torch, in a venv of its own under ``tmp_path``."""
    cell = Cell(vllm=version, torch="none", wheel=wheel)
    return run_cell(cell, tmp_path / "venvs" / cell.id, opts, progress=lambda s: None)


@pytest.mark.slow  # builds a venv with uv
def test_a_cell_whose_offload_child_cannot_import_is_an_import_error(tmp_path):
    """One test passed, one failed, one errored: the probe runs, the child does not import, the cell is an
    import error (a bisect's skip), its tests kept to read."""
    folder = tmp_path / "wheel"
    folder.mkdir()
    wheel = build_wheel(folder, {**RELEASE, f"{V1}/simple_cpu_offload_connector.py": BROKEN_CHILD}, version="0.34.0")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_children.py").write_text(SUITE)
    result = run_fake_cell(wheel, "0.34.0", tmp_path, fake_cell_options(tmp_path, tmp_path / "suite"))
    assert result.counts()["passed"] == 1 and result.counts()["failed"] == 1 and result.counts()["error"] == 1
    assert result.outcome is Outcome.IMPORT_ERROR, result.detail
    assert "the CPU-offload child SimpleCPUOffloadConnector does not import" in result.detail
    assert "cannot import name 'DmaCopy'" in result.detail
