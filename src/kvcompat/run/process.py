"""Commands a cell runs: each in its own process group, streamed to the cell log, killable as a whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvcompat.atomic import write_atomic
from kvcompat.run.cellfiles import CellFiles

# Environment for everything that runs inside a cell: no hub, no telemetry, no GPU probing surprises.
CELL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


def cell_environ(env: dict | None = None) -> dict[str, str]:
    """The environment a cell's commands run in: the caller's, then ours, then ``env``."""
    full_env = {**os.environ, **CELL_ENV, **(env or {})}
    full_env.pop("VIRTUAL_ENV", None)
    # uv installs without .pyc files; with PYTHONDONTWRITEBYTECODE set (it is on this
    # project's machines) every run would recompile ~5000 modules of vLLM and torch from
    # source: ~12 s per process.  Cells are ours, so let Python cache bytecode (where: CellContext.bytecode_env).
    full_env.pop("PYTHONDONTWRITEBYTECODE", None)
    return full_env


def run_command(
    cmd: list,
    files: CellFiles,
    *,
    timeout: float,
    heartbeat_s: float,
    say: Callable[[str], None],
    phase: str,
    cwd: Path,
    env: dict | None = None,
) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group, streaming its output to the cell log; rc is None on timeout.

    Long commands say every ``heartbeat_s`` that they are still running, with their last line.
    """
    files.append_log(f"$ {' '.join(map(str, cmd))}")
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cell_environ(env),
        cwd=cwd,
        start_new_session=True,
        errors="replace",
    )
    # Who runs what, so that a run after a SIGKILL (which nothing can clean up) can reap it.
    write_atomic(files.running, json.dumps({"group": proc.pid, "owner": os.getpid()}))
    lines: list[str] = []

    def pump() -> None:
        # Reads to the end whatever happens to the log: a reader that stopped (say, at a full disk)
        # would leave the command blocked on a full pipe until its timeout.
        try:
            log = files.log.open("a")
        except OSError:
            log = None
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError:
                    log = None

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t0 = time.monotonic()
    rc: int | None = None
    try:
        while True:
            elapsed = time.monotonic() - t0
            try:
                rc = proc.wait(timeout=max(0.05, min(heartbeat_s, timeout - elapsed)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 >= timeout:
                    kill_group(proc.pid)
                    proc.wait()
                    break
                last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
                say(f"{phase} still running after {time.monotonic() - t0:.0f}s" + (f": {last[-100:]}" if last else ""))
    except BaseException:  # Ctrl-C: take the whole process group down with us, and go
        kill_group(proc.pid)
        raise
    finally:
        files.running.unlink(missing_ok=True)
    reader.join(timeout=30)
    out = "".join(lines)
    if rc is None:
        note = f"[kvcompat] {phase} killed after {timeout:.0f}s timeout\n"
        files.append_log(note)
        out += "\n" + note
    return rc, out


def reap_leftover(files: CellFiles, say: Callable[[str], None]) -> None:
    """Kill what a SIGKILLed run of this cell left behind (its pytest keeps running in its own session).

    Only when the run that started it is gone: another live run of the same cell is left alone.
    """
    try:
        info = json.loads(files.running.read_text())
        group, owner = int(info["group"]), int(info["owner"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if alive(owner) or not alive(group):
        return
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    files.running.unlink(missing_ok=True)
    say(f"killed process group {group}, left running by an earlier run of this cell that was killed")


def alive(pid: int) -> bool:
    """A live process (not a zombie) with this pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def last_error_line(text: str, default: str) -> str:
    """The most telling line of a failed command's output: the last exception or error line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or line.startswith(("error", "ERROR", "E ")):
            return line[:300]
    return lines[-1][:300] if lines else default
