"""Phase 1: resolve the cell's requirements into a lock, and decide whether the cell is unchanged.

A cell's identity (its cache key) is the resolved lock, the in-cell code, the exact
Python, and what selects or bounds its tests.  An unchanged cell is answered from
its result file without installing or testing anything.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvcompat import index
from kvcompat.atomic import write_atomic
from kvcompat.cells import TORCH_COMPANIONS, Cell, constraints_for
from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome
from kvcompat.results import CellResult, write_result
from kvcompat.run import record
from kvcompat.run.context import CellContext
from kvcompat.run.options import RunOptions

IN_CELL_PACKAGE = "kvcompat.testkit"


@dataclasses.dataclass
class Resolved:
    """A fresh lock for the cell, and the key a result built from it carries."""

    lock: str
    key: str
    resolved_at: float  # epoch seconds of the online resolution


def in_cell_sources(repo: Path) -> list[Path]:
    """The harness code a cell runs: the in-cell package and the kvcompat modules it imports.

    Derived from the imports, so a module added to the testkit (or a new shared module it
    starts to import) counts at once, and harness-only edits never invalidate cached cells.
    """
    src = repo / "src"
    package = src / Path(*IN_CELL_PACKAGE.split("."))
    found = sorted(package.rglob("*.py")) if package.is_dir() else []
    shared: set[Path] = set()
    for path in found:
        st = path.stat()
        for name in _kvcompat_imports(path, st.st_mtime_ns, st.st_size):
            shared.add(src / Path(*name.split(".")).with_suffix(".py"))
    init = src / "kvcompat" / "__init__.py"
    return found + sorted(p for p in shared | {init} if p.is_file())


@functools.lru_cache(maxsize=512)
def _kvcompat_imports(path: Path, mtime_ns: int, size: int) -> tuple[str, ...]:  # noqa: ARG001 (cache key)
    """The shared kvcompat modules one in-cell file imports.  Parsing is most of an unchanged cell's
    cost, so it is kept per file version (path, mtime, size) for the life of the process."""
    names = []
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return tuple(n for n in names if n.startswith("kvcompat.") and not n.startswith(IN_CELL_PACKAGE))


def suite_hash(repo: Path, suite: str, extra: tuple[str, ...] = ()) -> str:
    """Hash of everything that runs inside a cell: the suite folder, the in-cell code, and ``extra`` files."""
    h = hashlib.sha256()
    suite_dir = repo / suite  # an absolute suite (tests' throwaway suites) stays absolute
    groups = [
        (suite_dir, sorted(suite_dir.rglob("*.py")) if suite_dir.is_dir() else []),
        (repo, in_cell_sources(repo) + [repo / p for p in extra]),
    ]
    for base, files in groups:
        for path in files:
            h.update(str(path.relative_to(base)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cell_suite_hash(cell: Cell, opts: RunOptions) -> str:
    # What the upstream suite runs is decided in the harness (which files, which models, what is deselected).
    extra: tuple[str, ...] = ("src/kvcompat/upstream.py",) if "upstream" in cell.suites else ()
    if "e2e" in cell.suites:  # the e2e suite's own folder runs in the cell too
        extra += tuple(str(p.relative_to(opts.repo)) for p in sorted((opts.repo / opts.e2e_suite).rglob("*.py")))
    return suite_hash(opts.repo, opts.suite, extra)


def cache_key(lock: str, suite: str, cell: Cell, python: str, opts: RunOptions) -> str:
    """Identity of a cell run: resolved lock, suite source, exact Python, NIXL, suites, a local wheel's
    bytes, and what selects or bounds the tests (pytest arguments, timeout, deployment shapes): a ``-k``
    subset that passed must never answer for the whole suite."""
    wheel = hashlib.sha256(cell.wheel.read_bytes()).hexdigest() if cell.wheel else None
    run = [list(opts.pytest_args), opts.timeout_s] + ([list(opts.shapes)] if opts.shapes else [])
    return hashlib.sha256(
        json.dumps([lock, suite, python, cell.nixl, list(cell.suites), wheel, run]).encode()
    ).hexdigest()[:16]


def interpreter(ctx: CellContext) -> str:
    """The exact Python version the cell runs on: its venv's, else the one uv would create it with."""
    cfg = ctx.venv / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version_info", "version"):  # uv writes the first, `python -m venv` the second
                return value.strip()
    return _python_uv_finds(ctx.cell.python)


