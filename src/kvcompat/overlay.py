"""A tree's vLLM Python laid over a release's wheel: what ``kvcompat qualify`` runs for a source checkout
and the commit bisect for each commit.

A tree's ``vllm/**.py`` files whose bytes differ from the wheel's (:func:`python_changes`) replace them in a
copy of the wheel named ``<base>+src.<hash of the changes>`` (:func:`lay_over`): the same changes are the
same wheel, built once, and a tree that changes no Python is its base release as built.

Only Python can be laid over.  What vLLM's build compiles into the wheel's extensions (:func:`is_compiled_source`)
must be the release's: a tree whose compiled sources differ from the release's sdist
(:func:`compiled_differences`) needs a wheel of its own.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import tarfile
import zipfile
from pathlib import Path

from packaging.utils import parse_wheel_filename

# What builds the wheel's extensions: setup.py runs CMake (CMakeLists.txt and cmake/) over csrc/, and
# setuptools-rust over rust/.  A C, C++ or CUDA file anywhere else (.buildkite/, benchmarks/, tests/, a kernel
# under vllm/ compiled at run time) is no part of the build, whatever its suffix.
COMPILED_FOLDERS = ("csrc/", "cmake/", "rust/")
COMPILED_FILES = ("CMakeLists.txt", "setup.py", "rust-toolchain.toml")


def is_compiled_source(rel: str) -> bool:
    """Whether ``rel`` (a path in a vLLM tree, ``/``-separated) is a source of the wheel's extensions."""
    return rel in COMPILED_FILES or rel.startswith(COMPILED_FOLDERS)


def compiled_sources_of_checkout(folder: Path) -> dict[str, bytes]:
    """A source checkout's compiled sources: {path: bytes}."""
    paths = [folder / rel for rel in COMPILED_FILES]
    paths += [p for top in COMPILED_FOLDERS for p in sorted((folder / top).rglob("*"))]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in paths if p.is_file() and not p.is_symlink()}


def compiled_sources_of_sdist(sdist: Path) -> dict[str, bytes]:
    """A release's compiled sources, from its sdist (``vllm-X.Y.Z/...``): {path: bytes}."""
    out = {}
    with tarfile.open(sdist, "r:*") as tar:
        for member in tar:
            parts = member.name.split("/", 1)
            if len(parts) == 2 and member.isfile() and is_compiled_source(parts[1]):
                out[parts[1]] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return out


def compiled_differences(tree: dict[str, bytes], base: dict[str, bytes]) -> list[str]:
    """The compiled sources a tree changed, added or removed relative to the base's (either side's values:
    bytes, or anything that compares as the files do, such as git blob ids)."""
    return sorted(rel for rel in tree.keys() | base.keys() if tree.get(rel) != base.get(rel))


def shown(paths: list[str], most: int = 5) -> str:
    """``a, b, c, d, e and 3 more``: the files a refusal names."""
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def python_changes(folder: Path, base_wheel: Path) -> dict[str, bytes]:
    """The tree's ``vllm/**.py`` files whose bytes differ from the base wheel's (new files included).

    Files only the wheel has (``vllm/_version.py``, generated at build time) are kept as built.
    """
    with zipfile.ZipFile(base_wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")}
        changes = {}
        for path in sorted((folder / "vllm").rglob("*.py")):
            rel = path.relative_to(folder).as_posix()
            if "__pycache__" in rel:
                continue
            data = path.read_bytes()
            if rel not in shipped or zf.read(rel) != data:
                changes[rel] = data
    return changes


def lay_over(base_wheel: Path, base: str, changes: dict[str, bytes], work: Path) -> Path:
    """``base_wheel`` with ``changes`` laid over it, as ``vllm-<base>+src.<hash of the changes>-…whl`` in ``work``:
    built once, then found by its name."""
    digest = hashlib.sha256(b"".join(k.encode() + b"\0" + v for k, v in sorted(changes.items()))).hexdigest()[:10]
    local = f"{base}+src.{digest}"
    built = work / f"vllm-{local}-{base_wheel.name.split('-', 2)[2]}"
    return built if built.is_file() else overlay_wheel(base_wheel, changes, local, work)


def overlay_wheel(base_wheel: Path, replacements: dict[str, bytes], version: str, out_dir: Path) -> Path:
    """A copy of ``base_wheel`` with ``replacements`` laid over it, renamed to ``version``.

    The dist-info folder, METADATA's Version and RECORD (every hash) are rewritten, so uv installs
    it like any wheel.  Written beside its final name and renamed: a half-written wheel never exists.
    """
    name, _, _, _ = parse_wheel_filename(base_wheel.name)
    tags = base_wheel.name.split("-", 2)[2]  # python-abi-platform.whl, unchanged
    dest = out_dir / f"{name}-{version}-{tags}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    record_rows: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(base_wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zout:
        old_info = next(n.split("/")[0] for n in zin.namelist() if n.split("/")[0].endswith(".dist-info"))
        new_info = f"{name}-{version}.dist-info"
        record_name = f"{new_info}/RECORD"
        for info in zin.infolist():
            rel = info.filename
            if rel.endswith("/") or rel == f"{old_info}/RECORD":
                continue
            data = replacements.get(rel)
            if data is None:
                data = zin.read(info)
            if rel.startswith(old_info + "/"):
                rel = new_info + rel[len(old_info) :]
                if rel == f"{new_info}/METADATA":
                    data = re.sub(rb"^Version: .*$", f"Version: {version}".encode(), data, count=1, flags=re.M)
            _write(zout, rel, data, info.external_attr)
            record_rows.append(_record_row(rel, data))
        for rel in sorted(set(replacements) - set(zin.namelist())):  # files the tree adds
            _write(zout, rel, replacements[rel], 0o644 << 16)
            record_rows.append(_record_row(rel, replacements[rel]))
        record_rows.append((record_name, "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(record_rows)  # quotes the names with commas
        _write(zout, record_name, text.getvalue().encode(), 0o644 << 16)
    tmp.rename(dest)
    return dest


def _write(zout: zipfile.ZipFile, rel: str, data: bytes, external_attr: int) -> None:
    info = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
    info.external_attr = external_attr
    info.compress_type = zipfile.ZIP_DEFLATED
    zout.writestr(info, data, compresslevel=1)


def _record_row(rel: str, data: bytes) -> tuple[str, str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return rel, f"sha256={digest}", str(len(data))
