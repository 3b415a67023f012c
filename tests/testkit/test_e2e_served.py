"""The served e2e suite's process handling (kvcompat.testkit.e2e.served), without vLLM: a start limit that
fails with the server's last log lines, a process tree that is gone after stop (killed or not), the
proxy read from a release's sdist as shipped or with a fault, and the readings of /metrics and of a
traceback."""

from __future__ import annotations

import ast
import asyncio
import io
import sys
import tarfile
import time

import pytest

from kvcompat.testkit import ports
from kvcompat.testkit.e2e import served

# A "server" that logs, starts a child that sleeps, and never answers /health.
SILENT = (
    "import subprocess, sys, time\n"
    "print('loading the tiny model', flush=True)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('still starting', flush=True)\n"
    "time.sleep(600)\n"
)


def _process(code: str, name: str = "prefill") -> served.Process:
    return served.Process(name, [sys.executable, "-c", code], {}, ports.reserve())


def test_a_server_that_does_not_answer_in_its_limit_fails_with_its_last_log_lines_and_is_stopped():
    p = _process(SILENT)
    time.sleep(1.0)
    with pytest.raises(served.ServeError, match=r"(?s)timeout: the prefill server did not answer.*still starting"):
        p.wait_ready(timeout=3)
    assert len(p.pids) == 2, f"the child was not seen: {p.pids}"
    assert p.survivors() == [], p.survivors()


def test_a_server_that_exits_while_starting_fails_with_its_status_and_last_lines():
    p = _process("import sys; print('Traceback (most recent call last):'); print('ValueError: no model'); sys.exit(3)")
    with pytest.raises(served.ServeError, match=r"(?s)exited with status 3 while starting.*ValueError: no model"):
        p.wait_ready(timeout=30)


@pytest.mark.parametrize("kill_first", [False, True])
def test_stop_leaves_no_process_of_the_tree_and_no_port_bound(kill_first):
    """Stopped gracefully (SIGTERM, then SIGKILL to what is left) or killed at once, the server and the
    child it started are gone and its port is free."""
    port = ports.reserve()
    code = (
        "import socket, subprocess, sys, time\n"
        f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port}))\n"
        "s.listen()\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(600)'])\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = served.Process("decode", [sys.executable, "-c", code], {}, port)
    deadline = time.monotonic() + 30
    while "up" not in p.log and time.monotonic() < deadline:
        time.sleep(0.1)
    p.note_tree()
    assert len(p.pids) == 2 and not served.port_free(port)
    p.stop(kill_first=kill_first)
    assert p.survivors() == [], p.survivors()
    assert served.port_free(port)


def _sdist(folder, version: str, proxy: str) -> None:
    with tarfile.open(folder / f"vllm-{version}.tar.gz", "w:gz") as tar:
        data = proxy.encode()
        info = tarfile.TarInfo(f"vllm-{version}/{served.PROXY_MEMBER}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


PROXY = (
    "def _handle(req_data, response_json):\n"
    "    try:\n"
    "        kv_transfer_params = response_json.get('kv_transfer_params', {})\n"
    + served._HANDOFF
    + "        return req_data\n"
    "    except Exception:\n"
    "        raise\n"
    "\n"
    "\n"
    "async def _relay(response):\n"
    "    if True:\n" + served._STREAM
)


@pytest.mark.parametrize("fault", [None, *served.PROXY_FAULTS])
def test_the_proxy_is_the_release_s_own_or_has_the_one_edit_of_its_fault(tmp_path, monkeypatch, fault):
    _sdist(tmp_path, "9.9.9", PROXY)
    monkeypatch.setenv(served.SDIST_DIR_ENV, str(tmp_path))
    path = served.proxy_source("9.9.9", tmp_path / "out", fault)
    text = path.read_text()
    if fault is None:
        assert text == PROXY and path.name == "toy_proxy_server.py"
        return
    # The faulted proxies sit beside the release's own, each in a file of its own.
    assert path.name != "toy_proxy_server.py", path
    namespace: dict = {}
    exec(compile(ast.parse(text), "proxy", "exec"), namespace)  # the edited source still runs
    params = {"remote_block_ids": [[1, 2, 3]], "do_remote_prefill": True}
    got = namespace["_handle"]({"prompt": [1]}, {"kv_transfer_params": dict(params)})
    relayed = asyncio.run(_relay_all(namespace["_relay"], [b"a", b"b", b"c"]))
    if fault == "cut-stream":  # the client's body ends after the first chunk, with the error that cut it
        assert relayed == ([b"a"], "RuntimeError") and got["kv_transfer_params"] == params
        return
    assert relayed == ([b"a", b"b", b"c"], None)
    if fault == "drop-kv-transfer-params":
        assert "kv_transfer_params" not in got
    else:
        assert got["kv_transfer_params"]["remote_block_ids"] == [[3, 2, 1]]


async def _relay_all(relay, chunks: list[bytes]) -> tuple[list[bytes], str | None]:
    """What the proxy's relay loop sends on of a decode's ``chunks``, and the error that ended it, if one did."""

    class Response:
        async def aiter_bytes(self):
            for c in chunks:
                yield c

    sent: list[bytes] = []
    try:
        async for c in relay(Response()):
            sent.append(c)
    except Exception as exc:  # noqa: BLE001 - the fault's error is what is checked
        return sent, type(exc).__name__
    return sent, None


def test_metrics_are_read_by_name_and_labels():
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 200.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 7.0\n'
    )
    m = served.parse_metrics(text)
    assert served.metric(m, "vllm:num_requests_running") == 0.0
    assert served.metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 200.0
    assert served.metric(m, "vllm:prompt_tokens_by_source_total") == 207.0
    assert served.metric(m, "vllm:nixl_bytes_transferred_sum") is None


def test_the_cli_failure_is_read_with_the_release_s_frame():
    log = [
        "Traceback (most recent call last):",
        '  File "/v/bin/vllm", line 10, in <module>',
        '  File "/v/lib/python3.11/site-packages/vllm/entrypoints/cli/main.py", line 99, in main',
        '  File "/usr/lib/python3.11/importlib/metadata/__init__.py", line 565, in from_name',
        "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm",
    ]
    assert served.vllm_frame(log) == "vllm/entrypoints/cli/main.py:99"
    assert served.last_exception(log).startswith("importlib.metadata.PackageNotFoundError")


def test_a_fault_whose_line_the_release_s_proxy_lacks_is_said_not_silently_dropped(tmp_path, monkeypatch):
    _sdist(tmp_path, "9.9.9", PROXY.replace(served._HANDOFF, "        pass\n"))
    monkeypatch.setenv(served.SDIST_DIR_ENV, str(tmp_path))
    with pytest.raises(served.ServeError, match="drop-kv-transfer-params.*has no"):
        served.proxy_source("9.9.9", tmp_path / "out", "drop-kv-transfer-params")


@pytest.mark.parametrize(
    ("status", "tokens", "verdict"),
    [
        (500, None, "an error status"),
        (410, None, "an error status"),
        (None, [5, 6, 7], "the reference"),
        (None, [5, 6, 8], "other tokens"),
        (None, [5, 6], "other tokens"),
        (None, None, "no answer"),
    ],
)
def test_a_late_decode_is_judged_by_what_its_client_got(status, tokens, verdict):
    """The late-decode contract passes on an error status or the reference only: a decode with other tokens
    (or none, and no status) is red."""
    assert served.late_decode_verdict(status, tokens, [5, 6, 7]) == verdict
