"""What the e2e suite sends: prompts, sizes, and the proxy step between prefill and decode."""

from __future__ import annotations

import os

from kvcompat.testkit.e2e import model

MAX_TOKENS = 16
# Four prompts of 100..160 words (one token per word with the tiny tokenizer): 4-6 blocks of 32.
PROMPTS = [model.prompt(i, 100 + 20 * i) for i in range(4)]
# Two prompts of one length: the decode is given the first one's remote blocks for the second.
CONTROL = [model.prompt(50, 120), model.prompt(51, 120)]
# Prompts that evict PROMPTS from the round trip's 20 device blocks.
FILLERS = [model.prompt(100 + i, 150) for i in range(4)]
ROUND_TRIP_DEVICE_BLOCKS = 20
CPU_BLOCKS = 64
PD_DEVICE_BLOCKS = 48


def engine_specs(model_dir, *, log_stats: bool = False) -> dict[str, dict]:
    """The suite's four engines by name (kvcompat.testkit.e2e.engine specs); the benchmark's floor builds
    the same ones.  Stats logging stays LLM's default (off) unless asked for (see engine.build_llm)."""
    plain = {"model": str(model_dir), "log_stats": log_stats}
    multi = {**plain, "connector": "multi", "cpu_blocks": CPU_BLOCKS}
    return {
        "reference": plain,
        "round-trip": {**multi, "num_gpu_blocks": ROUND_TRIP_DEVICE_BLOCKS, "engine_id": "kvcompat-round-trip"},
        "prefill": {**multi, "num_gpu_blocks": PD_DEVICE_BLOCKS, "engine_id": "kvcompat-prefill"},
        "decode": {**multi, "num_gpu_blocks": PD_DEVICE_BLOCKS, "engine_id": "kvcompat-decode"},
    }


# A negative control of our proxy step (tests/harness/test_e2e_control.py): "pd-wrong-blocks" hands
# the decode the prefill's blocks in reverse order, a transfer of the wrong blocks.
PROXY_FAULT_ENV = "KVCOMPAT_E2E_PROXY_FAULT"


REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def proxy_params(kv_transfer_params: dict) -> dict:
    """What vLLM's proxy hands the decode: the prefill's kv_transfer_params, as returned."""
    params = dict(kv_transfer_params)
    if os.environ.get(PROXY_FAULT_ENV) == "pd-wrong-blocks":
        params["remote_block_ids"] = _reversed_blocks(params.get("remote_block_ids"))
    return params


def _reversed_blocks(ids):
    if ids and isinstance(ids[0], list):
        return [list(reversed(g)) for g in ids]
    return list(reversed(ids or []))
