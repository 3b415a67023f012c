"""Ports for the listeners a suite's engines start (NIXL's side channel, vLLM's VLLM_PORT).

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, and once it is closed
the kernel hands it out again to any process's next connection or ``bind(0)`` (UCX's, ZMQ's, another
cell's). An engine binds its side channel some 20 s after we picked the port; if the port was taken in
between, vLLM's handshake listener dies in its thread (ZMQError "Address already in use") and the
engine waits for it forever, until our start timeout: the likeliest cause of a CI run whose prefill
and decode engines never came up (its messages were not kept; holding the port reproduces it).

So a port here is taken below the ephemeral range, which the kernel never hands out on its own, and
is held for the life of the process that reserved it by a lock on a file named after it, so that our
own processes (cells side by side, a mutation run's forked children) never share one. A reservation
is a block of :data:`SPAN` ports: the first is the side channel; vLLM listens on the side channel
port plus the TP rank in some releases and scans upward from VLLM_PORT when it is in use, so the rest
of the block is theirs.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

SPAN = 8
LOWEST = 10000  # below: ports of well-known services
LOCK_DIR = Path(tempfile.gettempdir()) / "kvcompat-ports"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_held: dict[int, int] = {}  # first port of a block -> the descriptor whose lock holds it


def ephemeral_range() -> range:
    """The ports the kernel hands out on its own (Linux's default when it cannot be read)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _blocks() -> list[int]:
    """First ports of the blocks outside the ephemeral range, in a random order."""
    eph = ephemeral_range()
    pools = [range(LOWEST, eph.start), range(eph.stop, 65536)]
    firsts = [p for pool in pools for p in range(pool.start, pool.stop - SPAN + 1, SPAN)]
    random.shuffle(firsts)
    return firsts


def _bindable(first: int) -> bool:
    for port in range(first, first + SPAN):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # as vLLM checks a port: every interface
            except OSError:
                return False
    return True


def _lock(first: int) -> int | None:
    fd = os.open(LOCK_DIR / str(first), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def reserve() -> int:
    """The first port of a block of SPAN free ports no other process of ours holds, held until this
    process exits (a forked child holds its parent's blocks too, and reserves its own)."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for first in _blocks():
        if first in _held:
            continue
        fd = _lock(first)
        if fd is None:
            continue
        if _bindable(first):
            _held[first] = fd
            return first
        os.close(fd)
    raise RuntimeError(f"no block of {SPAN} free ports outside the ephemeral range {ephemeral_range()}")
