"""The ``kvcompat`` command: what a user does without nox, through the same functions as the nox sessions.

    kvcompat report [DIR…]      merge result folders into reports/ and print the grid
    kvcompat show CELL          one cell's verdict, tests and log tail
    kvcompat list               the cells of a matrix and their last verdicts
    kvcompat bisect …           the first release where a test breaks, or with --find-fix is fixed (as nox -s bisect);
                                with --repo PATH GOOD BAD the first commit of a vLLM git checkout
    kvcompat qualify CANDIDATE  a vLLM wheel or source checkout against its base release: regressions, exit 1

Bad input is one line on stderr, ``kvcompat: error: …``, and exit status 2, as in the nox sessions.
Running cells needs nox (``nox -s matrix``): it is what puts each cell in its own session.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvcompat import option_table, options
from kvcompat.commands import bisect, matrix, qualify, report, show
from kvcompat.errors import KvcompatError, one_line_errors


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise option_table.OptionError(f"{message}; see `{self.prog} --help`")


VERBS = ("report", "show", "list", "bisect", "qualify")


def build_parser() -> argparse.ArgumentParser:
    """kvcompat's parser: each command's help, positionals and options come from kvcompat.options, as the
    nox session's do (``kvcompat report --help`` and ``nox -s report -- --help`` print the same text)."""
    parser = _Parser(
        prog="kvcompat",
        description="Compatibility of vLLM's MultiConnector(Nixl + CPU offload), per vLLM and torch release.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path.cwd(),
        help="the kvcompat project (pyproject.toml, results/); default: the current folder",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for verb in VERBS:
        spec = option_table.COMMANDS[verb]
        options.configure(
            sub.add_parser(verb, help=spec.summary, **options.parser_kwargs(verb, f"kvcompat {verb}")), verb
        )
    return parser


def run(argv: list[str]) -> int:
    ns, extras = build_parser().parse_known_args(argv)
    options.refuse_extras(ns.command, extras, f"kvcompat {ns.command}")
    root = ns.root.resolve()
    if not (root / "pyproject.toml").is_file():
        raise KvcompatError(
            f"{root} is not a kvcompat project (no pyproject.toml); run from the project or pass --root"
        )
    if ns.command == "bisect":
        options.take_refs(ns, ns.refs)
    if ns.command in ("report", "list", "bisect", "qualify"):
        options.finish(ns, ns.command, os.environ)
    if ns.command == "report":
        from kvcompat.report.terminal import print_table

        dirs = report.report_dirs(root, ns.dirs)
        rep, paths = report.update_report(root, dirs, summary_file=ns.summary_file)
        print_table(rep)
        print("wrote " + ", ".join(str(p) for p in paths))
    elif ns.command == "show":
        print(show.show(show.find_result(root, ns.cell)))
    elif ns.command == "list":
        print(matrix.list_cells(root, matrix.matrix_cells(root, ns)))
    elif ns.command == "bisect":
        bisect.bisect(root, ns)
    elif ns.command == "qualify":
        code, text = qualify.qualify(root, ns, say=lambda line: print(line, file=sys.stderr))
        print(text, end="")
        return code
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        with one_line_errors():
            code = run(sys.argv[1:] if argv is None else argv)
            sys.stdout.flush()  # inside the try: a reader that went away shows up here, not at exit
            return code
    except BrokenPipeError:  # the reader went away (`kvcompat show X | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
