"""kvcompat.run.diskneed: a cell's disk need is what its lock pins and uv's cache lacks, unpacked."""

from __future__ import annotations

import json

import pytest

from kvcompat import simple_api
from kvcompat.run import diskneed

LOCK = """\
# compiled by uv
torch==2.15.0
numpy==2.2.6
vllm @ file:///{wheel}
nvidia-nccl-cu12==2.27.3  # via torch
"""

GIB = 2**30


@pytest.fixture
def index(monkeypatch):
    pages = {
        "torch": [
            {"filename": "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl", "size": 2 * GIB},
            {"filename": "torch-2.15.0-cp311-cp311-win_amd64.whl", "size": 9 * GIB},  # not this platform
            {"filename": "torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", "size": 7 * GIB},  # not this version
        ],
        "nvidia-nccl-cu12": [{"filename": "nvidia_nccl_cu12-2.27.3-py3-none-manylinux_2_18_x86_64.whl"}],  # no size
    }
    asked = []

    def http_get(url, **kw):
        name = url.rstrip("/").rsplit("/", 1)[-1]
        asked.append(name)
        return json.dumps({"meta": {"api-version": "1.1"}, "files": pages.get(name, [])}).encode()

    monkeypatch.setattr(simple_api, "http_get", http_get)
    return asked


def test_only_what_the_cache_lacks_counts(tmp_path, index):
    wheel = tmp_path / "vllm-0.34.1.dev1-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"x" * (GIB // 4))
    lock = LOCK.format(wheel=str(wheel).lstrip("/"))
    need = diskneed.estimate(lock, {("numpy", "2.2.6")}, "https://idx.example/simple")
    assert need.pins == 4
    assert {(n, v) for n, v, _ in need.missing} == {
        ("torch", "2.15.0"),
        ("vllm", "0.34.1.dev1"),
        ("nvidia-nccl-cu12", "2.27.3"),
    }
    assert "numpy" not in index and "vllm" not in index  # cached: never asked; local: its file size
    sizes = {n: s for n, _, s in need.missing}
    assert sizes == {"torch": 2.0, "vllm": 0.25, "nvidia-nccl-cu12": None}
    expected = diskneed.VENV_OWN_GIB + diskneed.UNPACK_FACTOR * (2.0 + 0.25 + diskneed.UNKNOWN_PIN_GIB)
    assert need.gib == pytest.approx(expected)
    assert need.line().startswith(
        f"needs about {expected:.1f} GiB (3 of 4 pins not in uv's cache: torch 2.15.0 2.0 GiB"
    )


def test_a_fully_cached_cell_needs_only_its_own_files(index):
    cached = {("torch", "2.15.0"), ("numpy", "2.2.6"), ("nvidia-nccl-cu12", "2.27.3"), ("vllm", "0.34.0")}
    lock = "torch==2.15.0\nnumpy==2.2.6\nnvidia-nccl-cu12==2.27.3\nvllm==0.34.0\n"
    need = diskneed.estimate(lock, cached, "https://idx.example/simple")
    assert need.missing == [] and need.gib == diskneed.VENV_OWN_GIB and index == []
    assert need.line() == f"needs about {diskneed.VENV_OWN_GIB:.1f} GiB (all 4 pins are in uv's cache)"
