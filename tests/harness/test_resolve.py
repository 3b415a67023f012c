"""What an unresolvable cell says: the missing pin, the nearest published versions, the override that tests it."""

from __future__ import annotations

from packaging.version import Version

from kvcompat.cells import Cell
from kvcompat.run.resolve import explain_resolution, missing_pin_hint

# uv 0.9's answer for vllm==0.34.0 (flashinfer-python 0.7.3 was never published)
UV_ERROR = """error: No solution found when resolving dependencies
  cause: Because there is no version of flashinfer-python==0.7.3 and vllm>=0.34.0 depends on flashinfer-python==0.7.3, we can conclude that vllm>=0.34.0 cannot be used.
         And because you require vllm==0.34.0, we can conclude that your requirements are unsatisfiable."""
FLASHINFER = [Version(v) for v in ["0.7.0", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4", "0.8.0rc1"]]


def test_missing_pin_names_neighbours_and_the_override_line():
    asked = []

    def versions_of(name):
        asked.append(name)
        return FLASHINFER

    hint = missing_pin_hint(UV_ERROR, Cell(vllm="0.34.0", torch="pinned"), versions_of)
    assert asked == ["flashinfer-python"]
    assert hint == (
        "flashinfer-python==0.7.3, which vllm==0.34.0 pins, is not on the index (nearest published: 0.7.2.post1, 0.7.4); "
        'to test this release anyway, add overrides = ["flashinfer-python==0.7.4"] to its matrix entry'
    )


def test_other_resolution_failures_keep_uvs_sentence():
    conflict = "  cause: Because vllm==0.34.0 depends on torch==2.14.0 and you require torch==2.9.0, no solution."
    assert missing_pin_hint(conflict, Cell(vllm="0.34.0", torch="2.9.0"), lambda name: FLASHINFER) is None
    assert explain_resolution(conflict, "vllm==0.34.0").startswith("Because vllm==0.34.0 depends on torch==2.14.0")
    # the pin's project is unknown to the index too: no neighbours to offer
    assert missing_pin_hint(UV_ERROR, Cell(vllm="0.34.0", torch="pinned"), lambda name: []) is None
