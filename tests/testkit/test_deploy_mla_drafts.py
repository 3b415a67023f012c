"""The mla-drafts builder's own arithmetic (kvcompat.testkit.deploy.mla_drafts), without a vLLM release."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvcompat import shapes
from kvcompat.testkit.deploy import drafts, mla_drafts


def test_the_mla_drafts_shapes_deploy_an_eagle3_head_beside_the_mla_model():
    family = [s for s in shapes.SHAPES if s.family == "mla-drafts"]
    assert [s.id for s in family] == ["mla-eagle", "mla-eagle-p1d2", "mla-eagle-p2d1"]
    assert all(s.model == "mla" and s.drafts == "eagle3" for s in family)
    assert [(s.prefill_tp, s.decode_tp) for s in family] == [(1, 1), (1, 2), (2, 1)]
    assert shapes.parse("mla-drafts") == family


def test_each_side_gets_its_own_eagle3_head_and_the_heads_differ_only_where_the_shape_says(tmp_path):
    shape = shapes.Shape("x", "mla-drafts", "", model="mla", drafts="eagle3|eagle3-h4")
    assert mla_drafts.sides(shape) == ("eagle3", "eagle3-h4")
    mla_drafts.write_model(shape, tmp_path)
    p = json.loads((tmp_path / "eagle3-head" / "config.json").read_text())
    d = json.loads((tmp_path / "eagle3-h4-head" / "config.json").read_text())
    assert p["architectures"] == ["LlamaForCausalLMEagle3"] and p["num_hidden_layers"] == 1
    assert (p["num_key_value_heads"], d["num_key_value_heads"]) == (2, 4)
    assert {k: v for k, v in p.items() if k != "num_key_value_heads"} == {
        k: v for k, v in d.items() if k != "num_key_value_heads"
    }
    spec = mla_drafts.speculative(shape, "decode")
    assert spec == {"method": "eagle3", "model": str(tmp_path / "eagle3-h4-head"), "num_speculative_tokens": 2}
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]


def test_the_draft_head_proposes_the_targets_tokens_except_at_its_misses():
    request = SimpleNamespace(num_tokens=9)
    got = mla_drafts.propose(request, 3)
    want = [drafts.target_token(p) for p in (9, 10, 11)]
    assert got == [w + 1 if p % mla_drafts.MISS_EVERY == 0 else w for p, w in zip((9, 10, 11), want, strict=True)]
    assert got[1] != want[1] and got[0] == want[0]  # position 10 is a miss, 9 is not
