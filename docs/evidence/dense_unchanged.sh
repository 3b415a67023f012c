#!/usr/bin/env bash
# The dense shape's verdicts before and after the deployment shapes, per release: the connector suite of a base
# commit and this tree's with KVCOMPAT_SHAPES=dense, in the same cell venv; every test of the base must have the
# same outcome (a shaped test's "[dense]" run is the base test).  Prints one line per release and each difference.
#
#   git worktree add /tmp/base 88b5b40
#   bash docs/evidence/dense_unchanged.sh /tmp/base vllm-0.34.0__torch-2.14.0__override-flashinfer-python-0.7.4 ...
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
base=${1:?usage: dense_unchanged.sh BASE_WORKTREE CELL...}
shift
out=$(mktemp -d)
for cell in "$@"; do
  venv=$repo/.kvcompat/venvs/$cell
  [[ -x $venv/bin/python ]] || { echo "error: $venv has no python; run the cell first (nox -s matrix -k ...)" >&2; exit 2; }
  (cd "$base" && PYTHONPATH=$base/src "$venv/bin/python" -m pytest tests/connectors -p kvcompat.testkit.pytest_plugin \
     --kvcompat-json="$out/base-$cell.json" -p no:cacheprovider -q >"$out/base-$cell.log" 2>&1) || true
  (cd "$repo" && KVCOMPAT_SHAPES=dense PYTHONPATH=$repo/src "$venv/bin/python" -m pytest tests/connectors \
     -p kvcompat.testkit.pytest_plugin --kvcompat-json="$out/head-$cell.json" -p no:cacheprovider -q >"$out/head-$cell.log" 2>&1) || true
  python3 - "$out" "$cell" <<'PY'
import json, sys
out, cell = sys.argv[1:]
def load(kind):
    return {t["nodeid"].replace("[dense]", ""): t["outcome"] for t in json.load(open(f"{out}/{kind}-{cell}.json"))["tests"]}
base, head = load("base"), load("head")
diff = [(k, v, head.get(k)) for k, v in base.items() if head.get(k) != v]
print(f"{cell}: {len(base)} base tests, {len(base) - len(diff)} with the same outcome, {len(diff)} differ", flush=True)
for nodeid, was, now in diff:
    print(f"    {nodeid}: {was} -> {now}")
PY
done
echo "logs and JSON of both runs: $out"
