"""Survivors of a mutation run, per method: reached (its tests ran and passed), not reached, killed.

    python3 docs/evidence/survivors_by_method.py results/mutants-<cell>--<group>.json [--top 20] [--unexplained]

Reads the run's results file (written by `nox -s mutants -- --target GROUP`) and prints one line per method
with survivors, most survivors first: where contracts are missing, or where the code serves a configuration
the pair's suite does not run (the report's per-file list names every survivor and its line).  "explained":
of the survivors, those whose cause tests/mutants/equivalent-<group>.toml writes down, read from that file as it is
now (an entry written after the run counts; one that calls a survivor equivalent takes it out); --unexplained
lists only the methods that still have survivors nobody has explained.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
from kvcompat.mutation.generate import load_reasons  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--unexplained", action="store_true", help="only methods with survivors not yet explained")
    args = ap.parse_args()
    if not args.results.is_file():
        print(f"error: {args.results} is not a file; give a results/mutants-*.json of a mutation run", file=sys.stderr)
        return 2
    run = json.loads(args.results.read_text())
    reasons = load_reasons(REPO / "tests" / "mutants" / f"equivalent-{run.get('group')}.toml")
    release = run["cell"]["vllm"]
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for m in run["mutants"]:
        status = "equivalent" if reasons.reason_for(m["id"], release) else m["status"]
        kind = "not reached" if status == "survived" and m.get("how") == "unreached" else status
        counts[(Path(m.get("file") or "?").name, m["contract"])][kind] += 1
        explained = status == "survived" and bool(reasons.explanation_for(m["id"], release))
        counts[(Path(m.get("file") or "?").name, m["contract"])]["explained"] += explained
    rows = [(k, c) for k, c in counts.items() if c["survived"] or c["not reached"]]
    if args.unexplained:
        rows = [(k, c) for k, c in rows if c["survived"] + c["not reached"] > c["explained"]]
    rows.sort(key=lambda kc: -(kc[1]["survived"] + kc[1]["not reached"]))
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    print(f"{run['id']} --target {run.get('group')}: " + ", ".join(f"{n} {k}" for k, n in sorted(total.items())))
    print("| file | method | survived (reached) | not reached | explained | killed |")
    print("|---|---|---|---|---|---|")
    for (file, method), c in rows[: args.top]:
        print(f"| `{file}` | `{method}` | {c['survived']} | {c['not reached']} | {c['explained']} | {c['killed']} |")
    if len(rows) > args.top:
        print(f"({len(rows) - args.top} more methods with survivors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
