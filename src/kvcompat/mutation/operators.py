"""Generic mechanical mutants for the files the pair runs beyond multi_connector.py (see kvcompat.mutation.targets).

MultiConnector's generator (kvcompat.mutation.generate) mutates loops over the children; the other files
have no children to skip, so their mutants are the classic mechanical ones.  In every function and method
in the file's scope (a nested function or lambda counts for the function that holds it), one mutant per
site and operator:

* ``negate-if``: the condition C of an ``if``, ``elif`` or ``while`` made ``not (C)``;
* ``compare``: a comparison operator flipped at its boundary: ``<`` and ``<=``, ``>`` and ``>=``,
  ``==`` and ``!=``, ``in`` and ``not in``, ``is`` and ``is not`` (one mutant per operator of a chain);
* ``and-or``: a boolean operation's ``and`` made ``or`` and back (every operator of that one
  operation, so ``a and b and c`` is one mutant, ``a or b or c``);
* ``no-early-return``: a ``return`` that is not its function's last statement, dropped (``pass``);
* ``drop-call``: a statement that only changes state through a call (``x.add(...)``, ``.discard``,
  ``.pop``, ``.remove``, ``.append``, ``.extend``, ``.update``, ``.clear``, ``.set``, ``.free``,
  ``.put``, … :data:`DROP_METHODS`) or a ``del``, made ``pass``;
* ``const``: an int literal k that is an operand of arithmetic or of a comparison made k+1
  (``n - 1`` becomes ``n - 2``, ``x > 0`` becomes ``x > 1``);
* ``zero-return``: in a function that returns a number (annotated ``int`` / ``float``, or returning
  arithmetic, a numeric literal, ``len``/``sum``/``min``/``max``/``cdiv``…), the returned value made ``0``
  (a ``return None`` of an ``int | None`` function is left alone: None is not a number).

Kept conservative, so that a file yields hundreds of mutants rather than thousands and few of them are
equivalent by construction: ``assert`` and ``raise`` statements, logging calls (``logger.debug(...)`` and
the like) and f-strings are left alone (a flipped assert crashes at once, a message changes nothing a
test reads), as is an ``if`` whose body only logs; arithmetic operators are not swapped (``const`` is
the off-by-one); default values and decorators of a top-level function, and module- and class-level
code, run at import and are not mutated.

A mutant is identified by file, class, function, operator and rank (the site's place among that
operator's sites in the function, in source order): ``gen-<file>-<class>-<method>-<op>-<rank>``, or
``gen-<file>-<function>-<op>-<rank>`` for a module-level function (``<file>`` is
:func:`kvcompat.mutation.targets.file_slug`).  The same change keeps its id from one release to the next
while its function's code does.  A property's getter and setter share a name: their sites are numbered
together, the getter's first.  Mutants apply by position, in memory (no text to match elsewhere).
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import re

from kvcompat.mutation.generate import GeneratedMutant
from kvcompat.mutation.targets import Scope, TargetFile, connector_statements, names_connector

OPERATORS = ("negate-if", "compare", "and-or", "no-early-return", "drop-call", "const", "zero-return")
# Methods whose call, as a statement of its own, is there to change some state.
DROP_METHODS = frozenset(
    {
        "add",
        "append",
        "appendleft",
        "clear",
        "difference_update",
        "discard",
        "extend",
        "free",
        "insert",
        "intersection_update",
        "pop",
        "popitem",
        "popleft",
        "put",
        "put_nowait",
        "remove",
        "set",
        "setdefault",
        "update",
    }
)
LOG_METHODS = frozenset(
    {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
    | {"debug_once", "info_once", "warning_once"}
)
FLIP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "in": "not in", "not in": "in"}
FLIP |= {"is": "is not", "is not": "is"}
# The operator's token in the text between two operands (which holds only it, brackets and blanks).
OP_TOKEN = {
    ast.Eq: r"==",
    ast.NotEq: r"!=",
    ast.Lt: r"<(?![<=])",
    ast.LtE: r"<=",
    ast.Gt: r"(?<![-])>(?![>=])",
    ast.GtE: r">=",
    ast.In: r"(?<![\w])in(?![\w])",
    ast.NotIn: r"(?<![\w])not\s+in(?![\w])",
    ast.Is: r"(?<![\w])is(?![\w])",
    ast.IsNot: r"(?<![\w])is\s+not(?![\w])",
}
NUMERIC_CALLS = frozenset(
    {"len", "sum", "min", "max", "int", "float", "round", "abs", "cdiv", "round_up", "round_down"}
)
ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


@dataclasses.dataclass(frozen=True)
class Function:
    """A function or method in scope; ``cls`` is its class (dotted when nested), None at module level."""

    cls: str | None
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def contract(self) -> str:
        return f"{self.cls}.{self.name}" if self.cls else self.name


class Text:
    """Character offsets of AST positions (whose columns count UTF-8 bytes)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def line_of(self, offset: int) -> int:
        """The 1-based line holding ``offset``: the number of line starts at or before it."""
        return bisect.bisect_right(self.starts, offset)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def functions(source: str, scope: Scope) -> list[Function]:
    """The functions and methods of ``source`` that ``scope`` takes, in file order."""
    tree = ast.parse(source)
    out: list[Function] = []

    def wanted(fn: ast.AST) -> bool:
        return not scope.connector_paths or names_connector(fn)

    def visit_class(node: ast.ClassDef, outer: str | None) -> None:
        qual = f"{outer}.{node.name}" if outer else node.name
        top = qual.split(".")[0]
        if scope.classes is not None and top not in scope.classes and qual not in scope.classes:
            return
        if scope.exclude_classes is not None and scope.exclude_classes.search(qual):
            return
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and wanted(item):
                out.append(Function(qual, item))
            elif isinstance(item, ast.ClassDef):
                visit_class(item, qual)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if scope.functions and scope.classes is None and wanted(node):
                out.append(Function(None, node))
        elif isinstance(node, ast.ClassDef):
            visit_class(node, None)
    return out


