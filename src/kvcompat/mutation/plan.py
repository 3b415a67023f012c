"""What a mutation session mutates: each target group's files and mutants in this release, placed in their
files, and which of them a rerun scores (the rest keep their previous verdicts).

``--target`` picks the groups of files to mutate (default ``multi``: multi_connector.py, with the catalogue
and MultiConnector's generator; the others get kvcompat.mutation.operators' mechanical mutants).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcompat.cells import Cell
from kvcompat.mutation import catalogue as cat
from kvcompat.mutation import covmap, operators
from kvcompat.mutation import generate as gen
from kvcompat.mutation import targets as tg
from kvcompat.mutation.context import MutationError, MutationOptions, cell_label, reasons_path, rel, site_for, state_for
from kvcompat.mutation.guard import Guard
from kvcompat.mutation.record import (
    SURVIVED,
    MutantVerdict,
    MutationRun,
    interrupted_verdicts,
    kept_verdicts,
    read_run,
    results_path,
    set_aside,
)
from kvcompat.run.context import CellContext


@dataclasses.dataclass
class Planned:
    """One mutant with the mutated text of its file, and where it sits there."""

    mutant: Any  # cat.Mutant | gen.GeneratedMutant
    mutated: str | None  # None: not applicable to this release
    target: str  # the file, inside site-packages
    line: int | None
    where: covmap.Where | None


@dataclasses.dataclass
class Group:
    name: str
    resolved: tg.Resolved
    sources: dict[str, str]  # path -> pristine text
    mutants: list[tuple[Any, str]]  # (mutant, its file), before --mutant picks
    run: MutationRun
    out: Path
    planned: list[Planned] = dataclasses.field(default_factory=list)
    kept: list[MutantVerdict] = dataclasses.field(default_factory=list)
    ours_before: dict[str, MutantVerdict] = dataclasses.field(default_factory=dict)
    maps: dict[str, dict[str, covmap.FileLines] | None] = dataclasses.field(default_factory=dict)  # per suite
    reasons: gen.Reasons = dataclasses.field(default_factory=lambda: gen.Reasons((), {}))
    release: str = ""

    def explain(self, v: MutantVerdict) -> MutantVerdict:
        """``v`` with its [[explained]] reason when it survived (none otherwise, or when none is given now)."""
        v.explained = self.reasons.explanation_for(v.id, self.release) if v.status == SURVIVED else None
        return v

    @property
    def hashes(self) -> dict[str, str]:
        return {path: covmap.file_hash(text.encode()) for path, text in self.sources.items()}

    def lines(self, suite: str, p: Planned) -> covmap.FileLines | None:
        """The coverage map of ``suite`` for ``p``'s file (None: no map, every mutant runs the whole suite)."""
        files = self.maps.get(suite)
        return None if files is None else files.get(p.target, {})


def group(cell: Cell, mo: MutationOptions, ctx: CellContext, name: str, written: list) -> Group:
    """A group's files in this release (pristine copies kept by their guards) and all their mutants."""
    site, state = site_for(mo.home, cell), state_for(mo.home, cell)
    resolved = tg.resolve(site, name)
    sources = {f.path: Guard(site, state, f.path).save_pristine().decode() for f in resolved.files}
    reasons = gen.load_reasons(reasons_path(mo, name))
    mutants: list[tuple[Any, str]] = []
    files: list[dict] = []
    if name == "multi":
        if cat.TARGET not in sources:
            raise MutationError(f"{cat.TARGET} is not in {cell_label(cell)}; there is nothing to mutate")
        source = sources[cat.TARGET]
        made = written + gen.mutants_for(source, cell.vllm, reasons)
        mutants = [(m, cat.TARGET) for m in made]
        coverage = gen.coverage(source, reasons)
        files.append(
            {
                "path": cat.TARGET,
                "slug": tg.file_slug(cat.TARGET),
                "scope": "the catalogue (tests/mutants/multi_connector.toml) and MultiConnector's generator",
                "functions": [m.contract for m in gen.methods(source)],
                "mutants": len(made),
            }
        )
    else:
        coverage = {}
        for f in resolved.files:
            source = sources[f.path]
            made = [m.with_reason(reasons.reason_for(m.id, cell.vllm)) for m in operators.generate(source, f)]
            mutants += [(m, f.path) for m in made]
            coverage |= operators.per_function(source, f, made)
            files.append(
                {
                    "path": f.path,
                    "slug": f.slug,
                    "scope": f.scope.describe(),
                    "functions": [fn.contract for fn in operators.functions(source, f.scope)],
                    "mutants": len(made),
                }
            )
    run = MutationRun(
        cell=cell.to_json(),
        catalogue=str(rel(mo.catalogue, mo.repo)) if name == "multi" else "kvcompat.mutation.operators",
        target=cat.TARGET if name == "multi" else " ".join(f.path for f in resolved.files),
        started=ctx.started,
        pytest_args=list(mo.pytest_args),
        coverage=coverage,
        group=name,
        files=files,
        replaced=list(resolved.replaced),
        absent=resolved.absent,
    )
    out = results_path(mo.results_dir, cell.id, name)
    return Group(name, resolved, sources, mutants, run, out, reasons=reasons, release=cell.vllm)


