"""The mutant catalogue (tests/mutants/*.toml): small behavioural changes to vLLM's multi_connector.py.

Each mutant names the contract it breaks and one or more *alternatives*: an exact
source snippet to find (or, with ``regex = true``, a regular expression) and what
replaces it.  Alternatives exist because the same behaviour is spelled differently
across releases.  Whether a mutant applies is decided by that explicit textual
probe of the release's pristine file and nothing else:

- no alternative matches: **not applicable** (the target code is absent in this release);
- exactly one match over all alternatives: the mutant is applied there;
- more than one: the catalogue is ambiguous, which is an error (give more context), never a guess.

A mutant with ``equivalent = "reason"`` cannot change behaviour the suite can see;
it is listed with its reason and not run.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from kvcompat.errors import KvcompatError

# Where the catalogue's mutants apply, relative to site-packages.
TARGET = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class CatalogueError(KvcompatError):
    """The catalogue is malformed, or a mutant does not pin down one place in the release's file."""


@dataclasses.dataclass(frozen=True)
class Alternative:
    target: str
    replacement: str
    regex: bool = False

    def matches(self, source: str) -> list[tuple[int, int]]:
        if self.regex:
            return [m.span() for m in re.finditer(self.target, source, re.MULTILINE)]
        spans, start = [], 0
        while (at := source.find(self.target, start)) >= 0:
            spans.append((at, at + len(self.target)))
            start = at + 1
        return spans

    def substitute(self, source: str, span: tuple[int, int]) -> str:
        start, end = span
        if self.regex:
            new = re.compile(self.target, re.MULTILINE).match(source, start).expand(self.replacement)  # type: ignore[union-attr]
        else:
            new = self.replacement
        return source[:start] + new + source[end:]


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    contract: str
    description: str
    alternatives: tuple[Alternative, ...]
    equivalent: str | None = None  # why no test can tell it from the original

    def locate(self, source: str) -> tuple[Alternative, tuple[int, int]] | None:
        """Where this mutant applies in ``source``: None when its target is absent (not applicable)."""
        found = [(alt, span) for alt in self.alternatives for span in alt.matches(source)]
        if len(found) > 1:
            lines = sorted({source.count("\n", 0, span[0]) + 1 for _, span in found})
            raise CatalogueError(
                f"mutant {self.id!r}: its target occurs {len(found)} times in {TARGET} (lines "
                f"{', '.join(map(str, lines))}); make the target snippet unique by including more of the surrounding code"
            )
        return found[0] if found else None

    def apply(self, source: str) -> str | None:
        """The mutated source, or None when the mutant is not applicable to ``source``."""
        where = self.locate(source)
        if where is None:
            return None
        alt, span = where
        mutated = alt.substitute(source, span)
        if mutated == source:
            raise CatalogueError(f"mutant {self.id!r} changes nothing; give it a replacement that differs")
        try:
            compile(mutated, TARGET, "exec")
        except SyntaxError as exc:
            raise CatalogueError(
                f"mutant {self.id!r} does not compile ({exc.msg}, line {exc.lineno}); fix its replacement"
            ) from None
        return mutated


def load(path: Path) -> list[Mutant]:
    """Read a catalogue: ``[[mutant]]`` tables with id, contract, description and target/replacement or alternatives."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogueError(
            f"cannot read the mutant catalogue {path}: {exc.strerror}; pass an existing file"
        ) from None
    return load_text(text, path.name)


def load_text(text: str, name: str = "catalogue") -> list[Mutant]:
    """The mutants of a catalogue's TOML text (``name`` is for messages)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueError(f"{name} is not valid TOML ({exc}); fix the catalogue") from None
    mutants, seen = [], set()
    for n, entry in enumerate(data.get("mutant", []), 1):
        where = f"{name}, mutant {n}"
        for key in ("id", "contract", "description"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise CatalogueError(f"{where}: {key!r} is missing; every mutant needs id, contract and description")
        mid = entry["id"]
        if not ID_RE.match(mid):
            raise CatalogueError(f"{where}: id {mid!r} is not lower-case-with-dashes; rename it")
        if mid in seen:
            raise CatalogueError(f"{where}: id {mid!r} is used twice; ids must be unique")
        seen.add(mid)
        raw = entry.get("alternatives") or ([{k: entry[k] for k in entry if k in ("target", "replacement", "regex")}])
        alts = []
        for alt in raw:
            if (
                not isinstance(alt.get("target"), str)
                or not isinstance(alt.get("replacement"), str)
                or not alt["target"]
            ):
                raise CatalogueError(f"{where} ({mid}): each alternative needs a target and a replacement (strings)")
            alts.append(Alternative(alt["target"], alt["replacement"], bool(alt.get("regex", False))))
        equivalent = entry.get("equivalent")
        if equivalent is not None and (not isinstance(equivalent, str) or not equivalent.strip()):
            raise CatalogueError(f"{where} ({mid}): equivalent must say why (a non-empty string)")
        mutants.append(Mutant(mid, entry["contract"], entry["description"], tuple(alts), equivalent))
    if not mutants:
        raise CatalogueError(f"{name} has no [[mutant]] entries; add some or point at another catalogue")
    return mutants


def select(mutants: list[Mutant], only: tuple[str, ...]) -> list[Mutant]:
    """The mutants named in ``only`` (all when empty); an unknown id is bad input."""
    if not only:
        return mutants
    known = {m.id for m in mutants}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise CatalogueError(f"no mutant {', '.join(unknown)} in the catalogue; known: {', '.join(sorted(known))}")
    return [m for m in mutants if m.id in only]
