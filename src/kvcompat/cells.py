"""Cells: one (vLLM, torch, NIXL) combination to install and test.

``resolve_cells`` turns matrix entries into concrete cells: ranges are expanded
against the index, ``torch = "pinned"`` becomes the version the vLLM wheel pins.
A cell whose vLLM cannot be found or resolved is still a cell (with torch
``pinned``); running it records ``unresolvable`` instead of crashing the listing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from kvcompat import index
from kvcompat.matrix import NIXL_FAKE, Entry, MatrixError, load_matrix, matrix_source
from kvcompat.option_table import PYPI
from kvcompat.outcomes import CHILD_ORDERS

PYTHON = "3.11"
# An as-released cell resolves as the index stood this long after the vLLM release's upload:
# long enough for what ships beside a release (the hotfix wheels of the packages it pins,
# published within a day or two), short enough that the lock is what a user installing in
# release week got, not the ecosystem of the weeks after.
AS_RELEASED_GRACE = dt.timedelta(days=3)
# What vLLM's own connector tests import beyond vLLM and pytest: tblib (tests/conftest.py)
# and ray (test_nixl_connector.py; vLLM itself stopped requiring it after 0.17).
UPSTREAM_TEST_REQUIREMENTS = ["tblib", "ray"]  # every surveyed vLLM release (0.8.5-0.34) accepts 3.11
# Each built against one torch release and pinning it exactly: an override cell's must match its torch.
TORCH_COMPANIONS = ("torchvision", "torchaudio")
# A range is expanded into cells when the matrix loads, and every cell asks the index for its torch pin
# (about 3 s each, on every `nox -l`) and would take a venv of ~10 GB: a range matching hundreds of
# releases is a typo, not a plan.  50 holds every vLLM minor from 0.11 on at one patch each, twice over.
MAX_RANGE_RELEASES = 50


@dataclasses.dataclass(frozen=True)
class Cell:
    """One environment of the matrix."""

    vllm: str  # the release, or the local wheel's version
    torch: str  # a torch version, or "pinned" when the pin could not be resolved
    dist: str = "vllm"
    torch_override: bool = False  # torch was requested explicitly (installed with --override)
    nixl: str = NIXL_FAKE  # "fake", or a nixl-cu12 version for real NIXL
    wheel: Path | None = None  # release qualification: a local vLLM wheel
    runner: str = "cpu"
    python: str = PYTHON
    # Suites run in the cell's one venv: "ours" (tests/connectors), "upstream" (vLLM's own tests).
    # Not part of the id: adding a suite to a cell keeps its venv and result file.
    suites: tuple[str, ...] = ("ours",)
    # Requirements that replace what the vLLM wheel pins (uv --override), e.g. a pin the index lacks.
    overrides: tuple[str, ...] = ()
    env: str = "today"  # or "as-released": resolved as the index stood at exclude_newer
    exclude_newer: str | None = None  # ISO timestamp: the release's upload time + AS_RELEASED_GRACE
    order: str = CHILD_ORDERS[0]  # MultiConnector's children: "nixl-first" or "offload-first"
    # The release whose sdist the upstream column's tests come from: a candidate wheel's base
    # (kvcompat.qualify); None: the cell's own release.  Not part of the id.
    upstream_from: str | None = None

    @property
    def id(self) -> str:
        """Filesystem-safe identifier, used for results/<id>.json."""
        parts = [f"{self.dist}-{self.vllm}", f"torch-{self.torch}"]
        if self.torch_override:
            parts[-1] += "-override"
        if self.wheel is not None:
            parts[0] += "-wheel"
        if self.nixl != NIXL_FAKE:
            parts.append(f"nixl-{self.nixl}")
        if self.overrides:
            parts.append("override-" + "+".join(o.replace("==", "-") for o in self.overrides))
        if self.env != "today":
            parts.append(self.env)
        if self.order != CHILD_ORDERS[0]:
            parts.append(self.order)
        return re.sub(r"[^A-Za-z0-9._+-]", "_", "__".join(parts))

    @property
    def nox_id(self) -> str:
        """The part of the nox session name in parentheses: ``vllm='0.33.0', torch='2.14.0'``."""
        vllm = self.vllm if self.dist == "vllm" else f"{self.dist}=={self.vllm}"
        if self.wheel is not None:
            vllm = f"{self.wheel.name}"
        parts = [f"vllm={vllm!r}", f"torch={self.torch!r}"]
        if self.nixl != NIXL_FAKE:
            parts.append(f"nixl={self.nixl!r}")
        if self.overrides:
            parts.append(f"overrides={' '.join(self.overrides)!r}")
        if self.env != "today":
            parts.append(f"env={self.env!r}")
        if self.order != CHILD_ORDERS[0]:
            parts.append(f"order={self.order!r}")
        return ", ".join(parts)

    @property
    def tags(self) -> list[str]:
        # nox -t matches tags literally (-t vllm-0.33); nox -k evaluates a Python expression,
        # so each version also gets an identifier form (-k "vllm_0_33_0 and torch_2_14").
        tags = [
            self.runner,
            f"vllm-{minor(self.vllm)}",
            self.dist,
            _ident(f"vllm_{self.vllm}"),
            _ident(f"torch_{self.torch}"),
            *(f"suite-{s}" for s in self.suites),
        ]
        if self.torch_override or self.overrides:
            tags.append("override")
        tags.append(self.env)
        if self.nixl != NIXL_FAKE:
            tags.append("real-nixl")
        if self.wheel is not None:
            tags.append("candidate")
        tags += [self.order, _ident(self.order)]  # nox -t offload-first; nox -k offload_first
        return tags

    @property
    def vllm_requirement(self) -> str:
        return str(self.wheel) if self.wheel is not None else f"{self.dist}=={self.vllm}"

    def requirements(self) -> list[str]:
        """What the cell's environment is resolved from (nixl is installed separately, --no-deps)."""
        reqs = [self.vllm_requirement, "pytest>=8"]
        if self.torch_override:
            # --override replaces the wheel's own torch pin; the requirement makes it explicit.
            reqs.append(f"torch=={self.torch}")
        if "upstream" in self.suites:
            reqs += UPSTREAM_TEST_REQUIREMENTS
        return reqs

    def override_lines(self) -> list[str]:
        """What ``uv pip compile --override`` gets: an explicit torch, and the entry's overrides.

        An explicit torch's companions (TORCH_COMPANIONS) are matched to it at resolve time
        (kvcompat.run.resolve.companion_overrides), since only the index knows their versions.
        """
        return ([f"torch=={self.torch}"] if self.torch_override else []) + list(self.overrides)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["wheel"] = str(self.wheel) if self.wheel else None
        d["suites"] = list(self.suites)
        d["id"] = self.id
        d["nox_id"] = self.nox_id
        return d

    @classmethod
    def from_json(cls, d: dict) -> Cell:
        """The cell ``to_json`` wrote (``id`` and ``nox_id`` are derived, not read back); a key an older
        result lacks takes the field's default, a key this kvcompat no longer knows is ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "wheel" in kw:
            kw["wheel"] = Path(kw["wheel"]) if kw["wheel"] else None
        for key in ("suites", "overrides"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)


def _ident(text: str) -> str:
    return re.sub(r"\W", "_", text)


def minor(version: str) -> str:
    """``0.33.0`` -> ``0.33``."""
    v = Version(version)
    return f"{v.major}.{v.minor}"


def constraints_for(vllm_version: str, constraints_dir: Path) -> list[Path]:
    """The constraints file for this vLLM minor, if the project keeps one (e.g. constraints/vllm-0.19.txt)."""
    path = constraints_dir / f"vllm-{minor(vllm_version)}.txt"
    return [path] if path.is_file() else []


def expand_versions(entry: Entry, available: Callable[[str], list[Version]]) -> list[tuple[str, Path | None]]:
    """The (version, wheel) pairs an entry stands for."""
    if isinstance(entry.vllm, Path):
        _, version, _, _ = parse_wheel_filename(entry.vllm.name)
        return [(str(version), entry.vllm)]
    if isinstance(entry.vllm, Version):
        known = available(entry.dist)
        if entry.vllm not in known:
            # A typo or a release that was never published is bad input, not an unresolvable cell.
            raise MatrixError(
                f"{entry.dist} {entry.vllm} is not on the index (or was yanked); fix the matrix entry "
                f"(nearest releases there: {index.nearest_versions(known, entry.vllm)})"
            )
        return [(str(entry.vllm), None)]
    spec: SpecifierSet = entry.vllm
    matched = list(spec.filter(available(entry.dist), prereleases=entry.pre))
    if len(matched) > MAX_RANGE_RELEASES:
        raise MatrixError(
            f"{entry.dist}{spec} matches {len(matched)} releases ({matched[0]} .. {matched[-1]}), more than the "
            f"{MAX_RANGE_RELEASES} one range may expand to; narrow it (e.g. >={matched[-MAX_RANGE_RELEASES]}) "
            "or list the releases you mean"
        )
    return [(str(v), None) for v in matched]


def resolve_cells(
    entries: Iterable[Entry],
    *,
    constraints_dir: Path,
    cache_root: Path,
    index_url: str = PYPI,
    find_links: tuple[str, ...] = (),
    available: Callable[[str], list[Version]] | None = None,
    pinned_torch: Callable[[Cell], str | None] | None = None,
    uploaded: Callable[[str, str], dt.datetime] | None = None,
) -> list[Cell]:
    """Expand matrix entries into cells, newest vLLM first, without duplicates.

    ``available``, ``pinned_torch`` and ``uploaded`` (when a release was published) default to
    asking the index; tests pass fakes.
    """
    if available is None:
        available = lambda dist: index.list_versions(dist, cache_root=cache_root, index_url=index_url)  # noqa: E731
    if pinned_torch is None:
        pinned_torch = lambda cell: _pinned_torch(cell, constraints_dir, cache_root, find_links, index_url)  # noqa: E731
    if uploaded is None:
        uploaded = lambda dist, v: index.release_uploaded(dist, v, cache_root=cache_root, index_url=index_url)  # noqa: E731
    cells: dict[str, Cell] = {}
    for entry in entries:
        for version, wheel in expand_versions(entry, available):
            for torch, nixl, env, order in itertools.product(entry.torch, entry.nixl, entry.env, entry.order):
                base = Cell(
                    vllm=version,
                    torch="pinned",
                    dist=entry.dist,
                    nixl=nixl,
                    wheel=wheel,
                    runner=entry.runner,
                    suites=entry.suites,
                    overrides=entry.overrides,
                    env=env,
                    exclude_newer=_cutoff(entry, version, wheel, env, uploaded),
                    order=order,
                )
                if torch == "pinned":
                    cell = dataclasses.replace(base, torch=pinned_torch(base) or "pinned")
                else:
                    cell = dataclasses.replace(base, torch=torch, torch_override=True)
                if cell.id in cells:  # the same cell named twice: run the union of its suites once
                    merged = tuple(dict.fromkeys(cells[cell.id].suites + cell.suites))
                    cell = dataclasses.replace(cells[cell.id], suites=merged)
                cells[cell.id] = cell
    return sorted(
        cells.values(),
        key=lambda c: (Version(c.vllm), c.dist, c.torch, c.nixl, c.env, c.order == CHILD_ORDERS[0]),
        reverse=True,
    )


def resolve_entry(root: Path, entry: Entry, *, index_url: str, find_links: tuple[str, ...] = ()) -> Cell:
    """The one cell of a single matrix entry (a bisect step, a qualify side) of the project at ``root``."""
    (cell,) = resolve_cells(
        [entry],
        constraints_dir=root / "constraints",
        cache_root=root,
        index_url=index_url,
        find_links=find_links,
    )
    return cell


def load_cells(root: Path, matrix: str, *, index_url: str, find_links: tuple[str, ...] = ()) -> list[Cell]:
    """The cells of matrix ``matrix`` (see :func:`kvcompat.matrix.matrix_source`) of the project at ``root``."""
    source, name = matrix_source(root, matrix)
    return resolve_cells(
        load_matrix(source, name, project=root),
        constraints_dir=root / "constraints",
        cache_root=root,
        index_url=index_url,
        find_links=find_links,
    )


def _cutoff(
    entry: Entry, version: str, wheel: Path | None, env: str, uploaded: Callable[[str, str], dt.datetime]
) -> str | None:
    """The --exclude-newer of an as-released cell: the release's upload time + the grace window."""
    if env == "today":
        return None
    if wheel is not None:
        raise MatrixError(f'{wheel.name} is a local wheel with no release date; give its entry env = "today"')
    return (uploaded(entry.dist, version) + AS_RELEASED_GRACE).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pinned_torch(
    cell: Cell, constraints_dir: Path, cache_root: Path, find_links: tuple[str, ...], index_url: str
) -> str | None:
    # The cell's own requirements, not vLLM's alone: torch is the same either way, and the cell's
    # resolve phase can then take this answer while it is fresh (kvcompat.run.resolve.listed_lock)
    # instead of asking the index the same question again minutes later.
    res = index.resolve(
        cell.requirements(),
        python=cell.python,
        constraints=constraints_for(cell.vllm, constraints_dir),
        overrides=cell.override_lines(),
        find_links=find_links,
        index_url=index_url,
        exclude_newer=cell.exclude_newer,
        cache_root=cache_root,
        timeout=120,
    )
    return res.pin("torch") if res.ok else None
