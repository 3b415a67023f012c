"""The per-shape survivor table of docs/mutation.md, read from the catalogue alone.

    python3 docs/evidence/shape_table.py 0.34.0 .kvcompat/venvs/<cell>

A mutant of the shape set (the ids whose explanation at 1efdd45 named a shape: shape_mutants.py --ids --at 1efdd45)
that tests/mutants/equivalent-<group>.toml still explains for the release is a survivor of the kind its reason starts
with; one it no longer explains was killed (prune_explained.py takes a killed id out).  So the table needs no
mutation record, only the catalogue kept true by prune_explained.py after each run.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = ("hybrid", "hetero-tp", "mla", "drafts", "restarted-prefill", None)


def kind(reason: str) -> str:
    r = reason.lower()
    if r.startswith("gap"):
        return "gap"
    if r.startswith("explained (reached"):
        return "reached"
    if r.startswith("out of scope"):
        return "out"
    return "other"


def main() -> int:
    release, venv = sys.argv[1], sys.argv[2]
    print("| release | group | shape | mutants | killed | out of scope | reached, not observable | gap | unexplained |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g in ("nixl", "offload", "scheduler"):
        data = tomllib.loads((REPO / f"tests/mutants/equivalent-{g}.toml").read_text())
        entries = [e for e in data.get("explained", []) if release in e.get("releases", [])]

        def explain(i: str, entries: list = entries) -> str:
            for e in entries:
                if any(re.fullmatch(r, i) for r in e["ids"]) if e.get("regex") else i in e["ids"]:
                    return kind(e["reason"])
            return "killed"

        for shape in SHAPES:
            cmd = [sys.executable, str(REPO / "docs/evidence/shape_mutants.py"), venv, "--target", g, "--ids"]
            cmd += ["--at", "1efdd45"] + (["--shape", shape] if shape else [])
            ids = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
            if not ids:
                continue
            c = collections.Counter(explain(i) for i in ids)
            n = len(ids)
            print(
                f"| {release} | {g} | {shape or '**all**'} | {n} | {c['killed']} ({round(100 * c['killed'] / n)} %) "
                f"| {c['out']} | {c['reached']} | {c['gap']} | {c['other']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
