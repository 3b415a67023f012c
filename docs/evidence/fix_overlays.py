"""Known vLLM bugs fixed by hand in a copy of a cell's venv: each fix must turn its bug's contracts green.

A contract red on every release could be red for the test's own reasons.  For such a known bug
(src/kvcompat/known-bugs.toml) this applies the smallest change to the release's code that removes the
bug, runs the contracts the entry names (they must now pass) and contracts of the same path that pass on the
release as shipped (they must still pass: the fix may not simply turn the feature off), then restores the file:

    python3 docs/evidence/fix_overlays.py .kvcompat/venvs/<cell>   [--only NAME]

The copy is hard-linked and files are swapped in it as planted_regressions.py swaps them, so the cell's own
venv never changes.  Exit status 1 if a fix left a named contract red or turned a kept contract red.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planted_regressions import NIXL, _swap, venv_copy  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Fix:
    bug: str  # the known-bugs.toml entry
    edits: tuple[tuple[str, str, str], ...]  # (file under site-packages, the release's snippet, its replacement)
    green: tuple[str, ...]  # test ids (relative to tests/connectors) the fix must turn green
    kept: tuple[str, ...]  # test ids that pass as shipped and must still pass with the fix
    why: str


FIXES = (
    Fix(
        "nixl-late-decode-reads-released-kv",
        (
            # P exports its lease's deadline with the blocks, as D already does for a turn-2 readback ...
            (
                f"{NIXL}/pull_scheduler.py",
                "            if is_d_node:\n"
                "                # D blocks expiry time exported for the turn-2 readback.\n"
                "                blocks_expiry_time = self._reqs_need_send[request.request_id]\n",
                "            blocks_expiry_time = self._reqs_need_send[request.request_id]\n",
            ),
            # ... and D declines any read past the deadline, not only a bidirectional turn-2 one.
            (
                f"{NIXL}/pull_worker.py",
                "        if self._bidirectional_kv_xfer_enabled and self._is_turn2_read_expired(meta):\n",
                "        if self._is_turn2_read_expired(meta):\n",
            ),
        ),
        (
            "test_nixl_peers.py::test_a_decode_arriving_after_the_prefills_lease_never_decodes_over_blocks_the_prefill_gave_away",
        ),
        ("test_multi_worker.py::test_decode_reads_exactly_the_kv_the_prefill_side_computed",),
        "The release already declines a read past its deadline (pull_worker.py 0.34.0 L127-136, L160-171), but only "
        "for a turn-2 readback of D's blocks: P's kv_transfer_params carry no deadline (pull_scheduler.py 0.34.0 "
        "L253, L270-272 set it for a D node only), and the check runs only with bidirectional transfer on (L160). "
        "A real fix must also move the deadline with the heartbeats that extend P's lease (base_worker.py L3449-3470). "
        "(test_nixl_worker_edges.py's late read, which needs D to read after the lease, has no scenario under it: "
        "D declines, as it should.)",
    ),
)


def _outcomes(venv: Path, repo: Path, tests: tuple[str, ...]) -> dict[str, str]:
    cmd = [str(venv / "bin/python"), "-m", "pytest", *(f"tests/connectors/{t}" for t in tests)]
    cmd += ["-p", "no:cacheprovider", "-q", "--tb=line", "-rA"]
    env = dict(os.environ, PYTHONPATH=str(repo / "src"))
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900).stdout
    got = {}
    for t in tests:
        # -rA: one "PASSED|FAILED|ERROR|SKIPPED <id>[param]" line per test run; every parametrization must pass
        seen = {
            ln.split()[0].lower()
            for ln in out.splitlines()
            if f"tests/connectors/{t}" in ln and ln.split()[0].isupper()
        }
        got[t] = "passed" if seen == {"passed"} else ("/".join(sorted(seen)) or "not run")
    return got


def run(venv: Path, fix: Fix, repo: Path) -> tuple[bool, str]:
    site = next(venv.glob("lib/python3*/site-packages"))
    pristine: dict[Path, str] = {}
    try:
        for file, target, replacement in fix.edits:
            path = site / file
            text = path.read_text()
            pristine.setdefault(path, text)
            if text.count(target) != 1:
                return False, f"its snippet is not found once in {file} (this release's code differs): not applied"
            fixed = text.replace(target, replacement)
            compile(fixed, file, "exec")
            _swap(path, fixed)
        got = _outcomes(venv, repo, fix.green + fix.kept)
    finally:
        for path, text in pristine.items():
            _swap(path, text)
    still_red = [t for t in fix.green if got[t] != "passed"]
    broken = [t for t in fix.kept if got[t] != "passed"]
    line = ", ".join(f"{t.split('::')[1][:60]}: {o}" for t, o in got.items())
    return not still_red and not broken, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("venv", type=Path, help="a cell's venv, e.g. .kvcompat/venvs/<cell>")
    ap.add_argument("--only", action="append", default=[], help="a known bug's id (repeatable)")
    args = ap.parse_args()
    if not (args.venv / "bin/python").exists():
        print(f"error: {args.venv} is not a cell venv (no bin/python); run the cell first", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    failed = 0
    with venv_copy(args.venv, "kvcompat-fix-") as venv:
        for fix in FIXES:
            if args.only and fix.bug not in args.only:
                continue
            ok, line = run(venv, fix, repo)
            failed += not ok
            print(f"{'GREEN ' if ok else 'STILL RED '} {fix.bug}: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
