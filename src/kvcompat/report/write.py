"""Write every rendering of a report into reports/, atomically, and the job summary in GitHub Actions."""

from __future__ import annotations

from pathlib import Path

from kvcompat.atomic import write_atomic
from kvcompat.report import mutants as mutation
from kvcompat.report import notrun
from kvcompat.report.jsonfile import render_json
from kvcompat.report.junit import render_junit
from kvcompat.report.markdown import LIMIT, fit, render_markdown
from kvcompat.report.model import Report
from kvcompat.report.webpage import render_html

SUMMARY_LIMIT = 1024 * 1024  # GitHub's job-summary cap


def write_reports(
    rep: Report, out_dir: Path, summary_file: Path | None = None, mutants: list[dict] | None = None
) -> list[Path]:
    """Write reports/compat.*; with ``summary_file`` (GitHub's $GITHUB_STEP_SUMMARY) append the Markdown there too.

    ``mutants`` (results/mutants-*.json, read by kvcompat.report.mutants.load) adds the "Mutation testing" section.
    """
    md = _markdown(rep, mutants or [])
    paths = {
        out_dir / "compat.json": render_json(rep),
        out_dir / "compat.md": md,
        out_dir / "compat.xml": _before(render_junit(rep), "</testsuites>", notrun.junit(rep)),
        out_dir / "compat.html": _before(
            _before(render_html(rep), "</body>", notrun.html(rep)), "</body>", mutation.render_html(mutants or [])
        ),
    }
    for path, text in paths.items():
        write_atomic(path, text)
    if summary_file:
        data = md.encode()
        if len(data) > SUMMARY_LIMIT:
            note = b"\n\n(truncated to GitHub's 1 MiB job-summary limit: see reports/compat.md)\n"
            data = data[: SUMMARY_LIMIT - len(note) - 4].decode(errors="ignore").encode() + note
        with open(summary_file, "ab") as fh:
            fh.write(data)
    return list(paths)


# compat.md gives the mutation section (and a long list of cells not run) at most this much: its summary
# table; the rest ("Per file", the survivors) is in compat.html.
MUTATION_SHARE = 4_000


def _markdown(rep: Report, mutants: list[dict]) -> str:
    """compat.md under markdown.LIMIT in all: the report, the cells not run after its title, the mutation
    section last (its summary table), each cut with a line naming compat.html where it is longer."""
    not_run = notrun.markdown(rep)
    if len(not_run) > MUTATION_SHARE:
        not_run = "\n".join(fit(not_run.splitlines(), MUTATION_SHARE)) + "\n\n"
    tail = mutation.render_markdown(mutants)
    body = render_markdown(rep, limit=LIMIT - len(not_run) - min(len(tail), MUTATION_SHARE))
    if tail:
        room = min(LIMIT - len(not_run) - len(body), MUTATION_SHARE)
        tail = (
            "\n".join(fit(tail.splitlines(), room, "compat.html beside this file")) + "\n" if len(tail) > room else tail
        )
    return _after_title(body, not_run) + tail


# The cells not run (kvcompat.report.notrun) go into each rendering at a fixed landmark, so every
# renderer stays about readable results only.
def _after_title(md: str, section: str) -> str:
    title, sep, rest = md.partition("\n\n")
    return title + sep + section + rest if section else md


def _before(text: str, landmark: str, section: str) -> str:
    head, sep, tail = text.rpartition(landmark)
    return head + section + sep + tail if section and sep else text
