#!/usr/bin/env bash
# usage: docs/evidence/release-source.sh VER...
#
# Unpack the Python sources of official vllm wheels, one folder per release, for the citations in
# docs/vllm-multiconnector-history.md: .kvcompat/release-src/VER/vllm/... (paths inside the wheel)
# and its dist-info. Downloads with `pip download --no-deps`, keeps only vllm/*.py and the dist-info,
# deletes the wheel. A release already unpacked is skipped.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  echo "usage: $0 VER..." >&2
  exit 2
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest_root="$root/.kvcompat/release-src"
mkdir -p "$dest_root"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for ver in "$@"; do
  dest="$dest_root/$ver"
  if [ -d "$dest/vllm" ]; then
    echo "have $ver: $dest"
    continue
  fi
  whl_dir="$tmp/$ver"
  if ! pip download -q --no-deps --only-binary=:all: -d "$whl_dir" "vllm==$ver" >"$tmp/pip-$ver.log" 2>&1; then
    echo "error: pip download vllm==$ver failed: $(grep -v '^\s*$' "$tmp/pip-$ver.log" | tail -n 1)" >&2
    exit 1
  fi
  wheels=("$whl_dir"/vllm-*.whl)
  if [ ! -f "${wheels[0]}" ]; then
    echo "error: pip download vllm==$ver left no vllm wheel in $whl_dir" >&2
    exit 1
  fi
  partial="$dest.partial"
  rm -rf "$partial"
  mkdir -p "$partial"
  unzip -q -o "${wheels[0]}" 'vllm/*.py' 'vllm-*.dist-info/*' -d "$partial"
  rm -rf "$whl_dir"
  mv "$partial" "$dest"
  echo "unpacked $ver: $dest"
done
