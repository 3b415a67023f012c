"""``mla-drafts``: the MLA model (a tiny DeepSeek-V2) with an EAGLE-3 draft head of its own KV layer, a GQA one.

What users deploy: DeepSeek-V3 / Kimi-K2 with an EAGLE-3 head (``LlamaForCausalLMEagle3``, a Llama decoder
layer with grouped-query attention: e.g. lightseekorg's Kimi-K2 EAGLE-3 heads), ``--speculative-config
'{"method": "eagle3", "model": <head>, "num_speculative_tokens": 2}'`` on P and D.  The target's KV is the
MLA latent, replicated on every TP rank; the draft's KV is ordinary attention, its KV heads split across
the TP ranks.  NixlConnector must then read the latent once (REPLICATE) and the draft's heads as a head
slice of P's (SPLIT) in the same transfer: ``nixl/base_worker.py`` 0.34.0 L395-431
(``_resolve_head_sharded_draft_kv_heads``, ``_get_head_sharded_draft_regions``), L2579-2586 (a draft TP
mapping per remote engine), L2789-2808 and L2909-2924 (what the handshake accepts), L2979-2982 (the draft
regions' block lengths); vLLM's own ``test_handshake_mla_target_reads_draft_head_slice`` (sdist
``tests/v1/kv_connector/unit/test_nixl_connector.py`` 0.34.0 L1596) drives the same by hand.

The models.  The target is :mod:`.mla`'s DeepSeek-V2 (two MLA layers, latent 576).  The draft head is a
``LlamaForCausalLMEagle3`` ``config.json`` (no weights) in a directory of its own: one decoder layer,
four query heads and ``DRAFT_KV_HEADS`` KV heads of 32 values; the release's SpeculativeConfig builds its
ModelConfig (``draft_model_config``), and its layer is named as the release's EAGLE-3 model names it,
after the target's layers (``llama_eagle3.py`` 0.34.0 L202, L325: ``model.layers.<target layers + i>``).

The layers' specs.  The MLA layers report theirs through the release's ``MLAAttention`` (:mod:`.mla`); the
draft layer is an ``Attention`` layer and reports a ``FullAttentionSpec`` of the rank's draft KV heads as the
release computes them (``draft_model_config.get_num_kv_heads(draft_parallel_config)``), the draft's head size
and dtype, at the block size the platform set for MLA (16).  The release's planner groups them
(``va.plan``), its allocator places them.

What the suite's forward writes (:class:`DraftKind`): a draft layer's block holds, per KV head, the dense
pattern of the head's global index, so a D rank's block equals P's heads ``first .. first + n`` and a
head slice read from the wrong offset reads back differently.  A rank's first draft head is what the
release's ``Attention`` gives TP rank ``r`` (``r * heads_per_rank``, or ``r // (tp / heads)`` when TP exceeds
the heads), read in :func:`allocate` (which runs as that rank: ``adapter.worker.build_rank``) and kept on the
rank's draft cache tensor.

Drafting.  A step is EngineCore's with a drafter (:func:`step`): the Scheduler schedules the previous step's
draft tokens, the model runner verifies them against the target (:func:`kvcompat.testkit.deploy.drafts.sampled`),
then the draft head proposes the next ``K`` tokens (``update_draft_token_ids``).  The head's proposals are the
target's tokens except at a position divisible by ``MISS_EVERY`` (where it guesses wrong), so drafts are
accepted and rejected.  The tokens a request decodes are the target's whatever the drafts were.

Which releases can have the shape (:func:`missing`): those that can have :mod:`.mla`'s shape and whose
SpeculativeConfig offers ``eagle3`` with the Llama EAGLE-3 head registered, and whose Scheduler takes draft
token ids.  Whether NixlConnector reads the draft's KV right (0.33 and 0.34 have the head-sharded draft
regions; older releases read the draft as part of the replicated MLA model) is what the contracts decide,
never a probe.  P TP 2 -> D TP 1 is a pair NixlConnector 0.33 and 0.34 refuse at the handshake by design
(L2799-2808: "head-sharded draft KV under an MLA target requires local TP >= remote TP"), the shape
``mla-eagle-p2d1`` deploys it anyway (users do) and its contract is that the refusal is clear and the
request never hangs or decodes over unread blocks.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

from kvcompat.shapes import Shape
from kvcompat.testkit import probes
from kvcompat.testkit.deploy import drafts as _drafts
from kvcompat.testkit.deploy import mla as _mla
from kvcompat.testkit.deploy.base import *  # noqa: F403
from kvcompat.testkit.deploy.base import write_config

K = 2  # draft tokens a step
DRAFT_KV_HEADS = 2  # the EAGLE-3 head's KV heads (GQA: four query heads)
DRAFT_HEAD_SIZE = 32  # a head size the CPU attention backend takes
MISS_EVERY = 5  # the draft head guesses a position divisible by this wrong
METHOD = "eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE3_MODEL = "vllm/model_executor/models/llama_eagle3.py"
FIRST_DRAFT_HEAD = "_kvcompat_first_draft_head"  # kept on a rank's draft cache tensor (see the docstring)
_MODEL_DIRS: dict[str, Path] = {}


def missing(shape: Shape) -> str | None:
    """Why the release cannot have an MLA target with an EAGLE-3 GQA head served by the pair, else None."""
    why = _mla.missing(shape)
    if why is not None:
        return why
    from vllm.v1.core.sched.scheduler import Scheduler

    if METHOD not in _drafts.speculative_methods():
        return f"the release's SpeculativeConfig has no {METHOD} method"
    if not probes.has_file(EAGLE3_MODEL):
        return f"the release ships no Llama EAGLE-3 head ({EAGLE3_MODEL})"
    registry = importlib.import_module("vllm.model_executor.models.registry")
    if ARCHITECTURE not in getattr(registry, "_SPECULATIVE_DECODING_MODELS", {}):
        return f"the release does not register {ARCHITECTURE} as a speculative decoding model"
    if not hasattr(Scheduler, "update_draft_token_ids"):
        return "the release's Scheduler takes no draft token ids (Scheduler.update_draft_token_ids)"
    return None


def sides(shape: Shape) -> tuple[str, str]:
    """The prefill's and the decode's draft head: ``eagle3`` (``DRAFT_KV_HEADS`` KV heads) or ``eagle3-hN``
    (N KV heads: another head, for pairs a contract builds itself)."""
    text = shape.drafts or METHOD
    p, _, d = text.partition("|")
    return p, (d or p)


def draft_kv_heads(drafter: str) -> int:
    return int(drafter.split("-h", 1)[1]) if "-h" in drafter else DRAFT_KV_HEADS


def draft_config(drafter: str) -> dict[str, Any]:
    """The EAGLE-3 head's ``config.json`` (a Llama decoder layer; no weights)."""
    from kvcompat.testkit.adapter import config as _config

    return {
        **_config.TINY_MODEL_COMMON,
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": _mla.MODEL_CONFIG["hidden_size"],
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": draft_kv_heads(drafter),
        "head_dim": DRAFT_HEAD_SIZE,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "draft_vocab_size": _config.TINY_MODEL_COMMON["vocab_size"],
    }


