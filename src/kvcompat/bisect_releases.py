"""The releases a bisect walks: ``nox -s bisect -- --test T --good V1 --bad V2`` (:func:`kvcompat.bisection.run`).

The releases between V1 and V2 (index or wheelhouse), in packaging order.  With ``--find-fix --bad OLD
--good NEW`` the ends swap places: OLD fails, NEW passes, and the search finds the first good release
after the bad one.  Each release is a normal matrix cell (same venv, same result cache), so a cell the
matrix already ran costs only its resolve.  The answer lists the connector sources changed between
the two wheels and the GitHub compare URL.
"""

from __future__ import annotations

import difflib
import zipfile
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvcompat import bisection as bis
from kvcompat import index
from kvcompat.cells import Cell
from kvcompat.matrix import Entry
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.options import RunOptions


def releases_between(available: list[Version], good: str, bad: str, *, pre: bool, find_fix: bool = False) -> list[str]:
    """The releases from ``good`` to ``bad`` (with ``find_fix``: ``bad`` to ``good``) inclusive, in packaging order."""
    known = {str(v) for v in available}
    for flag, value in (("--good", good), ("--bad", bad)):
        try:
            Version(value)
        except InvalidVersion:
            raise bis.BisectError(f"{flag} {value!r} is not a version; give a release such as 0.26.0") from None
        if value not in known:
            raise bis.BisectError(
                f"{flag} {value} is not a known release; nearest on the index: "
                f"{index.nearest_versions(available, Version(value))}"
            )
    if find_fix:
        lo, hi = Version(bad), Version(good)
        if lo >= hi:
            raise bis.BisectError(
                f"with --find-fix, --bad {bad} must be older than --good {good} (the fix comes after the break); "
                "swap them, or drop --find-fix to find where the test broke"
            )
    else:
        lo, hi = Version(good), Version(bad)
        if lo >= hi:
            raise bis.BisectError(
                f"--good {good} must be older than --bad {bad}; swap them to find where the test broke, "
                "or add --find-fix to find the release that fixed it"
            )
    out = [v for v in sorted(available) if lo <= v <= hi and (pre or not v.is_prerelease or v in (lo, hi))]
    return [str(v) for v in out]


class Releases:
    """The bisect's handler for releases (see :class:`kvcompat.bisection.Handler`)."""

    noun = "release"
    check_older = False  # the good end is the search's first candidate, taken on the user's word till then

    def __init__(self, root: Path, values: Namespace, items: list[str], cells: bis.Cells, say: Callable[[str], None]):
        self.root, self.values, self.items, self.cells, self.say = root, values, items, cells, say
        self.env = values.env or ("today" if values.wheelhouse else "as-released")
        self.wheels = (
            {str(v): p for v, p in index.wheels_in(values.wheelhouse, values.dist)} if values.wheelhouse else {}
        )
        self.ran: dict[str, Cell] = {}

    def header(self) -> str:
        v = self.values
        return f"({self.env}, torch {v.torch}) {len(self.items)} {v.dist} releases {self.items[0]} .. {self.items[-1]}"

    def name(self, item: str) -> str:
        return item

    full = name

    def evaluate(self, version: str) -> bis.Step:
        v = self.values
        entry = Entry(vllm=self.wheels.get(version) or Version(version), dist=v.dist, torch=(v.torch,), env=(self.env,))
        cell, result = self.cells.run(entry, self.cells.opts, lambda s: self.say("    " + s))
        reused = shared_with_earlier_steps(self.cells.opts, cell, list(self.ran.values()))
        if reused:
            self.say("    " + reused)
        self.ran[version] = cell
        return bis.verdict_for(result, v.test)

    def resume(self, good: str, bad: str) -> str:
        from kvcompat.options import command_line

        return command_line("bisect", {**vars(self.values), "good": good, "bad": bad})

    def changes(self, older: str, newer: str) -> tuple[str, list[bis.FileChange]] | None:
        try:
            old, new = (
                connector_tree(self.root, self.ran[v], self.values.index_url, self.cells.venv) for v in (older, newer)
            )
        except RuntimeError as exc:
            self.say(f"(no source diff: {exc})")
            return None
        return f"{older} and {newer}", diff_trees(old, new)

    def link(self, older: str, newer: str) -> str:
        return f"compare: {compare_url(older, newer)}"


