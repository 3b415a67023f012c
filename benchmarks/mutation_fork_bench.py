"""Benchmark: our suite's mutation verdicts the usual way and forked, on the same mutants, side by side.

    python benchmarks/mutation_fork_bench.py [--cell "vllm_0_34_0 and torch_2_14_0"] [--target aggregator]
        [--target offload] [--sample 40] [--spread] [--jobs 16] [--transfer-wait 5]

Needs the cell run once (`nox -s matrix -k CELL`) and a previous `nox -s mutants --target GROUP` of each group.
Takes SAMPLE mutants of the groups, then scores them twice in one run, our suite only (the upstream column is
left out of both):
  usual : one pytest per mutant, the mutated file swapped on disk (nox -s mutants)
  fork  : one pytest per batch, the release imported once, JOBS forked children at a time (nox -s mutants --fork)
The sample is the first SAMPLE mutants that a test reaches (the costly ones: decided by the stored coverage map,
a mutant no test reaches is not run either way), or with --spread every k-th mutant of the whole catalogue
in file order, reached or not, as a whole run meets them.  Prints seconds a mutant for each (over the sample and
over the mutants that ran), the ratio, and every mutant whose verdict differs (goal: none, and the forked run at
most 2 s a mutant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _verdicts(path: Path) -> dict[str, tuple[str, str | None]]:
    data = json.loads(path.read_text())
    return {m["id"]: (m["status"], m.get("how")) for m in data["mutants"]}


def main() -> int:
    from kvcompat import options
    from kvcompat.commands import mutants as front
    from kvcompat.commands.matrix import matrix_cells
    from kvcompat.errors import one_line_errors
    from kvcompat.mutation import session as mutation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="vllm_0_34_0 and torch_2_14_0")
    ap.add_argument("--target", action="append", default=[], help="a group (repeatable; default aggregator, offload)")
    ap.add_argument("--sample", type=int, default=40, help="mutants a test reaches, taken in file order")
    ap.add_argument("--spread", action="store_true", help="every k-th mutant of the catalogue, reached or not")
    ap.add_argument("--jobs", type=int, default=16, help="forked children at a time (nox -s mutants --fork-jobs)")
    ap.add_argument(
        "--transfer-wait", type=float, default=None, help="KVCOMPAT_TRANSFER_WAIT_S for both (a quiet machine)"
    )
    args = ap.parse_args()
    if args.transfer_wait is not None:  # the suite's wall-time wait for other threads' work, both ways alike
        import os

        os.environ["KVCOMPAT_TRANSFER_WAIT_S"] = str(args.transfer_wait)
        print(f"KVCOMPAT_TRANSFER_WAIT_S={args.transfer_wait} for both", flush=True)
    groups = tuple(args.target or ("aggregator", "offload"))
    with one_line_errors():
        values, _ = options.parse("mutants", [])
        (cell,) = front.select_cells(list(matrix_cells(REPO, values)), args.cell)
        cell = dataclasses.replace(cell, suites=("ours",))  # our suite only, both ways
        with tempfile.TemporaryDirectory() as tmp:
            ids, reached = _sample(cell, values, groups, args.sample, Path(tmp), args.spread)
            what = "spread over the catalogue" if args.spread else "that a test reaches"
            print(
                f"sample: {len(ids)} mutants of {', '.join(groups)} {what}, {len(reached)} of them reached", flush=True
            )
            timed = {}
            for mode in ("usual", "fork"):
                out = Path(tmp) / mode
                mo = dataclasses.replace(
                    front.options_for(REPO, values),
                    results_dir=out,
                    targets=groups,
                    only=tuple(ids),
                    fork=mode == "fork",
                    fork_jobs=args.jobs,
                )
                t0 = time.monotonic()
                runs = mutation.run_targets(cell, mo, progress=lambda line: None)
                seconds = time.monotonic() - t0
                mutants_s = sum(r.timing.get("mutants_s", 0.0) for r in runs if r.timing)
                verdicts: dict = {}
                for f in out.glob("mutants-*.json"):
                    if ".coverage-" not in f.name:
                        verdicts.update(_verdicts(f))
                timed[mode] = (seconds, mutants_s, {i: verdicts.get(i) for i in ids})
                print(
                    f"{mode:5}: {mutants_s / len(ids):5.2f} s a mutant, {mutants_s / max(1, len(reached)):5.2f} s a "
                    f"reached one ({mutants_s:.0f} s for the mutants, {seconds:.0f} s in all with the baseline)",
                    flush=True,
                )
    (_, usual_s, usual), (_, fork_s, fork) = timed["usual"], timed["fork"]
    differ = [i for i in ids if (usual[i] or ("?",))[0] != (fork[i] or ("?",))[0]]
    print(f"fork / usual: {fork_s / usual_s:.2f}x; verdicts identical on {len(ids) - len(differ)} of {len(ids)}")
    for i in differ:
        print(f"  differs: {i}: usual {usual[i]}, fork {fork[i]}")
    return 1 if differ else 0


def _sample(cell, values, groups: tuple[str, ...], n: int, tmp: Path, spread: bool) -> tuple[list[str], set[str]]:
    """``n`` mutants of ``groups`` as a previous `nox -s mutants --target GROUP` recorded them in results/ (run
    one first if there is none), and which of them a test reaches: the first ``n`` reached ones, or with
    ``spread`` every k-th of the whole catalogue.  The coverage maps are copied beside both runs' results, so
    neither measures coverage again."""
    import shutil

    pool, reached = [], set()
    for group in groups:
        for f in (REPO / "results").glob(f"mutants-{cell.id}.coverage-{group}.json"):
            for mode in ("usual", "fork"):
                (tmp / mode).mkdir(parents=True, exist_ok=True)
                shutil.copy(f, tmp / mode / f.name)
        path = (
            REPO / "results" / (f"mutants-{cell.id}.json" if group == "multi" else f"mutants-{cell.id}--{group}.json")
        )
        if group == "multi" and not path.exists():  # MultiConnector's generated mutants, as the release spells them
            ids = _generated_multi_ids(cell)
            pool += ids
            reached.update(ids)
            continue
        if not path.exists():
            raise SystemExit(f"error: no {path.name}; run `nox -s mutants -- -k '{cell.id}' --target {group}` first")
        for m in json.loads(path.read_text())["mutants"]:
            if m["status"] not in ("killed", "survived") or (m.get("detail") or "").startswith("the same program as"):
                continue
            if m.get("how") != "unreached":
                reached.add(m["id"])
            if spread or m["id"] in reached:
                pool.append(m["id"])
    ids = pool[:: max(1, len(pool) // n)][:n] if spread else pool[:n]
    return ids, reached & set(ids)


def _generated_multi_ids(cell) -> list[str]:
    from kvcompat.mutation import generate as gen

    site = next((REPO / ".kvcompat" / "venvs" / cell.id).glob("lib/python3*/site-packages"))
    source = (site / "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py").read_text()
    reasons = gen.load_reasons(REPO / "tests" / "mutants" / "equivalent.toml")
    return [m.id for m in gen.mutants_for(source, cell.vllm, reasons) if not m.equivalent and not m.same_as]


if __name__ == "__main__":
    sys.exit(main())
