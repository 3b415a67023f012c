"""Mutants generated from a release's multi_connector.py, so that coverage does not hang on hand-picking.

For every method of MultiConnector and of its metadata, worker-metadata and stats classes (class
methods and properties included), the generator reads the release's own source with ``ast`` and
makes one mutant per site and operator:

* ``skip-first`` / ``skip-last`` / ``only-first``: every loop (or comprehension) over the children,
  or over something that follows them one to one (their metadata, configs, classes, stats), made to
  skip the first child, skip the last one, or take only the first;
* ``any-to-all`` / ``all-to-any``: every ``any(...)`` and ``all(...)``;
* ``index-0`` / ``index-last``: every index into the children (``self._connectors[i]``, a metadata
  tuple's ``[i]``) fixed to 0 and to -1;
* ``no-early-return``: every ``return`` that is not its function's last statement, dropped.

A mutant is identified by class, method, operator and the site's rank among that operator's sites in
the method (``gen-multiconnector-get-finished-skip-first-1``), so the same change keeps its id from
one release to the next while the method's code does.  Mutants apply by position, in memory: they need
no unique text and cannot match elsewhere.  What a mutant's change means for this pair of children
decides whether a test can see it; where none can, ``tests/mutants/equivalent.toml`` says why, per
release, with the children's file:line, and the mutant is listed, not run.  A method with no site at
all needs a reason there too (``[methods]``): :func:`coverage` names those that lack one.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from pathlib import Path

from kvcompat.errors import KvcompatError

CLASSES = ("MultiConnector", "MultiKVConnectorMetadata", "MultiKVConnectorWorkerMetadata", "MultiKVConnectorStats")
LOOP_OPERATORS = {
    "skip-first": "list({})[1:]",
    "skip-last": "list({})[:-1]",
    "only-first": "list({})[:1]",
}
INDEX_OPERATORS = {"index-0": "0", "index-last": "-1"}
# Iterables that are exactly the children (the suite's MultiConnector has two): there, taking only the
# first child is the same program as skipping the last, so ``only-first`` is that mutant, not run twice.
TWO_CHILDREN = re.compile(
    r"^(self\._connectors|enumerate\(self\._connectors\)|zip\(self\._connectors, .*\)|connectors_config|ktcs|children"
    r"|cls\._get_connector_classes_and_configs\(\s*vllm_config\s*\)|self\._get_connector_classes_and_configs\(\s*vllm_config\s*\)"
    r'|kv_transfer_config\.kv_connector_extra_config\.get\(\s*"connectors",\s*\[\]\s*\))$',
    re.S,
)
# What a loop or an index follows one to one with the children: the children themselves, their
# metadata tuple, their configs and classes, the stats per child (by class name).
CHILDREN = re.compile(
    r"(self\._connectors|self\._ktc_kv_transfer_config|\bmetadata\b|\.metadata\b|connectors_config|"
    r'get\(\s*"connectors"|_get_connector_classes_and_configs|\bktcs\b|\bchildren\b|\bchild_counts\b|'
    r"\.data\.items\(\)|\bself\.data\.values\(\)|\bmetadata_list\b)"
)


class GenerateError(KvcompatError):
    """The equivalence file cannot be used."""


@dataclasses.dataclass(frozen=True)
class GeneratedMutant:
    """One generated change at one site of the release's file (applied by position)."""

    id: str
    contract: str  # "<Class>.<method>"
    description: str
    start: int  # character offsets of the replaced text in the pristine source
    end: int
    replacement: str
    equivalent: str | None = None
    same_as: str | None = None  # another mutant that makes the same program for this pair: its verdict is this one's
    target: str = ""  # the file, inside site-packages ("": multi_connector.py, kvcompat.mutation.catalogue.TARGET)
    line: int = 0  # where the change starts in the pristine file (0: not recorded; the session works it out)

    def apply(self, source: str) -> str:
        mutated = source[: self.start] + self.replacement + source[self.end :]
        compile(mutated, self.target or "multi_connector.py", "exec")
        return mutated

    def with_reason(self, reason: str | None) -> GeneratedMutant:
        return dataclasses.replace(self, equivalent=reason)


