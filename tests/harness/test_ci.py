"""Generated CI pipelines parse, and their jobs come from `nox -l --json` with cpu/gpu placement."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcompat import ci

from helpers import REPO, build_project, run_nox

BIN = Path(sys.executable).parent  # the linters come with the test extras (pyproject.toml)
LISTING = json.dumps(
    [
        {"session": "matrix(vllm='0.33.0', torch='2.14.0')", "name": "matrix", "tags": ["cpu", "vllm-0.33"]},
        {"session": "matrix(vllm='0.32.0', torch='2.13.0')", "name": "matrix", "tags": ["gpu", "vllm-0.32"]},
        {"session": "report", "name": "report", "tags": []},
    ]
)


def lint(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = BIN / argv[0]
    assert tool.exists(), f"{tool} missing: install the test extras (pip install -e '.[test]')"
    return subprocess.run([str(tool), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=300)


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


def generated(tmp_path: Path) -> Path:
    ci.write("github", tmp_path)
    ci.write("buildkite", tmp_path)
    (tmp_path / "steps.yml").write_text(ci.dump(ci.buildkite_steps(ci.cells_from_listing(LISTING))))
    return tmp_path


def test_generated_workflow_passes_actionlint(tmp_path):
    proc = lint("actionlint", "-no-color", ".github/workflows/kvcompat.yml", cwd=generated(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("persona", ["regular", "pedantic"])
def test_generated_workflow_has_no_zizmor_findings(tmp_path, persona):
    proc = lint(
        "zizmor", "--offline", f"--persona={persona}", ".github/workflows/kvcompat.yml", cwd=generated(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No findings to report" in proc.stdout, proc.stdout


def test_generated_buildkite_pipelines_match_buildkites_schema(tmp_path):
    root = generated(tmp_path)
    for name in (".buildkite/pipeline.yml", "steps.yml"):  # the static pipeline and the steps it uploads
        proc = lint("check-jsonschema", "--builtin-schema", "vendor.buildkite", name, cwd=root)
        assert proc.returncode == 0 and "ok -- validation done" in proc.stdout, proc.stdout + proc.stderr


def test_linters_catch_what_they_are_here_for(tmp_path):
    """The three checks are live: a tag-pinned action, a persisted token and a bad step each fail."""
    root = generated(tmp_path)
    wf = root / ".github/workflows/kvcompat.yml"
    text = wf.read_text()
    wf.write_text(re.sub(r"actions/checkout@[0-9a-f]{40}.*", "actions/checkout@v4", text, count=1))
    assert "unpinned-uses" in lint("zizmor", "--offline", str(wf), cwd=root).stdout
    wf.write_text(re.sub(r"\n +with:\n +persist-credentials: false", "", text))  # checkout's default persists it
    assert "artipacked" in lint("zizmor", "--offline", str(wf), cwd=root).stdout
    wf.write_text(text.replace("runs-on: ubuntu-latest", "runs-on: ${{ matrix.nothing }}", 1))
    assert lint("actionlint", "-no-color", str(wf), cwd=root).returncode == 1
    steps = root / "steps.yml"
    steps.write_text(steps.read_text().replace("timeout_in_minutes: 90", "timeout_in_minutes: ninety", 1))
    assert lint("check-jsonschema", "--builtin-schema", "vendor.buildkite", "steps.yml", cwd=root).returncode == 1


def test_workflow_pins_every_action_to_a_commit_with_its_tag():
    text = ci.dump(ci.github_workflow())
    refs = re.findall(r"uses: (\S+)(.*)", text)
    assert len(refs) == 9
    for ref, comment in refs:
        action, _, sha = ref.partition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", sha), ref
        assert comment == f" # {ci.ACTIONS[action][1]}" and ci.ACTIONS[action][0] == sha
    wf = yaml.safe_load(text)
    assert wf["permissions"] == {} and all(job["permissions"] == {"contents": "read"} for job in wf["jobs"].values())
    checkouts = [s for job in wf["jobs"].values() for s in job["steps"] if "checkout" in s.get("uses", "")]
    assert len(checkouts) == 3 and all(s["with"]["persist-credentials"] is False for s in checkouts)


def test_cell_job_frees_disk_before_a_cell_on_hosted_runners():
    cell = ci.github_workflow()["jobs"]["cell"]
    first = cell["steps"][0]
    assert first["if"] == "runner.environment == 'github-hosted'"  # self-hosted GPU runners are left alone
    for path in ("/usr/local/lib/android", "/usr/share/dotnet", "/opt/ghc"):
        assert path in first["run"]
    run = next(s for s in cell["steps"] if "nox -s" in s.get("run", ""))
    assert f"--min-free-gb={ci.MIN_FREE_GB}" in run["run"]  # still too small: one line before any download


def test_committed_pipelines_are_what_the_generator_writes(tmp_path):
    root = generated(tmp_path)
    for name in (".github/workflows/kvcompat.yml", ".buildkite/pipeline.yml"):
        assert (REPO / name).read_text() == (root / name).read_text(), (
            f"{name} is stale: run `nox -s ci -- github buildkite`"
        )


@pytest.mark.slow  # real nox
def test_committed_pipelines_are_exactly_what_nox_s_ci_writes(tmp_path):
    project = build_project(tmp_path / "proj", "def test_x():\n    pass\n")
    proc = run_nox(project, "-s", "ci", "--", "github", "buildkite", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (".github/workflows/kvcompat.yml", ".buildkite/pipeline.yml"):
        assert (project / name).read_text() == (REPO / name).read_text(), name
