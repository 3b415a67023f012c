"""vLLM bugs the suite knows, as data: which contract each turns red, in which releases and shapes.

``known-bugs.toml`` beside this module holds one ``[[bug]]`` table per bug, each attributed from the
release's own source (``where``: the file and line), with the upstream issue or PR where one exists.  The
report names the bug beside every red test it explains, so a known, attributed vLLM bug does not read
like a new regression; a red test that no entry explains is new.  An entry::

    [[bug]]
    id = "vllm-45330"                      # a short name, unique
    title = "..."                          # one line, as a user would describe the symptom
    contracts = ["test_..."]               # the contracts (test function names) it turns red; "*": every one
    shapes = ["hetero-tp-p1d4"]            # the deployment shapes it shows in (omitted: any, or unshaped tests)
    releases = ">=0.20.2,<0.24.0"          # the affected releases (a PEP 440 specifier; open-ended while unfixed)
    impact = "hang"                        # wrong-output | hang | leak | crash | fails-requests | refused | efficiency
    where = "nixl/worker.py 0.22.1 L1541"  # the release's file and line
    upstream = "https://github.com/vllm-project/vllm/issues/45330"
    fix = "https://github.com/vllm-project/vllm/pull/45879"   # omitted while unfixed

Stdlib and ``packaging`` only: the harness reads it when it renders a report.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

DATA = Path(__file__).with_name("known-bugs.toml")
IMPACTS = ("wrong-output", "hang", "leak", "crash", "fails-requests", "refused", "efficiency")


@dataclasses.dataclass(frozen=True)
class KnownBug:
    id: str
    title: str
    contracts: tuple[str, ...]
    releases: SpecifierSet
    impact: str
    where: str
    shapes: tuple[str, ...] = ()
    upstream: str | None = None
    fix: str | None = None

    def explains(self, contract: str, shape: str | None, release: str) -> bool:
        """Whether this bug explains ``contract`` red in ``shape`` on ``release``."""
        if ("*" not in self.contracts and contract not in self.contracts) or (self.shapes and shape not in self.shapes):
            return False
        try:
            return Version(release) in self.releases
        except InvalidVersion:
            return False

    def line(self) -> str:
        """One line for a report: the title, its impact, where, and the upstream links."""
        links = ", ".join(x for x in (_short(self.upstream), f"fixed by {_short(self.fix)}" if self.fix else "") if x)
        return f"known vLLM bug ({self.impact}): {self.title} ({self.where}{'; ' + links if links else ''})"


def _short(url: str | None) -> str:
    """``vllm#45330`` for a vLLM issue or PR URL, the URL otherwise."""
    if not url:
        return ""
    for kind in ("/issues/", "/pull/"):
        if "github.com/vllm-project/vllm" + kind in url:
            return "vllm#" + url.rsplit("/", 1)[-1]
    return url


class KnownBugsError(ValueError):
    """The known-bugs file is malformed; the message names the entry and the field."""


def parse(text: str) -> tuple[KnownBug, ...]:
    """The entries of a known-bugs TOML document; :class:`KnownBugsError` naming what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KnownBugsError(f"known-bugs.toml is not valid TOML: {exc}") from None
    bugs, seen = [], set()
    for i, entry in enumerate(data.get("bug", [])):
        name = entry.get("id", f"entry {i + 1}")
        missing = [k for k in ("id", "title", "contracts", "releases", "impact", "where") if k not in entry]
        if missing:
            raise KnownBugsError(f"known bug {name!r} lacks {', '.join(missing)}")
        if entry["impact"] not in IMPACTS:
            raise KnownBugsError(f"known bug {name!r}: impact {entry['impact']!r} is not one of {', '.join(IMPACTS)}")
        if name in seen:
            raise KnownBugsError(f"known bug {name!r} is listed twice")
        seen.add(name)
        try:
            releases = SpecifierSet(entry["releases"])
        except InvalidSpecifier:
            raise KnownBugsError(f"known bug {name!r}: releases {entry['releases']!r} is not a version range") from None
        bugs.append(
            KnownBug(
                id=name,
                title=entry["title"],
                contracts=tuple(entry["contracts"]),
                releases=releases,
                impact=entry["impact"],
                where=entry["where"],
                shapes=tuple(entry.get("shapes", ())),
                upstream=entry.get("upstream"),
                fix=entry.get("fix"),
            )
        )
    return tuple(bugs)


@functools.cache
def known() -> tuple[KnownBug, ...]:
    """The known bugs kvcompat ships (``known-bugs.toml`` beside this module)."""
    return parse(DATA.read_text())


def explaining(contract: str, shape: str | None, release: str) -> KnownBug | None:
    """The known bug that explains ``contract`` red in ``shape`` on ``release``, if any."""
    return next((b for b in known() if b.explains(contract, shape, release)), None)
