"""In-cell pytest plugin of a mutation session: many mutants in one pytest, each in a forked child.

Loaded with ``-p kvcompat.mutation.incell.forkrun --kvcompat-fork-plan=PLAN --kvcompat-fork-out=OUT`` in the
session's venv (kvcompat.mutation.forked is the harness's side).  The parent collects the suite and
imports vLLM once (CpuPlatform first, then every target module, pristine); then, per mutant of PLAN
(a JSON list of ``{"id", "module", "source", "tests", "timeout"}``), it forks.  The child swaps the
mutated source's code into the module's existing functions and methods (``__code__``, so every
reference anyone holds sees the mutant, exactly as a mutated file on disk would once imported), runs
the mutant's tests (``tests``: node ids; null: the whole suite) in the order given, stops at the first
failure, and reports each test's outcome through a pipe.  The parent appends one JSON line per mutant
to OUT: ``{"id", "tests": [{"nodeid", "outcome", "message"}], "seconds"}`` plus ``"timeout": true``
(the child was killed after ``timeout`` seconds), ``"crash": "…"`` (it died without answering, twice: a
child that dies is forked once more, ``"retried": true``) or
``"unswappable": [names]`` (a change outside any function: the harness runs that mutant the slow way) or
``"missing": [node ids]`` (tests the plan names that this pytest did not collect: no verdict).

Nothing is written to the installed files: the pristine module stays on disk and in the parent.
"""

from __future__ import annotations

import enum
import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import sys
import time
import traceback
import types
from pathlib import Path

import pytest

from kvcompat.outcomes import NOT_APPLICABLE_PREFIX


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompat-fork")
    group.addoption("--kvcompat-fork-plan", default=None, help="mutants to run, one forked child each (JSON)")
    group.addoption("--kvcompat-fork-out", default=None, help="one JSON line per mutant is appended here")
    group.addoption("--kvcompat-fork-jobs", default="1", help="children in flight at once")


# -- swapping a module's code ----------------------------------------------------------------------


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    return a.co_code == b.co_code and a.co_consts == b.co_consts and a.co_names == b.co_names


def _move_code(old: object, new: object, where: str, problems: list[str], moved: list[str]) -> None:
    if not (isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType)):
        return
    inner_old, inner_new = getattr(old, "__wrapped__", None), getattr(new, "__wrapped__", None)
    if inner_old is not None and inner_new is not None:
        # A decorated function (functools.wraps: @contextmanager, a cache): the wrapper's code is the
        # decorator's, the same in both; the mutated code is the function it wraps, held in its closure.
        _move_code(inner_old, inner_new, where, problems, moved)
    if _same_code(old.__code__, new.__code__):
        return
    if old.__code__.co_freevars != new.__code__.co_freevars:
        problems.append(where)
        return
    old.__code__ = new.__code__
    old.__defaults__, old.__kwdefaults__ = new.__defaults__, new.__kwdefaults__
    moved.append(where)


def _move_function(old: object, new: object, where: str, problems: list[str], moved: list[str]) -> None:
    """Move the code of what ``new`` runs into what ``old`` runs; a cache the pristine code filled (lru_cache)
    is cleared when code moved, so it cannot answer for the mutant."""
    before = len(moved)
    _move_code(_function_of(old), _function_of(new), where, problems, moved)
    if len(moved) > before:
        getattr(old, "cache_clear", lambda: None)()


def _function_of(value: object) -> object:
    """The function whose code ``value`` runs: itself, or what a staticmethod, classmethod or a
    non-function wrapper (functools.lru_cache, …) holds."""
    if isinstance(value, staticmethod | classmethod):
        return value.__func__
    return getattr(value, "__wrapped__", None) if not isinstance(value, types.FunctionType) else value


def _equal(a: object, b: object) -> bool:
    """Whether a value the mutated source made equals the module's own.  An Enum's members are compared
    by class name, name and value (a new class's members never equal the old ones by identity), and the
    containers of them (an Enum's member maps) element by element."""
    if isinstance(a, enum.Enum) and isinstance(b, enum.Enum):
        return (type(a).__qualname__, a.name) == (type(b).__qualname__, b.name) and _equal(a.value, b.value)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 - an odd __eq__: count it as a change that cannot be moved
        return False


