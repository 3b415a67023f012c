"""vLLM's own connector unit tests, runnable in a cell as a second suite ("upstream").

The tests come from the vLLM *sdist* of the release under test (the wheels do
not ship ``tests/``).  Only the connector tests and what they import are
extracted, into ``cache_dir/<version>/``, which then serves as pytest's rootdir::

    suite = upstream.prepare("0.33.0", cache_dir)
    cmd = [python, "-m", "pytest", str(suite.path), "-p", "kvcompat.testkit.pytest_plugin",
           f"--kvcompat-json={json}", "--kvcompat-suite=upstream", *suite.pytest_args]
    subprocess.run(cmd, cwd=suite.rootdir, env={**os.environ, **suite.env})

Nothing is built: the sdist is fetched straight from the index's simple API
(PEP 691 JSON, hash-verified), because ``pip download`` of an sdist runs the
PEP 517 metadata hook, i.e. vLLM's ``setup.py`` (torch, cmake).  The tarball
is read with :mod:`tarfile`; its ``vllm/`` sources are never extracted (they
would shadow the installed wheel, since the rootdir ends up on ``sys.path``).

Which files are needed is computed, not listed per release: the target test
files, plus every ``__init__.py``/``conftest.py`` above them, plus, transitively,
every ``tests.*`` (or relative) module they import anywhere in the file,
including imports inside functions.

Model ids that the tests pass to ``VllmConfig``/``ModelConfig`` are served from
an offline Hugging Face hub cache that :func:`hf_offline_cache` writes: real
hub layout, config files written here, no weights, no download.

This module is harness code: it runs in the nox process and never imports vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from kvcompat import simple_api
from kvcompat.hfcache import MODEL_CONFIGS, hf_offline_cache
from kvcompat.option_table import PYPI

MANIFEST = "kvcompat-upstream.json"
CPU_PLATFORM_PLUGIN = "kvcompat.testkit.cpu_platform_plugin"  # in-cell: imports vLLM
MANIFEST_FORMAT = 3  # bump when the extraction rules change; older caches are re-extracted

UNIT = "tests/v1/kv_connector/unit"
# The upstream column: vLLM's own tests of this pair, the seed of this project (in every sdist since
# 0.23.0), and MultiConnector's own.  Files or folders (a folder means every test_*.py in it).  A
# release whose sdist lacks one predates it: that file is not applicable there (the manifest's
# "absent_targets", read from the sdist's file list), never red.
TARGETS = (
    f"{UNIT}/test_nixl_simple_cpu_offload.py",
    f"{UNIT}/test_multi_connector.py",
)


class UpstreamError(RuntimeError):
    """The upstream tests of a release cannot be obtained (no sdist, bad hash, no targets)."""


@dataclasses.dataclass(frozen=True)
class UpstreamSuite:
    """What the runner needs to run one release's upstream connector tests.

    Run ``python -m pytest <path> -p kvcompat.testkit.pytest_plugin --kvcompat-json=…
    --kvcompat-suite=upstream <pytest_args>`` with ``env`` added to the
    environment and ``cwd=rootdir``.
    """

    version: str
    path: Path  # what to hand pytest (the unit-test folder)
    rootdir: Path  # cwd; holds tests/ and the pytest.ini that pins rootdir and registers markers
    env: dict[str, str]
    pytest_args: list[str]
    targets: list[str]  # target test files found in this release, relative to rootdir
    absent: list[str]  # target files this release's sdist does not have: not applicable here
    model_ids: list[str]  # hub ids the extracted tests mention
    missing_models: list[str]  # mentioned ids with no config written (tests using them will fail offline)
    deselected: list[str] = dataclasses.field(
        default_factory=list
    )  # --deselect ids, see prepare(exclude_engine_tests=)


# --------------------------------------------------------------------------------------
# fetching


def sdist_link(version: str, index_url: str = PYPI) -> tuple[str, str | None]:
    """(url, sha256) of ``vllm-<version>.tar.gz`` on the index's simple API."""
    base = index_url.rstrip("/")
    filename = f"vllm-{version}.tar.gz"
    for f in simple_api.project_files(base, "vllm"):
        if f["filename"] == filename:
            return f["url"], f["sha256"]
    raise UpstreamError(f"{base} has no sdist {filename} (some releases, e.g. 0.15.x, were published as wheels only)")


