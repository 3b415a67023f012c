"""What the noxfile's non-matrix sessions do, as plain functions (testable without nox)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from packaging.version import Version

from kvcompat import bisection as bis
from kvcompat import index
from kvcompat.cells import Cell, resolve_cells
from kvcompat.matrix import Entry
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell

SITE = "lib/python3.11/site-packages"


def update_report(root: Path, dirs: list[Path]):
    """Rebuild reports/ from result folders, under a lock.

    Parallel cells (nox -j) each call this after writing their own result; the
    lock makes read-all-results-then-write atomic, so the last cell to finish
    always leaves a report that includes every finished cell.
    """
    import fcntl

    from kvcompat.report.model import build_report
    from kvcompat.report.write import write_reports

    out = root / "reports"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rep = build_report(dirs, previous=out / "compat.json")
        return rep, write_reports(rep, out)


def matrix_venv(root: Path, cell: Cell) -> Path:
    """The venv nox uses for this cell's matrix session, so bisect and matrix share it."""
    name = f"matrix({cell.nox_id})"
    try:
        from nox.sessions import _normalize_path  # nox's own naming, so the path matches exactly

        return Path(_normalize_path(str(root / ".nox"), name))
    except ImportError:  # pragma: no cover - nox missing or renamed
        return root / ".nox" / re.sub(r"[^\w-]+", "-", name).strip("-").lower()


def bisect_main(root: Path, argv: list[str], say: Callable[[str], None] = print) -> int:
    """``nox -s bisect -- …``: returns the exit status; bad input is one line and status 2."""
    try:
        args = bis.parse_args(argv)
        available = index.list_versions(args.dist, cache_root=root, wheelhouse=args.wheelhouse)
        versions = bis.releases_between(available, args.good, args.bad, pre=args.pre)
        return _bisect(root, args, versions, say)
    except (bis.BisectError, index.IndexError_) as exc:
        print(f"kvcompat: error: {exc}", file=sys.stderr)
        return 2


def _bisect(root: Path, args: bis.BisectArgs, versions: list[str], say: Callable[[str], None]) -> int:
    budget = bis.cell_budget(len(versions))
    say(f"bisecting {len(versions)} {args.dist} releases {versions[0]} .. {versions[-1]} for {args.test!r} "
        f"(torch {args.torch}); at most {budget} cells")
    opts = RunOptions(repo=root, results_dir=root / "results", force=args.force)
    wheels = dict((str(v), p) for v, p in index.wheels_in(args.wheelhouse, args.dist)) if args.wheelhouse else {}
    cells: dict[str, Cell] = {}

    def evaluate(version: str) -> bis.Step:
        spec = wheels.get(version) or Version(version)
        entry = Entry(vllm=spec, dist=args.dist, torch=(args.torch,))
        (cell,) = resolve_cells([entry], constraints_dir=root / "constraints", cache_root=root)
        cells[version] = cell
        result = run_cell(cell, matrix_venv(root, cell), opts, progress=lambda s: say("    " + s))
        return bis.verdict_for(result, args.test)

    res = bis.bisect(versions, evaluate, say=say, resume=args.command)
    changes = None
    try:
        old = connector_tree(root, cells[res.last_good])
        new = connector_tree(root, cells[res.first_bad])
        changes = bis.diff_trees(old, new)
    except RuntimeError as exc:
        say(f"(no source diff: {exc})")
    say(bis.render_answer(res, changes, args))
    return 0


def connector_tree(root: Path, cell: Cell) -> Path:
    """A site-packages-like tree holding the cell's vLLM connector sources.

    The cell's venv has them when it was installed; otherwise the wheel is
    downloaded once and just the connector folders are extracted.
    """
    site = matrix_venv(root, cell) / SITE
    if (site / "vllm" / "distributed" / "kv_transfer").is_dir():
        return site
    dest = root / ".kvcompat" / "sources" / f"{cell.dist}-{cell.vllm}"
    if dest.is_dir():
        return dest
    wheel = cell.wheel
    if wheel is None:
        dl = root / ".kvcompat" / "wheels"
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), cell.vllm_requirement],
                              capture_output=True, text=True)
        found = sorted(dl.glob(f"{cell.dist.replace('-', '_')}-{cell.vllm}-*.whl"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"could not download {cell.vllm_requirement}")
        wheel = found[0]
    tmp = dest.with_name(dest.name + ".tmp")
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(bis.CONNECTOR_DIRS):
                zf.extract(name, tmp)
    tmp.rename(dest)
    return dest
