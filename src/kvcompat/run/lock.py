"""One run of a cell at a time: a lock beside the cell's venv, held from the first look at its result to the last write.

Two ``nox -s matrix`` runs over the same cells (two terminals, a CI retry) would otherwise
install into one venv at once and interleave its log.  The second run does not wait (a cell
can hold its venv for half an hour): it says in one line which run holds the cell, and exits 2.
The lock is ``flock`` on ``<venv>.lock``: the kernel releases it when its holder exits, however it
exits (SIGKILL included), so a dead run never leaves a cell locked.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from kvcompat.errors import KvcompatError


class CellBusyError(KvcompatError):
    """Another live run holds the cell."""


def lock_path(venv: Path) -> Path:
    return venv.with_name(venv.name + ".lock")


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it: pid, command, start time, host."""
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']} (`{info['command']}`, started {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):  # taken a moment ago, not yet written
        return "another run"


def program() -> str:
    """This process's program as a user typed it: ``nox``, also when started as ``python -m nox``."""
    path = Path(sys.argv[0])
    return path.parent.name if path.name == "__main__.py" else path.name


@contextlib.contextmanager
def held(venv: Path, cell_id: str) -> Iterator[None]:
    """Hold the cell's lock for the body, or raise :class:`CellBusyError` naming the run that holds it."""
    path = lock_path(venv)
    path.parent.mkdir(parents=True, exist_ok=True)
    # os.open's descriptors are not inherited: the cell's pytest and uv never hold the lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CellBusyError(
                f"cell {cell_id} is being run by {holder(path)}; one run at a time per venv ({venv}): "
                "wait for that run to finish or stop it, then rerun"
            ) from None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": shlex.join([program(), *sys.argv[1:]])[:200],
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (unlinking it would race with the next taker)
