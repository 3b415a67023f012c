"""Build a candidate vLLM wheel from a release's wheel, as a maintainer's PR build would be, for `kvcompat qualify`.

    python docs/evidence/make_candidate_wheel.py 0.34.0 0.34.1.dev1 dist/ \\
        --drop "results.failed_recving.update(child_results.failed_recving)"
    python docs/evidence/make_candidate_wheel.py 0.34.0 0.34.1.dev2 dist/      # an unmodified rebuild

The release's wheel comes from the index (cached in .kvcompat/wheels); ``--drop LINE`` removes that one
statement from MultiConnector (it must occur exactly once); the wheel is renamed to the new version with
its METADATA and RECORD rewritten (kvcompat.qualify.overlay_wheel, the same code that lays a source
checkout over its base wheel).
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from kvcompat import index  # noqa: E402
from kvcompat.option_table import PYPI  # noqa: E402
from kvcompat.qualify import overlay_wheel  # noqa: E402

TARGET = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("version")
    ap.add_argument("out", type=Path)
    ap.add_argument("--drop", help="a statement of multi_connector.py to remove (exactly one occurrence)")
    ap.add_argument("--index-url", default=PYPI)
    args = ap.parse_args()
    wheel = index.download_wheel("vllm", args.base, ROOT / ".kvcompat" / "wheels", args.index_url)
    replacements = {}
    if args.drop:
        source = zipfile.ZipFile(wheel).read(TARGET).decode()
        lines = source.splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if line.strip() == args.drop.strip()]
        if len(hits) != 1:
            sys.exit(f"error: {args.drop!r} occurs {len(hits)} times in {TARGET}; give a statement that occurs once")
        indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
        lines[hits[0]] = f"{indent}pass  # kvcompat candidate: dropped {args.drop.strip()}\n"
        replacements[TARGET] = "".join(lines).encode()
        print(f"{TARGET}:{hits[0] + 1}: dropped {args.drop.strip()}")
    print(overlay_wheel(wheel, replacements, args.version, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
