"""``nox -s qualify`` and ``kvcompat qualify``: a candidate vLLM against the release it descends from."""

from __future__ import annotations

import dataclasses
import functools
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from packaging.version import Version

from kvcompat import index, upstream
from kvcompat import qualify as q
from kvcompat.atomic import write_atomic
from kvcompat.cells import resolve_entry
from kvcompat.matrix import Entry
from kvcompat.run.cellfiles import CellFiles
from kvcompat.run.options import run_options
from kvcompat.run.workflow import run_cell


def qualify(root: Path, values: Namespace, say: Callable[[str], None] = print) -> tuple[int, str]:
    """Run a candidate vLLM and the release it descends from side by side; (exit status, Markdown).

    Exit status 1 when a contract regressed (or the candidate ran no tests where its base did), else 0.
    The Markdown is also written to reports/qualify-<candidate>.md.
    """

    @functools.cache
    def releases() -> list[Version]:
        # Listed when first needed (a bad candidate is refused before the index is asked), then once
        # for both the base it descends from and the check that --against names a release.
        return index.list_versions("vllm", cache_root=root, index_url=values.index_url)

    work = root / ".kvcompat" / "candidates"
    candidate, base = q.candidate_from(
        Path(values.candidate),
        against=values.against,
        base_wheel=lambda v: index.download_wheel("vllm", v, root / ".kvcompat" / "wheels", values.index_url),
        base_sdist=lambda v: upstream.download_sdist_cached(v, root / ".kvcompat" / "sdists", values.index_url),
        releases=releases,
        work=work,
    )
    if Version(base) not in releases():
        raise q.QualifyError(f"--against {base}: vllm {base} is not on the index; name a published release")
    overrides, suites, table = q.base_entry(root / "pyproject.toml", base)
    say(
        f"qualifying {candidate.source} ({candidate.origin}, vllm {candidate.version}) against vllm {base}"
        + (f"; as the {table!r} matrix runs it: suites {', '.join(suites)}" if table else "; suite ours")
        + (f", overrides {' '.join(overrides)}" if overrides else "")
    )
    base_cell, cand_cell = (
        resolve_entry(root, entry, index_url=values.index_url, find_links=values.find_links)
        for entry in (
            Entry(vllm=Version(base), overrides=overrides, suites=suites),
            Entry(vllm=candidate.wheel, overrides=overrides, suites=suites),
        )
    )
    # The candidate runs the base release's upstream tests (a wheel has no sdist of its own on the index).
    cand_cell = dataclasses.replace(cand_cell, upstream_from=base)
    opts = run_options(root, values)
    base_result = run_cell(base_cell, CellFiles.venv(root, base_cell), opts, progress=lambda s: say("  base: " + s))
    cand_opts = dataclasses.replace(opts, results_dir=root / "results" / "qualify")
    cand_result = run_cell(
        cand_cell, CellFiles.venv(root, cand_cell), cand_opts, progress=lambda s: say("  candidate: " + s)
    )
    cmp = q.compare(base_result, cand_result)
    text = q.render_markdown(cmp, candidate, base)
    out = root / "reports" / f"qualify-{cand_cell.id}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    say(f"wrote {out.relative_to(root)}")
    return (0 if cmp.ok else 1), text
