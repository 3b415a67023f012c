"""The options table: one source for parsers, environment variables, docs/options.md and resume commands."""

from __future__ import annotations

import pytest

from kvcompat import option_docs, option_table, options
from kvcompat.option_table import OptionError
from kvcompat.run.options import run_options

from helpers import REPO


def test_environment_fills_what_the_command_line_leaves_out():
    env = {
        "KVCOMPAT_FIND_LINKS": "/w1 /w2",
        "UV_INDEX_URL": "https://mirror.example/simple/",
        "KVCOMPAT_UPSTREAM_INDEX": "https://sdists.example/simple",
    }
    values, rest = options.parse("matrix", ["--timeout=60", "-k", "load"], env)
    assert rest == ["-k", "load"]  # the pytest options matrix passes through, in order
    assert values.timeout == 60.0 and values.find_links == ("/w1", "/w2")
    assert values.index_url == "https://mirror.example/simple"  # uv's older spelling counts too
    opts = run_options(REPO, values, rest)
    assert opts.upstream_index == "https://sdists.example/simple" and opts.pytest_args == ("-k", "load")
    values, _ = options.parse("matrix", [], {"UV_DEFAULT_INDEX": "https://a.example/simple"})
    assert run_options(REPO, values, []).upstream_index == "https://a.example/simple"  # falls back to the index


def test_the_command_line_wins_over_the_environment():
    values, _ = options.parse(
        "bisect", ["--test", "t", "--good", "1", "--bad", "2", "--torch", "2.13.0"], {"KVCOMPAT_FIND_LINKS": "/w"}
    )
    assert values.torch == "2.13.0" and values.find_links == ("/w",)


def test_an_option_that_picks_cells_is_refused_as_a_session_argument():
    with pytest.raises(OptionError, match=r"--matrix picks the cells before nox runs a session; set KVCOMPAT_MATRIX"):
        options.parse("matrix", ["--matrix", "releases"], {})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--timeout=soon"], "--timeout='soon' is not a positive number of seconds; write e.g. --timeout=900"),
        (["--min-free-gb=0"], "--min-free-gb='0' is not a positive number of GiB; write e.g. --min-free-gb=15"),
    ],
)
def test_bad_values_name_the_fix(argv, needle):
    with pytest.raises(OptionError) as err:
        options.parse("matrix", argv, {})
    assert str(err.value) == needle


@pytest.mark.parametrize("value", ["0", "two", "1.5"])
def test_fork_jobs_is_a_whole_number_of_children(value):
    with pytest.raises(OptionError) as err:
        options.parse("mutants", [f"--fork-jobs={value}"], {})
    assert (
        str(err.value)
        == f"--fork-jobs={value!r} is not a whole number of children (1 or more); write e.g. --fork-jobs=16"
    )
    assert options.parse("mutants", ["--fork-jobs=3"], {})[0].fork_jobs == 3


def test_bad_environment_values_name_the_variable():
    with pytest.raises(OptionError, match="UV_DEFAULT_INDEX 'mirror' is not a URL"):
        options.parse("list", [], {"UV_DEFAULT_INDEX": "mirror"})


def test_docs_options_table_is_the_generated_one():
    page = (REPO / option_docs.DOCS_PAGE).read_text()
    begin, end = "<!-- options:begin (generated from kvcompat.options) -->", "<!-- options:end -->"
    assert (option_docs.TABLE_BEGIN, option_docs.TABLE_END) == (begin, end)
    assert begin in page and end in page
    table = page.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == option_docs.markdown_table(), (
        f"{option_docs.DOCS_PAGE}'s options table is stale: regenerate it with "
        "python3 -c 'from pathlib import Path; from kvcompat import options; option_docs.write_docs_table(Path.cwd())'"
    )
    assert option_docs.with_table(page) == page


def test_the_readme_links_the_options_page():
    assert f"]({option_docs.DOCS_PAGE})" in (REPO / "README.md").read_text()