def download_sdist(version: str, dest_dir: Path, index_url: str = PYPI) -> Path:
    """Download ``vllm-<version>.tar.gz`` into ``dest_dir`` and check its sha256; builds nothing."""
    url, sha = sdist_link(version, index_url)
    data = simple_api.http_get(url, timeout=600.0)
    digest = hashlib.sha256(data).hexdigest()
    if sha and digest != sha:
        raise UpstreamError(f"sha256 mismatch for {url}: index says {sha}, got {digest}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / url.rsplit("/", 1)[-1]
    path.write_bytes(data)
    return path


def download_sdist_cached(version: str, dest_dir: Path, index_url: str = PYPI) -> Path:
    """``dest_dir/vllm-<version>.tar.gz``, downloaded (hash-checked) the first time only."""
    path = dest_dir / f"vllm-{version}.tar.gz"
    if path.is_file():
        return path
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=_mkdir(dest_dir)))
    try:
        os.replace(download_sdist(version, tmp, index_url), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _mkdir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# --------------------------------------------------------------------------------------
# selecting what to extract


def read_sdist(sdist: Path) -> tuple[set[str], dict[str, bytes]]:
    """All member paths (top folder stripped) and the bytes of ``tests/**.py`` and ``pyproject.toml``."""
    names: set[str] = set()
    sources: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:*") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if len(parts) < 2 or not member.isfile() or ".." in parts:
                continue
            rel = "/".join(parts[1:])
            names.add(rel)
            if (rel.startswith("tests/") and rel.endswith(".py")) or rel == "pyproject.toml":
                sources[rel] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return names, sources


def _module_files(module: str, sources: dict[str, bytes]) -> list[str]:
    base = module.replace(".", "/")
    return [p for p in (base + ".py", base + "/__init__.py") if p in sources]


def _imported_modules(path: str, source: bytes) -> tuple[set[str], bool]:
    """Dotted names a file may import (absolute, relative ones resolved), at any depth; and whether it parsed."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return set(), False
    package = path.rsplit("/", 1)[0].split("/")
    if path.endswith("/__init__.py"):
        package = path[: -len("/__init__.py")].split("/")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets
        ):
            value = node.value
            elts = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            found.update(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return found, True


def select_files(
    names: Iterable[str], sources: dict[str, bytes], targets: Iterable[str] | None = None
) -> tuple[list[str], list[str], list[str]]:
    """(target test files present, every file to extract, files that failed to parse).

    Targets are files or folders; the closure adds the ``__init__.py`` and
    ``conftest.py`` of every folder from ``tests/`` down to each selected file
    and, transitively, every module of the sdist's ``tests`` tree it imports.
    """
    names = set(names)
    found: list[str] = []
    queue: list[str] = []
    for target in TARGETS if targets is None else targets:
        if target.endswith(".py"):
            if target in sources:
                found.append(target)
                queue.append(target)
        else:
            inside = sorted(p for p in sources if p.startswith(target + "/"))
            found += [p for p in inside if PurePosixPath(p).name.startswith("test_")]
            queue += inside  # helpers, conftest and __init__ of the folder too
    selected: set[str] = set()
    unparsable: list[str] = []
    while queue:
        path = queue.pop()
        if path in selected:
            continue
        selected.add(path)
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            queue += [
                p for p in (f"{folder}/__init__.py", f"{folder}/conftest.py") if p in sources and p not in selected
            ]
        modules, ok = _imported_modules(path, sources[path])
        if not ok:
            unparsable.append(path)
        for module in modules:
            if module == "tests" or module.startswith("tests."):
                queue += [p for p in _module_files(module, sources) if p not in selected]
    assert selected <= names | set(sources)
    return sorted(found), sorted(selected), sorted(unparsable)


def _pytest_ini(pyproject: bytes | None) -> str:
    """Our rootdir's pytest.ini: pins rootdir, registers upstream's markers; nothing else of upstream's config."""
    markers: list[str] = []
    if pyproject:
        try:
            import tomllib

            markers = tomllib.loads(pyproject.decode())["tool"]["pytest"]["ini_options"].get("markers", [])
        except (ValueError, KeyError, TypeError):
            markers = []
    lines = ["# written by kvcompat.upstream; markers copied from the sdist's pyproject.toml", "[pytest]"]
    if markers:
        lines.append("markers =")
        lines += [f"    {m}" for m in markers]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# model ids

_HUB_ID = re.compile(r"""["']((?:[A-Za-z0-9][A-Za-z0-9_.-]*)/(?:[A-Za-z0-9][A-Za-z0-9_.-]*))["']""")
_NOT_HUB_ORGS = {
    "tests",
    "vllm",
    "v1",
    "tmp",
    "test",
    "dev",
    "usr",
    "proc",
    "sys",
    "home",
    "data",
    "models",
    "path",
    "some",
    "fake",
    "dummy",
    "mock",
    "foo",
    "remote",
}


def model_ids_in(sources: Iterable[bytes]) -> list[str]:
    """Hub-id-looking string literals (``org/name``) in test sources; filesystem-ish ones dropped."""
    ids: set[str] = set()
    for source in sources:
        for m in _HUB_ID.finditer(source.decode(errors="replace")):
            org, name = m.group(1).split("/")
            if org.lower() in _NOT_HUB_ORGS or name.endswith((".py", ".json", ".txt", ".so")) or org.startswith("."):
                continue
            ids.add(m.group(1))
    return sorted(ids)


# --------------------------------------------------------------------------------------
# fetch_tests


def fetch_tests(version: str, cache_dir: Path, *, index_url: str = PYPI, sdist: Path | None = None) -> Path:
    """Extract the connector tests of ``vllm==version`` into ``cache_dir/<version>/``; return that folder.

    Cached: a folder with a current manifest is returned at once.  Extraction
    goes to a temp folder beside it and is renamed into place, so readers never
    see half a tree and concurrent callers are safe (the first rename wins).
    ``sdist`` uses a local tarball instead of downloading.
    """
    cache_dir = Path(cache_dir).resolve()
    dest = cache_dir / version
    if manifest(dest).get("format") == MANIFEST_FORMAT:
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=cache_dir))
    try:
        tarball = sdist or download_sdist(version, tmp / "_sdist", index_url)
        names, sources = read_sdist(tarball)
        targets, files, unparsable = select_files(names, sources)  # none: the release predates them all
        tree = tmp / "tree"
        tree.mkdir(parents=True)
        for rel in files:
            out = tree / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(sources[rel])
        (tree / "pytest.ini").write_text(_pytest_ini(sources.get("pyproject.toml")))
        info = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "sdist": tarball.name,
            "sdist_sha256": hashlib.sha256(tarball.read_bytes()).hexdigest(),
            "targets": targets,
            "absent_targets": [t for t in TARGETS if not any(f == t or f.startswith(t + "/") for f in targets)],
            "files": files,
            "unparsable": unparsable,
            # from the connector tests and their helpers only (tests/models/registry.py lists hundreds)
            "model_ids": model_ids_in(sources[f] for f in files if f.startswith("tests/v1/")),
        }
        (tree / MANIFEST).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(tree, dest)
        except OSError:
            if manifest(dest).get("format") != MANIFEST_FORMAT:  # not a concurrent winner: a stale tree
                stale = cache_dir / f".{version}.stale.{os.getpid()}"
                os.rename(dest, stale)
                os.rename(tree, dest)
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def manifest(root: Path) -> dict:
    """The manifest fetch_tests wrote into ``root`` (targets, files, model ids, sdist hash); {} when absent."""
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------------------
# tests that start a whole engine on a real model


