"""docs/options.md's options table, generated from :mod:`kvcompat.option_table`."""

from __future__ import annotations

from pathlib import Path

from kvcompat.option_table import OPTIONS, PYTEST_OPTIONS

# The page that documents every option, and the markers its generated table sits between.
DOCS_PAGE = "docs/options.md"
TABLE_BEGIN = "<!-- options:begin (generated from kvcompat.options) -->"
TABLE_END = "<!-- options:end -->"


def with_table(page: str) -> str:
    """``page`` (the text of :data:`DOCS_PAGE`) with the table between its markers made :func:`markdown_table`."""
    if page.count(TABLE_BEGIN) != 1 or page.count(TABLE_END) != 1 or page.index(TABLE_BEGIN) > page.index(TABLE_END):
        raise ValueError(f"{DOCS_PAGE} needs one {TABLE_BEGIN} line and, after it, one {TABLE_END} line")
    head, rest = page.split(TABLE_BEGIN)
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}\n{TABLE_END}{rest.split(TABLE_END)[1]}"


def write_docs_table(repo: Path) -> bool:
    """Regenerate the options table of ``repo``'s :data:`DOCS_PAGE`; True when it changed."""
    path = repo / DOCS_PAGE
    old = path.read_text()
    new = with_table(old)
    if new != old:
        path.write_text(new)
    return new != old


def markdown_table() -> str:
    """The options table of :data:`DOCS_PAGE` (between :data:`TABLE_BEGIN` and :data:`TABLE_END`)."""

    def cell(value: str) -> str:
        return value.replace("|", "\\|")

    rows = ["| option | commands | default | environment | what it does |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        flag = o.flag if o.switch else f"{o.flag} {o.metavar}"
        default = "" if o.default in (None, (), False) else f"`{o.default}`"
        env = f"`{o.env}`" + (" (the only way under nox)" if o.listing else "") if o.env else ""
        rows.append(f"| `{cell(flag)}` | {', '.join(o.commands)} | {default} | {env} | {cell(o.help)} |")
    rows += [
        "",
        "The pytest options passed through to the cells' pytest runs; no other argument after `--` reaches pytest "
        "(`nox -s tests -- …` is the one session that hands pytest everything):",
        "",
        "| pytest option | commands | what it does |",
        "|---|---|---|",
    ]
    for p in PYTEST_OPTIONS:
        flags = ", ".join(f"`{f}{'' if p.metavar is None else ' ' + p.metavar}`" for f in p.flags)
        rows.append(f"| {flags} | {', '.join(p.commands)} | {cell(p.help)} |")
    return "\n".join(rows)
