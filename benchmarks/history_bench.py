"""Benchmark: the history matrix warm at -j 2, unchanged, and the naive loop, side by side in one run.

    python benchmarks/history_bench.py [--naive-sample 0.33.0] [--skip-naive]

In this project, in one run:
  warm      : `KVCOMPAT_MATRIX=history nox -s matrix -j 2 -- --force --prune` (every cell reruns its
              suite; uv's cache holds the wheels, so a pruned venv is reinstalled by hardlinks)
  unchanged : the same without --force (every cell answered from its result)
  naive     : fresh `python -m venv` + `pip install vllm==X` (no cache) + pytest, for the sampled
              release(s); the naive loop over the whole history is their mean times the cell count
Prints the ratios naive / warm (goal >= 8x) and the unchanged wall time (goal < 3 s).
Needs uv's cache to hold the history's wheels (a cold history run first) and ~20 GB free
for the naive venv (skipped, and said so, with less).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix_bench import naive  # noqa: E402

# A naive cell (pip, no cache) filled 13 GiB of a 16 GiB-free disk before it was stopped.
NAIVE_GB = 20


def nox_history(*extra: str, log: Path) -> float:
    env = {**os.environ, "KVCOMPAT_MATRIX": "history"}
    t0 = time.monotonic()
    with log.open("a") as fh:
        subprocess.run([sys.executable, "-m", "nox", "-s", "matrix", *extra], cwd=REPO, env=env, stdout=fh, stderr=fh)
    return time.monotonic() - t0


def history_ids() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json"],
        cwd=REPO,
        env={**os.environ, "KVCOMPAT_MATRIX": "history"},
        capture_output=True,
        text=True,
    ).stdout
    return [s["session"] for s in json.loads(out) if s["session"].startswith("matrix(")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--naive-sample", nargs="+", default=["0.33.0"])
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcompat-history-bench-"))
    log = work / "bench.log"
    cells = len(history_ids())
    print(f"history matrix: {cells} cells; logs in {log}", flush=True)

    warm = nox_history("-j", "2", "--", "--force", "--prune", log=log)
    print(f"warm -j 2 (--force --prune): {warm:.0f}s, {warm / cells:.1f}s a cell", flush=True)
    unchanged = nox_history("--", "--prune", log=log)
    print(f"unchanged: {unchanged:.1f}s for {cells} cells ({unchanged / cells:.2f}s a cell; goal < 3 s)", flush=True)
    outcomes: dict[str, int] = {}
    for p in (REPO / "results").glob("*.json"):
        o = json.loads(p.read_text()).get("outcome", "?")
        outcomes[o] = outcomes.get(o, 0) + 1
    print(f"outcomes in results/: {outcomes}")

    free = shutil.disk_usage(work).free / 2**30
    if not args.skip_naive and free < NAIVE_GB:
        print(f"naive: skipped, {free:.0f} GiB free and a naive venv needs about {NAIVE_GB} (pip, no cache)")
    elif not args.skip_naive:
        per = naive(args.naive_sample, work, log)
        mean = sum(per.values()) / len(per)
        loop = mean * cells
        print(
            f"naive loop estimate: {mean:.0f}s a cell (mean of {', '.join(per)}) x {cells} cells = {loop:.0f}s; "
            f"naive / warm = {loop / warm:.1f}x   (goal >= 8x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