def engine_tests(path: str, source: bytes, constructors: tuple[str, ...] = ("LLM",)) -> list[str]:
    """``--deselect`` ids for the tests of one file that build an ``LLM(...)`` engine.

    Found statically: a test function (module level or in a ``Test*`` class)
    that calls a constructor directly or through a module-level function of the
    same file.  Such tests need the model's weights and tokenizer, which the
    offline cache does not (and must not) provide.  pytest's ``--deselect`` is
    a prefix match, so a parametrized test gets ``id[`` and a test whose name
    prefixes another test's name is left alone rather than over-matched.
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return []

    def calls(fn: ast.AST) -> set[str]:
        return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}

    funcs: dict[str, ast.AST] = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    builds = {name for name, fn in funcs.items() if calls(fn) & set(constructors)}
    changed = True
    while changed:  # helpers calling helpers
        grown = {name for name, fn in funcs.items() if calls(fn) & builds} | builds
        changed, builds = grown != builds, grown
    tests: list[tuple[str, ast.AST]] = [(n, f) for n, f in funcs.items() if n.startswith("test")]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")):
        tests += [
            (f"{cls.name}::{f.name}", f)
            for f in cls.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")
        ]
    names = [n for n, _ in tests]
    out = []
    for name, fn in tests:
        if not (calls(fn) & (builds | set(constructors))):
            continue
        parametrized = any("parametrize" in ast.unparse(d) for d in fn.decorator_list)  # type: ignore[attr-defined]
        if parametrized:
            out.append(f"{path}::{name}[")
        elif not any(other != name and other.startswith(name) for other in names):
            out.append(f"{path}::{name}")
    return out


# --------------------------------------------------------------------------------------
# prepare


def prepare(
    version: str,
    cache_dir: Path,
    *,
    index_url: str = PYPI,
    platform: str = "native",
    exclude_engine_tests: bool = False,
) -> UpstreamSuite:
    """Fetch (cached) the upstream connector tests of ``version`` and say how to run them.

    ``platform``: ``"native"`` leaves vLLM's own platform detection alone (the
    official CUDA wheels resolve to UnspecifiedPlatform on a GPU-less box);
    ``"cpu"`` selects vLLM's CpuPlatform, as our own suite does: it sets
    ``VLLM_TARGET_DEVICE=cpu`` (honoured from 0.28.0) and loads this module as
    loads :mod:`kvcompat.testkit.cpu_platform_plugin`, which sets
    ``vllm.platforms._current_platform`` for older releases before any
    conftest imports vLLM, and stops the run (usage error) if the platform
    is not CpuPlatform afterwards.

    ``exclude_engine_tests`` deselects the tests that build a whole ``LLM``
    engine on a hub model (see :func:`engine_tests`); without weights they can
    only fail.  Off by default: what is deselected is listed in ``deselected``.
    """
    cache_dir = Path(cache_dir).resolve()
    root = fetch_tests(version, cache_dir, index_url=index_url)
    info = manifest(root)
    mentioned = list(info.get("model_ids", []))
    known = [m for m in mentioned if m in MODEL_CONFIGS]
    env = hf_offline_cache(cache_dir / "hf", known)
    env.update(
        {
            "PYTHONDONTWRITEBYTECODE": "1",  # keep the shared extracted tree pristine
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    pytest_args = ["-p", "no:cacheprovider", f"--rootdir={root}"]
    if platform == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        pytest_args += ["-p", CPU_PLATFORM_PLUGIN]  # selects CpuPlatform before upstream's conftest imports vLLM
    elif platform != "native":
        raise ValueError(f"platform must be 'native' or 'cpu', not {platform!r}")
    targets = list(info["targets"])
    # Test modules outside the targets that a target imports (e.g. test_nixl_connector.py's
    # FakeNixlWrapper, or tests/v1/simple_kv_offload/test_scheduler.py's helpers) are extracted
    # as helpers; only those under the collected folder need keeping out of collection.
    for rel in info["files"]:
        name = PurePosixPath(rel).name
        if rel.startswith(UNIT + "/") and name.startswith("test_") and rel not in targets:
            pytest_args.append(f"--ignore={rel}")  # helper module, not a selected suite
    deselected: list[str] = []
    if exclude_engine_tests:
        for rel in targets:
            # needs the model's weights and tokenizer (an LLM engine end to end); the offline cache has configs only
            deselected += engine_tests(rel, (root / rel).read_bytes())
        pytest_args += [f"--deselect={d}" for d in deselected]
    return UpstreamSuite(
        version=version,
        path=root / UNIT,
        rootdir=root,
        env=env,
        pytest_args=pytest_args,
        targets=targets,
        absent=list(info.get("absent_targets", [])),
        model_ids=mentioned,
        missing_models=[m for m in mentioned if m not in MODEL_CONFIGS],
        deselected=deselected,
    )
