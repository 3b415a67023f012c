"""Known vLLM bugs as data (kvcompat.known_bugs): the shipped file parses, and an entry explains exactly its
contracts, shapes and releases."""

from __future__ import annotations

import pytest

from kvcompat import known_bugs

ENTRY = """
[[bug]]
id = "b"
title = "a bug"
contracts = ["test_x"]
shapes = ["hybrid"]
releases = ">=0.20,<0.24"
impact = "hang"
where = "K/v1/nixl/worker.py 0.22.1 L1"
upstream = "https://github.com/vllm-project/vllm/issues/1"
fix = "https://github.com/vllm-project/vllm/pull/2"
"""


def test_the_shipped_known_bugs_parse_and_name_real_contracts():
    from pathlib import Path

    bugs = known_bugs.known()
    assert bugs, "known-bugs.toml is empty"
    suite = "".join(p.read_text() for p in Path(__file__).parents[1].joinpath("connectors").glob("test_*.py"))
    for bug in bugs:
        for contract in bug.contracts:
            if contract == "*":
                continue
            assert f"def {contract}(" in suite, f"known bug {bug.id} names {contract}, which tests/connectors lacks"


def test_an_entry_explains_its_contract_in_its_shapes_and_releases_only():
    (bug,) = known_bugs.parse(ENTRY)
    assert bug.explains("test_x", "hybrid", "0.22.1")
    assert not bug.explains("test_x", "hybrid", "0.24.0"), "fixed in 0.24: a red there is new"
    assert not bug.explains("test_x", "dense", "0.22.1"), "another shape: a red there is new"
    assert not bug.explains("test_y", "hybrid", "0.22.1")
    assert bug.line() == ("known vLLM bug (hang): a bug (K/v1/nixl/worker.py 0.22.1 L1; vllm#1, fixed by vllm#2)")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (ENTRY.replace('impact = "hang"', 'impact = "bad"'), "impact 'bad' is not one of"),
        (ENTRY.replace('releases = ">=0.20,<0.24"', 'releases = "soon"'), "is not a version range"),
        (ENTRY.replace('where = "K/v1/nixl/worker.py 0.22.1 L1"\n', ""), "lacks where"),
        (ENTRY + ENTRY, "listed twice"),
    ],
)
def test_a_malformed_entry_is_named(text, says):
    with pytest.raises(known_bugs.KnownBugsError, match=says):
        known_bugs.parse(text)
