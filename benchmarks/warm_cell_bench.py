"""Benchmark: a warm cell against its floor, and what each removed warm-path cost saves, in one run.

    python benchmarks/warm_cell_bench.py [--cell vllm_0_33_0] [--rounds 2]

Needs the cell's venv built (run `nox -s matrix -k CELL` once).  Per round, side by side:
  floor   : a fresh interpreter importing vLLM's scheduler and connector modules (time inside
            the process), plus the tests' bodies once vLLM is imported: every test's duration in
            the warm cell's own results but the largest (the test that pays for the import)
  warm    : `nox -s matrix -k CELL -- --force`, wall time (resolve, install, ABI, pytest, result)
  removed : each cost taken off the warm path, measured now against the way it was:
            pytest with/without --kvcompat-cell-process, the lock resolved online vs re-derived
            offline, the ABI verdict scanned vs read
Prints the ratio warm / floor (goal <= 1.3x) per round and the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# The modules a cell cannot avoid importing, under each release's name for them (see
# ../shared/notes/vllm-api-drift.md): the first of each group that the release has.
FLOOR_PROBE = r"""
import gc, importlib, importlib.util, sys, time
if sys.argv[1:] == ["nogc"]:
    gc.disable()
groups = [
    ["vllm.v1.core.sched.scheduler"],
    ["vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"],
    ["vllm.distributed.kv_transfer.kv_connector.v1.nixl", "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector"],
    ["vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
     "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"],
]
t0 = time.perf_counter()
for group in groups:
    for name in group:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name)
            break
print("FLOOR_IMPORT", time.perf_counter() - t0)
"""


def sh(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return time.monotonic() - t0, proc


def cell_files(cell_id: str):
    """The cell's working files where `nox -s matrix` keeps them (its lock, its bytecode)."""
    from kvcompat.run.cellfiles import CellFiles

    return CellFiles(REPO / ".kvcompat" / "cells" / cell_id, REPO / "results", cell_id)


def cell_env(cell_id: str) -> dict[str, str]:
    """The environment a cell's processes run in, its bytecode folder included.

    Without it the floor's interpreter would recompile vLLM and torch from source (~12 s, with
    PYTHONDONTWRITEBYTECODE set as on this machine) while the cell reads its cached bytecode: a
    floor slower than the cell, and a ratio below 1 that measures nothing.
    """
    from kvcompat.run import process

    return process.cell_environ({"PYTHONPYCACHEPREFIX": str(cell_files(cell_id).bytecode)})


def floor_import(python: Path, env: dict[str, str], *, gc: bool = True) -> float:
    _, proc = sh([str(python), "-c", FLOOR_PROBE, *([] if gc else ["nogc"])], cwd=REPO, env=env)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FLOOR_IMPORT"))
    return float(line.split()[1])


