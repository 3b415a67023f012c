"""What a mutation session mutates: named groups of vLLM files the pair runs, resolved per installed release.

``--target`` picks one or more groups (default ``multi``, the session's behaviour before groups existed):

* ``multi``: kv_connector/v1/multi_connector.py, with the hand-written catalogue
  (tests/mutants/multi_connector.toml), the MultiConnector generator (kvcompat.mutation.generate)
  and tests/mutants/equivalent.toml;
* ``nixl``: NixlConnector's own modules, scheduler and worker side.  From 0.24 the package
  kv_connector/v1/nixl/ splits them into base_*/pull_* modules (the pull ones are what
  ``NixlConnector = NixlPullConnector`` runs); push_*.py and the class NixlPushConnector are
  NixlPushConnector's only and left out, as is stats.py (metrics only).  In 0.20-0.23 the package
  holds scheduler.py / worker.py / connector.py (probed by the same list: a file that is absent is
  skipped, a re-export shim has no function and yields no mutant); before 0.20 it is one file,
  kv_connector/v1/nixl_connector.py;
* ``offload``: SimpleCPUOffloadConnector and its scheduler/worker halves
  (vllm/v1/simple_kv_offload/manager.py, worker.py, metadata.py).  copy_backend.py and cuda_mem_ops.py
  are the CUDA transport, which the testkit replaces (kvcompat.testkit.cuda_transport): not mutated,
  listed as "transport replaced";
* ``scheduler``: vllm/v1/core/sched/scheduler.py, the Scheduler's connector paths only: in the methods
  whose AST names the connector or a KV transfer (:data:`CONNECTOR_WORDS`), the statements that do
  (a compound statement whose header does, whole; every statement of a method whose name does).
  ``schedule`` and ``update_from_output`` are mostly general scheduling (chunked prefill, drafts,
  encoder inputs, structured output): their other lines are not the connector's path;
* ``aggregator``: kv_connector/utils.py, class KVOutputAggregator only (what the executor uses to merge
  the workers' KVConnectorOutput).

Files are probed in the installed release (paths inside site-packages): a group with no file in a
release is not applicable there.  Harness code: reads files with ``ast``, imports no vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from kvcompat.errors import KvcompatError
from kvcompat.mutation.catalogue import TARGET

GROUPS = ("multi", "nixl", "offload", "scheduler", "aggregator")
DEFAULT_GROUPS = ("multi",)

V1 = "vllm/distributed/kv_transfer/kv_connector/v1/"
NIXL_PACKAGE = V1 + "nixl/"
# In the order a reader follows NixlConnector: the connector, its metadata, the scheduler side, the worker side.
NIXL_FILES = (
    "connector.py",
    "metadata.py",
    "base_scheduler.py",
    "pull_scheduler.py",
    "scheduler.py",
    "base_worker.py",
    "pull_worker.py",
    "worker.py",
    "utils.py",
    "tp_mapping.py",
)
NIXL_SINGLE_FILE = V1 + "nixl_connector.py"  # before 0.20
# Classes of the nixl files that only NixlPushConnector uses.
NIXL_EXCLUDED_CLASSES = re.compile(r"Push")
OFFLOAD_FILES = (
    V1 + "simple_cpu_offload_connector.py",
    "vllm/v1/simple_kv_offload/manager.py",
    "vllm/v1/simple_kv_offload/worker.py",
    "vllm/v1/simple_kv_offload/metadata.py",
)
OFFLOAD_REPLACED = ("vllm/v1/simple_kv_offload/copy_backend.py", "vllm/v1/simple_kv_offload/cuda_mem_ops.py")
SCHEDULER_FILE = "vllm/v1/core/sched/scheduler.py"
AGGREGATOR_FILE = "vllm/distributed/kv_transfer/kv_connector/utils.py"
# A Scheduler method, or a statement in one, is on the connector's path when its name or a name in it (a
# variable, an attribute, a called function, an argument, a keyword) contains one of these.  The encoder-cache
# connector (``ec_connector``, ECConnector) is another connector: its names do not count.
CONNECTOR_WORDS = (
    "connector",
    "kv_xfer",
    "remote_kv",
    "finished_sending",
    "finished_recving",
    "invalid_block",
    "kv_transfer",
    "WAITING_FOR_REMOTE_KVS",
    "_free_blocks",
    "failed_recving",
    "external_computed",  # num_external_computed_tokens: the tokens the connector will load
    "load_kv_async",
)
NOT_THE_CONNECTOR = re.compile(r"ec_connector|ECConnector|EC_CONNECTOR|aux_output_connector")


class TargetError(KvcompatError):
    """An unknown target group."""


@dataclasses.dataclass(frozen=True)
class Scope:
    """Which functions of a file are mutated."""

    classes: tuple[str, ...] | None = None  # only these classes (None: every class)
    exclude_classes: re.Pattern | None = None  # classes whose name matches are left out
    functions: bool = True  # module-level functions too
    connector_paths: bool = (
        False  # only the statements that name the connector (CONNECTOR_WORDS), see connector_statements
    )

    def describe(self) -> str:
        parts = []
        if self.classes is not None:
            parts.append("class " + ", ".join(self.classes) + " only")
        if self.exclude_classes is not None:
            parts.append(f"classes matching /{self.exclude_classes.pattern}/ left out")
        if self.connector_paths:
            parts.append("statements that name the connector or a KV transfer")
        return "; ".join(parts) or "every function and method"


@dataclasses.dataclass(frozen=True)
class TargetFile:
    path: str  # inside site-packages
    scope: Scope

    @property
    def slug(self) -> str:
        return file_slug(self.path)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A group in one installed release: the files mutated, and the ones named but left alone."""

    group: str
    files: tuple[TargetFile, ...]
    replaced: tuple[str, ...] = ()  # the transport the testkit replaces: present, not mutated
    absent: str = ""  # why the group has no file in this release


