"""Deployment shapes: the ways users deploy the pair, one dimension of the connector suite (shared vocabulary).

A contract about transfer, storage or block accounting runs once per shape it names
(``@pytest.mark.shapes("dense", "hetero-tp", ...)``, by family), each run a test of its own
(``test_x[hetero-tp-p1d2]``); its result carries the shape (the pytest plugin records it) and the
report shows which shapes pass per release.  ``KVCOMPAT_SHAPES`` (the harness's ``--shapes``) names
the shapes or families a cell runs, ``-k`` selects by id as usual.

A shape is data: the model it serves, each side's TP size, the scheduler's order and drafts.  The
connector suite's fixtures (``tests/connectors/conftest.py``) build it the release's way: the model's
config, the KV-cache specs and the release's own planner, one worker rank per TP rank with its own rank
and heads.  Whether a release can have a shape at all is decided in the cell by an explicit probe of the
installed release (:func:`kvcompat.testkit.shape_probes.missing`, never a construction that raised):
only then is a shape not applicable.  A release that can have the shape and refuses it is
``unsupported``; one that serves it wrongly fails.

Both worlds use this module (the harness to select and report shapes, the testkit to build them): it
is stdlib-only.
"""

from __future__ import annotations

import dataclasses
import os

SHAPES_ENV = "KVCOMPAT_SHAPES"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One deployment shape of a prefill engine P and a decode engine D (one engine: P's)."""

    id: str
    family: str
    what: str  # one line for the report
    model: str = "llama"  # the tiny model: "llama" (dense attention), "hybrid" (Mamba2 + attention), "mla"
    prefill_tp: int = 1
    decode_tp: int = 1
    drafts: str | None = None  # speculative decoding on both sides: "ngram"; "eagle3" (an EAGLE-3 head, mla-drafts)
    async_scheduling: bool = False  # EngineCore's batch-queue order, as GPU users run it by default from 0.34
    restarted_prefill: bool = False  # D's prefill peer replaced by a new engine at the same address
    prefix_match_unit: int | None = None  # --prefix-match-unit: prefix-cache hits inside a block (hybrid models)
    kv_cache_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT the user sets on both sides (None: the release's)

    @property
    def hetero_tp(self) -> bool:
        return self.prefill_tp != self.decode_tp


DENSE = Shape("dense", "dense", "a dense attention model, the same TP (1) on both sides")

HYBRID = "a hybrid model: Mamba2 layers, full attention and a sliding-window group, HMA on"
SHAPES: tuple[Shape, ...] = (
    DENSE,
    Shape("hybrid", "hybrid", HYBRID, model="hybrid"),
    Shape(
        "hybrid-match-unit",
        "hybrid",
        "a hybrid model: Mamba2 layers and full attention (no sliding window, which turns sub-block hits off), "
        "HMA on; prefix-cache hits inside a block (--prefix-match-unit 16 with 32-token blocks)",
        model="hybrid",
        prefix_match_unit=16,
    ),
    Shape("hetero-tp-p1d2", "hetero-tp", "prefill TP 1, decode TP 2 (each D rank reads its head of P's)", decode_tp=2),
    Shape("hetero-tp-p2d1", "hetero-tp", "prefill TP 2, decode TP 1 (D reads each P rank's head)", prefill_tp=2),
    Shape(
        "hetero-tp-p1d4",
        "hetero-tp",
        "prefill TP 1, decode TP 4 with 2 KV heads: D's ranks replicate the heads (TP > KV heads, vllm#45330)",
        decode_tp=4,
    ),
    Shape("mla", "mla", "an MLA model (a tiny DeepSeek-V2), TP 1 on both sides", model="mla"),
    Shape(
        "mla-p2d1",
        "mla",
        "the MLA model with prefill TP 2, decode TP 1: the latent is replicated, D reads it once",
        model="mla",
        prefill_tp=2,
    ),
    Shape(
        "mla-eagle",
        "mla-drafts",
        "the MLA model with an EAGLE-3 draft head of its own (GQA) KV layer on both sides, TP 1 (DeepSeek/Kimi "
        "with an EAGLE-3 head)",
        model="mla",
        drafts="eagle3",
    ),
    Shape(
        "mla-eagle-p1d2",
        "mla-drafts",
        "the MLA model with an EAGLE-3 GQA draft head, prefill TP 1, decode TP 2: each D rank reads the latent "
        "whole and its slice of the draft's heads (VLLM_KV_CACHE_LAYOUT=HND, the layout Nixl asks for it)",
        model="mla",
        drafts="eagle3",
        decode_tp=2,
        kv_cache_layout="HND",
    ),
    Shape(
        "mla-eagle-p2d1",
        "mla-drafts",
        "the MLA model with an EAGLE-3 GQA draft head, prefill TP 2, decode TP 1: D needs each P rank's draft "
        "heads (a pair Nixl refuses at the handshake from 0.33)",
        model="mla",
        drafts="eagle3",
        prefill_tp=2,
    ),
    Shape("drafts-ngram", "drafts", "ngram speculative decoding on both sides (2 draft tokens)", drafts="ngram"),
    Shape(
        "restarted-prefill",
        "restarted-prefill",
        "the prefill engine D knows replaced by a new one (a new engine id) at the same address",
        restarted_prefill=True,
    ),
    Shape(
        "async-sched-dense",
        "async-sched",
        "the dense model under async scheduling (EngineCore's batch queue), the GPU default from 0.34",
        async_scheduling=True,
    ),
    Shape(
        "async-sched-hybrid", "async-sched", HYBRID + ", under async scheduling", model="hybrid", async_scheduling=True
    ),
)
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(s.family for s in SHAPES))
BY_ID = {s.id: s for s in SHAPES}


def parse(text: str) -> list[Shape]:
    """The shapes named by ``text`` (comma- or space-separated shape ids or families); ValueError naming
    what is not one."""
    names = [n for n in text.replace(",", " ").split() if n]
    unknown = [n for n in names if n not in BY_ID and n not in FAMILIES]
    if unknown:
        raise ValueError(
            f"unknown shape {', '.join(map(repr, unknown))}: use a shape ({', '.join(BY_ID)}) "
            f"or a family ({', '.join(FAMILIES)})"
        )
    return [s for s in SHAPES if s.id in names or s.family in names]


def selected() -> list[Shape]:
    """The shapes this run selects: ``KVCOMPAT_SHAPES``, every shape when unset."""
    text = os.environ.get(SHAPES_ENV, "").strip()
    return parse(text) if text else list(SHAPES)


def of_families(families: tuple[str, ...]) -> list[Shape]:
    """The selected shapes of ``families`` (a contract's ``shapes`` marker), in registry order."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown shape family {', '.join(map(repr, unknown))}: families are {', '.join(FAMILIES)}")
    return [s for s in selected() if s.family in families]
