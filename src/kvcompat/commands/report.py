"""``nox -s report`` and ``kvcompat report``: result folders merged into reports/, under a lock."""

from __future__ import annotations

import fcntl
import sys
from collections.abc import Callable
from pathlib import Path

from kvcompat.errors import KvcompatError
from kvcompat.report import mutants as mutation_report
from kvcompat.report.model import Report, build_report
from kvcompat.report.write import write_reports
from kvcompat.results import scan_results


class NoResults(KvcompatError):
    """Result folders that hold no cell result: no report is written, the one in reports/ stays."""


def update_report(
    root: Path,
    dirs: list[Path],
    summary_file: Path | None = None,
    warn: Callable[[str], None] | None = None,
    *,
    if_any: bool = False,
) -> tuple[Report, list[Path]]:
    """Rebuild reports/ from result folders, under a lock; ``warn`` (default: stderr) gets one line per
    result file that could not be read (its cell counts as not run).

    Folders with neither a readable cell result nor a mutation result raise :class:`NoResults` (with
    ``if_any``: write nothing and return no paths), so an empty or missing folder never replaces a report.

    Parallel cells (nox -j) each call this after writing their own result; the
    lock makes read-all-results-then-write atomic, so the last cell to finish
    always leaves a report that includes every finished cell.
    """
    out = root / "reports"
    found, unreadable = scan_results(*dirs)
    if not found and not mutation_report.load(dirs):
        if if_any:
            return build_report([]), []
        for bad in unreadable:
            (warn or _warn)(bad.line())
        where = ", ".join(_shown(root, d) for d in dirs)
        missing = [d for d in dirs if not d.is_dir()]
        why = "is not there" if missing == dirs else f"holds no {'readable ' if unreadable else ''}cell result"
        hint = (
            "run `nox -s matrix` first"
            if dirs == [root / "results"]
            else "name the folders that hold results/*.json, e.g. `nox -s report -- results/ other-machine/results/`"
        )
        old = " (reports/ left as it was)" if any(out.glob("compat.*")) else ""
        raise NoResults(f"{where} {why}: no report to write{old}; {hint}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rep = build_report(dirs, previous=out / "compat.json")
        for bad in rep.unreadable:
            (warn or _warn)(bad.line())
        return rep, write_reports(rep, out, summary_file=summary_file, mutants=mutation_report.load(dirs))


def _shown(root: Path, folder: Path) -> str:
    """A folder as the user named it: relative to the project when inside it."""
    path = folder if folder.is_absolute() else Path.cwd() / folder
    try:
        return f"{path.resolve().relative_to(root.resolve())}/"
    except ValueError:
        return f"{folder}/"


def _warn(line: str) -> None:
    print(f"kvcompat: warning: {line}", file=sys.stderr)


def report_dirs(root: Path, args: list[str]) -> list[Path]:
    """The result folders named in ``args`` (default: results/); a name that is not a folder is bad input."""
    for arg in args:
        if not Path(arg).is_dir():
            raise KvcompatError(
                f"report takes folders of results/*.json, and {arg!r}: it is not a folder; "
                "e.g. `nox -s report -- results/ other-machine/results/`"
            )
    return [Path(a) for a in args] or [root / "results"]
