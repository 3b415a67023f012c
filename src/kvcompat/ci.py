"""Fan the matrix out on an existing CI engine: GitHub Actions or Buildkite.

Both pipelines take their cell list from ``nox -l --json`` at run time, so the
matrix in pyproject.toml stays the single source: one job per cell uploads its
results/*.json, and a final job downloads them all and runs ``nox -s report``.
Cells tagged ``gpu`` land on GPU runners/agents.

``python -m kvcompat.ci github-matrix|buildkite-steps < nox-list.json`` is what
the generated pipelines call to turn the listing into jobs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from kvcompat.errors import KvcompatError


class PipelineError(KvcompatError):
    """An unknown CI engine."""


SETUP = "python -m pip install --quiet 'nox>=2026.10.20' 'uv>=0.5' 'pyelftools>=0.31'"
CPU_RUNNER = "ubuntu-latest"
GPU_RUNNER = ["self-hosted", "linux", "gpu"]


def cells_from_listing(listing: str) -> list[dict]:
    """Matrix sessions from ``nox -l --json``: session name, runner kind, artifact-safe name."""
    cells = []
    for s in json.loads(listing):
        if s.get("name") != "matrix":
            continue
        runner = "gpu" if "gpu" in s.get("tags", []) else "cpu"
        artifact = re.sub(r"[^A-Za-z0-9._-]+", "-", s["session"]).strip("-")
        cells.append({"session": s["session"], "runner": runner, "artifact": artifact})
    return cells


def github_matrix(cells: list[dict], cpu_runner=CPU_RUNNER, gpu_runner=GPU_RUNNER) -> list[dict]:
    return [{**c, "runs_on": gpu_runner if c["runner"] == "gpu" else cpu_runner} for c in cells]


def _gh_setup() -> list[dict]:
    return [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/setup-python@v5", "with": {"python-version": "3.11"}},
        {"run": SETUP},
    ]


def github_workflow() -> dict:
    """The workflow: list -> one job per cell -> report."""
    return {
        "name": "kvcompat matrix",
        "on": {"workflow_dispatch": {}, "schedule": [{"cron": "0 4 * * *"}]},
        "jobs": {
            "list": {
                "runs-on": CPU_RUNNER,
                "outputs": {"cells": "${{ steps.list.outputs.cells }}"},
                "steps": _gh_setup()
                + [
                    {
                        "id": "list",
                        "run": 'echo "cells=$(nox -l --json | PYTHONPATH=src python -m kvcompat.ci github-matrix)" >> "$GITHUB_OUTPUT"',
                    }
                ],
            },
            "cell": {
                "needs": "list",
                "name": "${{ matrix.session }}",
                "runs-on": "${{ matrix.runs_on }}",
                "timeout-minutes": 90,
                "strategy": {"fail-fast": False, "matrix": {"include": "${{ fromJSON(needs.list.outputs.cells) }}"}},
                "steps": _gh_setup()
                + [
                    {"run": 'nox -s "$SESSION"', "env": {"SESSION": "${{ matrix.session }}"}},
                    {
                        "if": "always()",
                        "uses": "actions/upload-artifact@v4",
                        "with": {
                            "name": "results-${{ matrix.artifact }}",
                            "path": "results/*.json",
                            "if-no-files-found": "error",
                        },
                    },
                ],
            },
            "report": {
                "needs": "cell",
                "if": "always()",
                "runs-on": CPU_RUNNER,
                "steps": _gh_setup()
                + [
                    {
                        "uses": "actions/download-artifact@v4",
                        "with": {"pattern": "results-*", "path": "collected", "merge-multiple": True},
                    },
                    {"run": "nox -s report -- collected"},  # also writes $GITHUB_STEP_SUMMARY
                    {
                        "if": "always()",
                        "uses": "actions/upload-artifact@v4",
                        "with": {"name": "compat-report", "path": "reports/"},
                    },
                ],
            },
        },
    }


def buildkite_pipeline() -> dict:
    """The static pipeline: one step that lists the cells and uploads their steps."""
    return {
        "steps": [
            {
                "label": ":nox: list kvcompat cells",
                "key": "list",
                "agents": {"queue": "cpu"},
                "command": f"{SETUP} && nox -l --json | PYTHONPATH=src python -m kvcompat.ci buildkite-steps | buildkite-agent pipeline upload",
            }
        ]
    }


def buildkite_steps(cells: list[dict]) -> dict:
    """The uploaded part: one step per cell on a cpu or gpu queue, then the report."""
    steps: list[dict] = []
    for c in cells:
        steps.append(
            {
                "label": c["session"],
                "key": "cell-" + re.sub(r"[^A-Za-z0-9_-]", "-", c["artifact"]),
                "agents": {"queue": c["runner"]},
                "env": {"KVCOMPAT_SESSION": c["session"]},
                "command": f'{SETUP} && nox -s "$$KVCOMPAT_SESSION"',  # $$: Buildkite leaves it for the shell
                "artifact_paths": ["results/*.json"],
                "timeout_in_minutes": 90,
            }
        )
    steps.append({"wait": None, "continue_on_failure": True})
    steps.append(
        {
            "label": ":bar_chart: kvcompat report",
            "key": "report",
            "agents": {"queue": "cpu"},
            "command": f"buildkite-agent artifact download 'results/*.json' collected/ && {SETUP} && nox -s report -- collected",
            "artifact_paths": ["reports/*"],
        }
    )
    return {"steps": steps}


def dump(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=200)


def write(engine: str, root: Path) -> Path:
    """``nox -s ci -- github|buildkite``: write the pipeline file and return its path."""
    if engine == "github":
        path = root / ".github" / "workflows" / "kvcompat.yml"
        text = "# Generated by `nox -s ci -- github`; cells come from `nox -l --json` at run time.\n" + dump(
            github_workflow()
        )
    elif engine == "buildkite":
        path = root / ".buildkite" / "pipeline.yml"
        text = "# Generated by `nox -s ci -- buildkite`; cell steps are uploaded from `nox -l --json`.\n" + dump(
            buildkite_pipeline()
        )
    else:
        raise PipelineError(f"unknown CI engine {engine!r}; use `nox -s ci -- github` or `nox -s ci -- buildkite`")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main(argv: list[str]) -> int:
    if argv == ["github-matrix"]:
        print(json.dumps(github_matrix(cells_from_listing(sys.stdin.read()))))
    elif argv == ["buildkite-steps"]:
        print(dump(buildkite_steps(cells_from_listing(sys.stdin.read()))))
    else:
        from kvcompat.errors import report

        return report(
            PipelineError(
                f"unknown command {' '.join(argv)!r}; "
                "use `python -m kvcompat.ci github-matrix|buildkite-steps < nox-list.json`"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
