"""The report's "Mutation testing" section, from results/mutants-<cell>.json (see kvcompat.mutation.record).

One result per cell and target group (``mutants-<cell>.json`` is the ``multi`` group, multi_connector.py;
``mutants-<cell>--<group>.json`` another, see kvcompat.mutation.targets).  Besides the table per run,
"Per file" counts, for every mutated file, the mutants killed, survived (ran, every test passed), not
reached (no test executes them: not run), equivalent and not applicable, names each survivor with its
line, and says what the run cost (the session's baseline, the mutants' runs, seconds a mutant).

Markdown and HTML fragments; :mod:`kvcompat.report.write` appends them to compat.md and compat.html.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from kvcompat.mutation.record import EQUIVALENT, KILLED, SCHEMA, STATUSES, SURVIVED, UNREACHED

COLUMNS = STATUSES  # killed, survived, not_applicable, equivalent


def _group(run: dict) -> str:
    return run.get("group") or "multi"


def _label(run: dict) -> str:
    """The run's row: the cell id, and its group unless it is multi_connector.py's."""
    return run["id"] if _group(run) == "multi" else f"{run['id']} ({_group(run)})"


def load(dirs: list[Path]) -> list[dict]:
    """Every mutation result under ``dirs`` (recursively); for a cell and group seen twice, the latest start wins."""
    by_id: dict[tuple[str, str], dict] = {}
    for d in dirs:
        for path in sorted(d.rglob("mutants-*.json")) if d.is_dir() else []:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                continue
            key = (data["id"], _group(data))
            old = by_id.get(key)
            if old is None or (data.get("started") or "") >= (old.get("started") or ""):
                by_id[key] = data
    order = {g: i for i, g in enumerate(("multi", "nixl", "offload", "scheduler", "aggregator"))}
    ids = sorted({k[0] for k in by_id}, reverse=True)
    return [
        by_id[(i, g)] for i in ids for g in sorted((g for j, g in by_id if j == i), key=lambda g: (order.get(g, 9), g))
    ]


def _state(run: dict) -> str:
    if not run.get("scored"):
        base = run.get("baseline") or {}
        return f"not scored: baseline {base.get('outcome', '?')} ({base.get('detail', '')})"
    done = len(run.get("mutants", []))
    if run.get("finished") is None:
        return f"incomplete: {done} of {run.get('planned', '?')} mutants"
    return "complete"


def _counts(run: dict) -> dict[str, int]:
    return {c: sum(1 for m in run.get("mutants", []) if m["status"] == c) for c in COLUMNS}


def _score(run: dict) -> str:
    """killed / (killed + survived): the share of the mutants a test could see that the suite caught."""
    c = _counts(run)
    seen = c["killed"] + c["survived"]
    return f"{100 * c['killed'] / seen:.1f} %" if seen else "—"


def _uncovered(run: dict) -> list[str]:
    return [m for m, how in (run.get("coverage") or {}).items() if how == "MISSING"]


def _killer(m: dict) -> str:
    return m["killed_by"].split("::")[-1] if m.get("how") == "test" else (m.get("how") or "")


def head_to_head(run: dict) -> dict | None:
    """Ours against the upstream column on the mutants both scored: counts and the mutants only one kills.

    None when the run has no upstream verdicts (the cell has no upstream column).
    """
    both_scored = [m for m in run.get("mutants", []) if m.get("upstream") and m["status"] in (KILLED, SURVIVED)]
    if not both_scored:
        return None
    ours = {m["id"] for m in both_scored if m["status"] == KILLED}
    theirs = {m["id"] for m in both_scored if m["upstream"]["status"] == KILLED}
    by_id = {m["id"]: m for m in both_scored}
    return {
        "scored": len(both_scored),
        "ours": len(ours),
        "upstream": len(theirs),
        "both": len(ours & theirs),
        "neither": len(set(by_id) - ours - theirs),
        "only_ours": [by_id[i] for i in sorted(ours - theirs)],
        "only_upstream": [by_id[i] for i in sorted(theirs - ours)],
        "planned": sum(1 for m in run.get("mutants", []) if m["status"] in (KILLED, SURVIVED)),
    }


def render_head_to_head(runs: list[dict]) -> list[str]:
    """Markdown: per release, how many mutants each suite kills and which only one of them kills."""
    rows = [(run, h) for run in runs if (h := head_to_head(run))]
    if not rows:
        return []
    out = [
        "### Ours against vLLM's own tests, on the same mutants",
        "",
        "The upstream column (vLLM's test_nixl_simple_cpu_offload.py and test_multi_connector.py from the "
        "release's sdist) run against the same mutants as ours.",
        "",
        "| cell | scored by both | ours kills | upstream kills | both | only ours | only upstream | neither |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run, h in rows:
        partial = "" if h["scored"] == h["planned"] else f" (of {h['planned']})"
        out.append(
            f"| {_label(run)} | {h['scored']}{partial} | {h['ours']} | {h['upstream']} | {h['both']} | "
            f"{len(h['only_ours'])} | {len(h['only_upstream'])} | {h['neither']} |"
        )
    out.append("")
    for run, h in rows:
        if h["only_upstream"]:
            out += [f"Killed by upstream only in {_label(run)}:", ""]
            out += [
                f"- `{m['id']}` ({m['contract']}): by {m['upstream'].get('killed_by', '').split('::')[-1]}"
                for m in h["only_upstream"]
            ]
            out.append("")
        if h["only_ours"]:
            out += [f"<details><summary>Killed by ours only in {_label(run)}: {len(h['only_ours'])}</summary>", ""]
            out += [f"- `{m['id']}` ({m['contract']}): by {_killer(m)}" for m in h["only_ours"]]
            out += ["", "</details>", ""]
    return out


def render_markdown(runs: list[dict]) -> str:
    if not runs:
        return ""
    out = [
        "## Mutation testing",
        "",
        "Each mutant is a small change to a file of the release (multi_connector.py, or the files of another "
        "target group: the nixl, offload, scheduler or aggregator row), applied in a copy of the cell's venv; "
        "the suite should fail on it (killed). Survivors are contracts the suite does not check.",
        "",
        "| cell | killed | survived | killed of non-equivalent | not applicable | equivalent | generated | state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        c = _counts(run)
        generated = sum(1 for m in run.get("mutants", []) if m.get("origin") == "generated")
        out.append(
            f"| {_label(run)} | {c['killed']} | {c['survived']} | {_score(run)} | {c['not_applicable']} | "
            f"{c['equivalent']} | {generated} | {_state(run)} |"
        )
    out.append("")
    for run in runs:
        survivors = [m for m in run.get("mutants", []) if m["status"] == SURVIVED]
        if survivors and _group(run) == "multi":
            out += [f"Survivors in {run['id']}:", ""]
            out += [f"- `{m['id']}` ({m['contract']}): {m['description']}" for m in survivors]
            out.append("")
        if _uncovered(run):
            out += [f"Methods with no mutant and no reason in {run['id']}: {', '.join(_uncovered(run))}", ""]
    out += render_per_file(runs)
    equivalent = {m["id"]: m for run in runs for m in run.get("mutants", []) if m["status"] == EQUIVALENT}
    if equivalent:
        out += ["Equivalent mutants (not run):", ""]
        out += [f"- `{m['id']}`: {m.get('reason')}" for m in equivalent.values()]
        out.append("")
    out += render_head_to_head(runs)
    return "\n".join(out) + "\n"


def render_html(runs: list[dict]) -> str:
    if not runs:
        return ""
    body = [
        '<h2 id="mutation-testing">Mutation testing</h2>',
        "<table><tr><th>cell</th><th>killed</th><th>survived</th><th>not applicable</th><th>equivalent</th>"
        "<th>killed of non-equivalent</th><th>state</th></tr>",
    ]
    for run in runs:
        c = _counts(run)
        body.append(
            f"<tr><td>{escape(_label(run))}</td>"
            + "".join(f"<td>{c[k]}</td>" for k in COLUMNS)
            + f"<td>{escape(_score(run))}</td><td>{escape(_state(run))}</td></tr>"
        )
    body.append("</table>")
    body.append(_per_file_html(runs))
    rows = [(run, h) for run in runs if (h := head_to_head(run))]
    if rows:
        body.append(
            "<h3>Ours against vLLM's own tests, on the same mutants</h3><table><tr><th>cell</th>"
            "<th>scored by both</th><th>ours kills</th><th>upstream kills</th><th>both</th><th>only ours</th>"
            "<th>only upstream</th><th>neither</th></tr>"
        )
        for run, h in rows:
            cells = [h["scored"], h["ours"], h["upstream"], h["both"], len(h["only_ours"]), len(h["only_upstream"])]
            cells.append(h["neither"])
            body.append(f"<tr><td>{escape(_label(run))}</td>" + "".join(f"<td>{v}</td>" for v in cells) + "</tr>")
        body.append("</table>")
    for run in runs:
        if not run.get("mutants"):
            continue
        body.append(
            f"<details><summary>{escape(_label(run))}: every mutant</summary><table>"
            "<tr><th>mutant</th><th>contract</th><th>status</th><th>killed by / why</th></tr>"
        )
        for m in run["mutants"]:
            why = _killer(m) if m["status"] == KILLED else (m.get("reason") or m.get("detail") or "")
            at = f" ({_where(m)})" if m.get("line") and _group(run) != "multi" else ""
            body.append(
                f"<tr><td><code>{escape(m['id'])}</code>{escape(at)}</td><td>{escape(m['contract'])}</td>"
                f"<td>{escape(m['status'].replace('_', ' '))}</td><td>{escape(why)}</td></tr>"
            )
        body.append("</table></details>")
    return "".join(body)


# -- per file ------------------------------------------------------------------------------------------

FILE_COLUMNS = ("killed", "survived", "not reached", "explained", "equivalent", "not applicable")


def _file_of(m: dict, run: dict) -> str:
    return m.get("file") or (run.get("target") if _group(run) == "multi" else "") or "?"


def _where(m: dict) -> str:
    name = (m.get("file") or "").rsplit("/", 1)[-1]
    return f"{name}:{m['line']}" if m.get("line") else name


def file_counts(run: dict) -> dict[str, dict[str, int]]:
    """Per mutated file of a run: killed, survived (ran, all green), not reached (not run), explained (of those
    two: why each survives is written down with the release's lines), equivalent, not applicable."""
    out: dict[str, dict[str, int]] = {}
    for f in run.get("files") or []:
        out[f["path"]] = dict.fromkeys(FILE_COLUMNS, 0)
    for m in run.get("mutants", []):
        c = out.setdefault(_file_of(m, run), dict.fromkeys(FILE_COLUMNS, 0))
        if m["status"] == SURVIVED:
            c["not reached" if m.get("how") == UNREACHED else "survived"] += 1
            c["explained"] += bool(m.get("explained"))
        else:
            c[m["status"].replace("_", " ")] += 1
    return out


def timing(run: dict) -> str:
    """What the run cost: the baseline(s), the mutants' loop, seconds a mutant; "" when not recorded."""
    t = run.get("timing") or {}
    if not t.get("decided"):
        return ""
    total = (t.get("baseline_s") or 0) + (t.get("mutants_s") or 0)
    runs = t.get("runs", 0)
    per_run = f", {t['mutants_s'] / runs:.1f} s a suite run" if runs else ""
    split = ""
    if t.get("upstream_s"):  # both suites scored: how long each took, a mutant
        split = (
            f" (our suite {t.get('ours_s', 0) / t['decided']:.1f} s a mutant, "
            f"vLLM's own {t['upstream_s'] / t['decided']:.1f} s)"
        )
    return (
        f"{total:.0f} s in all (baseline {t.get('baseline_s', 0):.0f} s, mutants {t.get('mutants_s', 0):.0f} s): "
        f"{t['decided']} mutants, {t['mutants_s'] / t['decided']:.1f} s a mutant{split}; {runs} suite runs{per_run}"
    )


def _short(path: str) -> str:
    return path.removeprefix("vllm/").removeprefix("distributed/kv_transfer/kv_connector/")


def render_per_file(runs: list[dict]) -> list[str]:
    """Markdown: per run and mutated file, the counts and the survivors with their line."""
    rows = [(run, path, c) for run in runs if run.get("scored") for path, c in file_counts(run).items()]
    if not rows:
        return []
    out = [
        "### Per file",
        "",
        "Survived: the tests that execute the mutated lines ran and passed. Not reached: no test executes "
        "them (coverage of the unmutated suite), so nothing ran. Explained: of those two, the survivors whose "
        "cause is written down with the release's lines (tests/mutants/equivalent-<group>.toml); still survivors.",
        "",
        "| cell | group | file | " + " | ".join(FILE_COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(FILE_COLUMNS),
    ]
    for run, path, c in rows:
        out.append(
            f"| {run['id']} | {_group(run)} | `{_short(path)}` | " + " | ".join(str(c[k]) for k in FILE_COLUMNS) + " |"
        )
    out.append("")
    for run in runs:
        if not run.get("scored"):
            continue
        notes = []
        if timing(run):
            notes.append(f"time: {timing(run)}")
        if run.get("selection"):
            notes.append(f"tests picked by {run['selection']}")
        if run.get("replaced"):
            notes.append("transport replaced (not mutated): " + ", ".join(f"`{_short(p)}`" for p in run["replaced"]))
        if run.get("absent"):
            notes.append(f"not in this release: {run['absent']}")
        if _group(run) == "scheduler":
            chosen = [fn for f in run.get("files") or [] for fn in f.get("functions", [])]
            notes.append(f"methods chosen ({len(chosen)}): " + ", ".join(f"`{fn}`" for fn in chosen))
        if notes:
            out += [f"{_label(run)}:", ""] + [f"- {n}" for n in notes] + [""]
        by_file: dict[str, list[dict]] = {}
        for m in run.get("mutants", []):
            if m["status"] == SURVIVED:
                by_file.setdefault(_file_of(m, run), []).append(m)
        for path, survivors in by_file.items():
            ran = [m for m in survivors if m.get("how") != UNREACHED]
            unreached = [m for m in survivors if m.get("how") == UNREACHED]
            title = f"Survivors in {_label(run)}, `{_short(path)}`: {len(ran)} ran"
            title += f", {len(unreached)} not reached" if unreached else ""
            title += f", {sum(1 for m in survivors if m.get('explained'))} of them explained"
            out += [f"<details><summary>{title}</summary>", ""]
            out += [_survivor(m) for m in ran if not m.get("explained")]
            if any(not m.get("explained") for m in unreached):
                out += ["", "Not reached by any test:", ""]
                out += [_survivor(m) for m in unreached if not m.get("explained")]
            out += _explained([m for m in survivors if m.get("explained")])
            out += ["", "</details>", ""]
    return out


def _survivor(m: dict) -> str:
    return f"- `{m['id']}` (line {m.get('line') or '?'}): {m['description']}"


def _explained(survivors: list[dict]) -> list[str]:
    """The explained survivors, once per reason (a reason often covers a whole method)."""
    by_reason: dict[str, list[dict]] = {}
    for m in survivors:
        by_reason.setdefault(m["explained"], []).append(m)
    out = []
    for reason, ms in by_reason.items():
        where = ", ".join(sorted({str(m.get("line") or "?") for m in ms}, key=lambda x: (len(x), x)))
        out += ["", f"Explained ({len(ms)}, lines {where}): {reason}", ""]
        out += [_survivor(m) for m in ms]
    return out


def _per_file_html(runs: list[dict]) -> str:
    rows = [(run, path, c) for run in runs if run.get("scored") for path, c in file_counts(run).items()]
    if not rows:
        return ""
    body = [
        "<h3>Per file</h3><table><tr><th>cell</th><th>group</th><th>file</th>"
        + "".join(f"<th>{k}</th>" for k in FILE_COLUMNS)
        + "</tr>"
    ]
    for run, path, c in rows:
        body.append(
            f"<tr><td>{escape(run['id'])}</td><td>{escape(_group(run))}</td><td><code>{escape(_short(path))}</code></td>"
            + "".join(f"<td>{c[k]}</td>" for k in FILE_COLUMNS)
            + "</tr>"
        )
    body.append("</table>")
    for run in runs:
        if run.get("scored") and timing(run):
            body.append(f"<p>{escape(_label(run))}: {escape(timing(run))}</p>")
    return "".join(body)
