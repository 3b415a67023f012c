"""The commits a bisect walks: the first commit of a vLLM git checkout where a test fails (``git bisect run``).

    kvcompat bisect --repo ~/src/vllm GOOD BAD --test test_load_errors_of_either_child_reach_the_scheduler
    nox -s bisect -- --repo ~/src/vllm GOOD BAD --test T

The handler for :func:`kvcompat.bisection.run`, its steps each a plain function or method:

1. :func:`kvcompat.vllm_git.commits_between` — GOOD, then ``git rev-list --first-parent --reverse GOOD..BAD``: the N
   commits the first bad one can be.  Bad input (not a git repository, an unknown ref, GOOD not an
   ancestor of BAD) is one line naming the fix.
2. :meth:`Bases.base_of` — the release a commit descends from: its tree's own version (an sdist's
   ``PKG-INFO``, a ``vllm/_version.py``), else the newest release tag its history holds; then the
   newest final release on the index at or below it (:func:`kvcompat.qualify.base_release`).
3. :meth:`Bases.base_sharing_compiled` — the commit's compiled sources (what builds the wheel's extensions,
   :func:`kvcompat.overlay.is_compiled_source`; git's blob ids) against the base's sdist.  A commit whose
   compiled sources differ cannot be laid over any release wheel that lacks them: at GOOD or BAD that is
   bad input (exit 2) naming the commit that first changed them, in between the commit is skipped, as
   ``git bisect skip``, with the files and the release that would be needed.  When the first release that
   contains the commit has the same compiled sources, that release is the base.
4. :func:`overlay` — ``git archive`` of the commit's ``vllm/`` (nothing is checked out in the user's work
   tree), its ``vllm/**.py`` laid over the base's wheel (:func:`kvcompat.overlay.lay_over`, named
   ``<base>+src.<hash of the Python changes>``: a commit that changes no Python shares its parent's wheel
   and cell).
5. :meth:`Commits.evaluate` — the overlaid wheel runs as a cell with the base's matrix-entry overrides (as
   ``kvcompat qualify`` runs a candidate), our suite only; the verdict is the named test's
   (:func:`kvcompat.bisection.verdict_for`).  A commit that cannot be built, installed or imported is
   skipped, never good or bad.  BAD is checked first, then GOOD, then the search: at most
   ceil(log2 N) + 2 cells, one more for each cell whose step is skipped.

Results go to ``.kvcompat/bisect/results/`` (out of the matrix's report), and a record per tree to
``.kvcompat/bisect/commits/``: a commit whose tree was evaluated before (with the same suite, torch
and overrides) is answered from its result without building anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from packaging.version import Version

from kvcompat import bisection as bis
from kvcompat import overlay as ov
from kvcompat import qualify as q
from kvcompat.atomic import write_atomic
from kvcompat.results import CellResult
from kvcompat.vllm_git import (
    GIT_URL,
    Commit,
    commits_between,
    git,
    git_blob_id,
    log_commits,
    open_repo,
    release_of_tag,
    show_file,
)

# The files a connector bisect is about: their changes between the last good and the first bad commit.
CONNECTOR_DIRS = tuple(d.rstrip("/") for d in bis.CONNECTOR_DIRS)


class Refused(Exception):
    """A commit whose Python cannot be laid over a release wheel; the message is the one-line reason.

    ``origin``: the commit after the bisect's older end that first changed the compiled sources the refused
    one has, when that is not the refused commit itself."""

    def __init__(self, message: str, origin: Commit | None = None) -> None:
        super().__init__(message)
        self.origin = origin


@dataclasses.dataclass(frozen=True)
class Overlay:
    """What runs as a commit's cell: the base release's wheel with the commit's Python laid over it."""

    commit: Commit
    base: str
    wheel: Path
    changed: tuple[str, ...]  # the vllm/**.py files that differ from the base wheel's


@dataclasses.dataclass(frozen=True)
class ReleaseFiles:
    """The index's side: its vllm releases, and a release's wheel and sdist (each fetched once, cached)."""

    listed: Callable[[], list[Version]]
    wheel: Callable[[str], Path]
    sdist: Callable[[str], Path]


# -- 2.-3. the release a commit is laid over -------------------------------------------------------


