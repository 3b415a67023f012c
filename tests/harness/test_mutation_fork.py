"""kvcompat.mutation.incell.forkrun: a mutated source's code swapped into a live module, and a mutant per forked child."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcompat.mutation.incell.forkrun import swap_module

SOURCE = textwrap.dedent(
    """
    import contextlib
    import dataclasses
    import functools

    LIMIT = 2

    @contextlib.contextmanager
    def opened(x):
        yield x + 1

    @functools.lru_cache
    def cached(x):
        return x * 10

    class Box:
        def __init__(self, f):
            self.f = f

        def __call__(self, x):
            return self.f(x)

    boxed = Box(lambda x: x - 1)

    def top(x):
        return x + 1

    class Counter:
        kind = "plain"

        def __init__(self):
            self.n = 0

        def add(self, k):
            if k > 0:
                self.n += k
            return self.n

        @property
        def double(self):
            return 2 * self.n

        @staticmethod
        def unit():
            return 1

        @classmethod
        def make(cls):
            return cls()

    @dataclasses.dataclass
    class Point:
        x: int = 0

        def norm(self):
            return abs(self.x)
    """
)


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "swapme.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("swapme", None)
    mod = importlib.import_module("swapme")
    yield mod
    sys.modules.pop("swapme", None)


def test_a_method_change_reaches_objects_and_references_made_before(module):
    counter, add = module.Counter(), module.Counter.add
    assert swap_module(module, SOURCE.replace("if k > 0:", "if k > 1:")) == []
    assert counter.add(1) == 0, "an instance made before the swap runs the mutated method"
    assert add(module.Counter(), 1) == 0, "a reference taken before the swap runs the mutated method"


def test_functions_properties_static_and_class_methods_are_swapped(module):
    mutated = (
        SOURCE.replace("return x + 1", "return x + 2")
        .replace("return 2 * self.n", "return 3 * self.n")
        .replace("return 1\n", "return 5\n")
        .replace("return abs(self.x)", "return -abs(self.x)")
    )
    assert swap_module(module, mutated) == []
    c = module.Counter()
    c.add(2)
    assert (module.top(1), c.double, module.Counter.unit(), module.Point(3).norm()) == (3, 6, 5, -3)
    assert isinstance(module.Counter.make(), module.Counter)


def test_an_unchanged_source_changes_nothing(module):
    before = module.Counter.add.__code__
    assert swap_module(module, SOURCE) == []
    assert module.Counter.add.__code__ is before


def test_decorated_functions_are_swapped_through_their_wrappers(module):
    """@contextmanager and @lru_cache keep the function in a wrapper whose own code never changes: the
    wrapped function's code is what must move (and a cache the pristine code filled must not answer)."""
    assert module.cached(2) == 20
    mutated = SOURCE.replace("yield x + 1", "yield x + 2").replace("return x * 10", "return x * 11")
    assert swap_module(module, mutated) == []
    with module.opened(1) as v:
        assert v == 3
    assert module.cached(2) == 22


def test_a_change_no_swap_reaches_is_named_not_silently_dropped(module):
    """A callable object holding the mutated lambda: nothing moves, so the child would run pristine code
    and call that a survivor; the mutant is named unswappable (the harness runs it the usual way)."""
    assert swap_module(module, SOURCE.replace("lambda x: x - 1", "lambda x: x + 1")) == ["<no code moved>"]
    assert module.boxed(1) == 0


def test_changes_outside_any_function_are_named_not_half_applied(module):
    assert swap_module(module, SOURCE.replace("LIMIT = 2", "LIMIT = 3")) == ["LIMIT"]
    assert swap_module(module, SOURCE.replace('kind = "plain"', 'kind = "fancy"')) == ["Counter.kind"]


