"""Coverage-based test selection for a mutation session: run a mutant against the tests that reach it only.

The unmutated suite runs once per (cell, target group) under coverage.py, with one context per test
(kvcompat.mutation.incell.covplugin, in the session's venv, where :func:`install` puts coverage).  What it
keeps, per file of the group, is line -> the node ids of the tests that executed the line ("" for code
run outside any test: at import, during collection, or by a thread between two tests).  The map is
stored beside the verdicts, ``results/mutants-<cell>.coverage-<group>.json``, one section per suite
(ours, upstream), and reused while the suite's files (and its pytest arguments) and every target
file's hash are unchanged; otherwise the baseline, which runs anyway, runs under coverage again.

For a mutant, :func:`select` decides from the lines it changes (and the first line of the innermost
statement holding them, which runs whenever the statement does):

* code outside any function body (module or class level, a top-level def's signature or decorators):
  it runs at import, which no per-test context sees: the whole suite;
* a line run outside any test (context ""): the whole suite (no test can be singled out);
* otherwise the tests green on the baseline that ran one of those lines, in the baseline's order
  (the session still puts the tests that killed earlier mutants first, and stops at the first
  failure); none: the mutant survives without a run, "no test reaches it".

No file of the group measured at all means the measurement failed: the map is not used (every mutant
runs the whole suite), and the session says so.  Harness code: reads JSON, never imports coverage.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from pathlib import Path

from kvcompat import index
from kvcompat.atomic import write_atomic
from kvcompat.mutation.operators import Text
from kvcompat.run.process import last_error_line

SCHEMA = "kvcompat-mutants-coverage/1"
COVERAGE = "coverage==7.18.0"  # what the session installs into its venv
PLUGIN = "kvcompat.mutation.incell.covplugin"
ENV_OUT = "KVCOMPAT_COVMAP"  # kvcompat.mutation.incell.covplugin.ENV_OUT (that module imports pytest: not here)
ENV_FILES = "KVCOMPAT_COVER"
NOT_REACHED = "no test reaches it"

# line -> the contexts (test node ids, "" outside any test) that executed it
FileLines = dict[int, frozenset[str]]


def map_path(results_dir: Path, cell_id: str, group: str) -> Path:
    return results_dir / f"mutants-{cell_id}.coverage-{group}.json"


def install(ctx) -> str | None:
    """Put coverage.py into the session's venv (from uv's cache when it can); None, or why it could not."""
    uv = index.uv_bin()
    online = ["--default-index", ctx.opts.index_url]
    for fl in ctx.opts.find_links:
        online += ["--find-links", fl]
    out = ""
    for where in (["--offline"], online):
        rc, out = ctx.sh([uv, "pip", "install", "--python", ctx.python, COVERAGE, *where], timeout=600, phase="install")
        if rc == 0:
            return None
    return last_error_line(out, "uv pip install failed")


def fingerprint(paths: list[Path], args: list[str], env: dict[str, str]) -> str:
    """What a suite's coverage depends on besides the target files: its files, arguments and environment."""
    h = hashlib.sha256(json.dumps([list(args), sorted(env.items())]).encode())
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
        for f in files:
            h.update(str(f.relative_to(root) if f != root else f.name).encode() + b"\0")
            try:
                h.update(hashlib.sha256(f.read_bytes()).digest())
            except OSError:
                h.update(b"?")
    return h.hexdigest()


def file_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_plugin_output(path: Path) -> dict[str, FileLines] | None:
    """The covplugin's JSON as path -> line -> contexts; None when it wrote nothing readable."""
    try:
        raw = json.loads(path.read_text())
        tests = raw["tests"]
        return {
            rel: {int(n): frozenset(tests[i] for i in ids) for n, ids in lines.items()}
            for rel, lines in raw["files"].items()
        }
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _encode(files: dict[str, FileLines], hashes: dict[str, str]) -> tuple[list[str], dict]:
    tests = sorted({c for lines in files.values() for ctxs in lines.values() for c in ctxs})
    at = {t: i for i, t in enumerate(tests)}
    out = {}
    for rel, digest in sorted(hashes.items()):
        lines = files.get(rel, {})
        out[rel] = {
            "sha256": digest,
            "lines": {str(n): sorted(at[c] for c in lines[n]) for n in sorted(lines)},
        }
    return tests, out


