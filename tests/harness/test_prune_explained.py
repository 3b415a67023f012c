"""docs/evidence/prune_explained.py: killed ids leave the [[explained]] entries of their release, nothing else."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "evidence" / "prune_explained.py"
spec = importlib.util.spec_from_file_location("prune_explained", SCRIPT)
prune_explained = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prune_explained)

TEXT = """# preamble kept

[[equivalent]]
ids = ["a"]
releases = ["0.34.0"]
reason = "equivalent: never touched"

# -- a comment kept --

[[explained]]
ids = ["a", "b"]
regex = false
releases = ["0.34.0"]
reason = "out of scope: one release"

[[explained]]
ids = ["c", "d"]
regex = false
releases = ["0.34.0", "0.33.0"]
reason = "out of scope: two releases"

[[explained]]
ids = ["e"]
regex = false
releases = ["0.34.0"]
reason = "out of scope: all killed"

[[explained]]
ids = ["x-.*"]
regex = true
releases = ["0.34.0"]
reason = "out of scope: a family"
"""


def entries(text):
    return [(e["ids"], e["releases"], e["reason"]) for e in tomllib.loads(text)["explained"]]


def test_killed_ids_leave_their_release_and_shared_entries_split():
    text, removed, left = prune_explained.prune(TEXT, {"0.34.0": {"a", "c", "e", "x-1"}})
    assert "# preamble kept" in text and "# -- a comment kept --" in text
    assert tomllib.loads(text)["equivalent"][0]["ids"] == ["a"]
    assert entries(text) == [
        (["b"], ["0.34.0"], "out of scope: one release"),
        (["d"], ["0.34.0"], "out of scope: two releases"),
        (["c", "d"], ["0.33.0"], "out of scope: two releases"),
        (["x-.*"], ["0.34.0"], "out of scope: a family"),
    ]
    assert removed == 3
    assert len(left) == 1 and "x-.*" in left[0]


def test_an_entry_of_another_release_is_untouched():
    text, removed, left = prune_explained.prune(TEXT, {"0.32.0": {"a", "b", "c", "d", "e"}})
    assert text == TEXT and removed == 0 and left == []
