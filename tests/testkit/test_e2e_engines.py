"""The e2e suite's engine processes without vLLM: a stand-in engine speaks the protocol, hangs, or dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvcompat.testkit.e2e import engines

FAKE = textwrap.dedent(
    """
    import json, sys, time
    from kvcompat.testkit.e2e.engine import answer
    spec = json.loads(sys.argv[1])
    print("a line of vLLM's log")
    if spec.get("hang") == "start":
        time.sleep(600)
    if spec.get("die") == "start":
        print("RuntimeError: the engine could not start"); sys.exit(3)
    answer({"ready": True, "seconds": 0.1, "counters": {}})
    for line in sys.stdin:
        req = json.loads(line)
        if spec.get("hang") == req.get("stage"):
            time.sleep(600)
        answer({"outputs": [{"token_ids": [len(p)], "num_cached_tokens": 0} for p in req["prompts"]], "counters": {}})
    """
)


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    (tmp_path / "fake_engine.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    return "fake_engine"


def test_an_engine_answers_generate(fake_module):
    e = engines.EngineProcess("plain", {}, module=fake_module)
    try:
        got = e.generate(["abc", "de"], stage="reference", max_tokens=1)
        assert [o["token_ids"] for o in got["outputs"]] == [[3], [2]]
    finally:
        e.stop()
    assert e.proc.poll() is not None


def test_a_hung_stage_is_a_timeout_naming_the_stage_and_the_engine_is_stopped(fake_module):
    e = engines.EngineProcess("decode", {"hang": "decode"}, module=fake_module)
    with pytest.raises(engines.StageTimeout, match="the decode engine did not answer stage 'decode' in 2s"):
        e.generate(["x"], stage="decode", max_tokens=1, timeout=2)
    assert e.proc.poll() is not None
    e2 = engines.EngineProcess("prefill", {"hang": "start"}, module=fake_module)
    with pytest.raises(engines.StageTimeout, match="stage 'start'"):
        e2.wait_ready(timeout=2)
    assert e2.proc.poll() is not None


def test_an_engine_that_dies_names_the_stage_and_its_last_words(fake_module):
    e = engines.EngineProcess("reference", {"die": "start"}, module=fake_module)
    with pytest.raises(engines.EngineError, match="exited with status 3 at stage 'start': RuntimeError: the engine"):
        e.wait_ready(timeout=30)


def test_killing_the_cells_process_group_leaves_no_engine_behind(fake_module, tmp_path):
    """The cell's pytest runs in its own process group; the engines are its children in that group, so the
    harness's kill of the group (a cell timeout, Ctrl-C) stops them too."""
    pids = tmp_path / "pid"
    driver = textwrap.dedent(
        f"""
        from kvcompat.testkit.e2e import engines
        e = engines.EngineProcess("decode", {{"hang": "start"}}, module="fake_engine")
        open({str(pids)!r}, "w").write(str(e.proc.pid))
        e.wait_ready(timeout=600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    engine_pid = int(pids.read_text())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        # a zombie whose parent died is reaped by init; ask /proc whether it still runs
        try:
            if open(f"/proc/{engine_pid}/stat").read().split()[2] == "Z":
                return
        except OSError:
            return
        time.sleep(0.1)
    pytest.fail(f"engine process {engine_pid} outlived its cell's process group")


def test_free_ports_differ_and_engines_get_their_own():
    env = engines.engine_env(engines.free_port())
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["UCX_NET_DEVICES"] == "lo"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert len({engines.free_port() for _ in range(5)}) > 1
