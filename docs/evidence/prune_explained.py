"""Keep tests/mutants/equivalent-<group>.toml true after a mutation run: killed ids leave, new explanations enter.

    python3 docs/evidence/prune_explained.py --target nixl results/mutants-<cell-0.34.0>--nixl.json \\
        results/mutants-<cell-0.33.0>--nixl.json [--add reexplained.toml]

An [[explained]] entry says why a mutant survives; once a run kills the mutant the explanation is stale.  For
each run given (its release read from the results), the killed ids leave every entry that applies to that
release; an entry shared by several releases is split where the releases now differ, and an entry left
without ids goes.  ``--add`` puts new [[explained]] entries first in the file (the first matching entry is
the one a run reads) and takes their ids out of the older entries of the same releases.  Entries written as
regular expressions are left for a person, and named.  The file's comments and layout are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def blocks(text: str) -> list[str]:
    """The file cut before every table header: the preamble, then one string per entry."""
    return re.split(r"(?m)^(?=\[\[(?:explained|equivalent)\]\]\s*$)", text)


def _with(block: str, ids: list[str], releases: list[str]) -> str:
    block = re.sub(r"(?m)^ids = \[.*\]$", lambda _m: "ids = " + json.dumps(ids), block, count=1)
    return re.sub(r"(?m)^releases = .*$", lambda _m: "releases = " + json.dumps(releases), block, count=1)


def prune(text: str, drop: dict[str, set[str]]) -> tuple[str, int, list[str]]:
    """``drop``: release -> ids whose explanation for that release is to go."""
    out, removed, left = [], 0, []
    for b in blocks(text):
        if not b.startswith("[[explained]]"):
            out.append(b)
            continue
        e = tomllib.loads(b)["explained"][0]
        releases, ids = _listed(e.get("releases", "*")), _listed(e["ids"])
        mine = [r for r in releases if r in drop]
        if e.get("regex"):
            if any(re.fullmatch(p, k) for r in mine for p in ids for k in drop[r]):
                left.append(f"regex entry {ids[0]!r} ({', '.join(mine)}): some of its mutants left; read it again")
            out.append(b)
            continue
        if not mine:
            out.append(b)
            continue
        by_keep: dict[tuple[str, ...], list[str]] = {}
        for r in releases:
            keep = tuple(i for i in ids if i not in drop.get(r, ()))
            removed += len(ids) - len(keep)
            by_keep.setdefault(keep, []).append(r)
        for keep, rels in by_keep.items():
            if keep:
                out.append(_with(b, list(keep), rels) if (list(keep), rels) != (ids, releases) else b)
    return "".join(out), removed, left


def _listed(value: str | list[str]) -> list[str]:
    """An entry's ``ids`` or ``releases``: one string or a list of them."""
    return [value] if isinstance(value, str) else list(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+", help="results/mutants-<cell>--<group>.json, one per release")
    ap.add_argument("--target", required=True, help="the mutation group: nixl, offload, scheduler")
    ap.add_argument("--add", type=Path, help="new [[explained]] entries to put first")
    args = ap.parse_args()
    drop: dict[str, set[str]] = {}
    for path in args.results:
        if not path.is_file():
            print(f"error: {path} does not exist; give a mutation run's results file", file=sys.stderr)
            return 2
        run = json.loads(path.read_text())
        killed = {m["id"] for m in run["mutants"] if m["status"] == "killed"}
        drop.setdefault(str(run["cell"]["vllm"]), set()).update(killed)
    new, added = "", []
    if args.add:
        try:
            new = args.add.read_text().strip() + "\n\n"
            added = tomllib.loads(new).get("explained", [])
        except (OSError, tomllib.TOMLDecodeError) as exc:
            print(f"error: --add {args.add}: {exc}; give a TOML file of [[explained]] entries", file=sys.stderr)
            return 2
        for e in added:
            for r in _listed(e["releases"]):
                drop.setdefault(r, set()).update(_listed(e["ids"]))
    path = REPO / "tests" / "mutants" / f"equivalent-{args.target}.toml"
    text, removed, left = prune(path.read_text(), drop)
    if new:
        parts = blocks(text)
        text = parts[0] + new + "".join(parts[1:])
    tomllib.loads(text)
    path.write_text(text)
    print(f"{path.relative_to(REPO)}: {removed} (release, id) explanations removed; {len(added)} entries added")
    for line in left:
        print(f"  left for a person: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