def model_config(shape: Shape) -> dict[str, Any]:
    return _mla.model_config(shape)


def write_model(shape: Shape, directory: Path) -> Path:
    """The DeepSeek-V2 target's config.json, and each side's EAGLE-3 head's beside it (``<drafter>-head/``)."""
    write_config(directory, model_config(shape))
    for drafter in set(sides(shape)):
        head = directory / f"{drafter}-head"
        head.mkdir(exist_ok=True)
        (head / "config.json").write_text(json.dumps(draft_config(drafter), indent=1))
    _MODEL_DIRS[shape.id] = directory
    return directory


def speculative(shape: Shape, side: str) -> dict[str, Any]:
    """``side``'s ``--speculative-config``."""
    p, d = sides(shape)
    drafter = p if side == "prefill" else d
    return {"method": METHOD, "model": str(_MODEL_DIRS[shape.id] / f"{drafter}-head"), "num_speculative_tokens": K}


def config_kwargs(shape: Shape, side: str) -> dict[str, Any]:
    return {"speculative": speculative(shape, side)}


def configure(vllm_config: Any, shape: Shape, side: str) -> None:
    """:mod:`.mla`'s (prefix caching and chunked prefill as a GPU user has them, the model length)."""
    _mla.configure(vllm_config, shape, side)
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None, "the release built no draft model config"
    assert not spec.draft_model_config.use_mla, "the EAGLE-3 head's ModelConfig uses MLA: not a GQA draft"


def draft_layer_names(vllm_config: Any) -> list[str]:
    """The draft head's attention layers, as the release's EAGLE-3 model names them (after the target's)."""
    target = vllm_config.model_config.get_total_num_hidden_layers()
    n = vllm_config.speculative_config.draft_model_config.get_total_num_hidden_layers()
    return [f"model.layers.{target + i}.self_attn.attn" for i in range(n)]