def test_the_options_table_is_regenerated_between_its_markers_only(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / option_docs.DOCS_PAGE
    stale = f"# Options\n\nabove\n\n{option_docs.TABLE_BEGIN}\n| old |\n{option_docs.TABLE_END}\n\nbelow\n"
    page.write_text(stale)
    assert option_docs.write_docs_table(tmp_path) is True
    text = page.read_text()
    assert (
        text
        == f"# Options\n\nabove\n\n{option_docs.TABLE_BEGIN}\n{option_docs.markdown_table()}\n{option_docs.TABLE_END}\n\nbelow\n"
    )
    assert option_docs.write_docs_table(tmp_path) is False and page.read_text() == text
    page.write_text("# Options\n\nno markers\n")
    with pytest.raises(ValueError, match="needs one"):
        option_docs.write_docs_table(tmp_path)


@pytest.mark.parametrize(
    "command, argv, message",
    [
        (
            "matrix",
            ["--froce"],
            "matrix takes no option --froce (did you mean --force?); see `nox -s matrix -- --help`",
        ),
        ("matrix", ["--timout=60"], "matrix takes no option --timout (did you mean --timeout?)"),
        (
            "matrix",
            ["--lf"],
            "matrix takes no option --lf; matrix passes only -k, --deselect, -x/--exitfirst, --maxfail of pytest's "
            "options through; see `nox -s matrix -- --help`",
        ),
        ("matrix", ["-m", "gpu"], "matrix takes no option -m; matrix passes only -k, --deselect"),
        (
            "matrix",
            ["tests/connectors/test_x.py"],
            "matrix takes no positional argument ('tests/connectors/test_x.py')",
        ),
        ("mutants", ["-x"], "mutants takes no option -x; mutants passes only --deselect of pytest's options through"),
        ("report", ["--frobnicate"], "report takes no option --frobnicate; see `nox -s report -- --help`"),
        ("qualify", [], "the following arguments are required: CANDIDATE; see `nox -s qualify -- --help`"),
        ("qualify", ["a.whl", "b.whl"], "qualify takes CANDIDATE, not 'b.whl'"),
        ("lint", ["--fix"], "lint takes no option --fix; see `nox -s lint -- --help`"),
        ("lint", ["src"], "lint takes no positional argument ('src')"),
        ("ci", ["--froce"], "ci takes no option --froce"),
    ],
)
def test_an_argument_a_session_does_not_take_is_one_line_naming_the_fix(command, argv, message):
    with pytest.raises(OptionError) as err:
        options.parse(command, argv, {})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bisect_refuses_a_misspelt_option_before_anything_runs():
    with pytest.raises(OptionError, match=r"bisect takes no option --tset \(did you mean --test\?\)"):
        options.parse_bisect(["--tset", "t", "--good", "0.1.0", "--bad", "0.2.0"], {})


def test_only_the_allowed_pytest_options_pass_through_in_order():
    argv = ["--deselect=tests/connectors/a.py::t", "-x", "--force", "-kload", "--maxfail", "2", "--exitfirst"]
    values, rest = options.parse("matrix", argv, {})
    assert values.force is True
    assert rest == ["--deselect", "tests/connectors/a.py::t", "-x", "-k", "load", "--maxfail", "2", "--exitfirst"]
    _, rest = options.parse("mutants", ["-k", "vllm_0_33_0", "--deselect", "tests/connectors/a.py::t"], {})
    assert rest == ["--deselect", "tests/connectors/a.py::t"]  # mutants' -k picks cells: it is not pytest's


@pytest.mark.parametrize("command", sorted(option_table.COMMANDS))
def test_help_is_built_from_the_tables_and_exits_0(command, capsys):
    text = options.help_text(command)
    assert text.startswith(f"usage: {options.usage(command, options._prog(command))}\n")
    for o in option_table.options_for(command):
        assert o.flag in text
    for p in option_table.passes_for(command):
        assert all(f in text for f in p.flags)
    for pos in option_table.COMMANDS[command].positionals:
        assert pos.metavar in text
    if option_table.COMMANDS[command].parsed and command != "bisect":
        with pytest.raises(SystemExit) as done:
            options.parse(command, ["--help"], {})
        assert done.value.code == 0 and capsys.readouterr().out == text
    assert options.wants_help(["-k", "x", "--help"]) and not options.wants_help(["-k", "x"])


def test_kvcompat_verbs_print_the_sessions_help(monkeypatch, capsys):
    """`kvcompat report --help` and `nox -s report -- --help` print the same text, the program's name aside."""
    from kvcompat import cli

    monkeypatch.setenv("COLUMNS", "100")
    for verb in cli.VERBS:
        with pytest.raises(SystemExit) as done:
            cli.main([verb, "--help"])
        assert done.value.code == 0
        expected = options.help_text(verb, prog=f"kvcompat {verb}")
        assert capsys.readouterr().out == expected
        if option_table.COMMANDS[verb].nox:
            assert expected.replace(f"kvcompat {verb}", f"nox -s {verb} --") == options.help_text(verb)
