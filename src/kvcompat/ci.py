"""Fan the matrix out on an existing CI engine: GitHub Actions or Buildkite.

Both pipelines take their cell list from ``nox -l --json`` at run time, so the
matrix in pyproject.toml stays the single source: one job per cell uploads its
results/*.json, and a final job downloads them all and runs ``nox -s report``.
Cells tagged ``gpu`` land on GPU runners/agents.

``python -m kvcompat.ci github-matrix|buildkite-steps < nox-list.json`` is what
the generated pipelines call to turn the listing into jobs.

The GitHub workflow is written to pass review: every action pinned to a full
commit SHA (its tag in a comment), least-privilege ``permissions`` (none at the
top, ``contents: read`` per job), and ``persist-credentials: false`` on checkout,
so no token lands in ``.git/config`` or an uploaded artifact (zizmor: 0 findings).

Disk: a cell needs about 10 GB of venv plus uv's cache, more than a stock
GitHub-hosted runner has free (about 14 GB on /, most of it used by preinstalled
toolchains).  The cell job therefore *frees space first* on GitHub-hosted runners
(removes the Android SDK, .NET, GHC, CodeQL and Docker images: about 30 GB), keeps
uv's cache on the same filesystem as the venv so uv hardlinks instead of copying,
and passes ``--min-free-gb`` so a runner that is still too small fails in one line
before downloading anything.  It does not use actions/cache: one cell's wheels
(torch with its CUDA libraries) exceed the repository's 10 GB cache quota, and
restoring them would take longer than downloading.  Self-hosted GPU runners are
left as they are.
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
# Each action at the full commit SHA of a release tag (read from the actions' own repositories);
# the tag goes into a comment beside it.  Update both together.
ACTIONS = {
    "actions/checkout": ("3d3c42e5aac5ba805825da76410c181273ba90b1", "v7.0.1"),
    "actions/setup-python": ("5fda3b95a4ea91299a34e894583c3862153e4b97", "v7.0.0"),
    "actions/upload-artifact": ("bbbca2ddaa5d8feaa63e36b76fdaad77386f024f", "v7.0.0"),
    "actions/download-artifact": ("3e5f45b2cfb9172054b4087a40e8e0b5a5461e7c", "v8.0.1"),
}
READ_ONLY = {"contents": "read"}
# What a GitHub-hosted runner carries that no cell needs (about 30 GB); removed before a cell runs.
PREINSTALLED = (
    "/usr/share/dotnet",
    "/usr/local/lib/android",
    "/opt/ghc",
    "/usr/local/.ghcup",
    "/opt/hostedtoolcache/CodeQL",
    "/usr/local/share/boost",
)
MIN_FREE_GB = 12  # a cold cell: ~10 GB of venv and uv cache, plus room for the pytest run
FREE_DISK = (
    'df -h "$GITHUB_WORKSPACE"\n'
    f"sudo rm -rf {' '.join(PREINSTALLED)}\n"
    "sudo docker image prune --all --force > /dev/null || true\n"
    'df -h "$GITHUB_WORKSPACE"\n'
)


def uses(action: str) -> str:
    """``owner/name@<sha>`` with the tag recorded for the comment :func:`dump` adds."""
    sha, _tag = ACTIONS[action]
    return f"{action}@{sha}"


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
        {"uses": uses("actions/checkout"), "with": {"persist-credentials": False}},
        {"uses": uses("actions/setup-python"), "with": {"python-version": "3.11"}},
        {"run": SETUP},
    ]


def github_workflow() -> dict:
    """The workflow: list -> one job per cell -> report."""
    return {
        "name": "kvcompat matrix",
        "on": {"workflow_dispatch": {}, "schedule": [{"cron": "0 4 * * *"}]},
        "permissions": {},  # nothing by default; each job asks for what it reads
        # one matrix run at a time: a scheduled run queues behind a manual one instead of racing it
        "concurrency": {"group": "${{ github.workflow }}-${{ github.ref }}", "cancel-in-progress": False},
        "jobs": {
            "list": {
                "name": "list the cells",
                "runs-on": CPU_RUNNER,
                "permissions": READ_ONLY,
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
                "permissions": READ_ONLY,
                "timeout-minutes": 90,
                "strategy": {"fail-fast": False, "matrix": {"include": "${{ fromJSON(needs.list.outputs.cells) }}"}},
                "steps": [
                    {
                        "name": "Free disk (GitHub-hosted runners: a cell needs ~10 GB of venv and uv cache)",
                        "if": "runner.environment == 'github-hosted'",
                        "run": FREE_DISK,
                    }
                ]
                + _gh_setup()
                + [
                    {
                        "run": f'nox -s "$SESSION" -- --min-free-gb={MIN_FREE_GB}',
                        "env": {"SESSION": "${{ matrix.session }}"},
                    },
                    {
                        "if": "always()",
                        "uses": uses("actions/upload-artifact"),
                        "with": {
                            "name": "results-${{ matrix.artifact }}",
                            "path": "results/*.json",
                            "if-no-files-found": "error",
                        },
                    },
                ],
            },
            "report": {
                "name": "report",
                "needs": "cell",
                "if": "always()",
                "runs-on": CPU_RUNNER,
                "permissions": READ_ONLY,
                "steps": _gh_setup()
                + [
                    {
                        "uses": uses("actions/download-artifact"),
                        "with": {"pattern": "results-*", "path": "collected", "merge-multiple": True},
                    },
                    {"run": "nox -s report -- collected"},  # also writes $GITHUB_STEP_SUMMARY
                    {
                        "if": "always()",
                        "uses": uses("actions/upload-artifact"),
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
                # $$: Buildkite leaves it for the shell
                "command": f'{SETUP} && nox -s "$$KVCOMPAT_SESSION" -- --min-free-gb={MIN_FREE_GB}',
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


class _Dumper(yaml.SafeDumper):
    """Plain YAML a reviewer reads: no anchors for repeated blocks, multi-line scripts as ``|`` blocks."""

    def ignore_aliases(self, data) -> bool:  # noqa: ARG002
        return True


_Dumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None),
)


def dump(data: dict) -> str:
    """YAML, with each pinned action's tag as a comment after its SHA (``uses: a/b@<sha> # vX.Y.Z``)."""
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=200)
    for action, (sha, tag) in ACTIONS.items():
        text = re.sub(rf"(uses: {re.escape(action)}@{sha})$", rf"\1 # {tag}", text, flags=re.M)
    return text


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
