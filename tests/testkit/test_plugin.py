"""The pytest plugin: per-test outcomes from hooks, and no way for a test to hide as a pass."""

import json
import platform

SUITE = """
import pytest
from kvcompat.testkit import not_applicable

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert [1, 2] == [1, 3], "lists differ"

def test_not_applicable():
    not_applicable("SimpleCPUOffloadConnector is absent from this release")

def test_plain_skip():
    pytest.skip("no GPU")

@pytest.fixture
def broken():
    raise RuntimeError("fixture exploded")

def test_setup_error(broken):
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown exploded")

def test_teardown_error(bad_teardown):
    pass
"""


def run(pytester, source, **more):
    pytester.makepyfile(test_suite=source, **more)
    out = pytester.path / "out.json"
    result = pytester.runpytest_subprocess("-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={out}")
    return result, json.loads(out.read_text())


def test_outcomes_are_mapped(pytester):
    result, data = run(pytester, SUITE)
    got = {t["nodeid"].split("::")[1]: t for t in data["tests"]}
    assert {k: v["outcome"] for k, v in got.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_not_applicable": "not_applicable",
        "test_plain_skip": "error",
        "test_setup_error": "error",
        "test_xfail": "error",
        "test_teardown_error": "error",
    }
    assert "lists differ" in got["test_fails"]["message"]
    assert got["test_not_applicable"]["message"] == "SimpleCPUOffloadConnector is absent from this release"
    assert "without a capability probe" in got["test_plain_skip"]["message"]
    assert "teardown exploded" in got["test_teardown_error"]["message"]
    assert data["collected"] == 7 and data["exitstatus"] == 1
    assert all(t["duration"] >= 0 for t in data["tests"])


EMPTY_PARAMETRIZATION = """
import pytest

BACKENDS = []  # as vLLM builds it from what the platform supports: nothing on a CPU

@pytest.mark.parametrize("backend", BACKENDS)
def test_per_backend(backend):
    assert backend
"""


def test_an_empty_parametrization_is_not_applicable_in_upstream_and_an_error_in_ours(pytester):
    pytester.makepyfile(test_suite=EMPTY_PARAMETRIZATION)
    got = {}
    for suite in ("upstream", "ours"):
        out = pytester.path / f"{suite}.json"
        pytester.runpytest_subprocess(
            "-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={out}", f"--kvcompat-suite={suite}"
        )
        (test,) = json.loads(out.read_text())["tests"]
        got[suite] = test
    assert got["upstream"]["outcome"] == "not_applicable"
    assert "no case for this platform" in got["upstream"]["message"]
    assert "got empty parameter set" in got["upstream"]["message"]  # pytest's own words, with the argument
    assert got["ours"]["outcome"] == "error"  # our suite never parametrizes over the platform: hiding is an error


def test_collection_error_is_recorded(pytester):
    result, data = run(pytester, "import not_a_module_anywhere\n\ndef test_x():\n    pass\n")
    assert [t["outcome"] for t in data["tests"]] == ["error"]
    assert "not_a_module_anywhere" in data["tests"][0]["message"]
    assert data["exitstatus"] == 2


def test_no_tests_collected(pytester):
    result, data = run(pytester, "x = 1\n")
    assert data == {
        "exitstatus": 5,
        "collected": 0,
        "deselected": [],
        "tests": [],
        "python": platform.python_version(),
        "facts": {},
    }


