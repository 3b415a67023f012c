"""--disk-budget: keep uv's cache under a size by evicting unpacked wheels no running cell needs.

A long matrix (the history: six torch releases with their CUDA libraries, ~63 GB unpacked)
can outgrow a disk that holds any few of its cells.  uv keeps each wheel it downloaded
unpacked once, in ``archive-v0/<id>/``, and every venv hardlinks into it.  Before a cell
installs, when those entries add up to more than the budget, the largest ones that neither
this cell's lock nor a running cell's lock names are deleted until the cache fits.  uv
fetches an evicted wheel again if a later cell needs it (it checks that the entry exists), so
eviction costs downloads, never correctness.  Matrices run in release order, and releases
that share torch are neighbours: what is evicted is mostly an older torch's CUDA libraries.

The budget bounds the cache before each install; a cell's own new wheels come on top of it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

from kvcompat import index
from kvcompat.index import parse_lock

Dist = tuple[str, str]  # canonical name, version


def uv_cache_dir() -> Path:
    """Where uv keeps its cache (UV_CACHE_DIR, uv's configuration, or its default)."""
    out = subprocess.run([index.uv_bin(), "cache", "dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def unpacked_entries(cache: Path) -> list[tuple[Dist, Path]]:
    """Each unpacked distribution in uv's cache: its name and version, and its archive folder."""
    found = []
    for info in cache.glob("archive-v0/*/*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        found.append(((re.sub(r"[-_.]+", "-", name).lower(), version), info.parent))
    return found


def disk_bytes(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks; a file hardlinked elsewhere still counts)."""
    total = 0
    for base, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def running_cells(venvs: Path) -> list[str]:
    """The cells whose venv lock (kvcompat.run.lock) some live run holds now, this one included."""
    busy = []
    for path in venvs.glob("*.lock"):
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                busy.append(path.name.removesuffix(".lock"))
        finally:
            os.close(fd)
    return busy


def needed(work_root: Path, cells: list[str]) -> set[Dist]:
    """What the locks of ``cells`` pin (a cell without a lock yet pins nothing we could evict for it)."""
    pins: set[Dist] = set()
    for cell_id in cells:
        lock = work_root / cell_id / "lock.txt"
        if lock.is_file():
            pins.update(parse_lock(lock.read_text()).items())
    return pins


def evict(cache: Path, budget_bytes: int, keep: set[Dist]) -> tuple[int, int, int]:
    """Delete the largest unpacked entries not in ``keep`` until they total at most ``budget_bytes``.

    Returns (entries evicted, bytes freed, bytes left).
    """
    sizes = [(dist, folder, disk_bytes(folder)) for dist, folder in unpacked_entries(cache)]
    total = sum(size for _, _, size in sizes)
    evicted = freed = 0
    for dist, folder, size in sorted(sizes, key=lambda entry: -entry[2]):
        if total - freed <= budget_bytes:
            break
        if dist in keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        evicted, freed = evicted + 1, freed + size
    return evicted, freed, total - freed
