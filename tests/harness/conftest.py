"""Helpers for the harness tests: fake vLLM wheels and throwaway suites, no real vLLM."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

from helpers import FAKE_CONNECTOR_FILES, SMALL_CELL_GB, build_wheel  # noqa: E402


def pytest_configure(config):
    # Fake cells need a few MB, not a real cell's 15 GiB: without this, every harness test that
    # runs a fake cell would fail on a host with less free disk than a real cell needs. The nox
    # subprocesses the tests start inherit it; tests of the disk check itself pass their own value.
    os.environ["KVCOMPAT_MIN_FREE_GB"] = SMALL_CELL_GB


@pytest.fixture
def fake_wheel(tmp_path: Path):
    def make(version: str = "0.0.1", extra: dict[str, str] | None = None, broken_import: bool = False) -> Path:
        files = dict(FAKE_CONNECTOR_FILES)
        if broken_import:
            files["vllm/__init__.py"] = "raise ImportError('libcudart.so.13: cannot open shared object file')\n"
        files.update(extra or {})
        folder = tmp_path / f"wheels-{version}-{int(broken_import)}"
        folder.mkdir(exist_ok=True)
        return build_wheel(folder, files, version=version)

    return make


@pytest.fixture
def make_suite(tmp_path: Path):
    """A throwaway test suite folder: make_suite(test_x="source", conftest="source")."""

    def make(**files: str) -> Path:
        suite = tmp_path / "suite"
        suite.mkdir(exist_ok=True)
        for name, src in files.items():
            (suite / (name if name.endswith(".py") else name + ".py")).write_text(textwrap.dedent(src))
        return suite

    return make
