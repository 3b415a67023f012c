"""The e2e suite's engine processes without vLLM: a stand-in engine speaks the protocol, hangs, or dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvcompat.testkit import ports
from kvcompat.testkit.e2e import engines

FAKE = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from kvcompat.testkit.e2e.engine import answer
    spec = json.loads(sys.argv[1])
    print("a line of vLLM's log")
    if spec.get("listen"):  # as NIXL's side channel listens
        side = socket.socket(); side.bind(("127.0.0.1", int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]))); side.listen()
    if spec.get("hang") == "start":
        time.sleep(600)
    if spec.get("die") == "start":
        print("RuntimeError: the engine could not start"); sys.exit(3)
    idle = {"free_device_blocks": 47, "pinned_cpu_blocks": 0, "scheduler_requests": 0}
    answer({"ready": True, "seconds": 0.1, "counters": {}, "idle": idle})
    added = {}
    for line in sys.stdin:
        req = json.loads(line)
        if spec.get("hang") == req.get("stage"):
            time.sleep(600)
        if req["op"] == "settle":  # spec "held": blocks a request never gave back
            held = spec.get("held", {})
            answer({"free_device_blocks": 47 - held.get("device", 0), "pinned_cpu_blocks": held.get("cpu", 0),
                    "steps": 3, "probes": 1, "settled": not held})
        elif req["op"] == "add":
            added.update({r["id"]: r for r in req["requests"]}); answer({"states": {i: {"status": "WAITING"} for i in added}})
        elif req["op"] == "step":
            done = {i: {"token_ids": [len(r["prompt"])]} for i, r in added.items()}; added.clear()
            answer({"states": {}, "finished": done})
        else:
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


def test_an_engine_reports_its_baseline_and_what_it_still_holds_once_settled(fake_module):
    """The baseline is the idle state the engine answered at start; a leak check settles the engine and says
    in words what it holds beyond that baseline."""
    clean = engines.EngineProcess("prefill", {}, module=fake_module)
    leaky = engines.EngineProcess("decode", {"held": {"device": 2, "cpu": 3}}, module=fake_module)
    try:
        assert clean.baseline == {"free_device_blocks": 47, "pinned_cpu_blocks": 0, "scheduler_requests": 0}
        assert clean.leaks(stage="settle") == [] and clean.last_settle["steps"] == 3
        got = leaky.leaks(stage="settle")
        assert got[0] == "decode: 2 device blocks still held (45 free, 47 at start)"
        assert got[1].startswith("decode: 3 CPU-tier blocks still pinned (3 pinned, 0 at start) after 3 steps")
        assert clean.ask("add", stage="s", requests=[{"id": "a", "prompt": "xyz"}])["states"]["a"]["status"]
        assert clean.ask("step", stage="s")["finished"] == {"a": {"token_ids": [3]}}
    finally:
        clean.stop()
        leaky.stop()


def test_killing_the_cell_mid_request_leaves_no_engine_and_no_port_behind(fake_module, tmp_path):
    """An engine killed with its cell while a request is in flight (the step API's add, then a step that
    never answers): its process is gone and its NIXL side-channel port is free again (NIXL's agent lives
    in that process, so it is gone with it)."""
    out = tmp_path / "engine"
    driver = textwrap.dedent(
        f"""
        from kvcompat.testkit.e2e import engines
        e = engines.EngineProcess("prefill", {{"listen": True, "hang": "step"}}, module="fake_engine")
        e.ask("add", stage="add", requests=[{{"id": "a", "prompt": "x"}}])
        open({str(out)!r}, "w").write(f"{{e.proc.pid}} {{e.side_channel_port}}")
        e.ask("step", stage="step", timeout=600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    engine_pid, port = map(int, out.read_text().split())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            gone = open(f"/proc/{engine_pid}/stat").read().split()[2] == "Z"
        except OSError:
            gone = True
        if gone:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"engine process {engine_pid} outlived its cell's process group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again: nothing listens on the engine's side channel


def test_an_engines_ports_are_its_own_block():
    first = ports.reserve()
    env = engines.engine_env(first)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["UCX_NET_DEVICES"] == "lo"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert (env["VLLM_NIXL_SIDE_CHANNEL_PORT"], env["VLLM_PORT"]) == (str(first), str(first + 1))
