"""HMA (hybrid KV-cache manager) support of MultiConnector given its children.

Contract (notes §HMA, drift item 8): MultiConnector supports HMA only if all
its children do.  Releases whose MultiConnector has no HMA support at all (no
``request_finished_all_groups``, before 0.21) are not applicable.
"""

from __future__ import annotations

from typing import Any

from kvcompat.testkit import adapter as va
from kvcompat.testkit import not_applicable, user_configuration

from conftest import BLOCK, token_ids


def _require_multi_hma() -> None:
    MultiConnector, _ = va.multi_classes()
    if not hasattr(MultiConnector, "request_finished_all_groups"):
        not_applicable("MultiConnector has no request_finished_all_groups (no HMA support) in this release")


def _children_hma(multi: Any) -> list[bool]:
    return [va.supports_hma(c) for c in multi._connectors]


def _nixl_plus_non_hma_child_config(tmp_path) -> Any:
    """MultiConnector([Nixl, ExampleConnector]): ExampleConnector is a child that
    does not implement SupportsHMA in the releases where this test applies."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        engine_id="kvcompat-engine",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                },
            ]
        },
    )


def test_hma_reporting_full_attention(make_engine, tmp_path):
    """With only full-attention layers, MultiConnector reports HMA support
    exactly when all its children support it: True for [Nixl, CPU offload]
    when both are SupportsHMA, False for [Nixl, a non-HMA child]; the release
    never leaves HMA on for a MultiConnector whose children do not all
    support it."""
    _require_multi_hma()
    MultiConnector, _ = va.multi_classes()

    engine = make_engine()
    children = _children_hma(engine.multi)
    assert va.supports_hma(engine.multi) is True  # the class implements SupportsHMA
    if va.hma_enabled(engine.vllm_config):
        assert all(children), f"HMA left on although children support it as {children}"
    if hasattr(MultiConnector, "all_children_support_hma"):
        assert MultiConnector.all_children_support_hma(engine.vllm_config.kv_transfer_config) == all(children)

    ExampleConnector = __import__(va.V1 + ".example_connector", fromlist=["ExampleConnector"]).ExampleConnector
    ktc = _nixl_plus_non_hma_child_config(tmp_path)
    mixed = make_engine(kv_transfer_config=ktc)
    mixed_children = _children_hma(mixed.multi)
    assert mixed_children == [va.supports_hma(mixed.multi._connectors[0]), va.supports_hma(ExampleConnector)]
    if not all(mixed_children):
        assert not va.hma_enabled(mixed.vllm_config), "HMA left on for a MultiConnector with a non-HMA child"
        if hasattr(MultiConnector, "all_children_support_hma"):
            assert MultiConnector.all_children_support_hma(ktc) is False


def test_hma_sliding_window_group_forwarded_to_all_children(make_engine):
    """With a full-attention group and a sliding-window group and HMA on,
    MultiConnector (whose children all support HMA) is accepted, and a
    prefill-side request's finish goes through request_finished_all_groups:
    Nixl's transfer params name the request's blocks of *both* groups."""
    _require_multi_hma()

    probe = make_engine()
    children = _children_hma(probe.multi)
    assert all(children), f"children HMA support: {children}"

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