def swap_module(module: types.ModuleType, source: str) -> list[str]:
    """Give ``module``'s functions and methods the code of ``source`` (the module's file, mutated), in
    place.  Returns the names whose change cannot be moved that way (module- or class-level values,
    closures that differ, or a source that differs from the module's own file where no code moved at all);
    empty when the module now behaves as ``source`` would."""
    ns: dict = {
        "__name__": module.__name__,
        "__package__": module.__package__,
        "__file__": module.__file__,
        "__spec__": module.__spec__,
        "__builtins__": __builtins__,
    }
    exec(compile(source, module.__file__ or module.__name__, "exec"), ns)  # noqa: S102 - the release's own code
    problems: list[str] = []
    moved: list[str] = []
    for name, new in ns.items():
        if name.startswith("__") or name not in module.__dict__:
            continue
        old = module.__dict__[name]
        if _function_of(new) is not None and _function_of(old) is not None and not isinstance(new, type):
            _move_function(old, new, name, problems, moved)
        elif isinstance(new, type) and isinstance(old, type) and new.__module__ == module.__name__:
            for attr, nv in vars(new).items():
                ov = vars(old).get(attr)
                if attr.startswith(("__", "_abc_")) and not isinstance(nv, types.FunctionType):
                    continue  # the class machinery's own slots (__dict__, __weakref__, ABC caches): new objects
                if isinstance(nv, property) and isinstance(ov, property):
                    for part in ("fget", "fset", "fdel"):
                        _move_code(getattr(ov, part), getattr(nv, part), f"{name}.{attr}", problems, moved)
                elif ov is not None and _function_of(nv) is not None:
                    _move_function(ov, nv, f"{name}.{attr}", problems, moved)
                elif ov is not None and not callable(nv) and not isinstance(nv, property) and not _equal(nv, ov):
                    problems.append(f"{name}.{attr}")
        elif not isinstance(new, types.ModuleType) and not callable(new) and not _equal(new, old):
            problems.append(name)
    if not moved and not problems and _differs_from_file(module, source):
        # The mutant changed something no swap reached (a wrapper of a kind not followed here): no verdict
        # can come from a child running the pristine code, so the harness runs it the usual way.
        problems.append("<no code moved>")
    return problems


def _differs_from_file(module: types.ModuleType, source: str) -> bool:
    try:
        return Path(module.__file__ or "").read_text() != source
    except OSError:
        return True


# -- running one mutant in a child ------------------------------------------------------------------


def _outcome(reports: list) -> tuple[str, str]:
    """One test's outcome from its setup/call/teardown reports, as the cell's plugin names them."""
    for rep in reports:
        if rep.failed:
            return ("failed" if rep.when == "call" else "error"), str(rep.longrepr)[-2000:]
    for rep in reports:
        if rep.skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            return ("not_applicable" if NOT_APPLICABLE_PREFIX in reason else "skipped"), reason
    return "passed", ""


def _child(items: list, module: types.ModuleType, source: str, wfd: int) -> None:
    from _pytest.runner import runtestprotocol

    from kvcompat.testkit import shutdowns

    shutdowns.INLINE = True  # this child exits without a session end: a shutdown must fail in its own test
    known = set(sys.modules)
    answer: dict = {"tests": []}
    try:
        problems = swap_module(module, source)
        if problems:
            answer = {"unswappable": problems}
        else:
            for i, item in enumerate(items):
                reports = runtestprotocol(item, nextitem=items[i + 1] if i + 1 < len(items) else None, log=False)
                outcome, message = _outcome(reports)
                answer["tests"].append({"nodeid": item.nodeid, "outcome": outcome, "message": message})
                if outcome not in ("passed", "not_applicable"):
                    break
    except BaseException:  # noqa: BLE001 - whatever the mutant does, the parent gets a line
        answer = {"crash": traceback.format_exc()[-2000:], **answer}
    answer["imported"] = [name for name in list(sys.modules) if name not in known]
    data = json.dumps(answer).encode()
    while data:
        data = data[os.write(wfd, data) :]
    os._exit(0)