def handler(root: Path, values: Namespace, cells: bis.Cells, say: Callable[[str], None]) -> Releases:
    """``nox -s bisect -- --test T --good V1 --bad V2``: the releases between them (bad input raises, one line)."""
    bis.check_test(values.test, root)  # before the index is asked or a cell runs
    available = index.list_versions(
        values.dist, cache_root=root, index_url=values.index_url, wheelhouse=values.wheelhouse
    )
    find_fix = bool(getattr(values, "find_fix", False))
    versions = releases_between(available, values.good, values.bad, pre=values.pre, find_fix=find_fix)
    return Releases(root, values, versions, cells, say)


def shared_with_earlier_steps(opts: RunOptions, cell: Cell, earlier: list[Cell]) -> str | None:
    """What a bisect step had from the steps before it: the pins its lock shares with theirs.

    uv keeps every wheel it unpacked in its cache and hardlinks it into each venv, so a
    shared pin (torch and its CUDA libraries above all) is neither downloaded nor stored again.
    """
    from kvcompat.index import parse_lock
    from kvcompat.run.cellfiles import CellFiles

    def pins(c: Cell) -> dict[str, str]:
        lock = CellFiles(opts.work_root / c.id, opts.results_dir, c.id).lock
        return parse_lock(lock.read_text()) if lock.is_file() else {}

    mine = pins(cell)
    if not mine or not earlier:
        return None
    seen: dict[str, str] = {}
    torch_from = None
    for other in earlier:
        theirs = pins(other)
        if torch_from is None and "torch" in mine and theirs.get("torch") == mine["torch"]:
            torch_from = other.vllm
        seen.update({n: v for n, v in theirs.items() if mine.get(n) == v})
    torch = ""
    if "torch" in mine:
        torch = f"; torch {mine['torch']} " + (f"as in {torch_from}'s cell" if torch_from else "is new to this bisect")
    how = (
        "hardlinked from uv's cache unless --disk-budget evicted them"
        if opts.disk_budget_gb is not None
        else "hardlinked from uv's cache, not downloaded again"
    )
    return f"reuse: {len(seen)} of {len(mine)} pins were installed by earlier steps ({how}){torch}"


# -- what changed between the two wheels -------------------------------------------------


def connector_tree(root: Path, cell: Cell, index_url: str, venv: Callable[[Cell], Path]) -> Path:
    """A site-packages-like tree holding the cell's vLLM connector sources.

    The cell's venv has them when it was installed; otherwise the release's wheel is
    fetched once from the same index uv resolves against, and just the connector
    folders are extracted.
    """
    site = CellFiles.site_packages(venv(cell))
    if site is not None and (site / "vllm" / "distributed" / "kv_transfer").is_dir():
        return site
    dest = root / ".kvcompat" / "sources" / f"{cell.dist}-{cell.vllm}"
    if dest.is_dir():
        return dest
    wheel = cell.wheel or index.download_wheel(cell.dist, cell.vllm, root / ".kvcompat" / "wheels", index_url)
    tmp = dest.with_name(dest.name + ".tmp")
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(bis.CONNECTOR_DIRS):
                zf.extract(name, tmp)
    tmp.rename(dest)
    return dest


def diff_trees(old_root: Path, new_root: Path, prefixes: tuple[str, ...] = bis.CONNECTOR_DIRS) -> list[bis.FileChange]:
    """+/- line counts per changed .py file under ``prefixes`` between two site-packages trees."""

    def files(root: Path) -> dict[str, Path]:
        out = {}
        for prefix in prefixes:
            base = root / prefix
            for p in base.rglob("*.py") if base.is_dir() else []:
                out[str(p.relative_to(root))] = p
        return out

    old, new = files(old_root), files(new_root)
    changes = []
    for path in sorted(old.keys() | new.keys()):
        a = old[path].read_text(errors="replace").splitlines() if path in old else []
        b = new[path].read_text(errors="replace").splitlines() if path in new else []
        if a == b:
            continue
        added = removed = 0
        for line in difflib.unified_diff(a, b, lineterm="", n=0):
            if line.startswith("+") and not line.startswith("+++"):
                added += 1
            elif line.startswith("-") and not line.startswith("---"):
                removed += 1
        status = "added" if path not in old else "removed" if path not in new else "modified"
        changes.append(bis.FileChange(path, added, removed, status))
    return changes


def compare_url(older: str, newer: str) -> str:
    return f"https://github.com/vllm-project/vllm/compare/v{older}...v{newer}"
