"""A static ABI verdict: would vLLM's compiled extensions link against the installed torch?

The suite runs vLLM's Python-level connector code, so an override cell (vLLM X with a
torch it does not pin) can pass while its compiled extensions would not even load on a
GPU machine, and on a CPU machine they cannot be loaded at all (no libcuda).  So they are
read instead: every undefined dynamic symbol of ``vllm/**/*.so`` (and torchvision's and
torchaudio's) that belongs to torch (c10, ATen, torch, caffe2, the AOTI stable ABI) must be
exported by one of torch's own libraries.  Reading ELF needs no import of anything.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from kvcompat.atomic import write_atomic

# Mangled names in torch's namespaces (c10::, at::, torch::, caffe2::; functions, const members,
# vtables, typeinfo), the AOTI stable C shim, and torch's other C entry points (torchaudio
# 2.11.1, whose metadata accepts torch 2.11.0, needs torch_exception_get_what_without_backtrace,
# which torch 2.11.0 does not export).
TORCH_SYMBOL = re.compile(r"^_Z(?:T[VIS])?NK?(?:3c10|2at|5torch|6caffe2)|^aoti_torch_|^torch_")
EXTENSION_DIRS = ("vllm", "torchvision", "torchaudio")
EXAMPLES = 8


@dataclasses.dataclass
class AbiVerdict:
    """What the check found: extensions read, torch-owned symbols they need that torch does not export."""

    torch: str
    extensions: int
    missing: list[str]  # mangled names, sorted
    by_extension: dict[str, int]  # extension (relative to site-packages) -> how many of its symbols are missing

    @property
    def ok(self) -> bool:
        return not self.missing

    def to_json(self) -> dict:
        return {
            "torch": self.torch,
            "extensions": self.extensions,
            "missing": len(self.missing),
            "examples": demangle(self.missing[:EXAMPLES]),
            "by_extension": self.by_extension,
        }


def dynamic_symbols(path: Path) -> tuple[set[str], set[str]]:
    """(undefined, defined) names in an ELF file's dynamic symbol table; empty for anything else."""
    try:
        with path.open("rb") as fh:
            table = ELFFile(fh).get_section_by_name(".dynsym")
            if table is None:
                return set(), set()
            undefined, defined = set(), set()
            for sym in table.iter_symbols():
                if sym.name:
                    (undefined if sym["st_shndx"] == "SHN_UNDEF" else defined).add(sym.name)
            return undefined, defined
    except (ELFError, OSError):
        return set(), set()


def torch_exports(site: Path, torch_version: str, cache_dir: Path | None) -> set[str]:
    """Every symbol torch's own libraries export; cached per torch version (a scan takes ~6 s)."""
    cache = cache_dir / f"torch-{torch_version}.json" if cache_dir else None
    if cache is not None and cache.is_file():
        return set(json.loads(cache.read_text()))
    exported: set[str] = set()
    for lib in sorted((site / "torch" / "lib").glob("*.so*")):
        exported |= dynamic_symbols(lib)[1]
    if cache is not None and exported:
        write_atomic(cache, json.dumps(sorted(exported)))
    return exported


def check(site: Path, torch_version: str, cache_dir: Path | None = None) -> AbiVerdict:
    """The verdict for the extensions installed under ``site`` (a site-packages folder)."""
    exported = torch_exports(site, torch_version, cache_dir)
    missing: set[str] = set()
    by_extension: dict[str, int] = {}
    extensions = [p for d in EXTENSION_DIRS for p in sorted((site / d).rglob("*.so")) if (site / d).is_dir()]
    for ext in extensions:
        undefined, _ = dynamic_symbols(ext)
        lost = {s for s in undefined if TORCH_SYMBOL.search(s)} - exported
        if lost:
            by_extension[str(ext.relative_to(site))] = len(lost)
            missing |= lost
    return AbiVerdict(torch_version, len(extensions), sorted(missing), by_extension)


def demangle(names: list[str]) -> list[str]:
    """C++ names as people read them, when c++filt is there (binutils); else as they are."""
    tool = shutil.which("c++filt")
    if not names or tool is None:
        return names
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    out = proc.stdout.splitlines()
    return out if proc.returncode == 0 and len(out) == len(names) else names
