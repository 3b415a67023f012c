"""Mutants generated from a release's multi_connector.py: every site and operator, stable ids, reasons."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvcompat.mutation import generate as gen

SOURCE = textwrap.dedent(
    """
    class MultiKVConnectorStats:
        def is_empty(self):
            return all(s.is_empty() for s in self.data.values())

        def __getitem__(self, key):
            return self.data[key]


    class MultiConnector:
        def wait_for_save(self):
            for c in self._connectors:
                c.wait_for_save()

        def get_handshake_metadata(self):
            for c in self._connectors:
                md = c.get_handshake_metadata()
                if md is not None:
                    return md
            return None

        def get_loaded(self, request):
            return self._connectors[self._requests_to_connector[request]].loaded(request)

        def has_pending_push_work(self):
            return any(c.has_pending_push_work() for c in self._connectors)

        def helper(self, x):
            return x + 1


    class Unrelated:
        def wait_for_save(self):
            for c in self._connectors:
                c.wait_for_save()
    """
)


def by_id(mutants):
    return {m.id: m for m in mutants}


def test_every_site_gets_its_operators_with_stable_ids():
    ms = by_id(gen.generate(SOURCE))
    assert set(ms) == {
        "gen-multikvconnectorstats-is-empty-skip-first-1",
        "gen-multikvconnectorstats-is-empty-skip-last-1",
        "gen-multikvconnectorstats-is-empty-only-first-1",
        "gen-multikvconnectorstats-is-empty-all-to-any-1",
        "gen-multiconnector-wait-for-save-skip-first-1",
        "gen-multiconnector-wait-for-save-skip-last-1",
        "gen-multiconnector-wait-for-save-only-first-1",
        "gen-multiconnector-get-handshake-metadata-skip-first-1",
        "gen-multiconnector-get-handshake-metadata-skip-last-1",
        "gen-multiconnector-get-handshake-metadata-only-first-1",
        "gen-multiconnector-get-handshake-metadata-no-early-return-1",
        "gen-multiconnector-get-loaded-index-0-1",
        "gen-multiconnector-get-loaded-index-last-1",
        "gen-multiconnector-has-pending-push-work-skip-first-1",
        "gen-multiconnector-has-pending-push-work-skip-last-1",
        "gen-multiconnector-has-pending-push-work-only-first-1",
        "gen-multiconnector-has-pending-push-work-any-to-all-1",
    }, "classes other than MultiConnector's own, and code that follows no child, get none"
    mutated = ms["gen-multiconnector-wait-for-save-skip-first-1"].apply(SOURCE)
    assert "for c in list(self._connectors)[1:]:" in mutated and mutated.count("list(") == 1
    assert "return self._connectors[-1].loaded(request)" in ms["gen-multiconnector-get-loaded-index-last-1"].apply(
        SOURCE
    )
    assert "if md is not None:\n                pass\n" in ms[
        "gen-multiconnector-get-handshake-metadata-no-early-return-1"
    ].apply(SOURCE)
    assert "return all(c.has_pending_push_work()" in ms["gen-multiconnector-has-pending-push-work-any-to-all-1"].apply(
        SOURCE
    )


def test_only_first_over_the_two_children_is_skip_last_but_not_over_a_dict():
    ms = by_id(gen.generate(SOURCE))
    assert ms["gen-multiconnector-wait-for-save-only-first-1"].same_as == "gen-multiconnector-wait-for-save-skip-last-1"
    assert ms["gen-multikvconnectorstats-is-empty-only-first-1"].same_as is None  # stats may hold one entry or two


def test_coverage_names_methods_without_a_site_or_a_reason():
    cov = gen.coverage(SOURCE, gen.Reasons((), {"MultiKVConnectorStats.__getitem__": "one key, no child"}))
    assert cov["MultiConnector.wait_for_save"] == "3 mutants"
    assert cov["MultiKVConnectorStats.__getitem__"] == "one key, no child"
    assert cov["MultiConnector.helper"] == "MISSING"


def test_equivalence_reasons_are_per_release(tmp_path):
    path = tmp_path / "equivalent.toml"
    path.write_text(
        textwrap.dedent(
            """
            [[equivalent]]
            ids = ["gen-multiconnector-wait-for-save-skip-last-1"]
            releases = ["0.34.0"]
            reason = "the offload child's wait_for_save does nothing here (x.py:1)"

            [[equivalent]]
            ids = ["gen-multiconnector-has-pending-push-work-.*"]
            regex = true
            reason = "neither child has push work (y.py:2)"

            [methods]
            "MultiKVConnectorStats.__getitem__" = "one key: no child to skip"
            """
        )
    )
    reasons = gen.load_reasons(path)
    new = {m.id: m.equivalent for m in gen.mutants_for(SOURCE, "0.34.0", reasons)}
    old = {m.id: m.equivalent for m in gen.mutants_for(SOURCE, "0.33.0", reasons)}
    assert new["gen-multiconnector-wait-for-save-skip-last-1"].endswith("(x.py:1)")
    assert old["gen-multiconnector-wait-for-save-skip-last-1"] is None
    assert old["gen-multiconnector-has-pending-push-work-any-to-all-1"].endswith("(y.py:2)")
    path.write_text('[[equivalent]]\nids = ["x"]\n')
    with pytest.raises(gen.GenerateError, match="needs ids and a reason"):
        gen.load_reasons(path)


def test_explained_survivors_are_read_apart_from_equivalent_ones(tmp_path):
    """[[explained]]: why a survivor survives, per release; it never makes a mutant equivalent (not run)."""
    path = tmp_path / "equivalent-nixl.toml"
    path.write_text(
        textwrap.dedent(
            """
            [[explained]]
            ids = ["gen-multiconnector-has-pending-push-work-.*"]
            regex = true
            releases = ["0.34.0"]
            reason = "only push mode reaches it (y.py:2); the suite pulls"
            """
        )
    )
    reasons = gen.load_reasons(path)
    mid = "gen-multiconnector-has-pending-push-work-any-to-all-1"
    assert reasons.explanation_for(mid, "0.34.0").startswith("only push mode")
    assert reasons.explanation_for(mid, "0.33.0") is None and reasons.reason_for(mid, "0.34.0") is None
    assert {m.id: m.equivalent for m in gen.mutants_for(SOURCE, "0.34.0", reasons)}[mid] is None
    path.write_text('[[explained]]\nids = ["gen-(x"]\nregex = true\nreason = "r"\n')
    with pytest.raises(gen.GenerateError, match="explained 1: 'gen-\\(x' is not a regular expression"):
        gen.load_reasons(path)
    path.write_text('[[explained]]\nids = ["x"]\n')
    with pytest.raises(gen.GenerateError, match="explained 1: needs ids and a reason"):
        gen.load_reasons(path)


def test_the_repositorys_reason_files_load():
    """Every tests/mutants/equivalent*.toml the sessions read: valid TOML, each entry with ids and a reason,
    each regular expression compiles (a broken file would stop a mutation session at its start)."""
    root = Path(__file__).resolve().parents[2] / "tests" / "mutants"
    files = sorted(root.glob("equivalent*.toml"))
    assert {f.name for f in files} >= {"equivalent.toml", "equivalent-nixl.toml", "equivalent-offload.toml"}
    for path in files:
        reasons = gen.load_reasons(path)
        assert reasons.equivalent or reasons.explained, path.name