def _is_log_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr not in LOG_METHODS:
        return False
    owner = node.func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return "log" in name.lower()


def _logs_only(node: ast.If) -> bool:
    """An ``if`` without ``else`` whose body only logs (or passes): negating it changes only messages."""
    if node.orelse:
        return False
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and _is_log_call(s.value)) for s in node.body)


def _left_alone(node: ast.AST) -> bool:
    """Subtrees no operator looks into: asserts, raises, logging calls, f-strings, type-checking blocks."""
    if isinstance(node, ast.Assert | ast.Raise | ast.JoinedStr):
        return True
    if isinstance(node, ast.Expr) and _is_log_call(node.value):
        return True
    if _is_log_call(node):
        return True
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.AST, ast.AST | None]]:
    """Every node of the function's body (not its own decorators or defaults) with its parent, minus left-alone subtrees."""
    out: list[tuple[ast.AST, ast.AST | None]] = []
    stack: list[tuple[ast.AST, ast.AST | None]] = [(s, fn) for s in reversed(fn.body)]
    while stack:
        node, parent = stack.pop()
        if _left_alone(node):
            continue
        out.append((node, parent))
        stack.extend((child, node) for child in reversed(list(ast.iter_child_nodes(node))))
    return out


def _owner_defs(fn: ast.AST) -> dict[int, ast.AST]:
    """For every Return in ``fn``: the innermost function or lambda it belongs to (by id of the Return)."""
    owners: dict[int, ast.AST] = {}

    def visit(node: ast.AST, owner: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Return):
                owners[id(child)] = owner
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else owner
            visit(child, inner)

    visit(fn, fn)
    return owners


