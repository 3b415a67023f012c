"""How much disk a cell's install needs: the unpacked size of what its lock pins and uv's cache lacks.

A venv is hardlinks into uv's cache, so a cell whose every pin is already unpacked there costs
almost nothing (its bytecode and entry points), however big torch is; a cold cell costs its
whole lock.  The estimate is, per pin missing from the cache, the wheel's size on the index
(PEP 700 ``size``; a local wheel's file size) times :data:`UNPACK_FACTOR`, plus
:data:`VENV_OWN_GIB` for the venv's own files.  Measured unpacked/wheel ratios in uv's cache:
torch 2.14.0 2.1, vllm 0.34.0 2.1, nvidia-cublas/cudnn 1.5, triton 3.6, numpy 3.6, transformers
4.4; the big CUDA wheels dominate a cell, so 2.5 errs on the side of refusing early.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import urllib.parse
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvcompat import simple_api
from kvcompat.index import parse_lock

UNPACK_FACTOR = 2.5
VENV_OWN_GIB = 1.0  # bytecode, entry points, metadata: what a venv holds that is not a hardlink
UNKNOWN_PIN_GIB = 0.5  # a pin whose size the index does not say (a PEP 503 HTML index)


@dataclasses.dataclass(frozen=True)
class Need:
    """The estimate and what it is made of."""

    gib: float
    pins: int  # in the lock
    missing: list[tuple[str, str, float | None]]  # (name, version, wheel GiB or None when unknown)

    def line(self) -> str:
        """``needs about 2.3 GiB (3 of 160 pins not in uv's cache: torch 2.15.0 1.1 GiB, …)``."""
        if not self.missing:
            return f"needs about {self.gib:.1f} GiB (all {self.pins} pins are in uv's cache)"
        big = sorted(self.missing, key=lambda m: -(m[2] or 0))[:3]
        shown = ", ".join(f"{n} {v}" + (f" {s:.1f} GiB" if s is not None else "") for n, v, s in big)
        more = ", …" if len(self.missing) > 3 else ""
        return (
            f"needs about {self.gib:.1f} GiB ({len(self.missing)} of {self.pins} pins not in uv's cache: "
            f"{shown}{more}; wheel sizes x{UNPACK_FACTOR} unpacked)"
        )


def missing_pins(lock_text: str, cached: set[tuple[str, str]]) -> tuple[int, list[tuple[str, str, str]]]:
    """(pins in the lock, [(name, version, lock line)] of those not unpacked in the cache)."""
    pins, missing = 0, []
    for line in lock_text.splitlines():
        pinned = parse_lock(line)
        if not pinned:
            continue
        pins += 1
        if not set(pinned.items()) <= cached:
            ((name, version),) = pinned.items()
            missing.append((name, version, line.strip()))
    return pins, missing


def wheel_gib(name: str, version: str, line: str, index_url: str) -> float | None:
    """The size of the wheel uv would install for this pin, in GiB; None when the index does not say."""
    if " @ " in line:  # a local wheel (a candidate): ``vllm @ file:///…/vllm-X.whl``
        url = urllib.parse.urlparse(line.split(" @ ", 1)[1].strip())
        local = Path(urllib.parse.unquote(url.path))
        return local.stat().st_size / 2**30 if local.is_file() else None
    try:
        page = json.loads(
            simple_api.http_get(
                f"{index_url.rstrip('/')}/{canonicalize_name(name)}/", accept="application/vnd.pypi.simple.v1+json"
            )
        )
    except (OSError, ValueError):
        return None
    supported = set(sys_tags())
    sizes = []
    for f in page.get("files", []):
        try:
            _, v, _, tags = parse_wheel_filename(f["filename"])
        except (KeyError, ValueError, InvalidVersion):
            continue
        if v == Version(version) and set(tags) & supported and isinstance(f.get("size"), int):
            sizes.append(f["size"])
    return max(sizes) / 2**30 if sizes else None


def estimate(lock_text: str, cached: set[tuple[str, str]], index_url: str) -> Need:
    """The disk a venv built from ``lock_text`` needs, given what uv's cache holds unpacked."""
    pins, missing = missing_pins(lock_text, cached)
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        sizes = list(pool.map(lambda m: wheel_gib(m[0], m[1], m[2], index_url), missing))
    gib = VENV_OWN_GIB + sum(UNPACK_FACTOR * (s if s is not None else UNKNOWN_PIN_GIB) for s in sizes)
    return Need(gib, pins, [(n, v, s) for (n, v, _), s in zip(missing, sizes, strict=True)])