def draft_spec(vllm_config: Any, block_size: int) -> Any:
    """A rank's draft layer spec: full attention over the rank's draft KV heads as the release computes them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec_cfg = vllm_config.speculative_config
    draft = spec_cfg.draft_model_config
    heads = draft.get_num_kv_heads(spec_cfg.draft_parallel_config)
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=draft.get_head_size(), dtype=draft.dtype
    )


def layer_specs(vllm_config: Any, shape: Shape, block_size: int, tp: int) -> list[dict[str, Any]]:
    """Each rank's MLA layers (:mod:`.mla`, at the platform's block size) and its draft layer."""
    specs = _mla.layer_specs(vllm_config, shape, block_size, tp)
    mla_block = next(iter(specs[0].values())).block_size
    for rank in specs:
        for name in draft_layer_names(vllm_config):
            rank[name] = draft_spec(vllm_config, mla_block)
    if shape.kv_cache_layout is not None:
        _resolve_requested_layout(vllm_config, shape.kv_cache_layout, specs)
    return specs


def _resolve_requested_layout(vllm_config: Any, requested: str, specs: list[dict[str, Any]]) -> None:
    """EngineCore's layout resolution (``v1/attention/backends/utils.py`` 0.34.0 L311-420) with the user's
    ``VLLM_KV_CACHE_LAYOUT``: the release checks the request against its backends and records the layout
    on ``cache_config``, where the planner's own resolution then finds it.  The variable is set only for
    this call (the suite's other engines keep the release's default)."""
    import os

    from kvcompat.testkit.adapter.kv_cache import resolve_kv_cache_layout

    before = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    os.environ["VLLM_KV_CACHE_LAYOUT"] = requested
    try:
        resolve_kv_cache_layout(vllm_config, [s for rank in specs for s in rank.values()])
    finally:
        if before is None:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = before


def kinds(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    drafted = set(draft_layer_names(vllm_config))
    return {
        name: (DRAFT if name in drafted else _mla.MLA)
        for g in kv_cache_config.kv_cache_groups
        for name in g.layer_names
    }


def first_draft_head(vllm_config: Any, rank: int, tp: int) -> int:
    """The global index of the first draft KV head TP rank ``rank`` of ``tp`` holds."""
    from kvcompat.testkit.adapter.parallel import kv_heads_of_rank

    total = vllm_config.speculative_config.draft_model_config.get_total_num_kv_heads()
    return kv_heads_of_rank(total, tp, rank)[0]


def allocate(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """A rank's caches from the release's allocator (:mod:`.mla`); each draft layer's cache tensor keeps the
    rank's first draft head (this runs as the rank: the TP rank is the release's)."""
    from vllm.distributed import parallel_state as ps

    caches = _mla.allocate(vllm_config, kv_cache_config)
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name in draft_layer_names(vllm_config):
        setattr(caches[name], FIRST_DRAFT_HEAD, first_draft_head(vllm_config, rank, tp))
    return caches


class DraftKind(_mla._forward.AttentionKind):
    """The draft head's attention cache: the dense pattern per KV head, from the rank's first draft head (kept on
    its cache tensor by :func:`allocate`), whatever ``first_head`` (the target's: the replicated latent's, 0) says."""

    name = "draft-attention"

    @staticmethod
    def _first(cache: Any) -> int:
        first = getattr(cache, FIRST_DRAFT_HEAD, None)
        assert first is not None, "a draft layer's cache that allocate() did not mark with its rank's first head"
        return first

    def fill(self, cache: Any, block_id: int, block_size: int, layer: str, prefix: list[int], first_head: int) -> None:
        super().fill(cache, block_id, block_size, layer, prefix, self._first(cache))

    def expected(self, cache: Any, layer: str, prefix: list[int], first_head: int, block_size: int) -> Any:
        return super().expected(cache, layer, prefix, self._first(cache), block_size)


DRAFT = DraftKind()


# --- drafting ------------------------------------------------------------------------------------------


def propose(request: Any, k: int) -> list[int]:
    """The draft head's next ``k`` tokens for ``request``: the target's, except at a position divisible by
    ``MISS_EVERY`` (a wrong guess, so some drafts are rejected)."""
    n = request.num_tokens
    out = []
    for pos in range(n, n + k):
        token = _drafts.target_token(pos)
        out.append(token + 1 if pos % MISS_EVERY == 0 else token)
    return out


def step(engine: Any) -> Any:
    """One engine step as EngineCore runs it with an EAGLE-3 head: schedule; the workers run it and verify
    the drafts; update_from_output; then the head's next drafts go to the Scheduler (post_step)."""
    from vllm.v1.outputs import DraftTokenIds

    scheduler = engine.scheduler
    so = engine.schedule()
    vars(engine).setdefault("out_of_block_writes", []).extend(_drafts.out_of_block_writes(engine, so))
    tokens = _drafts._SAMPLED[id(so)] = _drafts.sampled(scheduler, so)
    verified = vars(engine).setdefault("verified", [])
    for req_id, spec in (so.scheduled_spec_decode_tokens or {}).items():
        verified.append((req_id, list(spec), tokens.get(req_id, [])))
    try:
        out = engine.execute(so)
    finally:
        _drafts._SAMPLED.pop(id(so), None)
    engine.update(so, out)
    if so.total_num_scheduled_tokens > 0:
        k = engine.vllm_config.speculative_config.num_speculative_tokens
        req_ids, proposals = [], []
        for req_id in so.num_scheduled_tokens:
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if (
                request.num_computed_tokens < request.num_prompt_tokens
            ):  # a prefill chunk: nothing sampled to draft from
                continue
            req_ids.append(req_id)
            proposals.append(propose(request, k))
        scheduler.update_draft_token_ids(DraftTokenIds(req_ids, proposals))
    time.sleep(_drafts.STEP_GAP_S)
    return so


runner_output = _drafts.runner_output
