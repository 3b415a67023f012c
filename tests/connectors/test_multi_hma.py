"""HMA (hybrid KV-cache manager) support of MultiConnector given its children.

Contract (notes §HMA, drift item 8): MultiConnector supports HMA exactly when all its children do.
The scenario is "a hybrid model served by MultiConnector whose children all support HMA": it cannot
arise in a release where a child of the pair does not implement SupportsHMA (Nixl before 0.18,
OffloadingConnector before 0.21), and only there are these tests not applicable.  A release whose
children all support HMA but which switches the hybrid KV-cache manager off, or refuses it, fails.
"""

from __future__ import annotations

from typing import Any

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, user_configuration

from conftest import BLOCK, token_ids


def _require_children_hma(vllm_config) -> None:
    """Probe the classes MultiConnector builds its children from: do they all implement SupportsHMA?"""
    MultiConnector, _ = va.multi_classes()
    kids = MultiConnector._get_connector_classes_and_configs(vllm_config)
    lacking = [cls.__name__ for cls, _ in kids if not va.supports_hma(cls)]
    if lacking:
        not_applicable(f"{', '.join(lacking)} does not implement SupportsHMA in this release")


def _children_hma(multi: Any) -> list[bool]:
    return [va.supports_hma(c) for c in multi._connectors]


def _nixl_plus_non_hma_child_config(tmp_path, example_first: bool = False) -> Any:
    """MultiConnector with Nixl and ExampleConnector (a child that does not implement SupportsHMA in
    the releases where this test applies), in either order."""
    from vllm.config import KVTransferConfig

    children = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    ]
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        engine_id="kvcompat-engine",
        kv_connector_extra_config={"connectors": children[::-1] if example_first else children},
    )


def test_hma_reporting_full_attention(make_engine, tmp_path):
    """With only full-attention layers, MultiConnector reports HMA support
    exactly when all its children support it: True for [Nixl, CPU offload]
    when both are SupportsHMA, False for [Nixl, a non-HMA child]; the release
    never leaves HMA on for a MultiConnector whose children do not all
    support it."""
    MultiConnector, _ = va.multi_classes()

    engine = make_engine()
    _require_children_hma(engine.vllm_config)
    children = _children_hma(engine.multi)
    assert all(children), f"children HMA support: {children}"
    assert va.supports_hma(engine.multi) is True, "MultiConnector does not implement SupportsHMA, all its children do"
    if hasattr(MultiConnector, "all_children_support_hma"):
        assert MultiConnector.all_children_support_hma(engine.vllm_config.kv_transfer_config) == all(children)

    ExampleConnector = __import__(va.V1 + ".example_connector", fromlist=["ExampleConnector"]).ExampleConnector
    assert not va.supports_hma(ExampleConnector)
    for example_first in (False, True):
        ktc = _nixl_plus_non_hma_child_config(tmp_path, example_first)
        mixed = make_engine(kv_transfer_config=ktc)
        assert not va.hma_enabled(mixed.vllm_config), "HMA left on for a MultiConnector with a non-HMA child"
        if hasattr(MultiConnector, "all_children_support_hma"):
            assert MultiConnector.all_children_support_hma(ktc) is False, (
                f"children {[type(c).__name__ for c in mixed.multi._connectors]}: one lacks HMA, yet all support it"
            )
        # A prefill-side request still finishes through it, with Nixl's params (the non-HMA path).
        req = va.make_request(
            "mixed", token_ids(2 * BLOCK + 3), max_tokens=1, kv_transfer_params=va.remote_decode_params()
        )
        mixed.scheduler.add_request(req)
        mixed.step()
        out = mixed.finished_output("mixed")
        assert out is not None and out.kv_transfer_params is not None, "the request did not finish with Nixl's params"


def test_hma_sliding_window_group_forwarded_to_all_children(make_engine):
    """With a full-attention group and a sliding-window group and HMA on,
    MultiConnector (whose children all support HMA) is accepted, and a
    prefill-side request's finish goes through request_finished_all_groups:
    Nixl's transfer params name the request's blocks of *both* groups."""
    probe = make_engine()
    _require_children_hma(probe.vllm_config)

    # What a user deploys: a sliding-window model with HMA on.  A release that refuses it
    # although every child supports HMA is ``unsupported``, with vLLM's error.
    with user_configuration("MultiConnector(Nixl, CPU offload) with HMA and a sliding-window group"):
        engine = make_engine(sliding_window=4 * BLOCK, disable_hybrid_kv_cache_manager=False)
    assert va.hma_enabled(engine.vllm_config), "the release refused HMA for HMA-capable children"
    assert len(engine.kv_cache_config.kv_cache_groups) == 2

    req = va.make_request(
        "hma-prefill", token_ids(3 * BLOCK + 5), max_tokens=1, kv_transfer_params=va.remote_decode_params()
    )
    engine.scheduler.add_request(req)
    engine.step()
    out = engine.finished_output("hma-prefill")
    assert out is not None and out.kv_transfer_params is not None
    rbi = out.kv_transfer_params["remote_block_ids"]
    held = [list(g) for g in engine.scheduler.kv_cache_manager.get_block_ids("hma-prefill")]
    assert len(held) == 2
    assert len(rbi) == 2, f"remote_block_ids should have one entry per KV-cache group: {rbi}"
    assert [list(g) for g in rbi] == held
    assert "hma-prefill" not in engine.multi._requests_to_connector


def test_hybrid_model_keeps_the_hybrid_kv_cache_manager(make_engine):
    """A user who serves a hybrid model (full attention + sliding window) through MultiConnector
    whose children all support HMA, leaving the release's default, keeps the hybrid KV-cache manager
    (and its sliding-window memory savings).  A release that switches it off for this deployment
    fails this test; it is never not applicable."""
    probe = make_engine()
    _require_children_hma(probe.vllm_config)
    with user_configuration("a hybrid model with MultiConnector(Nixl, CPU offload), the release's HMA default"):
        engine = make_engine(sliding_window=4 * BLOCK)
    assert va.hma_enabled(engine.vllm_config), (
        "the release switched the hybrid KV-cache manager off although every child supports HMA "
        f"(scheduler_config.disable_hybrid_kv_cache_manager={engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager})"
    )