def test_deselected_tests_are_listed(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    pytester.makepyfile(
        test_suite="import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n\ndef test_cpu():\n    pass\n"
    )
    out = pytester.path / "out.json"
    pytester.runpytest_subprocess("-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={out}", "-m", "not gpu")
    data = json.loads(out.read_text())
    assert [(t["nodeid"], t["outcome"]) for t in data["tests"]] == [("test_suite.py::test_cpu", "passed")]
    assert data["deselected"] == ["test_suite.py::test_gpu"]


CELL_PROCESS_SUITE = """
import atexit, gc, pathlib, weakref

FREED = []

class Cycle:
    def __init__(self):
        self.me = self  # only the cycle collector can free it

def test_makes_cyclic_garbage():
    c = Cycle()
    weakref.finalize(c, FREED.append, "freed")
    del c

def test_sees_the_previous_tests_garbage_collected():
    assert FREED == ["freed"]  # collected between the tests, finalizer run

def test_fails_at_the_end():
    atexit.register(lambda: pathlib.Path("atexit-ran").write_text("yes"))
    assert False, "the last test fails"
"""


def test_cell_process_collects_each_tests_garbage_and_keeps_the_exit_status(pytester):
    """--kvcompat-cell-process (what the cell runner passes): a test's cyclic garbage is
    collected before the next test starts; the JSON, pytest's summary and its exit status
    (1: a test failed) are all out although the interpreter's teardown is skipped."""
    pytester.makepyfile(test_suite=CELL_PROCESS_SUITE)
    out = pytester.path / "out.json"
    result = pytester.runpytest_subprocess(
        "-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={out}", "--kvcompat-cell-process"
    )
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*1 failed, 2 passed*"])
    got = {t["nodeid"].split("::")[1]: t["outcome"] for t in json.loads(out.read_text())["tests"]}
    assert got == {
        "test_makes_cyclic_garbage": "passed",
        "test_sees_the_previous_tests_garbage_collected": "passed",
        "test_fails_at_the_end": "failed",
    }
    assert not (pytester.path / "atexit-ran").exists()  # os._exit: the interpreter's teardown never ran


def test_cell_process_exit_status_of_a_green_run_is_zero(pytester):
    pytester.makepyfile(test_suite="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-json={pytester.path / 'o.json'}", "--kvcompat-cell-process"
    )
    assert result.ret == 0 and json.loads((pytester.path / "o.json").read_text())["tests"][0]["outcome"] == "passed"


BLOCKED_SUITE = """
from kvcompat.testkit import setup_owned_by

def test_owner():
    assert False, "register_kv_caches raised"

def test_needs_the_owners_step():
    with setup_owned_by("test_owner"):
        raise AssertionError("All kv cache tensors must have the same number of blocks")
    assert False, "never reached"

def test_owner_step_fine_then_own_fail():
    with setup_owned_by("test_owner"):
        pass
    assert False, "its own contract"
"""


def test_a_setup_step_owned_by_another_test_is_an_error_blocked_by_it(pytester):
    """setup_owned_by: the failure is the owner's finding; this test is an error naming the owner, with
    the exception; once the step passes, the test's own assertions count as usual."""
    _, data = run(pytester, BLOCKED_SUITE)
    got = {t["nodeid"].split("::")[1]: t for t in data["tests"]}
    assert {k: (v["outcome"], v["blocked_by"]) for k, v in got.items()} == {
        "test_owner": ("failed", None),
        "test_needs_the_owners_step": ("error", "test_owner"),
        "test_owner_step_fine_then_own_fail": ("failed", None),
    }
    msg = got["test_needs_the_owners_step"]["message"]
    assert (
        msg.startswith("setup step of test_owner failed: AssertionError: All kv cache tensors") and "never" not in msg
    )


def test_listed_tests_run_first_in_the_listed_order(pytester):
    """--kvcompat-first: the listed tests run first, in the file's order; the rest keep theirs."""
    pytester.makepyfile(test_suite="def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    first = pytester.path / "first.txt"
    first.write_text("test_suite.py::test_c\ntest_suite.py::test_b\n")
    result = pytester.runpytest_subprocess("-p", "kvcompat.testkit.pytest_plugin", f"--kvcompat-first={first}", "-v")
    order = [line.split("::")[1].split()[0] for line in result.outlines if line.startswith("test_suite.py::")]
    assert order == ["test_c", "test_b", "test_a"]


def test_a_refusal_inside_a_user_configuration_is_unsupported_not_blocked(pytester):
    """Building the user's configuration: vLLM refusing it in a step another contract owns is still the
    release refusing the configuration (unsupported), not that contract's finding."""
    pytester.mkpydir("vllm")
    (pytester.path / "vllm" / "factory.py").write_text(
        "def build():\n    raise ValueError('MultiConnector does not support HMA')\n"
    )
    suite = """
from kvcompat.testkit import setup_owned_by, user_configuration
import vllm.factory

def test_refused():
    with user_configuration("a hybrid model"):
        with setup_owned_by("test_worker_up"):
            vllm.factory.build()
"""
    _, data = run(pytester, suite)
    (t,) = data["tests"]
    assert (t["outcome"], t["blocked_by"]) == ("unsupported", None)
    assert "a hybrid model: ValueError: MultiConnector does not support HMA (vllm/factory.py:2)" in t["message"]