def _numeric_annotation(fn: ast.AST) -> bool:
    ann = getattr(fn, "returns", None)
    names = set()
    while isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):  # int | None
        if isinstance(ann.right, ast.Name):
            names.add(ann.right.id)
        ann = ann.left
    if isinstance(ann, ast.Name):
        names.add(ann.id)
    return bool(names & {"int", "float"})


def _numeric_value(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, ARITHMETIC)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _numeric_value(node.operand)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in NUMERIC_CALLS
    return False


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _first_line(text: str, width: int = 90) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= width and "\n" not in text.strip() else line[:width].rstrip() + " …"


@dataclasses.dataclass(frozen=True)
class Site:
    op: str
    start: int
    end: int
    replacement: str
    what: str
    # Two sites with the same key make the same program: ``if a is None`` negated is ``if a is not None``,
    # the compare mutant of the same test.  The later one takes the earlier one's verdict (same_as).
    twin: int | None = None


# Comparisons whose flip is their negation (``<`` flipped is ``<=``, not ``>=``: no twin there).
NEGATING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _negating_compare(node: ast.AST) -> int | None:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], NEGATING):
        return id(node)
    return None


def _token_in_gap(text: str, start: int, end: int, pattern: str) -> tuple[int, int] | None:
    """Where the operator's token is in ``text[start:end]`` (the text between two operands)."""
    gap = text[start:end]
    if "#" in gap:  # a comment between the operands: leave the site alone rather than guess
        return None
    m = re.search(pattern, gap)
    return (start + m.start(), start + m.end()) if m else None


def sites(fn: Function, text: Text) -> list[Site]:
    """Every site of every operator in ``fn``, in source order."""
    src = text.source
    found: list[Site] = []
    owners = _owner_defs(fn.node)
    last = fn.node.body[-1]
    nested = {
        id(r)
        for n in ast.walk(fn.node)
        if n is not fn.node and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for r in ast.walk(n)
        if isinstance(r, ast.Return)
    }
    nodes = _nodes(fn.node)
    parents = {id(n): p for n, p in nodes}
    for node, parent in nodes:
        if isinstance(node, ast.If | ast.While):
            if isinstance(node, ast.If) and _logs_only(node):
                continue
            s, e = text.span(node.test)
            cond = src[s:e]
            kw = "while" if isinstance(node, ast.While) else "if"
            what = f"`{kw} {_first_line(cond)}` made `{kw} not (…)`"
            found.append(Site("negate-if", s, e, f"not ({cond})", what, _negating_compare(node.test)))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                a_end = text.span(operands[i])[1]
                b_start = text.span(operands[i + 1])[0]
                where = _token_in_gap(src, a_end, b_start, OP_TOKEN[type(op)])
                if where is None:
                    continue
                token = re.sub(r"\s+", " ", src[where[0] : where[1]])
                flipped = FLIP[token]
                s, e = text.span(node)
                what = f"`{token}` made `{flipped}` in `{_first_line(src[s:e])}`"
                found.append(Site("compare", where[0], where[1], flipped, what, _negating_compare(node)))
        elif isinstance(node, ast.BoolOp):
            s, e = text.span(node)
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            pieces, at, ok = [], s, True
            for a, b in zip(node.values, node.values[1:], strict=False):
                a_end, b_start = text.span(a)[1], text.span(b)[0]
                where = _token_in_gap(src, a_end, b_start, rf"(?<![\w]){word}(?![\w])")
                if where is None:
                    ok = False
                    break
                pieces += [src[at : where[0]], other]
                at = where[1]
            if ok:
                pieces.append(src[at:e])
                what = f"`{word}` made `{other}` in `{_first_line(src[s:e])}`"
                found.append(Site("and-or", s, e, "".join(pieces), what))
        elif isinstance(node, ast.Return):
            s, e = text.span(node)
            if node is not last and id(node) not in nested:
                found.append(Site("no-early-return", s, e, "pass", f"the early `{_first_line(src[s:e])}` dropped"))
            value = node.value
            owner = owners.get(id(node), fn.node)
            none = isinstance(value, ast.Constant) and value.value is None  # `-> int | None`'s None stays
            numeric = _numeric_annotation(owner) or _numeric_value(value) if value is not None else False
            if value is not None and not none and not _is_zero(value) and numeric:
                vs, ve = text.span(value)
                what = f"`{_first_line(src[s:e])}` made `return 0`"
                found.append(Site("zero-return", vs, ve, "0", what))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in DROP_METHODS:
                s, e = text.span(node)
                found.append(Site("drop-call", s, e, "pass", f"`{_first_line(src[s:e])}` dropped"))
        elif isinstance(node, ast.Delete):
            s, e = text.span(node)
            found.append(Site("drop-call", s, e, "pass", f"`{_first_line(src[s:e])}` dropped"))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            child, holder = node, parent
            if isinstance(holder, ast.UnaryOp) and isinstance(holder.op, ast.USub):  # -k: k is the literal
                child, holder = holder, parents.get(id(holder))
            operand = isinstance(holder, ast.BinOp | ast.Compare) or (
                isinstance(holder, ast.AugAssign) and holder.value is child
            )
            if operand:
                s, e = text.span(node)
                k = node.value
                hs, he = text.span(holder)
                what = f"`{k}` made `{k + 1}` in `{_first_line(src[hs:he])}`"
                found.append(Site("const", s, e, str(k + 1), what))
    found.sort(key=lambda x: (x.start, -x.end, OPERATORS.index(x.op)))
    return found


