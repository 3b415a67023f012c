"""In-cell pytest plugin of a mutation session: which test runs which line, and running only some tests.

Loaded with ``-p kvcompat.mutation.incell.covplugin`` in the session's venv (kvcompat.mutation.covmap is the
harness's side).  Two jobs:

* with ``KVCOMPAT_COVMAP=OUT`` and ``KVCOMPAT_COVER=PATH[:PATH…]`` (paths inside site-packages) in the
  environment, it measures those files with coverage.py from the moment pytest imports this plugin
  (before any conftest or test module imports vLLM), with one dynamic context per test (its node id,
  from its setup to its teardown; "" outside any test: import, collection, threads between tests),
  and at the session's end writes OUT: ``{"tests": [context, …], "files": {path: {line: [index into
  tests, …]}}}``.  The environment, not an option, because measuring must start before options exist.
  Written at ``pytest_sessionfinish``: the cell's pytest ends with ``os._exit`` (kvcompat.testkit's
  CellProcess), which skips coverage.py's own atexit save;
* ``--kvcompat-only=FILE`` (node ids, one a line): every other collected test is deselected.  When
  none of them is collected (a stale list), nothing is deselected: the whole suite runs, never none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ENV_OUT = "KVCOMPAT_COVMAP"
ENV_FILES = "KVCOMPAT_COVER"


class _Measure:
    def __init__(self, out: Path, files: list[str]) -> None:
        import coverage  # installed into the session's venv by kvcompat.mutation.covmap

        self.out = out
        self.files = files
        self.cov = coverage.Coverage(data_file=None, include=[f"*/{f}" for f in files], branch=False, config_file=False)
        self.cov.start()
        self.done = False

    def switch(self, context: str) -> None:
        if not self.done:
            self.cov.switch_context(context)

    def write(self) -> None:
        if self.done:
            return
        self.done = True
        self.cov.stop()
        data = self.cov.get_data()
        index: dict[str, int] = {}
        files: dict[str, dict[str, list[int]]] = {}
        for measured in sorted(data.measured_files()):
            norm = measured.replace(os.sep, "/")
            rel = next((f for f in self.files if norm.endswith("/" + f)), None)
            if rel is None:
                continue
            lines = files.setdefault(rel, {})
            for lineno, contexts in sorted(data.contexts_by_lineno(measured).items()):
                ids = sorted({index.setdefault(c, len(index)) for c in contexts})
                lines[str(lineno)] = sorted(set(lines.get(str(lineno), [])) | set(ids))
        payload = {"tests": sorted(index, key=index.__getitem__), "files": files}
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, self.out)


def _start() -> _Measure | None:
    out = os.environ.get(ENV_OUT)
    files = [f for f in os.environ.get(ENV_FILES, "").split(os.pathsep) if f]
    return _Measure(Path(out), files) if out and files else None


MEASURE = _start()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("kvcompat").addoption(
        "--kvcompat-only",
        default=None,
        help="a file of test node ids, one a line: deselect every other test (a mutation run: the tests that "
        "execute the mutated lines)",
    )


def pytest_configure(config: pytest.Config) -> None:
    only = config.getoption("--kvcompat-only")
    if only:
        config.pluginmanager.register(Only(Path(only)), "kvcompat-only")


class Only:
    def __init__(self, path: Path) -> None:
        self.names = {line.strip() for line in path.read_text().splitlines() if line.strip()}

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep = [item for item in items if item.nodeid in self.names]
        if not keep:  # nothing of the list was collected: run everything rather than nothing
            return
        drop = [item for item in items if item.nodeid not in self.names]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):  # noqa: ARG001
    if MEASURE is not None:
        MEASURE.switch(item.nodeid)
    try:
        yield
    finally:
        if MEASURE is not None:
            MEASURE.switch("")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:  # noqa: ARG001
    if MEASURE is not None:
        MEASURE.write()
