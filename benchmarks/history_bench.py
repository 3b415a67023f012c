"""Benchmark: the history matrix and a bisect over it, cold, warm and unchanged, against the naive loop, in one run.

    python benchmarks/history_bench.py [--naive-sample 0.33.0] [--skip-naive] [--workdir DIR]

In one run, on fresh copies of the project (its own results/ and venvs) and fresh uv caches:
  naive        : `python -m venv` + `pip install vllm==X pytest` (no cache) + pytest, for the sampled
                 release(s); the naive loop over the history is their mean times the cell count
  bisect cold  : `nox -s bisect -- --find-fix --bad 0.13.0 --good 0.33.0 --test <reset test> --env today`
                 on an empty uv cache; cells run and each step's wall time, against ceil(log2 N)+1
  bisect warm  : the same with --force (venvs and cache kept, every step's suite rerun)
  history cold : `KVCOMPAT_MATRIX=history nox -l`, then `nox -s matrix -j 2 -- --prune`, on an empty uv
                 cache: bytes received (the listing's too) against the unique-wheel floor, peak disk
                 against the unique unpacked floor
  history warm : the same with --force (every cell reruns its suite; venvs reinstalled by hardlinks)
  unchanged    : the same without --force (every cell answered from its result)

Byte counts come from /proc/net/dev for the whole machine and disk from statvfs of the work
folder's filesystem: run it when nothing else downloads or writes.  Needs about 72 GiB free (--disk-budget 64 on every run);
every cache and venv it made is deleted at the end (results and logs stay in the work folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix_bench import gib, naive, rx_bytes, wheel_sizes  # noqa: E402

from kvcompat.index import parse_lock  # noqa: E402  (matrix_bench put src/ on the path)

NEEDS_GIB = 72
PHASES = ["naive", "bisect", "cold", "warm", "unchanged"]
# uv's cache for the whole history is ~57 GiB unpacked (+2.3 GiB of bytecode): the budget is a bound
# that fits it, so no ratio counts re-downloads of what it evicted.
BUDGET_GIB = "64"
BISECT = ["--find-fix", "--bad", "0.13.0", "--good", "0.33.0", "--test", "test_reset_cache_goes_to_both_children"]


class DiskPeak:
    """The most bytes used on a filesystem while it runs, above what was used when it started."""

    def __init__(self, path: Path) -> None:
        self.path, self.base, self.peak = path, shutil.disk_usage(path).used, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)


def copy_project(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".nox", ".kvcompat", "results", "reports", ".git", "__pycache__")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def nox(project: Path, args: list[str], env: dict, log: Path) -> tuple[float, str]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "nox", *args], cwd=project, env={**os.environ, **env}, capture_output=True, text=True
    )
    with log.open("a") as fh:
        fh.write(f"\n$ nox {' '.join(args)}  (rc {proc.returncode})\n{proc.stdout}{proc.stderr}")
    return time.monotonic() - t0, proc.stdout + proc.stderr


class UnpackedFloor:
    """The unpacked size of each distribution uv's cache held at any moment of a run, by name and
    version, from its RECORD: the floor of a cache + hardlinked venvs.  Watched while the run goes,
    so entries that --disk-budget evicted still count."""

    def __init__(self, cache: Path) -> None:
        self.cache, self.sizes, self._seen = cache, {}, set()

    def scan(self) -> None:
        for record in self.cache.glob("archive-v0/*/*.dist-info/RECORD"):
            if record in self._seen:
                continue
            try:
                rows = record.read_text().splitlines()
            except OSError:  # evicted, or still being written
                continue
            self._seen.add(record)
            name, _, version = record.parent.name.removesuffix(".dist-info").rpartition("-")
            total = sum(int(f[2]) for f in (r.rsplit(",", 2) for r in rows) if len(f) == 3 and f[2].isdigit())
            self.sizes.setdefault((re.sub(r"[-_.]+", "-", name).lower(), version), total)

    def _watch(self) -> None:
        while not self._stop.wait(15.0):
            self.scan()

    def __enter__(self) -> UnpackedFloor:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()

    def of(self, locks: list[Path]) -> tuple[int, int]:
        """(count, bytes) of the distributions the locks name, each once."""
        wanted: set[tuple[str, str]] = set()
        for lock in locks:
            wanted.update(parse_lock(lock.read_text()).items())
        found = [n for key, n in self.sizes.items() if key in wanted]
        return len(found), sum(found)


def bisect_steps(output: str) -> list[str]:
    return [ln.strip() for ln in output.splitlines() if re.search(r"\[\d+/≤\d+\]", ln)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--naive-sample", nargs="+", default=["0.33.0"])
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--phases", nargs="+", default=PHASES, choices=PHASES, help="a subset, e.g. --phases cold")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcompat-history-bench-", dir=args.workdir))
    free = shutil.disk_usage(work).free / 2**30
    if free < NEEDS_GIB:
        print(
            f"error: {free:.0f} GiB free under {work}; this benchmark needs about {NEEDS_GIB} (free some, or --workdir)"
        )
        return 2
    log = work / "bench.log"
    print(f"logs in {log}", flush=True)
    out: dict[str, object] = {}
    # The cells' own disk check (15 GiB by default) would stop the cold history near its peak on a
    # 2x-sized disk; the benchmark measures that peak instead.
    base_env = {"KVCOMPAT_MIN_FREE_GB": "5", "PYTHONDONTWRITEBYTECODE": "1"}

    if "naive" in args.phases and not args.skip_naive:
        rx = rx_bytes()
        per = naive(args.naive_sample, work, log)
        out["naive_per_cell"] = sum(per.values()) / len(per)
        print(f"naive: {out['naive_per_cell']:.0f}s a cell, {gib(rx_bytes() - rx)} received", flush=True)

    # -- bisect, cold then warm, on a cache of its own
    if "bisect" in args.phases:
        project = copy_project(work / "bisect-project")
        env = {**base_env, "UV_CACHE_DIR": str(work / "uv-bisect")}
        bisect_runs = {}
        for mode, extra in (("cold", []), ("warm", ["--force"])):
            rx = rx_bytes()
            cmd = ["-s", "bisect", "--", *BISECT, "--env", "today", "--disk-budget", BUDGET_GIB, *extra]
            secs, text = nox(project, cmd, env, log)
            steps = bisect_steps(text)
            answer = next((ln.strip() for ln in text.splitlines() if "first good:" in ln), "?")
            bisect_runs[mode] = {"seconds": secs, "steps": steps, "received": rx_bytes() - rx, "answer": answer}
            print(f"bisect {mode}: {len(steps)} cells in {secs:.0f}s, {gib(rx_bytes() - rx)} received", flush=True)
            for ln in steps:
                print("   ", ln)
        versions = re.search(r"bisecting \(\w+\) (\d+) vllm releases", text)
        n = int(versions.group(1)) if versions else 0
        out["bisect"] = {"releases": n, "bound": math.ceil(math.log2(n)) + 1 if n > 1 else 1, **bisect_runs}
        shutil.rmtree(work / "uv-bisect")
        shutil.rmtree(project / ".kvcompat" / "venvs", ignore_errors=True)

    # -- the history matrix: cold, warm, unchanged, on another empty cache
    project = copy_project(work / "history-project")
    cache = work / "uv-history"
    env = {**base_env, "UV_CACHE_DIR": str(cache), "KVCOMPAT_MATRIX": "history"}
    # Listing the matrix is part of a cold run (it resolves each cell to learn its torch): timed and
    # counted with the cold phase.
    rx = rx_bytes()
    list_secs, listed = nox(project, ["-l", "--json"], env, log)
    listing = {"seconds": list_secs, "received": rx_bytes() - rx}
    cells = len([s for s in json.loads(listed) if s["session"].startswith("matrix(")])
    runs = {}
    budget = ["--prune", "--disk-budget", BUDGET_GIB]
    floor = UnpackedFloor(cache)
    for mode, extra in (
        ("cold", ["-j", "2", "--", *budget]),
        ("warm", ["-j", "2", "--", "--force", *budget]),
        ("unchanged", ["--", *budget]),
    ):
        if mode not in args.phases:
            continue
        rx = rx_bytes()
        with DiskPeak(work) as disk, floor:
            secs, _ = nox(project, ["-s", "matrix", *extra], env, log)
        runs[mode] = {"seconds": secs, "received": rx_bytes() - rx, "peak_disk": disk.peak}
        if mode == "cold":
            runs[mode] = {**runs[mode], "listing": listing}
            runs[mode]["seconds"] += listing["seconds"]
            runs[mode]["received"] += listing["received"]
        print(
            f"history {mode}: {secs:.1f}s for {cells} cells, {gib(runs[mode]['received'])} received, peak disk +{gib(disk.peak)}",
            flush=True,
        )
    locks = sorted((project / ".kvcompat" / "cells").glob("*/lock.txt"))
    wheels = wheel_sizes(locks)
    n_unpacked, unpacked = floor.of(locks)
    bytecode = sum(p.stat().st_size for p in (project / ".kvcompat" / "cells").glob("*/bytecode/**/*") if p.is_file())
    outcomes: dict[str, int] = {}
    for p in (project / "results").glob("*.json"):
        o = json.loads(p.read_text()).get("outcome", "?")
        outcomes[o] = outcomes.get(o, 0) + 1
    out["history"] = {
        "cells": cells,
        **runs,
        "wheel_floor": sum(wheels.values()),
        "wheels": len(wheels),
        "unpacked_floor": unpacked,
        "unpacked": n_unpacked,
        "bytecode": bytecode,
        "outcomes": outcomes,
    }
    shutil.rmtree(cache)
    (work / "summary.json").write_text(json.dumps(out, indent=2))

    h = out["history"]
    print(
        f"\n== one run, {time.strftime('%Y-%m-%d %H:%M')} ({os.cpu_count()} cores), phases {' '.join(args.phases)} =="
    )
    print(f"history: {cells} cells; outcomes {outcomes}")
    if "naive_per_cell" in out:
        loop = out["naive_per_cell"] * cells
        print(
            f"naive loop: {out['naive_per_cell']:.0f}s a cell ({', '.join(args.naive_sample)}) x {cells} = {loop:.0f}s"
        )
        for mode in ("warm", "cold"):
            if mode in runs:
                goal = "   (goal >= 8x)" if mode == "warm" else ""
                print(f"naive / history {mode} -j 2 = {loop / runs[mode]['seconds']:.1f}x{goal}")
    if "warm" in runs:
        r = runs["warm"]
        print(
            f"history warm -j 2: {r['seconds']:.0f}s ({r['seconds'] / cells:.1f}s a cell), {gib(r['received'])} received"
        )
    if "unchanged" in runs:
        print(f"history unchanged: {runs['unchanged']['seconds']:.2f}s   (goal < 3 s)")
    if "cold" in runs:
        r = runs["cold"]
        print(
            f"history cold {r['seconds']:.0f}s, received {gib(r['received'])} = {r['received'] / h['wheel_floor']:.3f}x "
            f"the floor ({h['wheels']} unique wheels, {gib(h['wheel_floor'])} on the index)   (goal <= 1.1x)"
        )
        print(
            f"    of which listing the matrix (one resolve a cell): {r['listing']['seconds']:.0f}s, "
            f"{gib(r['listing']['received'])}"
        )
        print(
            f"history cold peak disk +{gib(r['peak_disk'])} = {r['peak_disk'] / unpacked:.3f}x the floor "
            f"({n_unpacked} unique distributions unpacked, {gib(unpacked)})   (goal <= 1.15x); "
            f"bytecode kept: {gib(bytecode)}"
        )
    b = out.get("bisect", {})
    for mode in ("cold", "warm"):
        if mode in b:
            r = b[mode]
            print(
                f"bisect {mode}: {len(r['steps'])} cells for {b['releases']} releases (bound ceil(log2 N)+1 = "
                f"{b['bound']}) in {r['seconds']:.0f}s; {r['answer']}"
            )
    print(f"summary: {work / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