def _offsets(source: str) -> list[int]:
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _span(node: ast.AST, lines: list[int]) -> tuple[int, int]:
    return lines[node.lineno - 1] + node.col_offset, lines[node.end_lineno - 1] + node.end_col_offset


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclasses.dataclass
class _Method:
    cls: str
    name: str
    node: ast.FunctionDef

    @property
    def contract(self) -> str:
        return f"{self.cls}.{self.name}"


def methods(source: str) -> list[_Method]:
    """Every method (def inside the classes, properties and class methods too), in file order."""
    tree = ast.parse(source)
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out.append(_Method(node.name, item.name, item))
    return out


def _iterables(fn: ast.FunctionDef) -> list[ast.expr]:
    """The iterables of every loop and comprehension in ``fn`` that follow the children."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.For | ast.AsyncFor):
            found.append(node.iter)
        elif isinstance(node, ast.comprehension):
            found.append(node.iter)
    return found


class _Sites:
    """The mutants of one method, numbered per operator in the order their sites appear."""

    def __init__(self, method: _Method, lines: list[int]) -> None:
        self.method = method
        self.lines = lines
        self.slug = f"gen-{_slug(method.cls)}-{_slug(method.name)}"
        self.counts: dict[str, int] = {}
        self.mutants: list[GeneratedMutant] = []

    def add(self, op: str, node: ast.AST, replacement: str, what: str, same_as: str | None = None) -> str:
        self.counts[op] = self.counts.get(op, 0) + 1
        start, end = _span(node, self.lines)
        mid = f"{self.slug}-{op}-{self.counts[op]}"
        contract = self.method.contract
        self.mutants.append(
            GeneratedMutant(mid, contract, f"{contract}: {what}", start, end, replacement, same_as=same_as)
        )
        return mid


def generate(source: str) -> list[GeneratedMutant]:
    """The mutants of ``source`` (a release's multi_connector.py), in file order."""
    lines = _offsets(source)
    out: list[GeneratedMutant] = []
    for m in methods(source):
        sites = _Sites(m, lines)
        for it in _iterables(m.node):
            text = ast.get_source_segment(source, it) or ""
            if not CHILDREN.search(text):
                continue
            ids: dict[str, str] = {}
            for op, pattern in LOOP_OPERATORS.items():
                twin = ids["skip-last"] if op == "only-first" and TWO_CHILDREN.match(text.strip()) else None
                what = f"the loop over `{text}` made to {op.replace('-', ' ')}"
                ids[op] = sites.add(op, it, pattern.format(text), what, twin)
        for node in ast.walk(m.node):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("any", "all"):
                flip = "all" if node.func.id == "any" else "any"
                sites.add(f"{node.func.id}-to-{flip}", node.func, flip, f"`{node.func.id}(...)` made `{flip}(...)`")
            if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
                value = ast.get_source_segment(source, node.value) or ""
                index = ast.get_source_segment(source, node.slice) or ""
                if CHILDREN.search(value) and not re.fullmatch(r"-?\d+|[\"'].*[\"']", index):
                    for op, fixed in INDEX_OPERATORS.items():
                        sites.add(op, node.slice, fixed, f"`{value}[{index}]` fixed to `{value}[{fixed}]`")
        last = m.node.body[-1]
        for node in ast.walk(m.node):
            if isinstance(node, ast.Return) and node is not last and not _is_nested_def_return(m.node, node):
                text = ast.get_source_segment(source, node) or "return"
                sites.add("no-early-return", node, "pass", f"the early `{text.splitlines()[0]}` dropped")
        out += sites.mutants
    return out


def _is_nested_def_return(fn: ast.FunctionDef, ret: ast.Return) -> bool:
    """A return inside a lambda or nested def belongs to that one, not to the method."""
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            if any(n is ret for n in ast.walk(node)):
                return True
    return False


# -- equivalence and method reasons ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reasons:
    """tests/mutants/equivalent.toml: why generated mutants (per release) and sited-less methods are what they are.

    [[equivalent]] entries: ``ids`` (generated ids, or regular expressions over them with
    ``regex = true``), ``releases`` (a list of versions, or ``"*"``), ``reason`` (read from that
    release's children, with file:line).  ``[methods]``: "<Class>.<method>" = why no mutant is needed.
    [[explained]] entries, the same shape: why a mutant that survives does (code only a configuration the
    suite never sets up runs, or the contract a test would need), with the release's lines.  Unlike an
    equivalent one, such a mutant is still run and, if it survives, still counted as a survivor.
    """

    equivalent: tuple[tuple[tuple[str, ...], bool, tuple[str, ...], str], ...]
    method_reasons: dict[str, str]
    explained: tuple[tuple[tuple[str, ...], bool, tuple[str, ...], str], ...] = ()

    def reason_for(self, mutant_id: str, release: str) -> str | None:
        return _first_match(self.equivalent, mutant_id, release)

    def explanation_for(self, mutant_id: str, release: str) -> str | None:
        return _first_match(self.explained, mutant_id, release)


def _first_match(entries, mutant_id: str, release: str) -> str | None:
    for ids, regex, releases, reason in entries:
        if "*" not in releases and release not in releases:
            continue
        if any((re.fullmatch(i, mutant_id) if regex else i == mutant_id) for i in ids):
            return reason
    return None


def _entries(path: Path, data: dict, kind: str) -> tuple:
    entries = []
    for n, e in enumerate(data.get(kind, []), 1):
        ids, releases, reason = e.get("ids"), e.get("releases", "*"), e.get("reason")
        if isinstance(ids, str):
            ids = [ids]
        if isinstance(releases, str):
            releases = [releases]
        if not ids or not isinstance(reason, str) or not reason.strip():
            why = "why no test can tell it apart" if kind == "equivalent" else "why it survives, with the lines"
            raise GenerateError(f"{path}, {kind} {n}: needs ids and a reason ({why})")
        regex = bool(e.get("regex", False))
        for i in ids if regex else ():
            try:
                re.compile(i)
            except re.error as exc:
                raise GenerateError(f"{path}, {kind} {n}: {i!r} is not a regular expression ({exc}); fix it") from None
        entries.append((tuple(ids), regex, tuple(releases), reason))
    return tuple(entries)


def load_reasons(path: Path | None) -> Reasons:
    if path is None or not path.is_file():
        return Reasons((), {})
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise GenerateError(f"{path} is not valid TOML ({exc}); fix it") from None
    methods_ = data.get("methods", {})
    if not all(isinstance(v, str) and v.strip() for v in methods_.values()):
        raise GenerateError(f"{path}: every [methods] entry needs a reason")
    return Reasons(_entries(path, data, "equivalent"), dict(methods_), _entries(path, data, "explained"))


def mutants_for(source: str, release: str, reasons: Reasons) -> list[GeneratedMutant]:
    """The generated mutants of ``release``'s file, each equivalent one with its reason."""
    return [m.with_reason(reasons.reason_for(m.id, release)) for m in generate(source)]


def coverage(source: str, reasons: Reasons) -> dict[str, str]:
    """Per method: how it is covered ("N mutants") or why it needs none; "MISSING" when neither."""
    per_method: dict[str, int] = {}
    for m in generate(source):
        per_method[m.contract] = per_method.get(m.contract, 0) + 1
    out = {}
    for m in methods(source):
        n = per_method.get(m.contract, 0)
        out[m.contract] = f"{n} mutants" if n else reasons.method_reasons.get(m.contract, "MISSING")
    return out
