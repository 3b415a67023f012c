"""End to end as it is served: ``vllm serve`` prefill and decode behind vLLM's own proxy, driven by the
``openai`` client.

The deployment (tests/e2e/conftest.py ``served``, kvcompat.testkit.e2e.served) is started once: a prefill
and a decode server each with MultiConnector(Nixl + the CPU-offload child, its CUDA transport replaced as
in the rest of the suite), and vLLM's ``toy_proxy_server.py`` from the release's sdist, unchanged, in
front; beside them ``vllm serve`` of the plain model, as users start a server (stopped once it answers).
Each server runs as deployed: the API server, its engine core and its worker in processes of their own.
Every contract compares tokens with the suite's plain engine's (the same release and model: the
reference) and reads the servers' own ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import time

from workload import (
    BLOCK_SIZE,
    EDGES,
    MAX_TOKENS,
    REMOTE_DECODE,
    SERVED_AFTER_LOAD,
    SERVED_CLOSED,
    SERVED_CPU_TIER,
    SERVED_FIRST,
    SERVED_LOAD,
    SERVED_ROLES,
    SERVED_SHARED,
    SERVED_TRANSFER,
    n_tokens,
    pd_fillers,
    proxy_params,
    tokens,
)

from kvcompat.testkit import not_applicable, record_fact, setup_owned_by
from kvcompat.testkit.e2e.model import kv_bytes_per_block
from kvcompat.testkit.e2e.served import completion, http_get, late_decode_verdict, metric, stream_many

TOKENS = "test_served_completions_through_the_proxy_equal_the_reference"
TRANSFER = "test_served_decode_uses_the_kv_transferred_over_nixl"
REFERENCE = "test_a_plain_engine_generates_the_reference"
PD = "test_prefill_then_decode_over_nixl_gives_the_reference_tokens"  # the in-process P/D (tests/e2e/test_engines.py)
IDLE_WAIT_S = 60.0
# The release's metrics the contracts read (a counter by its family's name with "_total").
BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # prompt tokens by where they came from
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"  # prefix-cache hit tokens by tier
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
OFFLOAD_LOADS = "vllm:simple_kv_offload_load_blocks_total"
RUNNING, WAITING, USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
PENDING_STORES = "vllm:simple_kv_offload_pending_store_blocks"
_IDLE_KEYS = (RUNNING, WAITING, USAGE, PENDING_STORES)
SUCCESS = "vllm:request_success_total"  # finished requests by finished_reason
CLOSED_MAX_TOKENS = 200  # the requests their clients close: still generating when closed
# The controls' prompts, fresh (no server saw them before: a cached prompt would need no transfer).
CONTROL_TRANSFER = tokens(700, 6 * BLOCK_SIZE + 8)
CONTROL_TOKENS = {f"{n} tokens": tokens(701 + i, n) for i, n in enumerate([3 * BLOCK_SIZE, 4 * BLOCK_SIZE + 1])}
CONTROL_STREAMS = [tokens(730 + i, n) for i, n in enumerate([2 * BLOCK_SIZE + 5, 3 * BLOCK_SIZE + 9])]
# The late decode: its prompt, a prompt sent the same way on time (our requests built right), and the
# prompt pair of its control (a decode handed another prompt's KV); each of 5 blocks and a bit.
LATE, ON_TIME = tokens(710, 5 * BLOCK_SIZE + 7), tokens(711, 5 * BLOCK_SIZE + 7)
OTHER_KV = (tokens(712, 5 * BLOCK_SIZE + 7), tokens(713, 5 * BLOCK_SIZE + 7))
# NixlConnector's lease on a prefill's blocks: kv_connector_extra_config "kv_lease_duration", 30 s unless set
# (nixl/base_scheduler.py and base_worker.py 0.32.0 L528); the deployment runs the release's default.
LEASE_S, LEASE_MARGIN_S = 30.0, 3.0
KV_BOTH_PROMPT, KV_BOTH_OTHER = tokens(720, 4 * BLOCK_SIZE + 9), tokens(721, 4 * BLOCK_SIZE + 9)
KV_BOTH_WARNING = "kv_role='kv_both' with NixlConnector is deprecated"  # nixl/connector.py 0.32.0 L98-99


def _tokens(response) -> list[int]:
    return list(response.choices[0].token_ids or [])


def _reference(request, prompts: list) -> list[list[int]]:
    """The plain engine's greedy tokens for each prompt (the suite's reference, its own contract)."""
    with setup_owned_by(REFERENCE):
        return request.getfixturevalue("reference_of")(prompts)


def _through_proxy(served, prompt, max_tokens: int = MAX_TOKENS):
    return completion(served.proxy.url, prompt["prompt_token_ids"], max_tokens=max_tokens)


def _moved(before: dict, after: dict, name: str, **labels: str) -> float | None:
    a, b = metric(before, name, **labels), metric(after, name, **labels)
    return None if b is None else b - (a or 0.0)


def _summary(streamed: list[dict]) -> list[dict]:
    return [
        {k: r.get(k) for k in ("finish_reason", "status", "error", "seconds", "chunks")} | {"n": len(r["tokens"])}
        for r in streamed
    ]


def _complete_or_a_clear_error(first: list[dict], prompts: list, reference: list[list[int]]) -> None:
    """The first-requests contract's check over streamed results (``stream_many``): at least one answered, and
    each a complete answer (a finish reason, the reference's tokens) or an error status before any body
    (a server error, 5xx); never a body cut off after the response began."""
    for i, (r, ref) in enumerate(zip(first, reference, strict=True)):
        assert r["status"] is not None or r["error"] is None, (
            f"request {i}: the body was cut off after the response began ({len(r['tokens'])} tokens): {r['error']}"
        )
        # An error status is a clear one only from a server that failed (5xx): a 4xx means the request was
        # refused, and the contract then proved nothing.
        assert r["status"] is None or r["status"] >= 500, f"request {i} was refused: {r['error']}"
        if r["status"] is None:
            assert r["finish_reason"] == "length", f"request {i}: the stream ended without a finish reason: {r}"
            assert r["tokens"] == ref, f"request {i} ({n_tokens(prompts[i])} tokens): tokens != reference"
    assert any(r["status"] is None for r in first), f"no first request was answered: {_summary(first)}"


def test_served_first_requests_after_start_are_complete_or_a_clear_error(served, request):
    """The first requests after the deployment answered /health, eight at once through the proxy, streamed
    (the decode's first NIXL handshake happens under load): each gets a complete answer (a finish reason,
    every token, the reference's) or an error status before any body; never a body cut off mid-stream."""
    first = served.first
    record_fact("e2e served first requests", str(_summary(first)))
    _complete_or_a_clear_error(first, SERVED_FIRST, _reference(request, SERVED_FIRST))


def test_served_vllm_serve_starts_as_users_start_it(served):
    """``vllm serve MODEL ...``, the command users run, starts a server that answers /health (started beside
    the deployment, stopped once it answers); where the CLI exits while starting, this is red with the
    release's frame (the suite's servers start through ``python -m vllm.entrypoints.openai.api_server``)."""
    failure = served.cli_failure
    if failure is not None:
        record_fact("e2e served vllm serve", f"exited {failure['status']}: {failure['error']} at {failure['where']}")
    assert failure is None, (
        f"`vllm serve` exited with status {failure['status']} while starting: {failure['error']} ({failure['where']})"
    )


def test_served_completions_through_the_proxy_equal_the_reference(served, request):
    """Completions through vLLM's proxy (prefill, then the decode with the prefill's kv_transfer_params)
    equal the reference server's, token for token: prompts under a block, of exact blocks, one token over,
    near the maximum length, and four sharing a two-block prefix."""
    prompts = {**EDGES, **{f"shared prefix {i}": p for i, p in enumerate(SERVED_SHARED)}}
    _tokens_through(served.proxy.url, request, prompts)


def _tokens_through(url: str, request, prompts: dict) -> None:
    """The tokens contract through the proxy at ``url`` (the release's, or a control's)."""
    reference = _reference(request, list(prompts.values()))
    for (name, prompt), ref in zip(prompts.items(), reference, strict=True):
        got = completion(url, prompt["prompt_token_ids"], max_tokens=MAX_TOKENS)
        assert got.usage.prompt_tokens == n_tokens(prompt), (name, got.usage)
        assert _tokens(got) == ref, f"{name} ({n_tokens(prompt)} tokens): through the proxy != reference"


def test_served_decode_uses_the_kv_transferred_over_nixl(served, request):
    """A fresh prompt through the proxy: the decode's own /metrics say its prompt came from a KV transfer
    (prompt tokens by source external_kv_transfer, at least its full blocks) and NIXL moved at least its
    full blocks' KV, and its tokens are the reference.  (A proxy that drops kv_transfer_params turns this
    red: tests/harness/test_e2e_served_control.py.)"""
    _transfer_through(served, served.proxy, request, SERVED_TRANSFER)


def _transfer_through(served, proxy, request, prompt: dict) -> None:
    """The transfer contract for a fresh ``prompt`` through ``proxy`` (the release's, or a control's)."""
    url = proxy.url
    (ref,) = _reference(request, [prompt])
    before = served.decode.metrics()
    got = completion(url, prompt["prompt_token_ids"], max_tokens=MAX_TOKENS)
    after = served.decode.metrics()
    full = n_tokens(prompt) // BLOCK_SIZE
    seen = {
        "transferred prompt tokens": _moved(before, after, BY_SOURCE, source="external_kv_transfer"),
        "computed prompt tokens": _moved(before, after, BY_SOURCE, source="local_compute"),
        "NIXL bytes": _moved(before, after, NIXL_BYTES),
    }
    record_fact(f"e2e served transfer ({proxy.name})", f"{seen}; prompt {n_tokens(prompt)} tokens, {full} full blocks")
    assert _tokens(got) == ref, "the decode's tokens != reference"
    with setup_owned_by(TOKENS):
        assert seen["transferred prompt tokens"] is not None or seen["NIXL bytes"] is not None, (
            f"the decode exports neither {BY_SOURCE} nor {NIXL_BYTES}: {sorted(after)[:40]}"
        )
    if seen["transferred prompt tokens"] is not None:
        assert seen["transferred prompt tokens"] >= full * BLOCK_SIZE, f"too few transferred prompt tokens: {seen}"
    if seen["NIXL bytes"] is not None:
        assert seen["NIXL bytes"] >= full * kv_bytes_per_block(BLOCK_SIZE), f"too few NIXL bytes: {seen}"


def test_served_prefill_and_decode_take_the_producer_and_consumer_roles(served, request):
    """The prefill serves as ``kv_producer`` and the decode as ``kv_consumer`` (the roles vLLM asks P/D
    deployments for; NixlConnector warns that ``kv_both`` is deprecated): neither server refused its role
    nor warned about it, and a request through them gives the reference.  (``kv_both`` on both sides is
    the in-process suite's P/D, tests/e2e/test_engines.py.)"""
    roles = {
        n: served.processes[n].argv[served.processes[n].argv.index("--kv-transfer-config") + 1]
        for n in ("prefill", "decode")
    }
    assert '"kv_role": "kv_producer"' in roles["prefill"] and '"kv_role": "kv_consumer"' in roles["decode"], roles
    (ref,) = _reference(request, [SERVED_ROLES])
    assert _tokens(_through_proxy(served, SERVED_ROLES)) == ref, "through producer and consumer: tokens != reference"
    warned = [line for n in ("prefill", "decode") for line in served.processes[n].grep("kv_role")]
    record_fact("e2e served kv_role lines", str(warned[:4]) if warned else "none")
    assert not [w for w in warned if "deprecat" in w.lower()], f"a role was warned about: {warned}"


def test_served_cpu_tier_serves_repeated_prompts_on_both_nodes(served, request):
    """Each node's CPU tier: a prompt served through the proxy, then fillers that evict both device caches,
    then the prompt again on the decode alone (no prefill) and through the proxy.  The decode kept the KV it
    received over NIXL in its CPU tier and serves the repeat from there; the prefill serves the repeat from
    its CPU tier before sending it over NIXL; every answer is the reference.  The transport stand-in counts
    the copies; the release's /metrics (host hits, CPU-offload loaded blocks) must move where exported."""
    prompt = SERVED_CPU_TIER
    (ref,) = _reference(request, [prompt])
    t0 = {n: served.transport(n) for n in ("prefill", "decode")}
    assert _tokens(_through_proxy(served, prompt)) == ref, "first pass through the proxy: tokens != reference"
    for filler in pd_fillers(1000):
        _through_proxy(served, filler, max_tokens=1)
    t1 = {n: served.transport(n) for n in ("prefill", "decode")}
    d1 = served.decode.metrics()
    alone = completion(served.decode.url, prompt["prompt_token_ids"], max_tokens=MAX_TOKENS)
    d2, t2 = served.decode.metrics(), {n: served.transport(n) for n in ("prefill", "decode")}
    p2 = served.prefill.metrics()
    again = _through_proxy(served, prompt)
    p3, t3 = served.prefill.metrics(), {n: served.transport(n) for n in ("prefill", "decode")}
    seen = {
        "prefill stores": t1["prefill"]["stores"] - t0["prefill"]["stores"],
        "decode stores": t1["decode"]["stores"] - t0["decode"]["stores"],
        "decode alone: loads": t2["decode"]["loads"] - t1["decode"]["loads"],
        "decode alone: host hits": _moved(d1, d2, CACHED_BY_SOURCE, source="host"),
        "decode alone: offload loaded blocks": _moved(d1, d2, OFFLOAD_LOADS),
        "prefill repeat: loads": t3["prefill"]["loads"] - t2["prefill"]["loads"],
        "prefill repeat: host hits": _moved(p2, p3, CACHED_BY_SOURCE, source="host"),
        "prefill repeat: offload loaded blocks": _moved(p2, p3, OFFLOAD_LOADS),
    }
    record_fact("e2e served CPU tier", str(seen))
    assert seen["prefill stores"] > 0 and seen["decode stores"] > 0, f"a node stored nothing to its CPU tier: {seen}"
    assert _tokens(alone) == ref, "the decode alone, from its CPU tier: tokens != reference"
    assert _tokens(again) == ref, "through the proxy, from the prefill's CPU tier: tokens != reference"
    assert seen["decode alone: loads"] > 0, f"the decode alone did not load from its CPU tier: {seen}"
    assert seen["prefill repeat: loads"] > 0, f"the prefill did not load the repeat from its CPU tier: {seen}"
    for node in ("decode alone", "prefill repeat"):
        hits = seen[f"{node}: host hits"]
        if hits is not None:  # where the release exports it
            assert hits > 0, f"{node}: the release's host hits did not move: {seen}"
        loaded = seen[f"{node}: offload loaded blocks"]
        if loaded is not None and hits is not None:
            assert loaded == hits // BLOCK_SIZE > 0, f"{node}: loaded blocks != host hits / block size: {seen}"


def _idle(served, name: str) -> dict[str, float | None]:
    m = served.processes[name].metrics()
    return {k: metric(m, k) for k in _IDLE_KEYS}


def test_served_load_with_client_aborts_leaves_both_servers_idle(served, request):
    """Ten streamed requests at once through the proxy, two closed by their client mid-stream: the others
    give the reference (the closed ones ask for 200 tokens, so they are still generating when closed); then
    both servers answer /health, their /metrics come back to what they read at
    start (0 running, 0 waiting, KV cache usage and CPU-offload pending stores as at start) within
    60 s, and a new request still gets the reference."""
    reference = _reference(request, SERVED_LOAD)
    before = {n: served.processes[n].metrics() for n in ("prefill", "decode")}
    got = stream_many(
        served.proxy.url,
        SERVED_LOAD,
        max_tokens=MAX_TOKENS,
        close_after=SERVED_CLOSED,
        max_tokens_of=dict.fromkeys(SERVED_CLOSED, CLOSED_MAX_TOKENS),
    )
    record_fact(
        "e2e served load",
        str([{k: r.get(k) for k in ("finish_reason", "closed", "error", "seconds")} for r in got]),
    )
    for i, (r, ref) in enumerate(zip(got, reference, strict=True)):
        if i in SERVED_CLOSED:
            assert r["closed"], f"request {i} was to be closed by its client: {r}"
            continue
        assert r["error"] is None and r["status"] is None, f"request {i} failed: {r}"
        assert r["tokens"] == ref and r["finish_reason"] == "length", f"request {i}: tokens != reference: {r}"
    # The CPU-offload child's gauge is bound at its first store: none at start is 0 pending.
    want = {n: {k: metric(served.idle[n], k) for k in _IDLE_KEYS} for n in served.idle}
    for n in want:
        if want[n][PENDING_STORES] is None:
            want[n][PENDING_STORES] = 0.0
    t0 = time.monotonic()
    while True:
        now = {n: _idle(served, n) for n in ("prefill", "decode")}
        if now == want or time.monotonic() - t0 > IDLE_WAIT_S:
            break
        time.sleep(1.0)
    record_fact("e2e served idle after load", f"{now} after {time.monotonic() - t0:.0f}s; at start {want}")
    finished = {
        n: {
            r: _moved(before[n], served.processes[n].metrics(), SUCCESS, finished_reason=r)
            for r in ("length", "abort", "stop")
        }
        for n in ("prefill", "decode")
    }
    record_fact("e2e served requests finished during the load, by reason", str(finished))
    for n in ("prefill", "decode"):
        status, body = http_get(served.processes[n].url + "/health")
        assert status == 200, f"{n}: /health answered {status} after the load: {body[:200]}"
        assert now[n][RUNNING] == 0 and now[n][WAITING] == 0, f"{n}: still busy {IDLE_WAIT_S:.0f}s after: {now[n]}"
        assert now[n] == want[n], f"{n}: not back to its idle state at start: {now[n]} (at start {want[n]})"
    (ref,) = _reference(request, [SERVED_AFTER_LOAD])
    assert _tokens(_through_proxy(served, SERVED_AFTER_LOAD)) == ref, "after the load: tokens != reference"


def _control_proxy(served, fault: str):
    proxy = served.fault_proxy(fault)
    if proxy is None:  # probed at start: the release's proxy has no line for the fault's edit
        not_applicable(f"no {fault} control of this release's proxy: {served.fault_missing[fault]}")
    return proxy


def _red_under(fault: str, check) -> str | None:
    """Run ``check`` (a contract's own check, through the ``fault`` proxy): the first line of what it asserted,
    recorded for the report under the fault's name; None when it stayed green."""
    try:
        check()
    except AssertionError as exc:
        red = str(exc).splitlines()[0]
    else:
        red = None
    record_fact(f"e2e served control {fault}", str(red))
    return red


def test_served_control_a_proxy_dropping_kv_transfer_params_turns_the_transfer_contract_red(served, request):
    """Control of the transfer contract: through a second proxy in front of the same servers, the release's
    proxy with the decode never handed the prefill's kv_transfer_params, a fresh prompt gives the reference
    tokens (the decode computes it) and the transfer contract's check is red on its own metrics."""
    proxy = _control_proxy(served, "drop-kv-transfer-params")
    red = _red_under("drop-kv-transfer-params", lambda: _transfer_through(served, proxy, request, CONTROL_TRANSFER))
    assert red is not None, "with the decode handed no kv_transfer_params the transfer contract stayed green"
    assert red.startswith("too few"), f"the transfer contract went red for another reason: {red}"


def test_served_control_a_proxy_reversing_remote_blocks_turns_the_tokens_contract_red(served, request):
    """Control of the tokens contract (and of every served contract that compares tokens): through a second
    proxy in front of the same servers, the release's proxy with the prefill's blocks handed to the decode in
    reverse order, the tokens contract's check on fresh prompts of several blocks is red."""
    proxy = _control_proxy(served, "reverse-remote-blocks")
    red = _red_under("reverse-remote-blocks", lambda: _tokens_through(proxy.url, request, CONTROL_TOKENS))
    assert red is not None, "with the decode reading its blocks in reverse order the tokens contract stayed green"
    assert "through the proxy != reference" in red, f"the tokens contract went red for another reason: {red}"


def test_served_control_a_proxy_cutting_the_stream_turns_the_first_requests_contract_red(served, request):
    """Control of the first-requests contract: through a second proxy in front of the same servers, the
    release's proxy failing after it relayed the decode's first chunk (its 200 and part of the body sent),
    fresh prompts streamed at once get bodies cut off mid-stream, and the contract's check says so."""
    proxy = _control_proxy(served, "cut-stream")
    got = stream_many(proxy.url, CONTROL_STREAMS, max_tokens=MAX_TOKENS)
    red = _red_under(
        "cut-stream", lambda: _complete_or_a_clear_error(got, CONTROL_STREAMS, _reference(request, CONTROL_STREAMS))
    )
    assert red is not None, "with the proxy cutting every stream off the first-requests contract stayed green"
    assert "the body was cut off" in red, f"the first-requests contract went red for another reason: {red}"


def _prefill_leg(served, prompt: dict, request_id: str):
    """The proxy's first leg, as vLLM's toy_proxy_server.py sends it: the prompt to the prefill with
    max_tokens 1 and do_remote_decode, under the request id the decode leg reuses.  The prefill's
    kv_transfer_params, returned."""
    got = completion(
        served.prefill.url,
        prompt["prompt_token_ids"],
        max_tokens=1,
        headers={"X-Request-Id": request_id},
        kv_transfer_params=dict(REMOTE_DECODE),
    )
    params = getattr(got, "kv_transfer_params", None) or (got.model_extra or {}).get("kv_transfer_params")
    assert params and params.get("remote_block_ids"), f"the prefill returned no kv_transfer_params: {got}"
    return params


def _decode_leg(served, prompt: dict, request_id: str, params: dict) -> dict:
    """The proxy's second leg: the prompt to the decode with the prefill's kv_transfer_params.  What the
    client sees: ``status`` (an error status), ``error``, ``tokens``."""
    import openai

    try:
        got = completion(
            served.decode.url,
            prompt["prompt_token_ids"],
            max_tokens=MAX_TOKENS,
            headers={"X-Request-Id": request_id},
            kv_transfer_params=dict(params),  # as the release's proxy hands them on
        )
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "error": str(exc)[:300], "tokens": None}
    except Exception as exc:  # noqa: BLE001 - no answer at all: said as it is
        return {"status": None, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "tokens": None}
    return {"status": None, "error": None, "tokens": _tokens(got)}


def _fill_prefill(served, seed: int) -> None:
    """Prompts on the prefill alone that take every one of its device blocks, twice over (8 x 13 blocks
    against 48): the blocks a released lease gave back now hold their KV."""
    for filler in pd_fillers(seed) + pd_fillers(seed + 10):
        completion(served.prefill.url, filler["prompt_token_ids"], max_tokens=1)


def test_served_a_late_decode_never_returns_tokens_from_released_kv(served, request):
    """A decode whose request reaches the decode server after the prefill's lease on the prompt's blocks
    expired (the release's default lease, ``kv_lease_duration`` 30 s), while the prefill served other
    prompts that took those blocks: the client gets an error status, or the reference (a recompute, or
    the KV still intact); never other tokens.  Sent as vLLM's proxy sends it (its two legs, by hand, the
    decode leg held back); first the same two legs on time give the reference (the requests are right)."""
    reference = dict(zip(("late", "on time"), _reference(request, [LATE, ON_TIME]), strict=True))
    on_time = _decode_leg(served, ON_TIME, "kvcompat-on-time", _prefill_leg(served, ON_TIME, "kvcompat-on-time"))
    assert on_time["tokens"] == reference["on time"], f"P/D by hand, on time: not the reference: {on_time}"
    params = _prefill_leg(served, LATE, "kvcompat-late")
    t0 = time.monotonic()
    time.sleep(LEASE_S + LEASE_MARGIN_S)
    _fill_prefill(served, 2000)  # the prefill steps: it reaps the expired lease, and the fillers take the blocks
    expired = served.prefill.grep("Releasing expired KV blocks", params["remote_request_id"])
    record_fact(
        "e2e served late decode: lease",
        f"{expired[:1] or 'no expiry logged'}; decode sent {time.monotonic() - t0:.0f}s after the prefill",
    )
    # Without the lease expired first, nothing here was late: not a verdict either way.
    assert expired, f"the prefill did not release {params['remote_request_id']} in {time.monotonic() - t0:.0f}s"
    late = _decode_leg(served, LATE, "kvcompat-late", params)
    # The prefill reads the decode's notification of the read at its next step: one more prompt on it.
    completion(served.prefill.url, ON_TIME["prompt_token_ids"], max_tokens=1)
    after = served.prefill.grep("Potentially invalid KV blocks", params["remote_request_id"])
    verdict = late_decode_verdict(late["status"], late["tokens"], reference["late"])
    record_fact(
        "e2e served late decode",
        f"{verdict}; status {late['status']}, error {late['error']}; the prefill then logged: {after[:1] or 'nothing'}",
    )
    assert verdict in ("an error status", "the reference"), (
        f"a decode read KV its prefill had released (lease expired, blocks reused): {verdict}; "
        f"the prefill logged {after[:1] or 'nothing'}"
    )


def test_served_control_a_decode_reading_other_kv_turns_the_late_decode_verdict_red(served, request):
    """Control of the late-decode contract: its two legs by hand, on time, with the decode handed another
    prompt's blocks (of the same length): the verdict the late-decode contract passes on is 'other tokens'."""
    a, b = OTHER_KV
    (ref_b,) = _reference(request, [b])
    got = _decode_leg(served, b, "kvcompat-other-kv", _prefill_leg(served, a, "kvcompat-other-kv"))
    verdict = late_decode_verdict(got["status"], got["tokens"], ref_b)
    record_fact("e2e served control other KV", verdict)
    assert verdict == "other tokens", f"a decode handed another prompt's KV: {verdict} ({got})"


def test_kv_both_pd_gives_the_reference_and_the_release_says_whether_it_is_deprecated(fleet, request):
    """``kv_role`` ``kv_both`` on both sides (the in-process P/D engines of the suite, started anyway; a
    served pair of its own would cost two more server starts): a fresh prompt's P/D gives the reference,
    the decode took the prompt's full blocks from the transfer, and where the release's NixlConnector
    deprecates ``kv_both`` (its source says so) the engines' log says it to the user.  The served pair's
    producer/consumer roles log no such warning (their own contract): the same reading, said both ways."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl_connector

    from kvcompat.testkit.e2e.engine import kv_transfer_config

    prompt = KV_BOTH_PROMPT
    (ref,) = _reference(request, [prompt])
    with setup_owned_by(PD):  # both engines up: the in-process P/D contract's
        fleet.prefill.wait_ready()
        fleet.decode.wait_ready()
    roles = {e.name: kv_transfer_config(e.spec).kv_role for e in (fleet.prefill, fleet.decode)}  # as each built it
    assert set(roles.values()) == {"kv_both"}, f"the in-process P/D engines are not kv_both: {roles}"
    pre = fleet.prefill.generate(
        [prompt], stage="prefill (kv_both)", max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE)]
    )
    params = pre["outputs"][0]["kv_transfer_params"]
    assert params and params.get("remote_block_ids"), f"the prefill returned no kv_transfer_params: {params}"
    out = fleet.decode.generate(
        [prompt], stage="decode (kv_both)", max_tokens=MAX_TOKENS, kv_transfer_params=[proxy_params(params)]
    )["outputs"][0]
    deprecated = KV_BOTH_WARNING in inspect.getsource(nixl_connector)
    said = [line for e in (fleet.prefill, fleet.decode) for line in e.log if "kv_both" in line and "deprecat" in line]
    record_fact("e2e kv_both", f"the release deprecates kv_both: {deprecated}; logged: {said[:1] or 'nothing'}")
    assert out["token_ids"] == ref, "kv_both P/D: the decode's tokens != reference"
    # The decode read the transferred KV: handed this prompt's blocks, another prompt of its length decodes
    # from them, not from its own prompt (a decode that computed its prompt would pass the line above).
    (ref_other,) = _reference(request, [KV_BOTH_OTHER])
    pre = fleet.prefill.generate(
        [prompt], stage="prefill (kv_both, control)", max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE)]
    )
    other = fleet.decode.generate(
        [KV_BOTH_OTHER],
        stage="decode (kv_both, control)",
        max_tokens=MAX_TOKENS,
        kv_transfer_params=[proxy_params(pre["outputs"][0]["kv_transfer_params"])],
    )["outputs"][0]
    assert other["token_ids"] != ref_other, "kv_both: a decode handed another prompt's KV still gave its own tokens"
    if deprecated:
        assert said, f"the release deprecates kv_both ({nixl_connector.__file__}) but the engines did not say so"


def test_served_nothing_outlives_the_deployment(served):
    """Stopped, the deployment leaves nothing behind: the prefill killed at once (SIGKILL, as a cell timeout
    kills), the others stopped gracefully; afterwards no process of any server's tree (API server, engine
    core, worker with its NIXL agent), of the proxy or of the ``vllm serve`` start is alive, and none of their
    ports (HTTP, NIXL side channel) is bound.  The last served test: it stops the deployment."""
    served.prefill.stop(kill_first=True)
    served.stop()
    pids = {n: sorted(p.pids) for n, p in served.processes.items()}
    record_fact("e2e served processes stopped", str(pids))
    assert all(len(v) >= 1 for v in pids.values()), pids
    assert len(pids["prefill"]) >= 3, f"the prefill's process tree was not seen whole: {pids}"
    left = served.survivors()
    assert not left, "left behind: " + "; ".join(left)