def check_only(groups: list[Group], only: tuple[str, ...]) -> None:
    """Every id of ``only`` names a mutant of one of the groups; an unknown id is bad input."""
    known = {m.id for g in groups for m, _ in g.mutants}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise cat.CatalogueError(
            f"no mutant {', '.join(unknown)} for this release; see results/mutants-<cell>.json for ids"
        )


def place(g: Group, only: tuple[str, ...]) -> None:
    """Apply the picked mutants in memory (an ambiguous or broken one stops us before any run) and place them."""
    picked = set(only) if only else None  # ids of every group (checked by check_only)
    locators = {path: covmap.Locator(text) for path, text in g.sources.items()}
    for mutant, path in g.mutants:
        if picked is not None and mutant.id not in picked:
            continue
        source = g.sources[path]
        mutated = mutant.apply(source)
        span = _span_of(mutant, source)
        loc = locators[path]
        where = loc.where(*span) if span is not None else None
        line = loc.line_of(loc.strip(*span)[0]) if span is not None else None
        g.planned.append(Planned(mutant, mutated, path, line, where))


def _span_of(mutant, source: str) -> tuple[int, int] | None:
    if isinstance(mutant, gen.GeneratedMutant):
        return mutant.start, mutant.end
    found = mutant.locate(source)
    return found[1] if found else None


def keep_previous(g: Group, cell: Cell, mo: MutationOptions, say: Callable[[str], None] = print) -> None:
    """--mutant ID reruns those mutants only: the previous full run's other verdicts are kept, so a rerun of
    a few (a new test, a new equivalence reason) never loses the rest of the score.  --upstream-only keeps
    ours' verdicts of every mutant.  A full run resumes after the verdicts of an interrupted one."""
    run = g.run
    run.planned = len(g.planned)
    resuming = not mo.only and not mo.upstream_only
    if resuming:
        previous = interrupted_verdicts(g.out, run)
        done = {v.id for v in previous}
        g.planned = [p for p in g.planned if p.mutant.id not in done]
        run.planned = len(g.planned)
    else:
        aside = set_aside(g.out, run, mo.only)
        if aside is not None:
            say(
                f"{g.name}: the previous record scored other tests (pytest arguments {run.pytest_args} now), so "
                f"its verdicts cannot be kept; it is kept as {aside.name}"
            )
        previous = kept_verdicts(g.out, run, mo.only or ("*",))
    g.kept = [g.explain(v) for v in previous]
    g.ours_before = {v.id: v for v in g.kept} if mo.upstream_only else {}
    if mo.upstream_only:
        prev = read_run(g.out) or {}
        if not g.ours_before or "upstream" not in cell.suites:
            raise MutationError(
                f"--upstream-only keeps our suite's verdicts of a previous scored run of {cell.id} with the "
                "upstream column; run `nox -s mutants` on that cell without --upstream-only first"
            )
        g.kept = [v for v in g.kept if v.id not in {p.mutant.id for p in g.planned}]
        run.baseline, run.scored = prev["baseline"], True
    run.planned += len(g.kept)
    # Every write of the results file from here on holds the kept verdicts: a rerun of a few mutants that is
    # stopped before its first verdict leaves the previous run's score as it was, not emptied.
    run.mutants = list(g.kept)
