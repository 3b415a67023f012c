"""The mutants a deployment shape's contracts are for: those whose [[explained]] reason names the shape.

    python3 docs/evidence/shape_mutants.py .kvcompat/venvs/<cell> --target nixl [--shape hybrid] [--ids]
    python3 docs/evidence/shape_mutants.py .kvcompat/venvs/<cell> --target nixl --score results/mutants-<cell>--nixl.json \
        --at 1efdd45
    python3 docs/evidence/shape_mutants.py .kvcompat/venvs/<cell> --target nixl --at 1efdd45 --from-catalogue --markdown

``--at REV`` reads the explanations as they stood at a git revision (the catalogue before the shapes' rerun removed
the entries of the mutants it killed), so the same mutants are scored after the catalogue has moved on.

Generates the group's catalogue from the cell's own files (kvcompat.mutation.operators, as `nox -s mutants` does)
and reads tests/mutants/equivalent-<group>.toml: a mutant belongs to a shape when the reason that explained it as a
survivor ("a configuration the suite never sets up") names the shape's configuration (hybrid/HMA/Mamba/sliding
window, heterogeneous TP, MLA, drafts, a replaced prefill).  ``--ids`` prints them space-separated, for
``nox -s mutants -- --mutant "..."``; ``--score`` reads a mutation run's results and prints, per shape, how many of
those mutants it killed and, of the survivors, how many the catalogue now explains as out of scope (a
configuration still not built), as reached but not observable, as a gap (a contract still to write), and which
are unexplained.  ``--from-catalogue`` scores the same without a run's results: once prune_explained.py has taken a
run's killed ids out of the catalogue, an id it no longer explains for the release was killed.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
from kvcompat.mutation import generate as gen  # noqa: E402
from kvcompat.mutation import operators  # noqa: E402
from kvcompat.mutation import targets as tg  # noqa: E402

# What an explanation says when the configuration it needs is one of the shapes (kvcompat.shapes families).
SHAPE_WORDS = {
    "hybrid": r"mamba|\bssm\b|hybrid|\bHMA\b|sliding[- ]window|several KV-cache groups|multi-group|\bGDN\b",
    "hetero-tp": r"heterogeneous TP|hetero(geneous)?[- ]tp|tp_ratio|\bP TP\b|\bD TP\b|different TP|TP sizes",
    "mla": r"\bMLA\b",
    "drafts": r"draft|speculative|spec[- ]decod|\bEAGLE\b|\bMTP\b|lookahead",
    "restarted-prefill": r"replac(ed|ement)|restart|new engine|_cleanup_remote_engine|engine_ttl|re-handshake",
}


def shapes_of(reason: str) -> list[str]:
    return [s for s, words in SHAPE_WORDS.items() if re.search(words, reason, re.I)]


def catalogue(venv: Path, group: str, reasons: gen.Reasons, release: str) -> dict[str, list[str]]:
    """Mutant id -> the shapes its explanation names, for the explained mutants of ``group`` in this release."""
    site = next(venv.glob("lib/python3*/site-packages"))
    out: dict[str, list[str]] = {}
    for f in tg.resolve(site, group).files:
        for m in operators.generate((site / f.path).read_text(), f):
            why = reasons.explanation_for(m.id, release)
            if why and (named := shapes_of(why)):
                out[m.id] = named
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("venv", type=Path)
    ap.add_argument("--target", required=True, help="a mutation group: nixl, offload or scheduler")
    ap.add_argument("--shape", action="append", default=[], help="only this shape (repeatable)")
    ap.add_argument("--ids", action="store_true", help="print the ids, space-separated")
    ap.add_argument("--score", type=Path, help="a mutation run's results (results/mutants-<cell>--<group>.json)")
    ap.add_argument(
        "--from-catalogue",
        action="store_true",
        help="score from the catalogue alone, no run's results: a mutant it no longer explains for the release was "
        "killed (prune_explained.py takes killed ids out), one it explains survives as its reason says",
    )
    ap.add_argument("--markdown", action="store_true", help="with --score: table rows for docs/mutation.md")
    ap.add_argument("--at", metavar="REV", help="read the explanations as they stood at this git revision")
    args = ap.parse_args()
    meta = next(args.venv.glob("lib/python3*/site-packages/vllm-*.dist-info/METADATA"), None)
    if meta is None:
        print(f"error: {args.venv} has no vllm installed; give a cell's venv", file=sys.stderr)
        return 2
    release = next(ln.split(":", 1)[1].strip() for ln in meta.read_text().splitlines() if ln.startswith("Version:"))
    toml = REPO / "tests" / "mutants" / f"equivalent-{args.target}.toml"
    reasons = gen.load_reasons(toml)
    then = reasons
    if args.at:
        rel = toml.relative_to(REPO).as_posix()
        old = subprocess.run(["git", "-C", str(REPO), "show", f"{args.at}:{rel}"], capture_output=True, text=True)
        if old.returncode:
            print(f"error: {rel} is not in git revision {args.at!r}; give a commit of this repository", file=sys.stderr)
            return 2
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(old.stdout)
            f.flush()
            then = gen.load_reasons(Path(f.name))
    named = {i: s for i, s in catalogue(args.venv, args.target, then, release).items()}
    if args.shape:
        named = {i: s for i, s in named.items() if set(s) & set(args.shape)}
    if args.ids:
        print(" ".join(sorted(named)))
        return 0
    if args.from_catalogue:
        # an id the catalogue now calls equivalent is no mutant to kill (not in the total); one it no longer explains
        # was killed (prune_explained.py takes killed ids out)
        status = {
            i: "equivalent"
            if reasons.reason_for(i, release) is not None
            else ("killed" if reasons.explanation_for(i, release) is None else "survived")
            for i in named
        }
    elif args.score is None:
        counts = collections.Counter(s for ss in named.values() for s in ss)
        print(f"{release} {args.target}: {len(named)} explained mutants name a shape: {dict(counts)}")
        return 0
    else:
        run = json.loads(args.score.read_text())
        status = {m["id"]: m["status"] for m in run["mutants"]}
    rows = collections.defaultdict(collections.Counter)
    left = collections.defaultdict(list)
    for i, shapes in named.items():
        verdict = status.get(i, "not scored")
        if verdict == "survived":
            verdict = kind_of(reasons.explanation_for(i, release))
        for s in [*shapes, "all"]:
            rows[s][verdict] += 1
            if verdict == "unexplained":
                left[s].append(i)
    for s in [*SHAPE_WORDS, "all"]:
        if s not in rows:
            continue
        c = rows[s]
        total = sum(n for k, n in c.items() if k != "equivalent")
        if args.markdown:
            cols = " | ".join(str(c[k]) for k in KINDS)
            print(
                f"| {release} | {args.target} | {s} | {total} | {c['killed']} ({100 * c['killed'] / total:.0f} %) | {cols} |"
            )
        else:
            print(
                f"{release} {args.target} {s}: {total} mutants, {c['killed']} killed ({100 * c['killed'] / total:.0f} %), "
                + ", ".join(f"{n} {k}" for k, n in c.items() if k != "killed")
            )
        if s != "all":
            for i in left[s]:
                print(f"    unexplained survivor: {i}")
    return 0


# How a survivor's current explanation classes it (tests/mutants/equivalent-*.toml's reason prefixes).
KINDS = ("out of scope", "not observable", "gap", "unexplained")


def kind_of(reason: str | None) -> str:
    if not reason:
        return "unexplained"
    if reason.startswith("gap"):
        return "gap"
    if reason.startswith("out of scope"):
        return "out of scope"
    return "not observable"


if __name__ == "__main__":
    sys.exit(main())
