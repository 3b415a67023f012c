"""``drafts``: the dense model with ngram speculative decoding on both sides (kvcompat.shapes).

A user's ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 2, ...}'`` on P and D: the
release's SpeculativeConfig, so the release's Scheduler pads a resumed request's first decode step to
``1 + k`` tokens, reserves its lookahead slots and admits an async KV load only with room for its first
speculative step (v1/core/sched/scheduler.py 0.34.0 ~L297-331, L1355-1380, L1462-1492).

A step gives the Scheduler what a real engine with drafts gives it (EngineCore.step, then ``post_step``,
v1/engine/core.py 0.34.0 L713-756): the model runner's verified tokens for every decoding request (the
accepted drafts plus one, up to ``k + 1``), then the next step's draft token ids through
``Scheduler.update_draft_token_ids``.  The release's Scheduler does the rest (scheduling the drafts,
rolling ``num_computed_tokens`` back by the rejected ones).  Only the model's arithmetic is ours:

* the target model samples :func:`target_token` of the position it predicts (deterministic, never EOS,
  periodic with a surprise, so drafts are sometimes accepted and sometimes rejected);
* the drafter is prompt lookup (ngram): the ``k`` tokens that followed the latest earlier occurrence of the
  request's last ``n`` tokens, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

A step also notes, per engine, any scheduled request whose step would write KV past the blocks it holds
(what a GPU runner's slot mapping would then write into: another request's block or the null block),
``engine.out_of_block_writes``, and what each drafted step verified (request, drafts, tokens sampled),
``engine.verified``; the drafts contracts read them (tests/connectors/test_shape_drafts.py).

``shape.drafts`` says each side's drafter: ``"ngram"`` (both sides ngram, ``k`` = 2), or ``"P|D"`` with
each of ``ngram`` / ``ngramK`` (``k`` = K) / ``eagle`` (an EAGLE draft head, a config without weights) /
``none``, for pairs a contract builds itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit.adapter import config as _config
from kvcompat.testkit.adapter import planner as _planner
from kvcompat.testkit.deploy.base import *  # noqa: F403
from kvcompat.testkit.deploy.base import write_model as _write_model

K = 2  # draft tokens of the drafts-ngram shape
PROMPT_LOOKUP = {"prompt_lookup_max": 3, "prompt_lookup_min": 2}
EAGLE_DIR = "eagle-draft"  # the EAGLE draft head's config.json, next to the target's
STEP_GAP_S = 0.001  # as the suite's own step (tests/connectors/conftest.py STEP_GAP_S)
_MODEL_DIRS: dict[str, Path] = {}


def missing(shape: Shape) -> str | None:
    """Explicit probe: the release's SpeculativeConfig offers the ``ngram`` method and its Scheduler takes
    draft token ids from the engine (``update_draft_token_ids``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if "ngram" not in speculative_methods():
        return "the release's SpeculativeConfig has no ngram method"
    if not hasattr(Scheduler, "update_draft_token_ids"):
        return "the release's Scheduler takes no draft token ids (Scheduler.update_draft_token_ids)"
    return None


def speculative_methods() -> set[str]:
    """The ``method`` values the release's SpeculativeConfig accepts (the literals of its type hint)."""
    import typing

    from vllm.config import SpeculativeConfig

    methods: set[str] = set()
    stack = [typing.get_type_hints(SpeculativeConfig).get("method")]
    while stack:
        t = stack.pop()
        if isinstance(t, str):
            methods.add(t)
        else:
            stack.extend(typing.get_args(t))
    return methods


def sides(shape: Shape) -> tuple[str, str]:
    """The prefill's and the decode's drafter (``"ngram"``, ``"ngram3"``, ``"eagle"``, ``"none"``)."""
    text = shape.drafts or "none"
    p, _, d = text.partition("|")
    return p, (d or p)


def drafter(shape: Shape, side: str) -> str:
    p, d = sides(shape)
    return p if side == "prefill" else d


def write_model(shape: Shape, directory: Path) -> Path:
    """The target's config.json, and an EAGLE draft head's (one decoder layer, no weights) beside it when a
    side drafts with EAGLE."""
    _write_model(shape, directory)
    if "eagle" in sides(shape):
        eagle = dict(_config.TINY_MODEL_CONFIG, architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
        (directory / EAGLE_DIR).mkdir(exist_ok=True)
        (directory / EAGLE_DIR / "config.json").write_text(json.dumps(eagle, indent=1))
    _MODEL_DIRS[shape.id] = directory
    return directory


def speculative(shape: Shape, side: str) -> dict[str, Any] | None:
    """``side``'s ``--speculative-config`` (None: no drafts)."""
    kind = drafter(shape, side)
    if kind == "none":
        return None
    if kind.startswith("ngram"):
        k = int(kind[len("ngram") :] or K)
        return {"method": "ngram", "num_speculative_tokens": k, **PROMPT_LOOKUP}
    if kind == "eagle":
        return {"method": "eagle", "model": str(_MODEL_DIRS[shape.id] / EAGLE_DIR), "num_speculative_tokens": K}
    raise ValueError(f"unknown drafter {kind!r} in shape {shape.id}")


def config_kwargs(shape: Shape, side: str) -> dict[str, Any]:
    spec = speculative(shape, side)
    return {} if spec is None else {"speculative": spec}


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    """The target's attention layers; with an EAGLE drafter also its draft layer, which reports the same
    full-attention spec (llama_eagle.py: ``model.layers.<target layers + i>``)."""
    specs = _planner.attention_layer_specs(vllm_config, block_size, tp)
    spec_cfg = vllm_config.speculative_config
    if spec_cfg is not None and spec_cfg.method == "eagle":
        name = f"model.layers.{len(_config.LAYER_NAMES)}.self_attn.attn"
        for rank in specs:
            rank[name] = next(iter(rank.values()))
    return specs


# --- the model's arithmetic ----------------------------------------------------------------------------


def target_token(position: int) -> int:
    """The token the target model samples for ``position``: a cycle of three with a surprise every seventh
    position (an ngram drafter then guesses right most of the time, not always); never EOS."""
    return 150 if position % 7 == 0 else 100 + position % 3


def propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens (``n`` from ``n_max`` down to ``n_min``); none when nothing matches."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def sampled(scheduler: Any, so: Any) -> dict[str, list[int]]:
    """What the model runner samples in step ``so`` (read right after ``schedule()``): for a request whose
    step ends its prompt or decodes, the verified tokens (a drafted position's token while the drafts match
    the target, then the target's own token); none for a prefill chunk that does not end the prompt."""
    out: dict[str, list[int]] = {}
    spec = so.scheduled_spec_decode_tokens or {}
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        end = request.num_computed_tokens  # schedule() counted this step's tokens (and drafts) already
        if end < request.num_tokens:  # a prefill chunk short of the known tokens: its sample is discarded
            out[req_id] = []
            continue
        drafts = list(spec.get(req_id) or ())
        first = end - len(drafts)  # the position the step samples first; the drafts sit at first, first + 1, ...
        tokens = [target_token(first)]
        for i, draft in enumerate(drafts):
            if draft != tokens[-1]:  # rejected: the target's own token stands, the rest is dropped
                break
            tokens.append(target_token(first + i + 1))
        out[req_id] = tokens
    return out


def model_runner_output(so: Any, kv_connector_output: Any, tokens: dict[str, list[int]]) -> Any:
    """The release's ModelRunnerOutput with ``tokens`` sampled per request (the field's type as the release
    declares it)."""
    from vllm.v1.outputs import ModelRunnerOutput

    from kvcompat.testkit.adapter.capabilities import _params, call_with_supported

    req_ids = list(so.num_scheduled_tokens)
    rows = [tokens.get(r, []) for r in req_ids]
    if "ndarray" in str(_params(ModelRunnerOutput)["sampled_token_ids"].annotation):
        import numpy as np

        rows = [np.array(row, dtype=np.int64) for row in rows]
    return call_with_supported(
        ModelRunnerOutput,
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=rows,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )


# The tokens each scheduled step samples, by id(SchedulerOutput), from the step hook to runner_output.
_SAMPLED: dict[int, dict[str, list[int]]] = {}


def runner_output(so: Any, kv_connector_output: Any) -> Any:
    """A rank's ModelRunnerOutput for ``so``: the tokens the step hook worked out (one per request if none)."""
    tokens = _SAMPLED.get(id(so))
    if tokens is None:
        tokens = {r: [target_token(0)] for r in so.num_scheduled_tokens}
    return model_runner_output(so, kv_connector_output, tokens)


def out_of_block_writes(engine: Any, so: Any) -> list[str]:
    """Scheduled requests of ``so`` whose step writes KV (its tokens and the drafter's lookahead slots,
    ``Scheduler.num_lookahead_tokens``) past the blocks they hold in an attention group."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    found = []
    scheduler = engine.scheduler
    lookahead = getattr(scheduler, "num_lookahead_tokens", 0) or 0
    groups = engine.kv_cache_config.kv_cache_groups
    for req_id, n in so.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        end = request.num_computed_tokens + lookahead
        block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or getattr(spec, "sliding_window", None):
                continue
            held = len(block_ids[g]) * spec.block_size
            if end > held:
                found.append(
                    f"{req_id}: a step of {n} tokens up to position {end - 1} (lookahead {lookahead}) "
                    f"holds {len(block_ids[g])} blocks of group {g} (positions < {held})"
                )
    return found


def step(engine: Any) -> Any:
    """One engine step as EngineCore runs it with drafts: schedule; the workers run it and sample the
    verified tokens; update_from_output; then (post_step) the drafter's next draft token ids go to the
    Scheduler (``update_draft_token_ids``), for requests that ran."""
    from vllm.v1.outputs import DraftTokenIds

    scheduler = engine.scheduler
    so = engine.schedule()
    vars(engine).setdefault("out_of_block_writes", []).extend(out_of_block_writes(engine, so))
    tokens = _SAMPLED[id(so)] = sampled(scheduler, so)
    verified = vars(engine).setdefault("verified", [])
    for req_id, spec in (so.scheduled_spec_decode_tokens or {}).items():
        verified.append((req_id, list(spec), tokens.get(req_id, [])))
    try:
        out = engine.execute(so)
    finally:
        _SAMPLED.pop(id(so), None)
    engine.update(so, out)
    spec_cfg = engine.vllm_config.speculative_config
    if spec_cfg is not None and spec_cfg.method.startswith("ngram") and so.total_num_scheduled_tokens > 0:
        k = spec_cfg.num_speculative_tokens
        lo, hi = spec_cfg.prompt_lookup_min or 1, spec_cfg.prompt_lookup_max or 1
        req_ids, drafts = [], []
        for req_id in so.num_scheduled_tokens:
            request = scheduler.requests.get(req_id)
            if request is None:
                continue
            req_ids.append(req_id)
            drafts.append(propose(list(request.all_token_ids), k, hi, lo))
        scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))
    time.sleep(STEP_GAP_S)
    return so
