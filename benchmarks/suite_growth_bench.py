"""Benchmark: what a set of new contracts costs a warm cell, measured side by side in one run.

    python benchmarks/suite_growth_bench.py --base REV [--cell vllm_0_34_0] [--rounds 2]
    python benchmarks/suite_growth_bench.py --base-shapes dense [--cell vllm_0_34_0] [--rounds 2]

Needs the cell's venv built (run `nox -s matrix -k CELL` once).  Per round, alternating:
  base  : the in-cell suite (tests/connectors, as the cell runs it) from git revision REV, with that
          revision's kvcompat, in the cell's venv (exported with `git archive`, nothing checked out)
          (--base-shapes SHAPES instead: today's suite with only those shapes, KVCOMPAT_SHAPES=SHAPES: what
          the other shapes cost, the contracts added beside them left out of the comparison)
  now   : the same suite from the working tree
  cell  : `nox -s matrix -k CELL -- --force` (resolve, install, ABI, both suites, result), wall time
Prints each time, the suite's ratio now / base, and the warm cell's ratio: its wall time now against
the same wall time with the base suite's run in place of today's (the cap is the growing issue's: 1.2, 1.5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SUITE_ARGS = ["tests/connectors", "-m", "not real_nixl and not gpu", "-p", "no:cacheprovider", "-q"]


def _venv(cell_expr: str) -> Path:
    from kvcompat import options
    from kvcompat.commands.matrix import matrix_cells
    from kvcompat.commands.mutants import select_cells

    values, _ = options.parse("matrix", [])

    (cell,) = select_cells(list(matrix_cells(REPO, values)), cell_expr)
    return REPO / ".kvcompat" / "venvs" / cell.id


def _export(rev: str, into: Path) -> Path:
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, "src", "tests"], cwd=REPO, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into / "base", filter="data")
    return into / "base"


def _suite(venv: Path, root: Path, shapes: str | None = None) -> tuple[float, str]:
    env = {"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    if shapes:
        env["KVCOMPAT_SHAPES"] = shapes
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(venv / "bin/python"), "-m", "pytest", *SUITE_ARGS],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"exit {proc.returncode}"
    return time.monotonic() - t0, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = ap.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="git revision whose suite is the baseline")
    base.add_argument("--base-shapes", help="the baseline is today's suite with only these shapes (KVCOMPAT_SHAPES)")
    ap.add_argument("--cell", default="vllm_0_34_0 and torch_2_14_0", help="nox -k expression of one cell")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    venv = _venv(args.cell)
    if not (venv / "bin/python").exists():
        print(f"error: no venv for {args.cell!r} ({venv}); run `nox -s matrix -k '{args.cell}'` first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base_root = _export(args.base, Path(tmp)) if args.base else REPO
        rows = []
        for r in range(1, args.rounds + 1):
            base_s, base_line = _suite(venv, base_root, args.base_shapes)
            now_s, now_line = _suite(venv, REPO)
            t0 = time.monotonic()
            subprocess.run(
                ["nox", "-s", "matrix", "-k", args.cell, "--", "--force"], cwd=REPO, capture_output=True, check=False
            )
            cell_s = time.monotonic() - t0
            rows.append((base_s, now_s, cell_s))
            print(f"round {r}: base suite {base_s:6.1f}s ({base_line})", flush=True)
            print(f"round {r}: now suite  {now_s:6.1f}s ({now_line})", flush=True)
            print(
                f"round {r}: warm cell  {cell_s:6.1f}s; suite now/base {now_s / base_s:.2f}x; "
                f"cell now/base {cell_s / (cell_s - now_s + base_s):.2f}x",
                flush=True,
            )
    base_m, now_m, cell_m = (statistics.median(c) for c in zip(*rows, strict=True))
    print(
        json.dumps(
            {
                "base_suite_s": round(base_m, 1),
                "now_suite_s": round(now_m, 1),
                "warm_cell_s": round(cell_m, 1),
                "suite_ratio": round(now_m / base_m, 2),
                "cell_ratio": round(cell_m / (cell_m - now_m + base_m), 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