def _in_scope(found: list[Site], fn: Function, text: Text, scope: Scope) -> list[Site]:
    """The sites the scope mutates: with ``connector_paths``, those inside a statement on the connector's path."""
    if not scope.connector_paths:
        return found
    spans = [text.span(s) for s in connector_statements(fn.node)]
    return [x for x in found if any(s <= x.start and x.end <= e for s, e in spans)]


def generate(source: str, target: TargetFile) -> list[GeneratedMutant]:
    """The mutants of one file of a group, in file order (each compiles: checked here, before any run)."""
    text = Text(source)
    file = target.slug
    counts: dict[tuple[str, str], int] = {}
    out: list[GeneratedMutant] = []
    seen: set[str] = set()
    twins: dict[int, str] = {}
    for fn in functions(source, target.scope):
        who = f"{_slug(fn.cls)}-{_slug(fn.name)}" if fn.cls else _slug(fn.name)
        for site in _in_scope(sites(fn, text), fn, text, target.scope):
            key = (fn.contract, site.op)
            counts[key] = counts.get(key, 0) + 1
            mid = f"gen-{file}-{who}-{site.op}-{counts[key]}"
            if mid in seen:  # e.g. a class and a function whose names slug alike: never two mutants under one id
                raise ValueError(f"{target.path}: two sites make the id {mid}; the generator needs a tie-breaker")
            seen.add(mid)
            same_as = twins.get(site.twin) if site.twin is not None else None
            if site.twin is not None and same_as is None:
                twins[site.twin] = mid
            mutant = GeneratedMutant(
                mid,
                fn.contract,
                f"{fn.contract}: {site.what}",
                site.start,
                site.end,
                site.replacement,
                same_as=same_as,
                target=target.path,
                line=text.line_of(site.start),
            )
            out.append(mutant)
    return out


def per_function(source: str, target: TargetFile, mutants: list[GeneratedMutant]) -> dict[str, str]:
    """Per function in scope: "N mutants", or "no site" (informational: no reason is asked for)."""
    counts: dict[str, int] = {}
    for m in mutants:
        counts[m.contract] = counts.get(m.contract, 0) + 1
    out = {}
    for fn in functions(source, target.scope):
        n = counts.get(fn.contract, 0)
        out[f"{target.slug}:{fn.contract}"] = f"{n} mutants" if n else "no site"
    return out
