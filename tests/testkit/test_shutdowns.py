"""Deferred engine shutdowns: a shutdown that raises or hangs is still an error of the test that built
the engine, in the terminal, the exit status and the results JSON."""

import json

import pytest

from kvcompat.testkit import shutdowns

CONFTEST = """
import time
import pytest
from kvcompat.testkit import shutdowns

shutdowns.JOIN_TIMEOUT_S = 1.0

@pytest.fixture(scope="session")
def deferred(request):
    pending = shutdowns.DeferredShutdowns()
    yield pending
    shutdowns.report(request.config, pending.join(shutdowns.JOIN_TIMEOUT_S))

@pytest.fixture
def engine(request, deferred):
    yield
    behaviour = request.node.get_closest_marker("shutdown").args[0]

    def shut():
        time.sleep(0.2)  # still running when the next test starts
        if behaviour == "raises":
            raise RuntimeError("listener would not stop")
        if behaviour == "hangs":
            time.sleep(30)

    deferred.start(request.node.nodeid, shut)
"""

SUITE = """
import pytest

@pytest.mark.shutdown("raises")
def test_whose_shutdown_raises(engine):
    pass

@pytest.mark.shutdown("clean")
def test_clean(engine):
    pass

@pytest.mark.shutdown("hangs")
def test_whose_shutdown_hangs(engine):
    pass

def test_without_an_engine():
    pass
"""


def test_a_failed_deferred_shutdown_is_its_owners_teardown_error(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    shutdown: how the engine's shutdown behaves\n")
    pytester.makepyfile(test_suite=SUITE)
    out = pytester.path / "out.json"
    result = pytester.runpytest_subprocess("-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={out}")
    got = {t["nodeid"].split("::")[1]: t for t in json.loads(out.read_text())["tests"]}
    assert {k: v["outcome"] for k, v in got.items()} == {
        "test_whose_shutdown_raises": "error",
        "test_clean": "passed",
        "test_whose_shutdown_hangs": "error",
        "test_without_an_engine": "passed",
    }
    assert (
        "engine shutdown raised RuntimeError: listener would not stop" in got["test_whose_shutdown_raises"]["message"]
    )
    assert "engine shutdown still running" in got["test_whose_shutdown_hangs"]["message"]
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*4 passed, 2 errors*"])


def test_in_line_a_shutdown_raises_where_it_is_called(monkeypatch):
    monkeypatch.setattr(shutdowns, "INLINE", True)
    pending = shutdowns.DeferredShutdowns()

    def shut():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        pending.start("t::x", shut)
    assert pending.join() == []
