"""The parsers of the nox sessions and of the ``kvcompat`` command, built from :mod:`kvcompat.option_table`.

Their usage lines and ``--help``, the refusal of an argument a command does not take, and bisect's
resume command (:func:`command_line`) come from the table too.  Environment variables are read here and
nowhere else: the rest of the harness gets plain values.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
from collections.abc import Mapping
from typing import Any

from kvcompat.option_table import COMMANDS, ENV_ALIASES, OptionError, options_for, passes_for

HELP_FLAGS = ("-h", "--help")


def usage(command: str, prog: str) -> str:
    """One usage line for ``command`` built from the tables."""
    parts = []
    for o in options_for(command):
        token = o.flag if o.switch else f"{o.flag} {o.metavar}"
        parts.append(token if o.required else f"[{token}]")
    for p in passes_for(command):
        parts.append(f"[{p.flags[0]}{'' if p.metavar is None else ' ' + p.metavar}]")
    for pos in COMMANDS[command].positionals if command in COMMANDS else ():
        parts.append(pos.metavar if pos.nargs is None else f"[{pos.metavar}…]")
    return " ".join([prog, *parts])


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`OptionError` (one line, exit 2 at the edge) instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise OptionError(f"{message}; see `{self.prog} --help`")


class _PassThrough(argparse.Action):
    """Keeps a pass-through pytest option, in the order given, in ``pytest_args``."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ARG002
        given = [option_string] if self.nargs == 0 else [option_string, values]
        namespace.pytest_args = [*(getattr(namespace, "pytest_args", None) or []), *given]


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``command``'s options to ``parser`` (values stay strings; :func:`finish` converts them)."""
    for o in options_for(command):
        if o.switch:
            parser.add_argument(o.flag, dest=o.dest, action="store_true", default=None, help=o.help)
        else:
            extra = f" (default {o.default})" if o.default not in (None, ()) else ""
            env = f"; env {o.env}" if o.env else ""
            if o.listing and command in COMMANDS and COMMANDS[command].nox:
                env += " (under nox the only way: nox picks the cells before a session runs)"
            parser.add_argument(
                o.flag, dest=o.dest, metavar=o.metavar, default=None, choices=o.choices, help=o.help + extra + env
            )
    passes = passes_for(command)
    if passes:
        group = parser.add_argument_group(
            "pytest options passed through",
            "to every suite the cell runs; no other argument reaches pytest",
        )
        for p in passes:
            group.add_argument(
                *p.flags,
                action=_PassThrough,
                dest="pytest_args",
                nargs=0 if p.metavar is None else None,
                metavar=p.metavar,
                default=argparse.SUPPRESS,
                help=p.help,
            )