def save(
    path: Path, cell_id: str, group: str, suite: str, print_: str, hashes: dict[str, str], files: dict[str, FileLines]
) -> None:
    """Store one suite's map of ``group``'s files (the other suites' sections are kept)."""
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            data = {}
    except (OSError, ValueError):
        data = {}
    tests, encoded = _encode(files, hashes)
    data.update({"schema": SCHEMA, "id": cell_id, "group": group})
    data.setdefault("suites", {})[suite] = {"fingerprint": print_, "tests": tests, "files": encoded}
    write_atomic(path, json.dumps(data, indent=None, separators=(",", ":")))


def load(path: Path, suite: str, print_: str, hashes: dict[str, str]) -> dict[str, FileLines] | None:
    """The stored map of ``suite`` when it is still good: same suite fingerprint, same hash for every file."""
    try:
        data = json.loads(path.read_text())
        section = data["suites"][suite]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("schema") != SCHEMA or section.get("fingerprint") != print_:
        return None
    files = section.get("files", {})
    if set(files) != set(hashes) or any(files[rel].get("sha256") != h for rel, h in hashes.items()):
        return None
    tests = section.get("tests", [])
    try:
        return {
            rel: {int(n): frozenset(tests[i] for i in ids) for n, ids in f["lines"].items()} for rel, f in files.items()
        }
    except (ValueError, IndexError, TypeError, KeyError):
        return None


# -- where a mutant is, and which tests to run ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Where:
    """The lines a mutant changes (plus its statement's first line), and whether they are in a function body."""

    lines: frozenset[int]
    in_function: bool


class Locator(Text):
    """The statements of one pristine file, to place mutants (parsed once per file)."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        # (start, end, statement, inside a function body)
        self.stmts: list[tuple[int, int, ast.stmt, bool]] = []
        self._visit(ast.parse(source).body, False)

    def _visit(self, body: list[ast.stmt], in_function: bool) -> None:
        for stmt in body:
            start = self.offset(stmt.lineno, stmt.col_offset)
            end = self.offset(stmt.end_lineno, stmt.end_col_offset)
            self.stmts.append((start, end, stmt, in_function))
            inner = in_function or isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody"):
                self._visit(getattr(stmt, field, None) or [], inner)
            for handler in getattr(stmt, "handlers", None) or []:
                self._visit(handler.body, inner)
            for case in getattr(stmt, "cases", None) or []:
                self._visit(case.body, inner)

    def strip(self, start: int, end: int) -> tuple[int, int]:
        """The span without the blanks around it (a catalogue target may start with the newline before its code)."""
        while start < end and self.source[start].isspace():
            start += 1
        while end > start and self.source[end - 1].isspace():
            end -= 1
        return start, end

    def where(self, start: int, end: int) -> Where:
        start, end = self.strip(start, end)
        first, last = self.line_of(start), self.line_of(max(start, end - 1))
        lines = set(range(first, last + 1))
        holders = [(s, e, st, inf) for s, e, st, inf in self.stmts if s <= start and end <= e]
        if not holders:
            return Where(frozenset(lines), False)
        s, e, stmt, in_function = min(holders, key=lambda h: h[1] - h[0])
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.body:
            body_start = self.offset(stmt.body[0].lineno, stmt.body[0].col_offset)
            if start >= body_start:  # several statements of the body: the first of them anchors
                in_function = in_function or not isinstance(stmt, ast.ClassDef)
                lines.add(min(b.lineno for b in stmt.body if self.offset(b.end_lineno, b.end_col_offset) > start))
                return Where(frozenset(lines), in_function)
            return Where(frozenset(lines), in_function)  # the signature or decorators: run when the def runs
        lines.add(stmt.lineno)
        return Where(frozenset(lines), in_function)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which tests a mutant runs: None, the whole suite; (), none (not reached); else those, in order."""

    tests: tuple[str, ...] | None
    why: str

    @property
    def reached(self) -> bool:
        return self.tests != ()


def select(lines: FileLines | None, at: Where, passed: list[str]) -> Selection:
    """The tests to run for a mutant at ``at``, from its file's map (None: no usable map)."""
    if lines is None:
        return Selection(None, "no coverage map: the whole suite")
    if not at.in_function:
        return Selection(None, "module- or class-level code, run at import: the whole suite")
    contexts: set[str] = set()
    for n in at.lines:
        contexts |= lines.get(n, frozenset())
    if "" in contexts:
        return Selection(None, "runs outside any test (import, collection, a thread between tests): the whole suite")
    chosen = tuple(t for t in passed if t in contexts)
    if not chosen:
        return Selection((), NOT_REACHED)
    return Selection(chosen, f"{len(chosen)} of {len(passed)} tests reach it")


def usable(files: dict[str, FileLines] | None) -> bool:
    """A measurement that saw some line of some file (else coverage did not measure: not used)."""
    return bool(files) and any(files.values())
