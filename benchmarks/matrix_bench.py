"""Benchmark: the naive way vs `nox -s matrix` (cold, warm, unchanged), side by side in one run.

    python benchmarks/matrix_bench.py [--releases 0.33.0 0.32.0 0.31.0] [--skip-naive]

Per release, on the same machine and in one run:
  naive     : fresh `python -m venv` + `pip install vllm==X pytest` (no pip cache) + pytest tests/connectors
  cold      : `nox -s matrix` on a fresh copy of the project with an empty uv cache
  warm      : the same again with `--force` (venvs and uv cache reused, tests rerun)
  unchanged : the same again without `--force` (answered from the result cache)
It prints wall times and ratios, bytes received from the network against the
floor (the sum of the unique wheels the cells need, sizes from the index), and
the extra disk a cell costs when it shares torch with one already built.

Byte counts are read from /proc/net/dev for the whole machine: run it when
nothing else downloads.  Needs about 25 GB free disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from packaging.tags import sys_tags  # noqa: E402
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename  # noqa: E402

from kvcompat.index import parse_lock  # noqa: E402


def rx_bytes() -> int:
    """Bytes received on real interfaces (not loopback, not ifb: those mirror eth0's ingress for shaping)."""
    total = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() != "lo" and not name.strip().startswith("ifb"):
            total += int(data.split()[0])
    return total


def du(*paths: Path) -> int:
    """Bytes on disk under ``paths`` together (hardlinked files counted once)."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = subprocess.run(["du", "-s", "-B1", "-c", *existing], capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(cmd: list[str], *, cwd: Path, env: dict | None = None, log: Path) -> float:
    t0 = time.monotonic()
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=fh, stderr=subprocess.STDOUT)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        print(f"  ! {' '.join(cmd[:4])}… exited {proc.returncode} (see {log})")
    return dt


def make_project(dest: Path, releases: list[str]) -> Path:
    """A copy of the project whose default matrix is ``releases`` (fresh venvs, results, reports)."""
    ignore = shutil.ignore_patterns(".nox", ".kvcompat", "results", "reports", ".git", "__pycache__")
    shutil.copytree(REPO, dest, ignore=ignore)
    entries = ", ".join(f'{{ vllm = "{v}" }}' for v in releases)
    (dest / "bench.toml").write_text(f"[matrix]\nbench = [{entries}]\n")
    return dest


def naive(releases: list[str], work: Path, log: Path) -> dict[str, float]:
    times = {}
    # The user's environment as it is (on this machine PYTHONDONTWRITEBYTECODE=1, but pip
    # compiles every module at install time, so the naive pytest imports from .pyc files).
    env = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO / "src"),
    }
    for v in releases:
        venv = work / f"naive-{v}"
        t_install = run([sys.executable, "-m", "venv", str(venv)], cwd=work, log=log)
        t_install += run([str(venv / "bin/pip"), "install", "-q", f"vllm=={v}", "pytest"], cwd=work, env=env, log=log)
        # the same selection a CPU cell runs (no real-NIXL, no GPU-only tests)
        t_test = run(
            [
                str(venv / "bin/python"),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "not real_nixl and not gpu",
                str(REPO / "tests/connectors"),
            ],
            cwd=REPO,
            env=env,
            log=log,
        )
        times[v] = t_install + t_test
        print(f"  naive {v}: {times[v]:.0f}s (venv + pip install {t_install:.0f}s, pytest {t_test:.0f}s)")
        shutil.rmtree(venv)
    return times


def nox_cells(
    project: Path, releases: list[str], env: dict, log: Path, *extra: str, disk: list | None = None
) -> dict[str, float]:
    times = {}
    for v in releases:  # one at a time, to time each cell and measure disk between them
        tag = "vllm_" + v.replace(".", "_")
        times[v] = run(
            [sys.executable, "-m", "nox", "-s", "matrix", "-k", tag, "--", *extra], cwd=project, env=env, log=log
        )
        if disk is not None:
            disk.append((v, du(Path(env["UV_CACHE_DIR"]), project / ".kvcompat" / "venvs")))
    return times


def wheel_sizes(locks: list[Path]) -> dict[tuple[str, str], int]:
    """Size on the index of each unique wheel (name and version) the locks name, from the index's JSON API."""
    pins: set[tuple[str, str]] = set()
    for lock in locks:
        pins.update(parse_lock(lock.read_text()).items())
    tags = {str(t): i for i, t in enumerate(sys_tags())}
    sizes = {}
    for name, version in sorted(pins):
        req = urllib.request.Request(
            f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
        best = None
        for f in files:
            if not f["filename"].endswith(".whl"):
                continue
            try:
                n, ver, _, ftags = parse_wheel_filename(f["filename"])
            except InvalidWheelFilename:  # ancient uploads with non-standard names
                continue
            if canonicalize_name(n) != name or str(ver) != version:
                continue
            rank = min((tags[str(t)] for t in ftags if str(t) in tags), default=None)
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, f["size"])
        sizes[(name, version)] = best[1] if best else 0
    return sizes


def installed_sizes(venv: Path) -> dict[tuple[str, str], int]:
    """Unpacked size of each distribution in ``venv``, from its RECORD (what the uv cache holds for it)."""
    sizes = {}
    for record in venv.glob("lib/python*/site-packages/*.dist-info/RECORD"):
        name, _, version = record.parent.name.removesuffix(".dist-info").rpartition("-")
        site = record.parent.parent
        total = 0
        for line in record.read_text().splitlines():
            path = site / line.split(",", 1)[0]
            if path.is_file():
                total += path.stat().st_size
        sizes[(canonicalize_name(name), version)] = total
    return sizes


def new_package_floor(project: Path, releases: list[str]) -> list[tuple[str, int, int, bool]]:
    """Per release, in run order: (release, unpacked bytes of the distributions no earlier cell
    has, the vllm wheel's unpacked size, whether it shares torch with an earlier cell)."""
    seen: set[tuple[str, str]] = set()
    torches: set[str] = set()
    rows = []
    for v in releases:
        venv = next((project / ".kvcompat" / "venvs").glob(f"vllm-{v}__*"))
        sizes = installed_sizes(venv)
        new = {k: n for k, n in sizes.items() if k not in seen}
        torch = next((ver for (name, ver) in sizes if name == "torch"), "?")
        rows.append((v, sum(new.values()), sizes.get(("vllm", v), 0), torch in torches))
        seen |= set(sizes)
        torches.add(torch)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--releases", nargs="+", default=["0.33.0", "0.32.0", "0.31.0"])
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcompat-bench-", dir=args.workdir))
    log = work / "bench.log"
    print(f"benchmark of {args.releases}; logs in {log}")
    project = make_project(work / "project", args.releases)
    env = {"UV_CACHE_DIR": str(work / "uv-cache"), "KVCOMPAT_MATRIX": "bench.toml:bench"}

    results: dict[str, dict[str, float]] = {}
    net: dict[str, int] = {}
    if not args.skip_naive:
        print("naive: venv + pip install + pytest, per release")
        rx = rx_bytes()
        results["naive"] = naive(args.releases, work, log)
        net["naive"] = rx_bytes() - rx
        print(f"  naive received {gib(net['naive'])}")

    print("nox cold: empty uv cache, fresh venvs")
    disk: list[tuple[str, int]] = []
    rx = rx_bytes()
    results["cold"] = nox_cells(project, args.releases, env, log, disk=disk)
    net["cold"] = rx_bytes() - rx
    print(f"  cold: {results['cold']}  ({gib(net['cold'])} received)")
    print("nox warm: venvs and cache reused, tests rerun (--force)")
    results["warm"] = nox_cells(project, args.releases, env, log, "--force")
    print(f"  warm: {results['warm']}")
    print("nox unchanged: same lock and suite, answered from the result cache")
    results["unchanged"] = nox_cells(project, args.releases, env, log)
    print(f"  unchanged: {results['unchanged']}")

    statuses = {p.stem: json.loads(p.read_text())["outcome"] for p in (project / "results").glob("*.json")}
    wheels = wheel_sizes(sorted((project / ".kvcompat" / "cells").glob("*/lock.txt")))
    floor, nwheels = sum(wheels.values()), len(wheels)
    unpacked = new_package_floor(project, args.releases)

    print("\n== wall time per cell (s) ==")
    modes = list(results)
    print("release   " + "".join(f"{m:>11}" for m in modes))
    for v in args.releases:
        print(f"{v:<10}" + "".join(f"{results[m][v]:>11.1f}" for m in modes))
    tot = {m: sum(results[m].values()) for m in modes}
    print("total     " + "".join(f"{tot[m]:>11.1f}" for m in modes))
    print("\n== ratios (same releases, same run) ==")
    if "naive" in tot:
        print(f"naive / cold      = {tot['naive'] / tot['cold']:.1f}x")
        print(f"naive / warm      = {tot['naive'] / tot['warm']:.1f}x   (goal >= 5x)")
        print(f"naive / unchanged = {tot['naive'] / tot['unchanged']:.0f}x")
    print(f"cold / warm       = {tot['cold'] / tot['warm']:.1f}x")
    print(f"unchanged per cell = {tot['unchanged'] / len(args.releases):.2f}s   (goal < 2 s)")
    print("\n== bytes from the network ==")
    print(f"floor: {nwheels} unique wheels, {gib(floor)} (sum of their sizes on the index)")
    for m, b in net.items():
        print(f"{m:<6}: {gib(b)}  = {b / floor:.2f}x the floor")
    print("\n== disk (uv cache + venvs, hardlinks counted once) ==")
    print("A cell's venv hardlinks into uv's cache, so a cell costs the unpacked size of the distributions")
    print("no earlier cell has (its floor), plus what the harness adds (bytecode Python caches on first import).")
    prev = 0
    for (v, used), (_, floor_new, vllm_size, shares) in zip(disk, unpacked, strict=True):
        delta = used - prev
        print(
            f"after {v}: {gib(used)}  (+{gib(delta)}; new distributions unpacked {gib(floor_new)}, of which vllm "
            f"{gib(vllm_size)} (its wheel: {gib(wheels.get(('vllm', v), 0))}); harness overhead {gib(delta - floor_new)})"
            f"{'  <- shares torch' if shares else ''}"
        )
        prev = used
    print(f"\ncell outcomes: {statuses}")
    shutil.rmtree(work / "uv-cache", ignore_errors=True)
    shutil.rmtree(project / ".kvcompat" / "venvs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
