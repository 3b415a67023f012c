"""``nox -s ci``: the CI pipelines (kvcompat.ci) written into the project."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvcompat import ci as pipelines


def ci(root: Path, engines: list[str], say: Callable[[str], None]) -> list[Path]:
    """Write the pipeline of each engine named (default: github); say and return each file written."""
    written = []
    for engine in engines or ["github"]:
        path = pipelines.write(engine, root)
        say(f"wrote {path.relative_to(root)}")
        written.append(path)
    return written
