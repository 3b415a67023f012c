"""The layout tells the architecture: two worlds with import rules, no circles, a map in docs/layout.md to match."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO

SRC = REPO / "src"
SHARED = {
    "kvcompat",
    "kvcompat.outcomes",
    "kvcompat.atomic",
    "kvcompat.shapes",
}  # the vocabulary both worlds use (stdlib only)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "kvcompat").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


# The in-cell packages: imported inside a cell's venv, next to vLLM (the mutation session's pytest plugins too)
IN_CELL = ("kvcompat.testkit", "kvcompat.mutation.incell")


def in_cell(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in IN_CELL)


def test_only_the_testkit_imports_vllm_torch_or_pytest_internals():
    for name, path in modules().items():
        heavy = {m for m in imports(path) if m.split(".")[0] in ("vllm", "torch", "numpy", "nixl")}
        if not in_cell(name):
            assert not heavy, f"harness module {name} imports {sorted(heavy)}"


def test_testkit_imports_no_harness_internals():
    known = set(modules())
    for name, path in modules().items():
        if in_cell(name):
            ours = {m for m in imports(path) if m.startswith("kvcompat") and m in known}
            harness = {m for m in ours if not in_cell(m)} - SHARED
            assert not harness, f"in-cell module {name} imports harness modules {sorted(harness)}"


def test_shared_vocabulary_is_stdlib_only():
    for name in SHARED - {"kvcompat"}:
        third_party = (
            {m.split(".")[0] for m in imports(modules()[name])} - set(sys.stdlib_module_names) - {"__future__"}
        )
        assert third_party <= {"kvcompat"}, f"{name} imports {third_party}"
        assert not {m for m in imports(modules()[name]) if m.startswith("kvcompat.")}, f"{name} imports kvcompat"


def test_harness_modules_import_without_vllm():
    """Import every harness module in a fresh interpreter where vllm/torch cannot be imported."""
    names = [n for n in modules() if not in_cell(n)]
    code = (
        "import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'torch'):\n            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\nimport importlib\n"
        f"for n in {names!r}:\n    importlib.import_module(n)\nprint('ok', len({names!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)})
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr


def test_only_the_front_doors_import_the_verbs():
    """kvcompat.commands is the verbs: noxfile.py and cli.py call them, no other module of src/ does."""
    for name, path in modules().items():
        if name == "kvcompat.cli" or name.startswith("kvcompat.commands"):
            continue
        verbs = {m for m in imports(path) if m == "kvcompat.commands" or m.startswith("kvcompat.commands.")}
        assert not verbs, f"{name} imports {sorted(verbs)}: only the front doors (noxfile.py, cli.py) call the verbs"
    assert "kvcompat.commands" in (REPO / "noxfile.py").read_text()


def test_the_runner_imports_no_report():
    """A cell run writes its result and tally (kvcompat.results); the report reads them, never the other way."""
    for name, path in modules().items():
        if name == "kvcompat.run" or name.startswith("kvcompat.run."):
            report = {m for m in imports(path) if m == "kvcompat.report" or m.startswith("kvcompat.report.")}
            assert not report, f"{name} imports {sorted(report)}"


def test_no_import_cycles():
    known = set(modules())
    graph = {
        n: {m for m in imports(p) if m in known and m != n and not n.startswith(m + ".")} for n, p in modules().items()
    }
    # an import of a package's name means its __init__; a package __init__ importing its own modules is fine
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_layout_map_lists_every_module_and_nothing_else():
    """docs/layout.md ("Where things are", linked from the README) maps every module."""
    assert "](docs/layout.md)" in (REPO / "README.md").read_text()
    page = (REPO / "docs" / "layout.md").read_text()
    section = page.split("# Where things are", 1)[1].split("\n## ", 1)[0]
    listed = {
        cell.strip("` ") for line in section.splitlines() if line.startswith("| `") for cell in [line.split("|")[1]]
    }
    # a package's __init__ is listed where it holds the package's own job (kvcompat/testkit/deploy/)
    files = {str(p.relative_to(SRC)) for p in (SRC / "kvcompat").rglob("*.py") if p.name != "__init__.py"}
    files |= {p for p in listed if p.endswith("/__init__.py") and (SRC / p).exists()}
    assert files - listed == set(), f"modules missing from docs/layout.md's map: {sorted(files - listed)}"
    stale = {p for p in listed if p.startswith("kvcompat/") and p not in files}
    assert not stale, f"docs/layout.md's map lists modules that do not exist: {sorted(stale)}"
    for top in ("noxfile.py", "tests/connectors/", "tests/harness/", "tests/testkit/", "constraints/", "benchmarks/"):
        assert top in listed and (REPO / top).exists(), top