def configure(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """Give ``parser`` (made with :func:`parser_kwargs`) ``command``'s positionals and options."""
    for pos in COMMANDS[command].positionals:
        nargs = {} if pos.nargs is None else {"nargs": pos.nargs}
        parser.add_argument(pos.dest, metavar=pos.metavar, help=pos.help, **nargs)
    add_options(parser, command)
    return parser


def parser_kwargs(command: str, prog: str) -> dict[str, Any]:
    """The keyword arguments of ``command``'s parser: the same for ``nox -s NAME --`` and ``kvcompat NAME``."""
    spec = COMMANDS[command]
    return {
        "prog": prog,
        "usage": usage(command, prog),
        "description": spec.description,
        "epilog": spec.epilog or None,
        "allow_abbrev": False,
    }


def command_parser(command: str, prog: str | None = None) -> argparse.ArgumentParser:
    return configure(_Parser(**parser_kwargs(command, prog or _prog(command))), command)


def help_text(command: str, prog: str | None = None) -> str:
    """``command``'s ``--help``: what ``nox -s NAME -- --help`` and ``kvcompat NAME --help`` print."""
    return command_parser(command, prog).format_help()


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def refuse_extras(command: str, extras: list[str], prog: str) -> None:
    """Refuse, in one line naming the fix, the first argument ``command``'s parser did not take."""
    if not extras:
        return
    see = f"see `{prog} --help`"
    passes = passes_for(command)
    passing = f"{command} passes only {', '.join('/'.join(p.flags) for p in passes)} of pytest's options through"
    flags = [a for a in extras if a.startswith("-") and a != "-"]
    if not flags:
        takes = " ".join(p.metavar for p in COMMANDS[command].positionals)
        what = f"takes {takes}, not {extras[0]!r}" if takes else f"takes no positional argument ({extras[0]!r})"
        raise OptionError(f"{command} {what}" + (f"; {passing}" if passes else "") + f"; {see}")
    flag = flags[0].split("=", 1)[0]
    known = [o.flag for o in options_for(command)] + [f for p in passes for f in p.flags]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    if close:
        raise OptionError(f"{command} takes no option {flag} (did you mean {close[0]}?); {see}")
    raise OptionError(f"{command} takes no option {flag}" + (f"; {passing}" if passes else "") + f"; {see}")


def finish(
    ns: argparse.Namespace, command: str, environ: Mapping[str, str], *, nox_session: bool = False
) -> argparse.Namespace:
    """Fill what the command line left out from the environment, then the defaults; convert and check each value."""
    env = dict(environ)
    for name, aliases in ENV_ALIASES.items():
        for alias in aliases:
            env.setdefault(name, env.get(alias, ""))
    for o in options_for(command):
        given = getattr(ns, o.dest, None)
        if given is not None and o.listing and nox_session:
            raise OptionError(
                f"{o.flag} picks the cells before nox runs a session; set {o.env}=… in the environment "
                f"instead (e.g. {o.env}={given} nox -s {command})"
            )
        if given is None:
            value = o.value_from(env)
            if o.required and value is None:
                raise OptionError(
                    f"the following arguments are required: {o.flag}; usage: {usage(command, _prog(command))}"
                )
        elif o.switch:
            value = True
        else:
            value = o.convert(o.flag, given)
        setattr(ns, o.dest, value)
    return ns


def _prog(command: str) -> str:
    """How ``command`` is run: its nox session, or the ``kvcompat`` command for those that have no session."""
    return f"nox -s {command} --" if command not in COMMANDS or COMMANDS[command].nox else f"kvcompat {command}"


def parse(
    command: str, argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse a nox session's posargs for ``command``: its values, and the rest, which is the pytest options it
    passes through (matrix, mutants) or its positional arguments (report's folders, qualify's candidate).

    ``-h``/``--help`` prints :func:`help_text` and exits 0; an argument ``command`` does not take is one
    :class:`OptionError` naming the fix, raised before anything runs.
    """
    parser = command_parser(command)
    ns, extras = parser.parse_known_intermixed_args(argv)
    refuse_extras(command, extras, parser.prog)
    rest: list[str] = list(getattr(ns, "pytest_args", None) or [])
    for pos in COMMANDS[command].positionals:
        value = getattr(ns, pos.dest)
        rest += value if isinstance(value, list) else [value]
    return finish(ns, command, os.environ if environ is None else environ, nox_session=True), rest


def take_refs(ns: argparse.Namespace, refs: list[str]) -> argparse.Namespace:
    """bisect's commit form, ``--repo PATH GOOD BAD``: the two positional refs become ``--good`` and ``--bad``."""
    if not refs:
        return ns
    if getattr(ns, "repo", None) is None:
        raise OptionError(
            f"bisect takes positional GOOD BAD only with --repo PATH (commits of a git checkout), got "
            f"{' '.join(refs)!r}; for releases give --good V1 --bad V2"
        )
    if len(refs) != 2:
        raise OptionError(f"--repo takes two commits, GOOD BAD, got {len(refs)}: {' '.join(refs)!r}")
    if ns.good is not None or ns.bad is not None:
        raise OptionError("give GOOD BAD either as the two positional arguments or as --good and --bad, not both")
    ns.good, ns.bad = refs
    return ns


def parse_bisect(argv: list[str], environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``nox -s bisect --`` arguments: the options, and with ``--repo PATH`` the two positional commits."""
    parser = command_parser("bisect")
    ns, extras = parser.parse_known_intermixed_args(argv)
    refuse_extras("bisect", extras, parser.prog)
    take_refs(ns, ns.refs)
    del ns.refs
    return finish(ns, "bisect", os.environ if environ is None else environ, nox_session=True)


def command_line(command: str, values: Mapping[str, Any], prog: str | None = None) -> str:
    """The command that reruns ``command`` with ``values``: options left at their default are left out."""
    args: list[str] = []
    for o in options_for(command):
        value = values.get(o.dest, o.default)
        if value in (None, o.default, ()) and not o.required:
            continue
        if o.switch:
            args.append(o.flag)
        else:
            args += [o.flag, " ".join(value) if isinstance(value, tuple) else str(value)]
    return f"{prog or _prog(command)} " + shlex.join(args)
