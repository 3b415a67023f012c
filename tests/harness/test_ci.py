"""Generated CI pipelines parse, and their jobs come from `nox -l --json` with cpu/gpu placement."""

import json
import subprocess
import sys

import pytest
import yaml

from kvcompat import ci

from helpers import REPO, run_nox


def listing(tmp_path):
    (tmp_path / "m.toml").write_text(
        '[matrix]\nmixed = [{ vllm = "0.33.0", torch = "2.14.0" }, { vllm = "0.32.0", torch = "2.13.0", runner = "gpu" }]\n'
    )
    proc = run_nox(REPO, "-l", "--json", env={"KVCOMPAT_MATRIX": f"{tmp_path / 'm.toml'}:mixed"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_github_workflow(tmp_path):
    path = ci.write("github", tmp_path)
    wf = yaml.safe_load(path.read_text())
    assert set(wf["jobs"]) == {"list", "cell", "report"}
    cell = wf["jobs"]["cell"]
    assert (
        cell["needs"] == "list" and cell["strategy"]["matrix"]["include"] == "${{ fromJSON(needs.list.outputs.cells) }}"
    )
    assert any(
        s.get("uses", "").startswith("actions/upload-artifact") and s["with"]["path"] == "results/*.json"
        for s in cell["steps"]
    )
    report = wf["jobs"]["report"]
    assert report["needs"] == "cell" and report["if"] == "always()"
    assert any("nox -s report -- collected" in s.get("run", "") for s in report["steps"])
    assert "nox -l --json" in wf["jobs"]["list"]["steps"][-1]["run"]


@pytest.mark.slow  # real nox listing, which asks the index for torch pins
def test_github_matrix_from_nox_listing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvcompat.ci", "github-matrix"],
        input=listing(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    include = json.loads(out.stdout)
    assert [(c["session"], c["runs_on"]) for c in include] == [
        ("matrix(vllm='0.33.0', torch='2.14.0')", ci.CPU_RUNNER),
        ("matrix(vllm='0.32.0', torch='2.13.0')", ci.GPU_RUNNER),
    ]
    assert len({c["artifact"] for c in include}) == 2


def test_buildkite(tmp_path):
    static = yaml.safe_load(ci.write("buildkite", tmp_path).read_text())
    assert "buildkite-agent pipeline upload" in static["steps"][0]["command"]
    steps = yaml.safe_load(ci.dump(ci.buildkite_steps(ci.cells_from_listing(listing(tmp_path)))))["steps"]
    cells = [s for s in steps if "env" in s]
    assert [s["agents"]["queue"] for s in cells] == ["cpu", "gpu"]
    assert cells[1]["env"]["KVCOMPAT_SESSION"] == "matrix(vllm='0.32.0', torch='2.13.0')"
    assert steps[-2] == {"wait": None, "continue_on_failure": True}
    assert "nox -s report -- collected" in steps[-1]["command"]


def test_unknown_engine(tmp_path):
    import pytest

    with pytest.raises(ci.PipelineError, match="unknown CI engine 'jenkins'"):
        ci.write("jenkins", tmp_path)


def test_module_entry_point_rejects_unknown_commands(capsys):
    assert ci.main(["jenkins-steps"]) == 2
    assert capsys.readouterr().err.startswith("kvcompat: error: unknown command 'jenkins-steps'")
