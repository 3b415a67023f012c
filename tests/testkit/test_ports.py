"""kvcompat.testkit.ports: blocks of ports no other process takes before an engine binds them."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvcompat.testkit import ports


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(ports, "_held", {})
    return tmp_path


def test_a_block_lies_outside_the_ephemeral_range_and_is_free(lock_dir):
    eph = ports.ephemeral_range()
    inside = [b for b in ports._blocks() if b + ports.SPAN > eph.start and b < eph.stop]
    assert inside == [], f"blocks that reach into the ephemeral range {eph}: {sorted(inside)[:5]}"
    first = ports.reserve()
    assert ports.LOWEST <= first and not set(range(first, first + ports.SPAN)) & set(eph)
    for port in range(first, first + ports.SPAN):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_reservations_in_one_process_differ(lock_dir):
    firsts = [ports.reserve() for _ in range(20)]
    assert len(set(firsts)) == 20


def test_a_block_another_process_holds_is_skipped(lock_dir, monkeypatch):
    held, free = ports._blocks()[:2]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(lock_dir / str(held))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(ports, "_blocks", lambda: [held, free])
        assert ports.reserve() == free
    finally:
        holder.communicate("")


def test_a_block_with_a_port_in_use_is_skipped(lock_dir, monkeypatch):
    busy, free = ports._blocks()[:2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy + 3))  # in use by a process that holds no lock: not ours
        s.listen()
        monkeypatch.setattr(ports, "_blocks", lambda: [busy, free])
        assert ports.reserve() == free
        assert (lock_dir / str(busy)).exists() and busy not in ports._held


def test_no_free_block_is_a_clear_error(lock_dir, monkeypatch):
    monkeypatch.setattr(ports, "_blocks", lambda: [])
    with pytest.raises(RuntimeError, match="no block of 8 free ports outside the ephemeral range"):
        ports.reserve()
