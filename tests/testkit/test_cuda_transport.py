"""The CPU stand-in of the CUDA transport: copies as the release's descriptors say, events, hold, faults."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from kvcompat.testkit import cuda_transport as ct


class Region:
    """A 'GPU KV cache' stand-in: anything with untyped_storage().data_ptr()/nbytes()."""

    def __init__(self, buf: ctypes.Array) -> None:
        self.buf = buf

    def untyped_storage(self):
        return self

    def data_ptr(self) -> int:
        return ctypes.addressof(self.buf)

    def nbytes(self) -> int:
        return len(self.buf)


def descriptors(copies: list[tuple[int, int, int]]):
    n = len(copies)
    arrays = [(ctypes.c_uint64 * n)(*[c[i] for c in copies]) for i in range(3)]
    return arrays, [ctypes.addressof(a) for a in arrays]


@pytest.fixture
def transport(monkeypatch):
    monkeypatch.setattr(ct, "TRANSPORT", ct.CudaTransport())
    return ct.TRANSPORT


def test_a_batch_copies_each_descriptor_and_an_event_after_it_is_complete(transport):
    gpu = (ctypes.c_uint8 * 64)(*range(64))
    cpu = (ctypes.c_uint8 * 64)()
    transport.add_gpu_region(Region(gpu))
    g, c = ctypes.addressof(gpu), ctypes.addressof(cpu)
    keep, (dsts, srcs, sizes) = descriptors([(c, g + 16, 16), (c + 16, g, 16)])  # store blocks 1 and 0
    assert transport.batch_memcpy(dsts, srcs, sizes, 2, None, None, 1, None, 0) == 0
    assert bytes(cpu[:16]) == bytes(range(16, 32)) and bytes(cpu[16:32]) == bytes(range(16))
    assert [transport.is_load(x) for x in transport.copies] == [False, False] and transport.launched() == 1
    event = ct.Event()
    event.record(ct.Stream())
    assert event.query()


def test_a_held_transport_keeps_copies_in_flight_until_released(transport):
    src = (ctypes.c_uint8 * 16)(*([5] * 16))
    dst = (ctypes.c_uint8 * 16)()
    transport.hold()
    keep, (dsts, srcs, sizes) = descriptors([(ctypes.addressof(dst), ctypes.addressof(src), 16)])
    transport.batch_memcpy(dsts, srcs, sizes, 1, None, None, 1, None, 0)
    event = ct.Event()
    event.record(ct.Stream())
    assert not event.query() and bytes(dst) == bytes(16) and transport.in_flight_count == 1
    transport.release()
    assert event.query() and bytes(dst) == bytes([5] * 16)


@pytest.mark.parametrize(("fault", "want"), [("drop-loads", bytes(16)), ("wrong-blocks", bytes([2] * 16))])
def test_faults_break_loads_only(transport, fault, want):
    """drop-loads copies nothing into a GPU region; wrong-blocks copies the next CPU block; stores are intact."""
    transport.fault = fault
    gpu = (ctypes.c_uint8 * 32)()
    cpu = (ctypes.c_uint8 * 32)(*([1] * 16 + [2] * 16))
    transport.add_gpu_region(Region(gpu))
    keep, (dsts, srcs, sizes) = descriptors([(ctypes.addressof(gpu), ctypes.addressof(cpu), 16)])
    transport.batch_memcpy(dsts, srcs, sizes, 1, None, None, 1, None, 0)
    assert bytes(gpu[:16]) == want and transport.loads()
    keep2, (d2, s2, z2) = descriptors([(ctypes.addressof(cpu) + 16, ctypes.addressof(gpu) + 16, 16)])
    transport.batch_memcpy(d2, s2, z2, 1, None, None, 1, None, 0)
    assert bytes(cpu[16:]) == bytes(16), "a store (out of a GPU region) must not be touched by a load fault"


def test_an_unknown_fault_is_refused():
    """A typo in the control's name is an error of the run, never a silently green control."""
    env = {**os.environ, "KVCOMPAT_CUDA_TRANSPORT_FAULT": "drop-everything"}
    proc = subprocess.run(
        [sys.executable, "-c", "import kvcompat.testkit.cuda_transport"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "is not a transport fault" in proc.stderr


def test_every_process_keeps_its_tally_and_they_add_up(tmp_path, monkeypatch):
    """A real engine may copy in a worker process of its own: each process's stand-in keeps its counts in
    the tally folder, and the engine adds them up."""
    import ctypes

    from kvcompat.testkit import cuda_transport as ct

    monkeypatch.setenv(ct.TALLY_ENV, str(tmp_path))
    (tmp_path / "1.json").write_text('{"batches": 2, "stores": 5, "loads": 1}')  # another process
    t = ct.CudaTransport()
    src, dst = ctypes.create_string_buffer(b"abcd"), ctypes.create_string_buffer(4)
    arrays = [(ctypes.c_uint64 * 1)(ctypes.addressof(x)) for x in (dst, src)] + [(ctypes.c_uint64 * 1)(4)]
    t.batch_memcpy(*(ctypes.addressof(a) for a in arrays), 1, None, None, 1)
    assert dst.raw == b"abcd"
    assert ct.tally(str(tmp_path)) == {"batches": 3, "stores": 6, "loads": 1}
