"""One real vLLM engine in its own process: ``python -m kvcompat.testkit.e2e.engine SPEC_JSON``.

The suite starts one process per engine (kvcompat.testkit.e2e.engines): two engines of one
release in one process would share vLLM's process-global state (its distributed groups, the
connector agent), which is not a deployment anyone runs.  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps
the engine core in this process, so vLLM is imported once per engine (~20 s instead of ~60 s) and
the release's scheduler, connectors and CPU-offload worker are reachable for their counters.

Protocol: every answer is one stdout line starting with ``MARK`` followed by JSON; everything else on
stdout/stderr is vLLM's log, kept by the parent for error messages.  After start the process answers
``{"ready": ...}``, then one answer per request line read from stdin: ``{"op": "generate", ...}`` or
``{"op": "counters"}``.  It exits when stdin closes.
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

    return multi_kv_transfer_config(
        BLOCK_SIZE,
        spec["cpu_blocks"],
        engine_id=spec["engine_id"],
        bytes_per_block=kv_bytes_per_block(BLOCK_SIZE),
    )


def build_llm(spec: dict) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        seed=0,
        enable_prefix_caching=True,
        # LLM's default.  With stats logged, an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        # crashes on a Nixl decode up to 0.29 (docs/vllm-multiconnector-history.md, "End to end"): a
        # vLLM bug of that mode, which the default, multiprocess deployment never meets, so the suite's
        # verdicts do not depend on it.  KVCOMPAT_E2E_LOG_STATS=1 turns it on (and the release's
        # Prometheus counters into the engines' answers).
        disable_log_stats=not spec.get("log_stats", False),
    )
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    config = kv_transfer_config(spec)
    if config is not None:
        kwargs["kv_transfer_config"] = config
    return LLM(**kwargs)  # EngineArgs: every one of these exists from 0.15 on


def scheduler_of(llm: Any) -> Any:
    """The engine core's scheduler (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    return getattr(core, "scheduler", None)


def counters(llm: Any, spec: dict) -> dict:
    """What the release itself counts, and what the CPU transport stand-in moved."""
    out: dict[str, Any] = {}
    sched = scheduler_of(llm)
    connector = getattr(sched, "connector", None)
    if connector is not None:
        out["connector"] = type(connector).__name__
        children = getattr(connector, "_connectors", [])
        out["children"] = [type(c).__name__ for c in children]
    out["metrics"] = metrics(llm) if spec.get("log_stats") else {}
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
# or a remote prefill), and the CPU-offload child's own metrics where the release has them.
METRIC_WORDS = ("prefix_cache", "kv_offload", "connector")


def metrics(llm: Any) -> dict[str, float]:
    """The release's Prometheus counters and gauges whose name says prefix cache or KV offload."""
    out: dict[str, float] = {}
    try:
        snapshot = llm.get_metrics()
    except Exception as exc:  # noqa: BLE001 - a release without it: the suite sees no counters
        return {"error": repr(exc)}  # type: ignore[dict-item]
    for m in snapshot:
        if any(w in m.name for w in METRIC_WORDS) and isinstance(getattr(m, "value", None), (int, float)):
            label = ",".join(
                f"{k}={v}" for k, v in sorted(getattr(m, "labels", {}).items()) if k not in ("engine", "model_name")
            )
            key = m.name + (f"{{{label}}}" if label else "")
            out[key] = out.get(key, 0) + m.value
    return out


def generate(llm: Any, spec: dict, req: dict) -> dict:
    from vllm import SamplingParams

    params = []
    for ktp in req.get("kv_transfer_params") or [None] * len(req["prompts"]):
        extra = {"kv_transfer_params": ktp} if ktp is not None else None
        params.append(SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True, extra_args=extra))
    t0 = time.monotonic()
    outs = llm.generate(req["prompts"], params, use_tqdm=False)
    result = []
    for o in outs:
        result.append(
            {
                "token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,
                "kv_transfer_params": getattr(o, "kv_transfer_params", None),
            }
        )
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
    answer({"ready": True, "seconds": time.monotonic() - t0, "counters": counters(llm, spec)})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "generate":
                answer(generate(llm, spec, req))
            elif req["op"] == "counters":
                answer(counters(llm, spec))
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