def warm_cell(tag: str) -> float:
    wall, proc = sh([sys.executable, "-m", "nox", "-s", "matrix", "-k", tag, "--", "--force"], cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"warm cell failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def cell_paths(tag: str) -> tuple[str, Path, Path]:
    """The cell the warm run of ``tag`` just wrote: its id, its venv's python, its result."""
    version = tag.removeprefix("vllm_").replace("_", ".")
    results = sorted((REPO / "results").glob(f"vllm-{version}__*.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        sys.exit(f"no result for {tag}: run `nox -s matrix -k {tag}` first")
    cell_id = results[-1].stem
    return cell_id, REPO / ".kvcompat" / "venvs" / cell_id / "bin" / "python", results[-1]


def test_bodies(result: Path) -> tuple[float, float, str]:
    tests = json.loads(result.read_text())["tests"]
    payer = max(tests, key=lambda t: t["duration"])
    return sum(t["duration"] for t in tests) - payer["duration"], payer["duration"], payer["nodeid"]


def pytest_with_and_without(python: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall time of the cell's pytest command as the runner gives it, with and without the cell-process mode."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for extra in (["--kvcompat-cell-process"], []):
            cmd = [str(python), "-m", "pytest", "tests/connectors", "-p", "kvcompat.testkit.pytest_plugin",
                   f"--kvcompat-json={tmp}/o.json", "-p", "no:cacheprovider", "-q",
                   "-m", "not real_nixl and not gpu", *extra]  # fmt: skip
            wall, proc = sh(cmd, cwd=REPO, env=env)
            if proc.returncode != 0:
                sys.exit(f"pytest failed:\n{proc.stdout[-2000:]}")
            times.append(wall)
    return times[0], times[1]


def resolve_online_vs_offline(cell_id: str, python: Path) -> tuple[float, float]:
    """vLLM's requirement resolved as a cell does, asking the index and from uv's cache."""
    from kvcompat import index

    reqs = [ln for ln in cell_files(cell_id).lock.read_text().splitlines() if ln.startswith("vllm==")]
    out = []
    for offline in (False, True):
        t0 = time.monotonic()
        res = index.resolve(reqs, python=str(python), offline=offline)
        out.append(time.monotonic() - t0)
        if not res.ok:
            sys.exit(f"resolve failed: {res.error[:500]}")
    return out[0], out[1]


def abi_scan(python: Path) -> float:
    from kvcompat import abi

    site = next(python.parent.parent.glob("lib/python*/site-packages"))
    torch = next(p.name.split("-")[1] for p in site.glob("torch-*.dist-info"))
    t0 = time.monotonic()
    abi.check(site, torch, REPO / ".kvcompat" / "cache" / "abi")  # torch's exports cached, as in a cell
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="vllm_0_33_0", help="a cell tag as `nox -s matrix -k` takes it")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    warm_cell(args.cell)  # builds the venv if needed, and makes the lock check current before measuring
    cell_id, python, result = cell_paths(args.cell)
    env = cell_env(cell_id)
    print(f"warm cell {cell_id}: {args.rounds} rounds, each the floor and the warm cell side by side")
    ratios: list[float] = []
    strict_ratios: list[float] = []
    for r in range(1, args.rounds + 1):
        imp = floor_import(python, env)
        imp_nogc = floor_import(python, env, gc=False)
        wall = warm_cell(args.cell)
        bodies, payer, name = test_bodies(result)
        phases = json.loads(result.read_text())["phases"]
        floor, strict = imp + bodies, imp_nogc + bodies
        ratios.append(wall / floor)
        strict_ratios.append(wall / strict)
        print(
            f"round {r}: floor {floor:.1f}s = import {imp:.1f}s + test bodies {bodies:.1f}s "
            f"(the import payer {name.split('::')[-1]}: {payer:.1f}s left out); warm cell {wall:.1f}s "
            f"(phases {phases}); warm / floor = {wall / floor:.2f}x; against the import with automatic gc off "
            f"as in a cell ({imp_nogc:.1f}s): {wall / strict:.2f}x"
        )
    print(f"\nwarm / floor, median of {len(ratios)}: {statistics.median(ratios):.2f}x   (goal <= 1.3x)")
    print(f"warm / floor with the floor's import gc-free like the cell's: {statistics.median(strict_ratios):.2f}x")

    print("\n== each cost removed from the warm path, measured now against the old way ==")
    fast, slow = pytest_with_and_without(python, env)
    print(f"pytest: {slow:.1f}s as before -> {fast:.1f}s with --kvcompat-cell-process (gc per test + os._exit): "
          f"saves {slow - fast:.1f}s")  # fmt: skip
    online, offline = resolve_online_vs_offline(cell_id, python)
    print(f"resolve: {online:.1f}s online -> {offline:.1f}s re-derived offline within the lock TTL: "
          f"saves {online - offline:.1f}s")  # fmt: skip
    scan = abi_scan(python)
    print(f"ABI: {scan:.1f}s scanning the extensions -> {phases.get('abi', 0):.1f}s reading the cached verdict: "
          f"saves {scan - phases.get('abi', 0):.1f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
