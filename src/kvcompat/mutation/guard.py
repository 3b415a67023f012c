"""The files a mutation session changes (one at a time), and how each is always put back.

The mutation venv is built with uv, which hardlinks installed files to its cache
(and so to every other venv holding the same wheel).  Opening the installed file
for writing would write through every link, so the file is only ever *replaced*:
a new file is written beside it and ``os.replace``-d over the path, which gives
the path a new inode and leaves the cache's copy untouched.

Restoring follows the same route, from a pristine copy kept next to the venv and
checked against the distribution's RECORD hash.  A journal (written before the
file is mutated, removed after it is restored) lets the next start restore a file
left mutated by a SIGKILLed run.  The compiled ``__pycache__`` entries of the file
are deleted on every swap, so a stale .pyc can never serve the other version.

Every target file (kvcompat.mutation.targets) has its own pristine copy and journal in the
state folder: multi_connector.py keeps the names it always had (journal.json, pristine.py), any
other file ``journal--<path>.json`` and ``pristine--<path>`` (its path inside site-packages, "/"
made "--").  Only one file is ever mutated at a time; :func:`journaled` finds every file a killed
session may have left mutated, whichever target it was running.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
from pathlib import Path

from kvcompat.atomic import write_atomic
from kvcompat.errors import KvcompatError
from kvcompat.mutation.catalogue import TARGET


class GuardError(KvcompatError):
    """The mutation venv's target file cannot be checked or put back."""


def sha256_record(data: bytes) -> str:
    """A file's hash as a wheel RECORD writes it: urlsafe base64 of the sha256, without padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_hash(site: Path, target: str = TARGET) -> str:
    """The RECORD hash of ``target`` in the installed vLLM distribution under ``site``."""
    for record in sorted(site.glob("vllm*.dist-info/RECORD")):
        for line in record.read_text().splitlines():
            path, _, rest = line.partition(",")
            if path == target:
                digest = rest.split(",")[0]
                if digest.startswith("sha256="):
                    return digest.removeprefix("sha256=")
        raise GuardError(f"{record} lists no sha256 for {target}; this release has no file to mutate")
    raise GuardError(f"no vllm*.dist-info/RECORD under {site}; the mutation venv is not installed (rerun to build it)")


def replace_file(path: Path, data: bytes) -> None:
    """Give ``path`` new contents, keeping its permissions, by renaming a new file over it (never writing through it)."""
    write_atomic(path, data, mode=path.stat().st_mode & 0o777 if path.exists() else 0o644)


class Guard:
    """The target file of one mutation venv: its pristine bytes, the journal, the swaps."""

    def __init__(self, site: Path, state: Path, target: str = TARGET) -> None:
        self.site = site
        self.path = site / target
        self.target = target
        self.state = state  # a folder next to the venv: journal, pristine copy, session lock
        if target == TARGET:
            self.journal = state / "journal.json"
            self.pristine = state / "pristine.py"
        else:
            flat = target.replace("/", "--")
            self.journal = state / f"journal--{flat}.json"
            self.pristine = state / f"pristine--{flat}"

    # -- the session lock -----------------------------------------------------------------

    def lock(self):
        """Hold the cell's mutation lock for the session (released by the kernel even on SIGKILL)."""
        self.state.mkdir(parents=True, exist_ok=True)
        fh = open(self.state / "session.lock", "a+")  # noqa: SIM115 (held for the session)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            fh.close()
            raise GuardError(
                f"another mutation session holds {self.state / 'session.lock'} (pid {owner}); wait for it to finish"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        return fh

    # -- checks ---------------------------------------------------------------------------

    def expected(self) -> str:
        return record_hash(self.site, self.target)

    def is_pristine(self) -> bool:
        return self.path.is_file() and sha256_record(self.path.read_bytes()) == self.expected()

    def recover(self) -> str | None:
        """At the start of a session: put back a file an earlier, killed session left mutated.

        Returns what was done (for the log), or None when nothing was needed.  Raises
        :class:`GuardError` when the file differs from RECORD and no good pristine copy
        exists (the caller rebuilds the venv).
        """
        journal = self._read_journal()
        if self.is_pristine():
            if journal is not None:
                self.journal.unlink(missing_ok=True)
                self.purge_bytecode()
                return f"journal of mutant {journal.get('mutant')} found; {self.target} already pristine"
            return None
        if not self.pristine.is_file() or sha256_record(self.pristine.read_bytes()) != self.expected():
            raise GuardError(f"{self.path} differs from its RECORD hash and there is no pristine copy to restore")
        self.restore()
        who = f"mutant {journal.get('mutant')} (pid {journal.get('pid')})" if journal else "an unknown change"
        return f"restored {self.target}, left mutated by {who} of an earlier session that was killed"

    def save_pristine(self) -> bytes:
        """Keep the pristine bytes next to the venv (checked against RECORD) and return them."""
        data = self.path.read_bytes()
        if sha256_record(data) != self.expected():
            raise GuardError(f"{self.path} differs from its RECORD hash; rebuild the mutation venv (delete it)")
        self.state.mkdir(parents=True, exist_ok=True)
        if not self.pristine.is_file() or self.pristine.read_bytes() != data:
            replace_file(self.pristine, data)
        return data

    # -- swaps ----------------------------------------------------------------------------

    def apply(self, mutant_id: str, source: str) -> None:
        """Journal first, then replace the file with the mutant."""
        journal = {"mutant": mutant_id, "path": str(self.path), "target": self.target, "pid": os.getpid()}
        write_atomic(self.journal, json.dumps(journal))
        replace_file(self.path, source.encode())
        self.purge_bytecode()

    def restore(self) -> None:
        """Put the pristine bytes back (a new file renamed over the path), then drop the journal."""
        replace_file(self.path, self.pristine.read_bytes())
        self.purge_bytecode()
        if not self.is_pristine():  # never go on with a file that is not what vLLM shipped
            raise GuardError(f"{self.path} still differs from its RECORD hash after restoring it")
        self.journal.unlink(missing_ok=True)

    def purge_bytecode(self) -> None:
        for pyc in (self.path.parent / "__pycache__").glob(f"{self.path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)

    def _read_journal(self) -> dict | None:
        try:
            return json.loads(self.journal.read_text())
        except (OSError, ValueError):
            return None


def journaled(state: Path) -> list[str]:
    """The target files (paths inside site-packages) with a journal in ``state``: each may be left mutated."""
    found = []
    for path in sorted(state.glob("journal*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if path.name == "journal.json":
            found.append(data.get("target") or TARGET)
        elif isinstance(data.get("target"), str):
            found.append(data["target"])
        else:  # a journal cut short: its name says which file
            found.append(path.name.removeprefix("journal--").removesuffix(".json").replace("--", "/"))
    return list(dict.fromkeys(found))
