"""What an unresolvable cell says: the missing pin, the nearest published versions, the override that tests it."""

from __future__ import annotations

from packaging.version import Version

from kvcompat.cells import Cell
from kvcompat.run.context import CellContext
from kvcompat.run.options import RunOptions
from kvcompat.run.resolve import companion_overrides, explain_resolution, missing_pin_hint, resolve_lock

from helpers import REPO, build_wheel, file_index

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


def test_a_torch_override_brings_the_torchvision_built_for_that_torch(tmp_path, monkeypatch):
    """vLLM pins torch 2.14 and the torchvision built for it; overriding torch to 2.11 must also move
    torchvision to the release whose own metadata pins 2.11 (uv's torch override alone keeps 0.29,
    which fails to load against 2.11).  torchaudio, which no release matches here, is left alone."""
    w = tmp_path / "wheels"
    w.mkdir()
    wheels = [
        build_wheel(w, {"torch/__init__.py": ""}, name="torch", version="2.11.0"),
        build_wheel(w, {"torch/__init__.py": ""}, name="torch", version="2.14.0"),
        build_wheel(
            w, {"torchvision/__init__.py": ""}, name="torchvision", version="0.26.0", requires=["torch==2.11.0"]
        ),
        build_wheel(
            w, {"torchvision/__init__.py": ""}, name="torchvision", version="0.29.0", requires=["torch==2.14.0"]
        ),
        build_wheel(w, {"vllm/__init__.py": ""}, version="0.19.1", requires=["torch==2.14.0", "torchvision==0.29.0"]),
    ]
    options = RunOptions(
        repo=REPO,
        results_dir=tmp_path / "r",
        suite="s",
        work_dir=tmp_path / "work",
        index_url=file_index(tmp_path, wheels),
    )
    said: list[str] = []
    ctx = CellContext(Cell(vllm="0.19.1", torch="2.11.0", torch_override=True), tmp_path / "venv", options, said.append)
    ctx.files.work.mkdir(parents=True)  # as the begin phase makes it: the missing torchaudio is logged there
    assert companion_overrides(ctx, offline=False) == ["torchvision==0.26.0"]
    monkeypatch.setattr(Cell, "requirements", lambda self: ["vllm==0.19.1"])  # not pytest & co, absent here
    res = resolve_lock(ctx, offline=False)
    assert res.ok, res.error
    assert (res.pin("torch"), res.pin("torchvision"), res.pin("vllm")) == ("2.11.0", "0.26.0", "0.19.1")
    # a cell on vLLM's own torch overrides nothing
    pinned = CellContext(Cell(vllm="0.19.1", torch="pinned"), tmp_path / "venv", options, said.append)
    assert companion_overrides(pinned, offline=False) == []
