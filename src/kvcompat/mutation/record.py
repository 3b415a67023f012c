"""The record of a mutation run: results/mutants-<cell>.json, what it says of each mutant, and how a rerun keeps it.

    results/mutants-<cell>.json               the verdicts of the ``multi`` group, rewritten (atomically)
                                              after every mutant
    results/mutants-<cell>--<group>.json      the verdicts of another group (``--target``, kvcompat.mutation.targets)

A mutant is *killed* when a test that passed on the baseline fails or errors with it applied, when the suite
crashes, or when the run exceeds the per-mutant timeout.  It *survived* when every test it ran still passes,
or when no test reaches it (``how = "unreached"``, reason "no test reaches it": nothing was run).  It is *not
applicable* when its target code is absent from this release's file, and *equivalent* when the catalogue (or
tests/mutants/equivalent*.toml) says why no test can tell it apart.

A rerun of a few mutants (``--mutant``) keeps the previous run's other verdicts (:func:`kept_verdicts`), and
a full run resumes after the verdicts of an interrupted one (:func:`interrupted_verdicts`).  Stdlib only: the
report (kvcompat.report.mutants) reads these files with the constants below.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SCHEMA = "kvcompat-mutants/1"
KILLED, SURVIVED, NOT_APPLICABLE, EQUIVALENT = "killed", "survived", "not_applicable", "equivalent"
STATUSES = (KILLED, SURVIVED, NOT_APPLICABLE, EQUIVALENT)
# A test that was green on the baseline and is not now (failed, error, unsupported, …) kills the mutant.
STILL_GREEN = ("passed", "not_applicable")
UNREACHED = "unreached"  # MutantVerdict.how of a survivor that no test executes (nothing was run)


def results_path(results_dir: Path, cell_id: str, group: str = "multi") -> Path:
    name = f"mutants-{cell_id}.json" if group == "multi" else f"mutants-{cell_id}--{group}.json"
    return results_dir / name


@dataclasses.dataclass
class MutantVerdict:
    id: str
    contract: str
    description: str
    status: str
    killed_by: str | None = None  # a test node id, "timeout" or "crash"
    how: str | None = None  # test | timeout | crash | unreached (survived: no test executes it)
    detail: str = ""
    seconds: float = 0.0
    reason: str | None = None  # equivalent: why; unreached: "no test reaches it"
    origin: str = "catalogue"  # or "generated" (kvcompat.mutation.generate, kvcompat.mutation.operators)
    # The upstream column's verdict on the same mutant: {"status", "killed_by", "how", "detail", "seconds"};
    # None where the cell has no upstream column or the mutant was not run (equivalent, absent).
    upstream: dict | None = None
    file: str | None = None  # the mutated file, inside site-packages
    line: int | None = None  # where the change starts in the pristine file
    tests_run: int | None = None  # how many tests coverage picked for it (None: the whole suite)
    # A survivor's [[explained]] reason (tests/mutants/equivalent-<group>.toml): why it survives, with the
    # release's lines.  Still a survivor; read afresh on every run, kept verdicts included.
    explained: str | None = None


@dataclasses.dataclass
class MutationRun:
    cell: dict
    catalogue: str
    target: str
    started: str
    baseline: dict = dataclasses.field(default_factory=dict)
    upstream_baseline: dict = dataclasses.field(default_factory=dict)  # {} where the cell has no upstream column
    mutants: list[MutantVerdict] = dataclasses.field(default_factory=list)
    scored: bool = False
    finished: str | None = None
    planned: int = 0
    pytest_args: list[str] = dataclasses.field(default_factory=list)
    # per method of MultiConnector and its classes: "N mutants", or why it needs none, or "MISSING"
    # (another group: per function in scope, "N mutants" or "no site", never MISSING)
    coverage: dict[str, str] = dataclasses.field(default_factory=dict)
    group: str = "multi"  # kvcompat.mutation.targets.GROUPS
    # per file of the group: path, slug, scope, functions (the methods chosen), mutants (generated)
    files: list[dict] = dataclasses.field(default_factory=list)
    replaced: list[str] = dataclasses.field(default_factory=list)  # files the testkit replaces: not mutated
    absent: str = ""  # why the group has no file in this release
    selection: str = ""  # how each mutant's tests were picked (coverage map measured / reused / off: why)
    suite: str = ""  # fingerprint of our suite, the testkit and the arguments it ran with (an interrupted run resumes only under the same)
    # baseline_s (the session's baseline runs, shared by its groups), mutants_s (this group's loop), runs
    timing: dict = dataclasses.field(default_factory=dict)

    @property
    def uncovered(self) -> list[str]:
        return [m for m, how in self.coverage.items() if how == "MISSING"]

    @property
    def id(self) -> str:
        return self.cell["id"]

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for m in self.mutants if m.status == s) for s in STATUSES}

    @property
    def survivors(self) -> list[MutantVerdict]:
        return [m for m in self.mutants if m.status == SURVIVED]

    @property
    def not_reached(self) -> int:
        return sum(1 for m in self.mutants if m.status == SURVIVED and m.how == UNREACHED)

    @property
    def explained(self) -> int:
        return sum(1 for m in self.mutants if m.status == SURVIVED and m.explained)

    @property
    def ok(self) -> bool:
        """Baseline green, every mutant decided, none survived, every method covered or explained."""
        return self.scored and self.finished is not None and not self.survivors and not self.uncovered

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "id": self.id,
            "group": self.group,
            "cell": self.cell,
            "catalogue": self.catalogue,
            "target": self.target,
            "files": self.files,
            "replaced": self.replaced,
            "absent": self.absent,
            "started": self.started,
            "finished": self.finished,
            "scored": self.scored,
            "baseline": self.baseline,
            "upstream_baseline": self.upstream_baseline,
            "planned": self.planned,
            "pytest_args": self.pytest_args,
            "selection": self.selection,
            "suite": self.suite,
            "timing": self.timing,
            "counts": self.counts(),
            "not_reached": self.not_reached,
            "explained": self.explained,
            "coverage": self.coverage,
            "mutants": [dataclasses.asdict(m) for m in self.mutants],
        }


def read_run(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def kept_verdicts(out: Path, run: MutationRun, only: tuple[str, ...]) -> list[MutantVerdict]:
    """With ``only``: the previous run's verdicts, when it scored the same target with the same pytest
    arguments (else nothing is kept: a changed release or test selection is scored afresh)."""
    prev = read_run(out) if only else None
    if not prev or not prev.get("scored") or prev.get("target") != run.target:
        return []
    if prev.get("pytest_args", []) != run.pytest_args:
        return []
    return _verdicts_of(prev)


def set_aside(out: Path, run: MutationRun, only: tuple[str, ...]) -> Path | None:
    """A rerun of a few mutants that cannot keep the previous record's verdicts (another target or other pytest
    arguments: a known bug's contract deselected since, say) would write over a scored record with only its
    own few.  The previous record is moved to ``<out>.previous`` first (one generation, out of the report's
    ``mutants-*.json``), and its path returned; None when there was nothing to keep aside."""
    prev = read_run(out) if only else None
    if not prev or not prev.get("scored") or kept_verdicts(out, run, only):
        return None
    aside = out.with_name(out.name + ".previous")
    out.replace(aside)
    return aside


def _verdicts_of(prev: dict) -> list[MutantVerdict]:
    fields = {f.name for f in dataclasses.fields(MutantVerdict)}
    return [MutantVerdict(**{k: v for k, v in m.items() if k in fields}) for m in prev.get("mutants", [])]


def interrupted_verdicts(out: Path, run: MutationRun) -> list[MutantVerdict]:
    """The verdicts of a run of the same group that stopped before it finished, when it scored the same files
    with the same suite and arguments: a rerun resumes after them.  Nothing when that run finished (a new
    run scores afresh) or anything it depends on changed."""
    prev = read_run(out)
    if not prev or prev.get("finished") or not prev.get("scored") or not run.suite:
        return []
    if (prev.get("target"), prev.get("pytest_args", []), prev.get("suite")) != (run.target, run.pytest_args, run.suite):
        return []
    return _verdicts_of(prev)


def merge(kept: list[MutantVerdict], new: list[MutantVerdict]) -> list[MutantVerdict]:
    """The previous verdicts in their order, each replaced by its new one; new ids after them."""
    fresh = {v.id: v for v in new}
    merged = [fresh.pop(v.id, v) for v in kept]
    return merged + list(fresh.values())
