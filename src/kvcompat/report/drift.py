"""A release run in both environments: how its two locks differ, and whether its verdict drifted.

vLLM did not change between the two cells; the packages around it did.  When the
verdicts differ (green in one, not in the other) that is ecosystem drift.  The
packages whose versions differ are listed most relevant first.
"""

from __future__ import annotations

import dataclasses
import re

from kvcompat.report.cells import GridCell
from kvcompat.report.model import Report

# What moves a connector verdict most, in this order; then everything else by name.
RELEVANCE = (r"^torch$", r"^transformers$", r"^nixl", r"^(cuda|nvidia)", r"^(torchvision|torchaudio|triton)$")


@dataclasses.dataclass
class EnvironmentPair:
    """One release in one lane, run as released and today."""

    as_released: GridCell
    today: GridCell
    changed: list[tuple[str, str | None, str | None]]  # (package, as-released version, today's), most relevant first

    @property
    def drifted(self) -> bool:
        return self.as_released.outcome.is_green != self.today.outcome.is_green

    @property
    def cutoff(self) -> str | None:
        """The as-released cell's index cutoff (its recorded environment, else the cell's own)."""
        old = self.as_released.result
        return (old.environment or {}).get("exclude_newer") or old.cell.exclude_newer

    def changes(self, most: int = 12) -> str:
        """The first ``most`` version changes, ``torch 2.13.0 → 2.14.0, …``, and how many more."""
        shown = ", ".join(f"{n} {a or '—'} → {b or '—'}" for n, a, b in self.changed[:most])
        return shown + (f" and {len(self.changed) - most} more" if len(self.changed) > most else "")


def _rank(name: str) -> tuple[int, str]:
    return next((i for i, pattern in enumerate(RELEVANCE) if re.search(pattern, name)), len(RELEVANCE)), name


def lock_differences(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """(package, old version, new version) for every package whose version differs, most relevant first."""
    names = sorted({n for n in old.keys() | new.keys() if old.get(n) != new.get(n)}, key=_rank)
    return [(n, old.get(n), new.get(n)) for n in names]


def environment_pairs(rep: Report) -> list[EnvironmentPair]:
    """Every release run in both environments, with the difference between its two locks."""
    pairs: dict[tuple, dict[str, GridCell]] = {}
    for gc in rep.cells:
        c = gc.result.cell
        dist, torch, env, suite, order = gc.lane
        pairs.setdefault((c.vllm, dist, torch, suite, order, c.overrides), {})[env] = gc
    out = []
    for envs in pairs.values():
        old, new = envs.get("as-released"), envs.get("today")
        if old and new:
            out.append(EnvironmentPair(old, new, lock_differences(old.result.versions, new.result.versions)))
    return out