def file_slug(path: str) -> str:
    """The file's part of a generated id: nixl/pull_scheduler.py -> nixl-pull-scheduler."""
    p = path.removeprefix("vllm/").removesuffix(".py")
    for prefix in ("distributed/kv_transfer/kv_connector/v1/", "distributed/kv_transfer/", "v1/core/sched/", "v1/"):
        if p.startswith(prefix):
            p = p.removeprefix(prefix)
            break
    return re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-")


def check_groups(groups: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise TargetError(f"--target {' '.join(unknown)}: no such group; pick from {', '.join(GROUPS)}")
    return tuple(dict.fromkeys(groups)) or DEFAULT_GROUPS


def resolve(site: Path, group: str) -> Resolved:
    """The files of ``group`` in the vLLM installed under ``site`` (probed: what exists)."""
    check_groups((group,))
    every = Scope()
    if group == "multi":
        files = [TargetFile(TARGET, every)] if (site / TARGET).is_file() else []
        return Resolved(group, tuple(files), absent="" if files else f"no {TARGET}")
    if group == "nixl":
        scope = Scope(exclude_classes=NIXL_EXCLUDED_CLASSES)
        if (site / NIXL_PACKAGE).is_dir():
            paths = [NIXL_PACKAGE + f for f in NIXL_FILES if (site / NIXL_PACKAGE / f).is_file()]
        else:
            paths = [NIXL_SINGLE_FILE] if (site / NIXL_SINGLE_FILE).is_file() else []
        files = [TargetFile(p, scope) for p in paths]
        return Resolved(group, tuple(files), absent="" if files else "no NixlConnector in this release")
    if group == "offload":
        files = [TargetFile(p, every) for p in OFFLOAD_FILES if (site / p).is_file()]
        replaced = tuple(p for p in OFFLOAD_REPLACED if (site / p).is_file())
        if not (site / OFFLOAD_FILES[0]).is_file():
            return Resolved(group, (), absent="no SimpleCPUOffloadConnector in this release")
        return Resolved(group, tuple(files), replaced)
    if group == "scheduler":
        scope = Scope(classes=("Scheduler",), functions=False, connector_paths=True)
        files = [TargetFile(SCHEDULER_FILE, scope)] if (site / SCHEDULER_FILE).is_file() else []
        return Resolved(group, tuple(files), absent="" if files else f"no {SCHEDULER_FILE}")
    scope = Scope(classes=("KVOutputAggregator",), functions=False)
    has = (site / AGGREGATOR_FILE).is_file() and "class KVOutputAggregator" in (site / AGGREGATOR_FILE).read_text()
    files = [TargetFile(AGGREGATOR_FILE, scope)] if has else []
    return Resolved(group, tuple(files), absent="" if files else "no KVOutputAggregator in this release")


def names_connector(fn: ast.AST) -> bool:
    """Whether a function (its name, or a name in its body) names the connector or a KV transfer."""
    return any(is_connector_name(name) for name in _names(fn))


def _names_another_connector(node: ast.AST) -> bool:
    return any(NOT_THE_CONNECTOR.search(name) for name in _names(node))


def _ours(node: ast.AST) -> bool:
    """A statement or header on the KV connector's path: it names it, and no other connector."""
    return names_connector(node) and not _names_another_connector(node)


def _names(fn: ast.AST):
    """Every identifier in ``fn``: names, attributes, arguments, keywords, function names."""
    for node in ast.walk(fn):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.append(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # the method's own name too
            names.append(node.name)
        yield from names


def is_connector_name(name: str) -> bool:
    """Whether an identifier names the connector or a KV transfer (the encoder-cache connector's do not)."""
    name = NOT_THE_CONNECTOR.sub("", name)
    return any(word in name for word in CONNECTOR_WORDS)


_HEADERS = {
    ast.If: ("test",),
    ast.While: ("test",),
    ast.For: ("target", "iter"),
    ast.AsyncFor: ("target", "iter"),
    ast.With: ("items",),
    ast.AsyncWith: ("items",),
    ast.Match: ("subject",),
}


def connector_statements(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The statements of ``fn`` on the connector's path, outermost first (what the scheduler group mutates).

    Every statement when the function's own name names the connector; otherwise a compound statement whose
    header (an ``if``'s or ``while``'s test, a ``for``'s target and iterable, a ``with``'s items) names it,
    whole (its ``else`` too), and each simple statement that names it; the bodies of other compound statements
    are looked into.
    """
    if is_connector_name(fn.name):
        return list(fn.body)
    found: list[ast.stmt] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            fields = _HEADERS.get(type(s))
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
                found.extend(connector_statements(s))
            elif fields is None and not _has_body(s):
                if _ours(s):
                    found.append(s)
            elif fields is not None and any(_ours(_as_node(getattr(s, f))) for f in fields):
                found.append(s)
            else:
                for inner in _bodies(s):
                    visit(inner)

    visit(fn.body)
    return found


def _has_body(s: ast.stmt) -> bool:
    return any(isinstance(getattr(s, f, None), list) for f in ("body", "orelse", "finalbody", "handlers", "cases"))


def _bodies(s: ast.stmt) -> list[list[ast.stmt]]:
    out = [getattr(s, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(s, f, None), list)]
    out += [h.body for h in getattr(s, "handlers", [])]
    out += [c.body for c in getattr(s, "cases", [])]
    return out


def _as_node(value: ast.AST | list) -> ast.AST:
    """A header field as one node (a ``with``'s items are a list)."""
    if isinstance(value, list):
        return ast.Tuple(elts=[v.context_expr if isinstance(v, ast.withitem) else v for v in value], ctx=ast.Load())
    return value
