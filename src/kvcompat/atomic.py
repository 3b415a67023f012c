"""Atomic file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` via a unique temp file in the same folder and ``os.replace``.

    The temp name is unique per writer, so concurrent writers (``nox -j``) never
    share a half-written file; the last ``replace`` wins whole.  Renaming over
    ``path`` also never writes through it (a hardlink into uv's cache stays as it
    was).  ``mode`` sets the new file's permissions (default: mkstemp's 0600).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
