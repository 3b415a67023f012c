"""The suite's side of the engine processes: start them, ask them, stop them, with a timeout per stage.

Each engine is a child of the test process and so in the cell's process group: a cell timeout or a
Ctrl-C, which kills that group, stops every engine with it.  Each engine gets a block of ports of its
own (NIXL's side channel, then VLLM_PORT) from :mod:`kvcompat.testkit.ports`, so cells running side
by side (``-j 2``) never collide and no other process takes them before the engine binds them.  A
stage that does not answer in time (start, prefill, decode, ...) is :class:`StageTimeout`, naming
the stage; a stage that fails is :class:`EngineError`, with vLLM's error and its source line.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcompat.testkit import ports
from kvcompat.testkit.e2e.engine import MARK

ENGINE_MODULE = "kvcompat.testkit.e2e.engine"
START_TIMEOUT_S = float(os.environ.get("KVCOMPAT_E2E_START_TIMEOUT", "300"))
STAGE_TIMEOUT_S = float(os.environ.get("KVCOMPAT_E2E_STAGE_TIMEOUT", "180"))


class EngineError(RuntimeError):
    """An engine stage failed; the message has vLLM's error and where it was raised."""


class StageTimeout(EngineError):
    """An engine did not answer a stage in time (the engine is stopped)."""


def engine_env(side_channel_port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One engine process's environment: in-process engine core, CPU KV space, NIXL over loopback.
    SIDE_CHANNEL_PORT is the first of a block from :func:`kvcompat.testkit.ports.reserve`; vLLM's
    own port is the next one."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: one vLLM import
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tests bound the blocks themselves
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_PORT": str(side_channel_port + 1),
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


class EngineProcess:
    """One engine (:mod:`kvcompat.testkit.e2e.engine`) in a child process."""

    def __init__(
        self, name: str, spec: dict[str, Any], *, env: dict[str, str] | None = None, module: str = ENGINE_MODULE
    ) -> None:
        self.name = name
        self.spec = dict(spec)
        self.side_channel_port = ports.reserve()
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self._answers: queue.Queue[dict | None] = queue.Queue()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=engine_env(self.side_channel_port, env),
        )
        self._reader = threading.Thread(target=self._read, name=f"e2e-{name}", daemon=True)
        self._reader.start()
        self.ready: dict | None = None
        self.last_settle: dict = {}  # the last settle's answer (steps, probes, seconds): kept for the record

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
            else:
                self.log.append(line.rstrip("\n"))
        self._answers.put(None)  # the process ended

    def _wait(self, stage: str, timeout: float) -> dict:
        try:
            got = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise StageTimeout(
                f"timeout: the {self.name} engine did not answer stage '{stage}' in {timeout:.0f}s "
                f"(stopped); last log line: {self.last_log_line()}"
            ) from None
        if got is None:
            self.proc.wait(timeout=30)
            raise EngineError(
                f"the {self.name} engine exited with status {self.proc.returncode} at stage '{stage}': "
                f"{self.last_log_line()}"
            )
        if "error" in got:
            raise EngineError(f"the {self.name} engine failed at stage '{stage}': {got['error']} ({got.get('where')})")
        return got

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict:
        """Block until the engine started (stage 'start'); what it counted at start."""
        if self.ready is None:
            left = max(1.0, timeout - (time.monotonic() - self.started))
            self.ready = self._wait("start", left)
        return self.ready

    def generate(
        self,
        prompts: list[str],
        *,
        stage: str,
        max_tokens: int,
        kv_transfer_params: list[dict | None] | None = None,
        timeout: float = STAGE_TIMEOUT_S,
    ) -> dict:
        self.wait_ready()
        req = {"op": "generate", "stage": stage, "prompts": prompts, "max_tokens": max_tokens}
        if kv_transfer_params is not None:
            req["kv_transfer_params"] = kv_transfer_params
        self._send(req, stage)
        return self._wait(stage, timeout)

    def ask(self, op: str, *, stage: str, timeout: float = STAGE_TIMEOUT_S, **fields: Any) -> dict:
        """One op of the engine's protocol (kvcompat.testkit.e2e.engine): idle, settle, add, step, abort, drain."""
        self.wait_ready()
        self._send({"op": op, "stage": stage, **fields}, stage)
        return self._wait(stage, timeout)

    @property
    def baseline(self) -> dict:
        """The engine's idle state right after it started, before any request (free device blocks, pinned
        CPU-tier blocks)."""
        got = self.wait_ready().get("idle") or {}
        if "error" in got:
            raise EngineError(f"the {self.name} engine could not read its idle state: {got['error']}")
        return got

    def leaks(self, *, stage: str, timeout: float = 30.0) -> list[str]:
        """What the engine still holds beyond its baseline once settled (stepped until idle or ``timeout``),
        in words; empty when nothing leaked."""
        base = self.baseline
        t0 = time.monotonic()
        got = self.ask("settle", stage=stage, baseline=base, timeout=timeout + STAGE_TIMEOUT_S, settle_s=timeout)
        self.last_settle = {**got, "seconds": round(time.monotonic() - t0, 1)}
        out = []
        if got["free_device_blocks"] != base["free_device_blocks"]:
            out.append(
                f"{self.name}: {base['free_device_blocks'] - got['free_device_blocks']} device blocks still held "
                f"({got['free_device_blocks']} free, {base['free_device_blocks']} at start)"
            )
        if got["pinned_cpu_blocks"] != base["pinned_cpu_blocks"]:
            out.append(
                f"{self.name}: {got['pinned_cpu_blocks'] - base['pinned_cpu_blocks']} CPU-tier blocks still pinned "
                f"({got['pinned_cpu_blocks']} pinned, {base['pinned_cpu_blocks']} at start)"
            )
        if out:
            out[-1] += f" after {got['steps']} steps and {got['probes']} probes"
        return out

    def _send(self, req: dict, stage: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(
                f"the {self.name} engine is gone before stage '{stage}': {self.last_log_line()}"
            ) from None

    def last_log_line(self) -> str:
        for line in reversed(self.log):
            if line.strip() and not line.startswith((" ", "\t")):
                return line.strip()[-400:]
        return "(no output)"

    def stop(self) -> None:
        """Close stdin (the engine exits), then terminate, then kill."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass
            for sig in (None, self.proc.terminate, self.proc.kill):
                if sig is not None:
                    sig()
                try:
                    self.proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue


def stop_all(engines: Iterable[EngineProcess]) -> None:
    """Stop several engines: every one is told to exit first (stdin closed), so their shutdowns overlap, then each
    is waited for, terminated or killed (EngineProcess.stop)."""
    engines = list(engines)
    for e in engines:
        if e.proc.stdin and e.proc.poll() is None:
            try:
                e.proc.stdin.close()
            except OSError:
                pass
    for e in engines:
        e.stop()


def model_dir() -> Path:
    """The tiny model's folder for this cell: beside the cell's interpreter (one per venv)."""
    override = os.environ.get("KVCOMPAT_E2E_MODEL_DIR")
    return Path(override) if override else Path(sys.prefix) / "kvcompat-e2e-model"