@functools.lru_cache(maxsize=16)
def _python_uv_finds(request: str) -> str:
    """One ``uv python find`` per Python request and process (a pruned matrix asks it once per cell)."""
    proc = subprocess.run([index.uv_bin(), "python", "find", request, "--show-version"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else request


def companion_overrides(ctx: CellContext, *, offline: bool) -> list[str]:
    """For a cell that overrides torch: the torchvision and torchaudio releases built for that torch.

    Overriding torch alone leaves them at the versions vLLM pins for its own torch, and they
    then fail to load against the overridden one ("operator torchvision::nms does not exist"),
    taking ``import vllm`` down: a verdict on torchvision, not on the connector.  Overriding them
    by name alone does not help either, since uv's override of torch also replaces their own
    ``torch==`` pin.  So ask the resolver, in a query of their own, which releases' metadata
    accept the overridden torch, and override them to exactly those.  Where none does, that one
    is left alone: a mismatch then shows as the cell's import error and ABI verdict.
    """
    if not ctx.cell.torch_override:
        return []
    lines = []
    for name in TORCH_COMPANIONS:  # one query each: a companion with no match must not block the other
        res = index.resolve(
            [f"torch=={ctx.cell.torch}", name],
            python=ctx.cell.python,
            find_links=ctx.opts.find_links,
            index_url=ctx.opts.index_url,
            exclude_newer=ctx.cell.exclude_newer,
            cache_root=ctx.opts.repo if ctx.cell.exclude_newer else None,
            offline=offline,
        )
        if res.ok and res.pin(name):
            lines.append(f"{name}=={res.pin(name)}")
        elif not offline:
            ctx.say(f"no {name} release accepts torch {ctx.cell.torch}: left as vLLM pins it")
            ctx.files.append_log(res.error)
    return lines


def resolve_lock(ctx: CellContext, *, offline: bool) -> index.Resolution:
    return index.resolve(
        ctx.cell.requirements(),
        python=ctx.cell.python,
        constraints=constraints_for(ctx.cell.vllm, ctx.opts.repo / "constraints"),
        overrides=ctx.cell.override_lines() + companion_overrides(ctx, offline=offline),
        find_links=ctx.opts.find_links,
        index_url=ctx.opts.index_url,
        exclude_newer=ctx.cell.exclude_newer,
        # An as-released lock cannot change: cached, a warm run skips the resolve.
        cache_root=ctx.opts.repo if ctx.cell.exclude_newer else None,
        offline=offline,
    )


def listed_lock(ctx: CellContext) -> tuple[str, float] | None:
    """The lock the matrix listing resolved online for this very cell (kvcompat.cells._pinned_torch
    asks the index the cell's own question to learn its torch), and when, if that was within the
    lock TTL: the same freshness ``recent_lock`` trusts.  None for a cell that overrides torch (its
    question differs) or when the listing's answer is older."""
    cell, opts = ctx.cell, ctx.opts
    if cell.torch_override:
        return None
    found = index.answered(
        cell.requirements(),
        python=cell.python,
        cache_root=opts.repo,
        constraints=constraints_for(cell.vllm, opts.repo / "constraints"),
        overrides=cell.override_lines(),
        find_links=opts.find_links,
        index_url=opts.index_url,
        exclude_newer=cell.exclude_newer,
    )
    if found is None or time.time() - found[1] > opts.lock_ttl_s:
        return None
    return found


def resolve_inputs(ctx: CellContext) -> str:
    """Hash of everything ``resolve_lock`` is given, besides the index: the same inputs, asked within
    the lock TTL, give the same lock.  uv itself counts (a new uv may resolve differently), and a
    candidate wheel by its path, size and mtime (its bytes are in the cache key)."""
    cell, opts = ctx.cell, ctx.opts
    uv = index.uv_bin()
    st = os.stat(uv)
    wheel = [str(cell.wheel), cell.wheel.stat().st_size, cell.wheel.stat().st_mtime_ns] if cell.wheel else None
    constraints = [p.read_text() for p in constraints_for(cell.vllm, opts.repo / "constraints")]
    parts = [
        cell.requirements(),
        cell.override_lines(),
        constraints,
        cell.python,
        cell.exclude_newer,
        wheel,
        list(opts.find_links),
        opts.index_url,
        [uv, st.st_size, st.st_mtime_ns],
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def checked_recently(ctx: CellContext, cached: CellResult | None) -> bool:
    """Whether the cached result's lock was checked against the index within the lock TTL."""
    if cached is None or cached.cache_key is None or cached.resolved_at is None:
        return False
    return time.time() - cached.resolved_at <= ctx.opts.lock_ttl_s


def recent_lock(ctx: CellContext, cached: CellResult | None) -> str | None:
    """The lock as the index gave it within the TTL, without asking the index again: read back when
    the resolve's inputs are unchanged (no uv run at all), else re-derived offline from uv's cache.
    None when the last online check is older than the TTL, or the offline resolve cannot answer."""
    if not checked_recently(ctx, cached):
        return None
    files, inputs = ctx.files, resolve_inputs(ctx)
    stored, stored_inputs = _read(files.lock), _read(files.lock_inputs)
    if stored is not None and stored_inputs == inputs:
        return stored
    res = resolve_lock(ctx, offline=True)
    if not res.ok:
        return None
    if res.lock == stored:  # the stored lock is what these inputs give: the next run can read it back
        write_atomic(files.lock_inputs, inputs)
    return res.lock


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # never written (a run before lock.inputs existed) or removed: the lock is derived
        return None


def unchanged(ctx: CellContext, cached: CellResult | None) -> bool:
    """Fast path: the recent lock still gives the cached key."""
    if ctx.opts.force:
        return False
    lock = recent_lock(ctx, cached)
    suite = cell_suite_hash(ctx.cell, ctx.opts)
    return lock is not None and cache_key(lock, suite, ctx.cell, interpreter(ctx), ctx.opts) == cached.cache_key


def phase(ctx: CellContext, cached: CellResult | None) -> Resolved | CellResult:
    """Resolve online (one retry when the index could not be asked); end the run when unresolvable,
    when the index is unreachable, or when the fresh lock gives the cached result's key."""
    with ctx.timed("resolve"):
        res = None
        # The index was asked within the lock's TTL (the same freshness the unchanged-cell
        # path trusts): take that lock (~0.0-0.3 s, not ~4 s online).
        recent = recent_lock(ctx, cached)
        if recent is not None:
            res = index.Resolution(ok=True, lock=recent, pins=index.parse_lock(recent), error="", seconds=0.0)
            resolved_at = cached.resolved_at
            age = (time.time() - cached.resolved_at) / 60
            ctx.say(f"lock as the index gave it {age:.0f} min ago (within the lock TTL): not asked again")
        listed = listed_lock(ctx) if res is None else None
        if listed is not None:
            lock, resolved_at = listed
            res = index.Resolution(ok=True, lock=lock, pins=index.parse_lock(lock), error="", seconds=0.0)
            age = (time.time() - resolved_at) / 60
            ctx.say(
                f"lock as the index gave it to the matrix listing {age:.0f} min ago (within the lock TTL): not asked again"
            )
        if res is None:
            res = resolve_lock(ctx, offline=False)
            if not res.ok and not res.unsatisfiable:  # the index could not be asked: one retry, as for installs
                ctx.files.append_log(res.error)
                ctx.say("resolve failed without a verdict from the index; retrying")
                res = resolve_lock(ctx, offline=False)
            resolved_at = time.time()
        ctx.files.append_log(res.lock or res.error)
    if res.unsatisfiable:
        detail = explain_resolution(res.error, ctx.cell.vllm_requirement)
        hint = missing_pin_hint(
            res.error,
            ctx.cell,
            lambda name: index.list_versions(name, cache_root=ctx.opts.repo, index_url=ctx.opts.index_url),
        )
        return record.finish(ctx, Outcome.UNRESOLVABLE, hint or detail)
    if not res.ok:  # a network failure is not a verdict on the release
        return record.finish(ctx, Outcome.INSTALL_ERROR, "could not resolve: " + root_cause(res.error))
    write_atomic(ctx.files.lock, res.lock)
    write_atomic(ctx.files.lock_inputs, resolve_inputs(ctx))
    key = cache_key(res.lock, cell_suite_hash(ctx.cell, ctx.opts), ctx.cell, interpreter(ctx), ctx.opts)
    if cached is not None and cached.cache_key == key and not ctx.opts.force:
        cached.resolved_at = resolved_at  # the online check is fresh again
        write_result(ctx.opts.results_dir, cached)
        return record.reuse(ctx, cached)
    return Resolved(res.lock, key, resolved_at)


def explain_resolution(error: str, requirement: str) -> str:
    """One line from uv's resolver output: the first 'Because …' sentence, else its first line."""
    lines = [ln.strip(" ×╰─▶│").strip() for ln in error.splitlines()]
    lines = [ln.removeprefix("error: ").removeprefix("cause: ") for ln in lines if ln]
    for line in lines:
        if line.startswith("Because"):
            return line[:300]
    return lines[0][:300] if lines else f"{requirement} cannot be resolved"


def missing_pin_hint(error: str, cell: Cell, versions_of: Callable[[str], list[Version]]) -> str | None:
    """When uv says a pinned version does not exist: which pin, the nearest published versions, and
    the override line that tests the release anyway (None when the error is about something else)."""
    m = re.search(r"there is no version of ([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s,]+)", error)
    if not m:
        return None
    name, pinned = m.group(1), m.group(2)
    try:
        wanted, known = Version(pinned), [v for v in versions_of(name) if not v.is_prerelease]
    except (InvalidVersion, KvcompatError):
        return None
    below = [v for v in known if v < wanted][-1:]
    above = [v for v in known if v > wanted][:1]
    if not below and not above:
        return None
    nearest = ", ".join(str(v) for v in below + above)
    suggestion = (above or below)[0]
    return (
        f"{name}=={pinned}, which {cell.vllm_requirement} pins, is not on the index (nearest published: {nearest}); "
        f'to test this release anyway, add overrides = ["{name}=={suggestion}"] to its matrix entry'
    )[:400]


def root_cause(error: str) -> str:
    """uv's first error line with its innermost ``cause:``, e.g. "Failed to fetch: … (Connection refused)"."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    if not lines:
        return "uv pip compile failed without output"
    causes = [ln.removeprefix("cause:").strip() for ln in lines if ln.startswith("cause:")]
    first = lines[0].removeprefix("error:").strip()
    return (f"{first} ({causes[-1]})" if causes else first)[:300]