def _run_plan(tmp_path: Path, plan: list[dict], jobs: int) -> tuple[dict, str]:
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), str(tmp_path)]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "kvcompat.mutation.incell.forkrun",
            "-p",
            "no:cacheprovider",
            f"--kvcompat-fork-plan={tmp_path / 'plan.json'}",
            f"--kvcompat-fork-out={out}",
            f"--kvcompat-fork-jobs={jobs}",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    answers = {a["id"]: a for a in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return answers, proc.stdout + proc.stderr


@pytest.mark.parametrize("jobs", [1, 3])
def test_forked_children_answer_per_mutant_and_the_parent_stays_pristine(tmp_path, jobs):
    """The plugin end to end in a tiny pytest project: a killed mutant, a survivor, a timeout, a crash, a
    child that dies only the first time (forked again, it answers), one child at a time or several at once."""
    (tmp_path / "lib.py").write_text("def inc(x):\n    return x + 1\n")
    (tmp_path / "test_lib.py").write_text(
        "import lib\n\ndef test_inc():\n    assert lib.inc(1) == 2\n\ndef test_type():\n    assert isinstance(lib.inc(1), int)\n"
    )
    plan = [
        {"id": "killed", "module": "lib", "source": "def inc(x):\n    return x + 2\n", "tests": None, "timeout": 60},
        {"id": "survived", "module": "lib", "source": "def inc(x):\n    return 1 + x\n", "tests": None, "timeout": 60},
        {
            "id": "hangs",
            "module": "lib",
            "source": "def inc(x):\n    while True:\n        pass\n",
            "tests": ["test_lib.py::test_inc"],
            "timeout": 3,
        },
        {
            "id": "crashes",
            "module": "lib",
            "source": 'def inc(x):\n    __import__("os")._exit(9)\n',
            "tests": None,
            "timeout": 60,
        },
        {
            "id": "crashes-once",
            "module": "lib",
            "source": (
                "def inc(x):\n    os = __import__('os')\n    mark = os.path.join(os.path.dirname(__file__), 'forked')\n"
                "    if not os.path.exists(mark):\n        open(mark, 'w').close()\n        os._exit(9)\n    return x + 1\n"
            ),
            "tests": ["test_lib.py::test_inc"],
            "timeout": 60,
        },
    ]
    answers, output = _run_plan(tmp_path, plan, jobs)
    assert sorted(answers) == sorted(m["id"] for m in plan), output
    assert [t["outcome"] for t in answers["killed"]["tests"]] == ["failed"], "stops at the first failure"
    assert [t["outcome"] for t in answers["survived"]["tests"]] == ["passed", "passed"]
    assert answers["hangs"].get("timeout") is True
    assert "crash" in answers["crashes"] and answers["crashes"]["retried"], "a crash is forked once more"
    once = answers["crashes-once"]
    assert "crash" not in once and once["retried"] and [t["outcome"] for t in once["tests"]] == ["passed"]
    assert all("imported" not in a for a in answers.values()), "the children's module lists stay in the parent"
    assert (tmp_path / "lib.py").read_text() == "def inc(x):\n    return x + 1\n", "the file on disk is never touched"


def test_what_a_child_imported_the_next_children_start_with(tmp_path):
    """A module the tests import lazily is imported by the first child and then by the parent, pristine:
    the children after it find it imported (a release's lazy imports are most of a child's time)."""
    (tmp_path / "lib.py").write_text("def inc(x):\n    return x + 1\n")
    (tmp_path / "lazy.py").write_text(
        "import os\nwith open(os.path.join(os.path.dirname(__file__), 'imports.txt'), 'a') as f:\n"
        "    f.write(str(os.getpid()) + '\\n')\n"
    )
    (tmp_path / "test_lib.py").write_text(
        "import lib\n\ndef test_inc():\n    import lazy\n    assert lib.inc(1) == 2\n"
    )
    plan = [
        {"id": f"m{i}", "module": "lib", "source": "def inc(x):\n    return 1 + x\n", "tests": None, "timeout": 60}
        for i in range(3)
    ]
    answers, output = _run_plan(tmp_path, plan, jobs=1)
    assert sorted(answers) == ["m0", "m1", "m2"], output
    pids = (tmp_path / "imports.txt").read_text().split()
    assert len(pids) == 2, f"lazy imported in {len(pids)} processes: the first child and the parent only"


def test_a_forked_mutants_time_limit_comes_from_its_own_tests():
    """5x the unmutated time of the mutant's tests, at least 30 s, plus 2 s a test for the engine shutdowns a
    child runs in line, never past the whole suite's limit."""
    import types as _types

    from kvcompat.mutation.forked import Forked

    run = _types.SimpleNamespace(baseline={"durations": {"a": 1.0, "b": 20.0}})
    g = _types.SimpleNamespace(run=run, planned=[])
    forked = Forked(ctx=None, g=g, passed=["a", "b"], site=Path("."), timeout=150.0)
    assert (forked._limit(["a"]), forked._limit(["a", "b"]), forked._limit(None)) == (32.0, 109.0, 150.0)
    forked.timeout = 100.0
    assert forked._limit(["a", "b"]) == 100.0
    assert forked.answers == {} and forked.batched == set()


def test_an_unchanged_enum_is_no_change_and_a_changed_one_is_named(tmp_path, monkeypatch):
    """A module with an Enum: its members, made anew by the mutated source, count as unchanged when their
    names and values are; a member whose value the mutant changed is named."""
    source = "import enum\n\nclass State(enum.Enum):\n    READY = 1\n    BUSY = 2\n\ndef f():\n    return State.READY\n"
    (tmp_path / "withenum.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("withenum", None)
    mod = importlib.import_module("withenum")
    try:
        assert swap_module(mod, source.replace("return State.READY", "return State.BUSY")) == []
        assert mod.f() is mod.State.BUSY, "the function's code was swapped and sees the module's own members"
        assert "State.BUSY" in swap_module(mod, source.replace("BUSY = 2", "BUSY = 3"))
    finally:
        sys.modules.pop("withenum", None)


def test_a_forked_crash_is_scored_again_the_usual_way_and_a_failed_test_before_it_kills():
    """A child that died without a failing test gets no verdict here (the usual way decides, in a fresh
    pytest); a child whose test failed before it died is killed by that test; tests the pytest did not
    collect stop the session with what to do."""
    import types as _types

    from kvcompat.mutation.context import MutationError
    from kvcompat.mutation.forked import Forked
    from kvcompat.mutation.record import KILLED

    mutant = _types.SimpleNamespace(id="m", contract="C.f", description="d", equivalent=False, same_as=None)
    planned = [_types.SimpleNamespace(mutant=mutant, mutated="src", target="vllm/x.py", line=3)]
    g = _types.SimpleNamespace(run=_types.SimpleNamespace(baseline={}), planned=planned)
    forked = Forked(ctx=None, g=g, passed=["t1", "t2"], site=Path("."), timeout=60.0)
    forked.batched.add(0)
    forked.answers["m"] = {"id": "m", "seconds": 1.0, "tests": [], "crash": "wait status 11", "why": ""}
    assert forked.verdict(0) is None
    failed = {"nodeid": "t1", "outcome": "failed", "message": "AssertionError: x"}
    forked.answers["m"] = {"id": "m", "seconds": 1.0, "tests": [failed], "crash": "wait status 11", "why": ""}
    v = forked.verdict(0)
    assert (v.status, v.killed_by) == (KILLED, "t1")
    forked.answers["m"] = {"id": "m", "seconds": 0.0, "missing": ["t3"]}
    with pytest.raises(MutationError, match="the suite changed during the session"):
        forked.verdict(0)


def test_a_forked_child_that_stalled_before_its_first_test_is_scored_again_the_usual_way():
    """Out of time having used no CPU (a fork that deadlocked on a lock another thread held, or a child starved
    by other work): no verdict here; out of time after burning CPU (spinning, or asleep after its fixtures ran),
    it is killed by the timeout."""
    import types as _types

    from kvcompat.mutation.forked import Forked
    from kvcompat.mutation.record import KILLED

    mutant = _types.SimpleNamespace(id="m", contract="C.f", description="d", equivalent=False, same_as=None)
    planned = [_types.SimpleNamespace(mutant=mutant, mutated="src", target="vllm/x.py", line=3)]
    g = _types.SimpleNamespace(run=_types.SimpleNamespace(baseline={}), planned=planned)
    forked = Forked(ctx=None, g=g, passed=["t1"], site=Path("."), timeout=60.0)
    forked.batched.add(0)
    forked.answers["m"] = {"id": "m", "seconds": 40.0, "tests": [], "timeout": True, "cpu_s": 0.0, "why": ""}
    assert forked.verdict(0) is None
    forked.answers["m"] = {"id": "m", "seconds": 40.0, "tests": [], "timeout": True, "cpu_s": 39.5, "why": ""}
    assert (forked.verdict(0).status, forked.verdict(0).killed_by) == (KILLED, "timeout")


def _one_test_project(tmp_path: Path) -> None:
    """A module ``lib`` with ``inc`` and one test of it, ``test_lib.py::test_inc``."""
    (tmp_path / "lib.py").write_text("def inc(x):\n    return x + 1\n")
    (tmp_path / "test_lib.py").write_text("import lib\n\ndef test_inc():\n    assert lib.inc(1) == 2\n")


def test_a_childs_clock_runs_at_its_share_of_a_core_and_cpu_time_ends_a_spinner(tmp_path):
    """A child's clock counts each wall second as its share of a core (a survivor running the whole suite
    beside 15 others on 2 cores is no timeout), while a child that burns its limit in CPU time is out of
    time at once (a spinning mutant does not hold its slot for the slowed clock)."""
    from kvcompat.mutation.incell import forkrun

    _one_test_project(tmp_path)
    plan = [
        {
            "id": "spins",
            "module": "lib",
            "source": "def inc(x):\n    while True:\n        pass\n",
            "tests": None,
            "timeout": 2,
        }
    ]
    answers, output = _run_plan(tmp_path, plan, jobs=8 * (os.cpu_count() or 1))
    spins = answers["spins"]
    assert spins.get("timeout") is True and spins["limit"] == 2.0, output
    assert spins["seconds"] < 10, f"a spinning child was let run {spins['seconds']} s past its 2 s of CPU"
    assert forkrun._cpu_seconds(os.getpid()) > 0
    child = forkrun._Child.__new__(forkrun._Child)
    child.limit, child.used, child.pid = 10.0, 0.0, os.getpid()
    child.tick(8.0, 2 / 16)
    assert child.used == 1.0, "8 wall seconds as one of 16 children on 2 cores are 1 s of its limit"
    child.tick(9.0, 2.0)
    assert child.used == 10.0, "alone, a wall second is a second (never more)"


def test_a_test_the_plan_names_but_pytest_did_not_collect_gives_no_verdict(tmp_path):
    """A mutant whose tests are not in this pytest's collection (the suite changed under the session) is
    answered as missing, never run with no tests and called a survivor."""
    _one_test_project(tmp_path)
    plan = [
        {
            "id": "m",
            "module": "lib",
            "source": "def inc(x):\n    return x + 2\n",
            "tests": ["test_lib.py::test_gone"],
            "timeout": 60,
        }
    ]
    answers, output = _run_plan(tmp_path, plan, jobs=1)
    assert answers["m"].get("missing") == ["test_lib.py::test_gone"] and "tests" not in answers["m"], output