class _Child:
    """One forked mutant in flight: its pipe, what it has said so far, and when it runs out of time.

    ``timeout`` (the plan's) is what the mutant's tests may take alone.  With more children than cores
    each gets a share of a core, so its clock runs at that share: every wall second counts as
    ``cores / children in flight`` (at most 1) of its ``timeout``, and a child that has burnt ``timeout``
    seconds of CPU is out of time whatever the clock says (a spinning mutant).  Without the share, a
    survivor that runs the whole suite beside 15 others on 2 cores is killed by the clock and scored as
    killed: a false kill; with a fixed multiple instead, a child that hangs asleep at a batch's tail holds
    the batch for that multiple of its limit."""

    def __init__(self, mutant: dict, items: list, module: types.ModuleType) -> None:
        self.mutant, self.t0 = mutant, time.monotonic()
        self.limit = float(mutant["timeout"])
        self.used = 0.0  # its share of the wall clock so far (tick)
        self.data = b""
        # What the parent holds is never garbage: out of the children's collections, whose walks would
        # otherwise touch (and so copy) every page the parent shares with them.
        gc.freeze()
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(items, module, mutant["source"], wfd)
        os.close(wfd)
        self.pid, self.rfd = pid, rfd

    def tick(self, seconds: float, share: float) -> None:
        self.used += seconds * min(1.0, share)

    def out_of_time(self) -> bool:
        return self.used >= self.limit or _cpu_seconds(self.pid) > self.limit

    def read(self) -> bool:
        """Take what the child wrote; True once it closed its end (it has answered or died)."""
        chunk = os.read(self.rfd, 1 << 16)
        self.data += chunk
        return not chunk

    def answer(self, timed_out: bool) -> dict:
        """Reap the child (killed first when ``timed_out``) and return its answer."""
        cpu = _cpu_seconds(self.pid)
        if timed_out:
            os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        os.close(self.rfd)
        if timed_out:
            answer: dict = {"timeout": True}
        elif not self.data:
            answer = {"crash": f"the child died without answering (wait status {status})"}
        else:
            answer = json.loads(self.data)
        seconds = round(time.monotonic() - self.t0, 2)
        return {**answer, "id": self.mutant["id"], "seconds": seconds, "limit": self.limit, "cpu_s": round(cpu, 1)}


def _cpu_seconds(pid: int) -> float:
    """CPU time a child has used, its threads included (Linux /proc; 0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _import_too(names: list[str]) -> None:
    """Import, pristine, what a child had to import for its tests, so that the next children start with it
    (the tests' own lazy imports of the release are most of a child's time otherwise)."""
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that cannot be imported twice, or only as a side effect
            pass


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    plan_path = session.config.getoption("--kvcompat-fork-plan")
    if not plan_path:
        return None
    if importlib.util.find_spec("vllm") is not None:  # a cell: CpuPlatform first, as the suite's fixture does
        from kvcompat.testkit import adapter as va

        va.select_cpu_platform()
    plan = json.loads(Path(plan_path).read_text())
    out = Path(session.config.getoption("--kvcompat-fork-out"))
    by_id = {item.nodeid: item for item in session.items}
    jobs = max(1, int(session.config.getoption("--kvcompat-fork-jobs")))
    cores = os.cpu_count() or 1
    killers: list[str] = []
    waiting, running = list(plan), {}
    while waiting or running:
        while waiting and len(running) < jobs:
            mutant = waiting.pop(0)
            module = importlib.import_module(mutant["module"])
            wanted = mutant["tests"] if mutant["tests"] is not None else list(by_id)
            missing = [n for n in wanted if n not in by_id]
            if missing:  # the suite changed since the baseline chose these tests: no child can give a verdict
                with out.open("a") as f:
                    f.write(json.dumps({"id": mutant["id"], "missing": missing[:20], "seconds": 0.0}) + "\n")
                continue
            ordered = [n for n in killers if n in wanted] + [n for n in wanted if n not in killers]
            child = _Child(mutant, [by_id[n] for n in ordered if n in by_id], module)
            running[child.rfd] = child
        before = time.monotonic()
        ready, _, _ = select.select(list(running), [], [], 1.0)
        answered = {fd for fd in ready if running[fd].read()}
        for c in running.values():
            c.tick(time.monotonic() - before, cores / len(running))
        done = [(c, fd not in answered) for fd, c in running.items() if fd in answered or c.out_of_time()]
        for child, timed_out in done:
            del running[child.rfd]
            answer = child.answer(timed_out)
            _import_too(answer.pop("imported", []))
            if "crash" in answer and not child.mutant.get("retried"):
                # A child that died of the fork itself (a library's state copied mid-use) is no verdict, and
                # the usual way costs a whole pytest: fork it once more first.
                waiting.insert(0, {**child.mutant, "retried": True})
                continue
            if child.mutant.get("retried"):
                answer["retried"] = True
            for t in answer.get("tests", []):
                if t["outcome"] not in ("passed", "not_applicable") and t["nodeid"] not in killers:
                    killers.insert(0, t["nodeid"])
            with out.open("a") as f:
                f.write(json.dumps(answer) + "\n")
    return True