class Bases:
    """Which release's wheel each commit of one repository is laid over, and the commits that cannot be."""

    def __init__(self, repo: Path, releases: ReleaseFiles, work: Path) -> None:
        self.repo = repo
        self.releases = releases
        self.work = work
        self.object_format = "sha1"
        try:
            self.object_format = git(repo, "rev-parse", "--show-object-format").strip() or "sha1"
        except subprocess.CalledProcessError:
            pass

    def version_of(self, commit: Commit) -> tuple[str | None, str]:
        """(version, where it came from): the tree's PKG-INFO or vllm/_version.py, else the newest release tag
        in its history."""
        with tempfile.TemporaryDirectory(prefix="version.", dir=_made(self.work)) as tmp:
            for rel in ("PKG-INFO", "vllm/_version.py"):
                data = show_file(self.repo, commit.sha, rel)
                if data is not None:
                    (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                    (Path(tmp) / rel).write_bytes(data)
            version = q.checkout_version(Path(tmp))
        if version is not None:
            return version, "its tree's version"
        tags = [v for v in map(release_of_tag, git(self.repo, "tag", "--merged", commit.sha).split()) if v is not None]
        if tags:
            return str(max(tags)), f"tag v{max(tags)} in its history"
        return None, "no version"

    def base_of(self, commit: Commit) -> str:
        version, _ = self.version_of(commit)
        if version is None:
            raise Refused(
                f"{commit.label} says no version (no PKG-INFO, no vllm/_version.py, no release tag such as v0.34.0 "
                f"in its history): fetch vLLM's tags (`git -C {self.repo} fetch --tags {GIT_URL}`)"
            )
        try:
            return q.base_release(version, self.releases.listed())
        except q.QualifyError as exc:
            raise Refused(f"{commit.label}: {exc}") from None

    def compiled_of_commit(self, commit: Commit) -> dict[str, bytes]:
        """The commit's compiled sources as {path: git blob id}, read from its tree (nothing exported)."""
        out = {}
        for line in git(self.repo, "ls-tree", "-r", "--full-tree", "-z", commit.sha).split("\x00"):
            meta, _, rel = line.partition("\t")
            parts = meta.split()
            if len(parts) == 3 and parts[1] == "blob" and parts[0] != "120000" and ov.is_compiled_source(rel):
                out[rel] = parts[2].encode()  # files only, not links
        return out

    @functools.cache  # noqa: B019 (one Bases per bisect: a release's sdist is read once)
    def compiled_of_release(self, release: str) -> dict[str, bytes]:
        sources = ov.compiled_sources_of_sdist(self.releases.sdist(release))
        return {rel: git_blob_id(data, self.object_format) for rel, data in sources.items()}

    def compiled_changes(self, commit: Commit, release: str) -> list[str]:
        """The compiled sources the commit has changed, added or removed relative to ``release``'s sdist."""
        return ov.compiled_differences(self.compiled_of_commit(commit), self.compiled_of_release(release))

    def first_release_containing(self, commit: Commit) -> str | None:
        tags = git(self.repo, "tag", "--contains", commit.sha).split()
        finals = [v for v in map(release_of_tag, tags) if v is not None and not v.is_prerelease]
        return str(min(finals)) if finals else None

    def first_change(self, commit: Commit, base: str, differ: list[str], since: Commit | None) -> Commit | None:
        """The commit that brought ``commit``'s compiled differences from ``base``: the oldest first-parent
        commit after ``since`` that touched one of ``differ`` and left the compiled sources differing; None
        when ``since`` differs already (the change came before it)."""
        if since is None or since == commit or self.compiled_changes(since, base):
            return None
        touched = log_commits(self.repo, "--first-parent", "--reverse", f"{since.sha}..{commit.sha}", "--", *differ)
        return next((c for c in touched if self.compiled_changes(c, base)), None)

    def base_sharing_compiled(self, commit: Commit, since: Commit | None = None) -> str:
        """The release whose wheel the commit's Python is laid over: its base, or (when the commit's compiled
        sources differ from the base's) the first release that contains it if that one's compiled sources are
        the commit's.  Otherwise :class:`Refused`, naming the files, the commit after ``since`` that first
        changed them, and the release that would be needed."""
        base = self.base_of(commit)
        differ = self.compiled_changes(commit, base)
        if not differ:
            return base
        shipped = self.first_release_containing(commit)
        needed = "no release contains it yet: build a wheel of the commit"
        if shipped and Version(shipped) > Version(base):
            if Version(shipped) not in self.releases.listed():
                needed = f"vllm {shipped} contains it but is not on the index: build a wheel of the commit"
            elif self.compiled_changes(commit, shipped):
                needed = (
                    f"vllm {shipped}, the first release that contains it, has other compiled changes too: "
                    "build a wheel of the commit"
                )
            else:
                return shipped
        elif shipped:
            needed = f"build a wheel of the commit (vllm {shipped} contains it, but is not newer than {base})"
        origin = self.first_change(commit, base, differ, since)
        origin = origin if origin != commit else None
        what = "changes compiled sources" if origin is None else f"has the compiled sources that {origin.label} changed"
        raise Refused(
            f"{commit.label} {what} relative to vllm {base} ({ov.shown(differ)}): its Python cannot be laid over "
            f"the {base} wheel; {needed}",
            origin,
        )


# -- 4. the overlaid wheel -------------------------------------------------------------------------


def python_of(repo: Path, commit: Commit) -> frozenset[str]:
    """The ``vllm/**.py`` files git tracks in ``commit`` (read from its tree, nothing exported)."""
    out = git(repo, "ls-tree", "-r", "--name-only", "-z", commit.sha, "--", "vllm")
    return frozenset(rel for rel in out.split("\x00") if rel.endswith(".py"))


def export(repo: Path, commit: Commit, dest: Path) -> Path:
    """The commit's ``vllm/**.py`` under ``dest`` (``git archive``: the user's work tree is left alone)."""
    proc = subprocess.Popen(
        ["git", "-C", str(repo), "archive", "--format=tar", commit.sha, "--", "vllm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".py") and ".." not in member.name.split("/"):
                target = dest / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    err = proc.stderr.read() if proc.stderr else b""
    if proc.wait():
        raise Refused(f"{commit.label}: git archive failed ({err.decode(errors='replace').strip()[:200]})")
    if not (dest / "vllm" / "__init__.py").is_file():
        raise Refused(f"{commit.label} has no vllm/__init__.py: not a vLLM tree")
    return dest


def overlay(bases: Bases, commit: Commit, since: Commit | None = None) -> Overlay:
    """The commit as a wheel: its base release's wheel with the commit's Python laid over it.

    A ``vllm/**.py`` file that ``since`` (the bisect's older end) tracks and the commit no longer
    does was deleted in between: it is replaced by one that fails to import, as the deleted module
    would.  (The release's sdist is no guide to deletions: it ships files git does not track.)
    """
    base = bases.base_sharing_compiled(commit, since)
    wheel = bases.releases.wheel(base)
    with tempfile.TemporaryDirectory(prefix="tree.", dir=_made(bases.work)) as tmp:
        tree = export(bases.repo, commit, Path(tmp))
        changes = ov.python_changes(tree, wheel)
        present = {p.relative_to(tree).as_posix() for p in (tree / "vllm").rglob("*.py")}
    deleted = (python_of(bases.repo, since) - present) if since is not None and since != commit else set()
    for rel in sorted(deleted):
        changes[rel] = f"raise ModuleNotFoundError({rel!r} + ' is deleted in this commit')\n".encode()
    return Overlay(commit, base, ov.lay_over(wheel, base, changes, bases.work), tuple(sorted(changes)))


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- resumability -----------------------------------------------------------------------------------


class Records:
    """One file per evaluated tree: which cell answered it, under which fingerprint (suite, torch, overrides).

    A commit whose tree has a record with the current fingerprint, and whose cell result is readable and
    not an infrastructure failure (those may be transient), is answered from that result.
    """

    def __init__(self, folder: Path, load: Callable[[str], CellResult | None]) -> None:
        self.folder = folder
        self.load = load

    def _path(self, commit: Commit) -> Path:
        return self.folder / f"{commit.tree}.json"

    def _read(self, commit: Commit) -> dict:
        try:
            return json.loads(self._path(commit).read_text())
        except (OSError, ValueError):
            return {}

    def get(self, commit: Commit, fingerprint: str) -> tuple[str, CellResult] | None:
        cell = self._read(commit).get("cells", {}).get(fingerprint)
        result = self.load(cell) if cell else None
        if result is None or result.outcome in bis.INFRASTRUCTURE:
            return None
        return cell, result

    def put(self, commit: Commit, fingerprint: str, overlay: Overlay, cell: str) -> None:
        data = self._read(commit) or {"tree": commit.tree, "cells": {}}
        data.update(commit=commit.sha, subject=commit.subject, base=overlay.base, changed=list(overlay.changed))
        data["cells"][fingerprint] = cell
        write_atomic(self._path(commit), json.dumps(data, indent=2, sort_keys=True) + "\n")


def crashed(result: CellResult) -> bool:
    """Whether the cell's pytest died of a signal (a crash the suite did not report) rather than giving a verdict."""
    from kvcompat.outcomes import Outcome

    return result.outcome is Outcome.TEST_ERROR and (result.detail or "").startswith("pytest exited -")


# -- 5. the handler ---------------------------------------------------------------------------------


class Commits:
    """The bisect's handler for the commits of GOOD..BAD (see :class:`kvcompat.bisection.Handler`).

    ``run`` puts an overlaid wheel to the suite and returns (cell id, result); ``fingerprint(base)``
    names everything besides the tree that a recorded result must share (suite, torch, overrides);
    ``force`` evaluates every commit again (its record is rewritten).  Both ends must be laid over a
    release before any cell runs: a refusal there is bad input.
    """

    noun = "commit"
    check_older = True  # as git bisect: neither end is taken on trust

    def __init__(
        self,
        bases: Bases,
        good: str,
        bad: str,
        *,
        test: str,
        run: Callable[[Overlay], tuple[str, CellResult]],
        fingerprint: Callable[[str], str],
        records: Records | None = None,
        force: bool = False,
        find_fix: bool = False,
        say: Callable[[str], None] = print,
        resume: Callable[[str, str], str] | None = None,
    ) -> None:
        self.bases, self.repo, self.test, self.run, self.fingerprint = bases, bases.repo, test, run, fingerprint
        self.records, self.force, self.say, self._resume = records, force, say, resume
        self.commits = commits_between(bases.repo, good, bad, find_fix=find_fix)
        self.by_sha = {c.sha: c for c in self.commits}
        self.items = [c.sha for c in self.commits]
        newer, older = (("GOOD", good), ("BAD", bad)) if find_fix else (("BAD", bad), ("GOOD", good))
        first = self.commits[0]
        for commit, (role, ref) in ((self.commits[-1], newer), (first, older)):  # in the search's order
            try:
                bases.base_sharing_compiled(commit, since=first)
            except Refused as exc:
                pick = f"pick a {role} older than {exc.origin.short}, or one" if exc.origin else f"pick a {role}"
                raise bis.BisectError(
                    f"{role} {ref}: {exc} (or {pick} whose compiled sources match a release's; "
                    "`kvcompat qualify WHEEL` takes a built wheel)"
                ) from None

    def header(self) -> str:
        n = len(self.commits) - 1
        return (
            f"{n} commit{'s' if n != 1 else ''} of {self.repo} after {self.commits[0].label} up to "
            f"{self.commits[-1].label} (first parents)"
        )

    def commit(self, sha: str) -> Commit:
        return self.by_sha[sha]

    def name(self, sha: str) -> str:
        return self.by_sha[sha].label

    def full(self, sha: str) -> str:
        return f"{sha} {self.by_sha[sha].subject}"

    def evaluate(self, sha: str) -> bis.Step:
        commit = self.by_sha[sha]
        try:
            base = self.bases.base_sharing_compiled(commit, since=self.commits[0])
        except Refused as exc:
            return bis.Step(sha, bis.Verdict.SKIP, str(exc).removeprefix(commit.label + " "), cell=False)
        key = self.fingerprint(base)
        found = self.records.get(commit, key) if self.records is not None and not self.force else None
        if found is not None and crashed(found[1]):  # a crash is no verdict on the tree: not kept as one
            found = None
        if found is not None:
            cell, result = found
            self.say(f"    answered from {cell}'s result (this tree was evaluated before)")
        else:
            t0 = time.monotonic()
            try:
                laid = overlay(self.bases, commit, since=self.commits[0])
            except (Refused, OSError, RuntimeError, zipfile.BadZipFile) as exc:  # never good or bad
                return bis.Step(sha, bis.Verdict.SKIP, f"could not be built: {exc}", cell=False)
            files = ", ".join(laid.changed[:3]) + (" …" if len(laid.changed) > 3 else "")
            self.say(
                f"    vllm {laid.base}'s wheel with {len(laid.changed)} Python file(s) of the commit laid over "
                f"it{': ' + files if files else ''} ({time.monotonic() - t0:.0f}s)"
            )
            cell, result = self.run(laid)
            if self.records is not None:
                self.records.put(commit, key, laid, cell)
        return bis.verdict_for(result, self.test)

    def resume(self, good: str, bad: str) -> str | None:
        return self._resume(good[:12], bad[:12]) if self._resume is not None else None

    def changes(self, older: str, newer: str) -> tuple[str, list[bis.FileChange]]:
        return f"{older[:10]} and {newer[:10]}", connector_changes(self.repo, older, newer)

    def link(self, older: str, newer: str) -> str:
        return f"show it: git -C {self.repo} show {newer}"


def connector_changes(repo: Path, older: str, newer: str) -> list[bis.FileChange]:
    """+/- per changed connector source between two commits (``git diff --numstat``)."""
    out = git(repo, "diff", "--numstat", "--no-renames", older, newer, "--", *CONNECTOR_DIRS)
    changes = []
    for line in out.splitlines():
        added, removed, path = line.split("\t", 2)
        status = "modified"
        if show_file(repo, older, path) is None:
            status = "added"
        elif show_file(repo, newer, path) is None:
            status = "removed"
        changes.append(
            bis.FileChange(path, int(added) if added != "-" else 0, int(removed) if removed != "-" else 0, status)
        )
    return changes


# -- the front door's --------------------------------------------------------------------------------


def check_options(values: Namespace) -> None:
    """Options that mean nothing for commits are bad input, not silently dropped."""
    for flag, given, why in (
        ("--wheelhouse", values.wheelhouse is not None, "the commits' wheels are built from --repo"),
        ("--dist", values.dist != "vllm", "a commit's Python is laid over a vllm release wheel"),
        ("--env", values.env == "as-released", "a built wheel has no release date: commits run with today's index"),
        ("--pre", bool(values.pre), "the commits are listed by git, not the index"),
    ):
        if given:
            raise bis.BisectError(f"{flag} does not go with --repo ({why}); drop it")


def handler(root: Path, values: Namespace, cells: bis.Cells, say: Callable[[str], None]) -> Commits:
    """``kvcompat bisect --repo PATH GOOD BAD --test T``: the commits of GOOD..BAD (bad input raises, one line)."""
    from kvcompat import index, upstream
    from kvcompat.matrix import Entry
    from kvcompat.options import command_line
    from kvcompat.results import check_result, result_path
    from kvcompat.run.cellfiles import CellFiles
    from kvcompat.run.resolve import suite_hash

    check_options(values)
    bis.check_test(values.test, root)  # a name no test has is refused before the checkout is read
    repo = open_repo(Path(values.repo))
    state = root / ".kvcompat" / "bisect"
    opts = dataclasses.replace(cells.opts, results_dir=state / "results")

    @functools.cache
    def listed() -> list[Version]:
        return index.list_versions("vllm", cache_root=root, index_url=values.index_url)

    releases = ReleaseFiles(
        listed=listed,
        wheel=lambda v: index.download_wheel("vllm", v, root / ".kvcompat" / "wheels", values.index_url),
        sdist=lambda v: upstream.download_sdist_cached(v, root / ".kvcompat" / "sdists", values.index_url),
    )

    def overrides(base: str) -> tuple[str, ...]:
        return q.base_entry(root / "pyproject.toml", base)[0]

    def fingerprint(base: str) -> str:  # at each step: the suite a cell would run now
        suite = suite_hash(root, opts.suite)
        return json.dumps({"suite": suite, "torch": values.torch, "overrides": list(overrides(base))}, sort_keys=True)

    def progress(line: str) -> None:
        say("    " + line)

    def run(laid: Overlay) -> tuple[str, CellResult]:
        entry = Entry(vllm=laid.wheel, overrides=overrides(laid.base), suites=("ours",), torch=(values.torch,))
        cell, result = cells.run(entry, opts, progress)
        if crashed(result):  # a signal, not a verdict on the commit: one more try before the step is a skip
            say(f"    {result.detail.splitlines()[0][:120]}: running the cell once more")
            cell, result = cells.run(entry, dataclasses.replace(opts, force=True), progress)
        # A commit's cell is answered from its result from now on: its venv and bytecode go (uv's cache keeps
        # the wheels, and the overlaid wheel stays in .kvcompat/candidates for a rerun).
        cells.prune(cell, progress)
        shutil.rmtree(CellFiles(opts.work_root / cell.id, opts.results_dir, cell.id).bytecode, ignore_errors=True)
        return cell.id, result

    def load(cell: str) -> CellResult | None:
        found = check_result(result_path(opts.results_dir, cell))
        return found if isinstance(found, CellResult) else None

    return Commits(
        Bases(repo, releases, root / ".kvcompat" / "candidates"),
        values.good,
        values.bad,
        test=values.test,
        run=run,
        fingerprint=fingerprint,
        records=Records(state / "commits", load),
        force=values.force,
        find_fix=bool(values.find_fix),
        say=say,
        resume=lambda good, bad: command_line("bisect", {**vars(values), "good": good, "bad": bad}),
    )
