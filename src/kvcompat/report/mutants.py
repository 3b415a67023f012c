"""The report's "Mutation testing" section, from results/mutants-<cell>.json (see kvcompat.mutation.session).

Markdown and HTML fragments; :mod:`kvcompat.report.write` appends them to compat.md and compat.html.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

SCHEMA = "kvcompat-mutants/1"  # kvcompat.mutation.session.SCHEMA (kept here: the report reads files, not sessions)
COLUMNS = ("killed", "survived", "not_applicable", "equivalent")


def load(dirs: list[Path]) -> list[dict]:
    """Every mutation result under ``dirs`` (recursively); for a cell seen twice, the latest start wins."""
    by_id: dict[str, dict] = {}
    for d in dirs:
        for path in sorted(d.rglob("mutants-*.json")) if d.is_dir() else []:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                continue
            old = by_id.get(data["id"])
            if old is None or (data.get("started") or "") >= (old.get("started") or ""):
                by_id[data["id"]] = data
    return [by_id[k] for k in sorted(by_id, reverse=True)]


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
    both_scored = [m for m in run.get("mutants", []) if m.get("upstream") and m["status"] in ("killed", "survived")]
    if not both_scored:
        return None
    ours = {m["id"] for m in both_scored if m["status"] == "killed"}
    theirs = {m["id"] for m in both_scored if m["upstream"]["status"] == "killed"}
    by_id = {m["id"]: m for m in both_scored}
    return {
        "scored": len(both_scored),
        "ours": len(ours),
        "upstream": len(theirs),
        "both": len(ours & theirs),
        "neither": len(set(by_id) - ours - theirs),
        "only_ours": [by_id[i] for i in sorted(ours - theirs)],
        "only_upstream": [by_id[i] for i in sorted(theirs - ours)],
        "planned": sum(1 for m in run.get("mutants", []) if m["status"] in ("killed", "survived")),
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
            f"| {run['id']} | {h['scored']}{partial} | {h['ours']} | {h['upstream']} | {h['both']} | "
            f"{len(h['only_ours'])} | {len(h['only_upstream'])} | {h['neither']} |"
        )
    out.append("")
    for run, h in rows:
        if h["only_upstream"]:
            out += [f"Killed by upstream only in {run['id']}:", ""]
            out += [
                f"- `{m['id']}` ({m['contract']}): by {m['upstream'].get('killed_by', '').split('::')[-1]}"
                for m in h["only_upstream"]
            ]
            out.append("")
        if h["only_ours"]:
            out += [f"<details><summary>Killed by ours only in {run['id']}: {len(h['only_ours'])}</summary>", ""]
            out += [f"- `{m['id']}` ({m['contract']}): by {_killer(m)}" for m in h["only_ours"]]
            out += ["", "</details>", ""]
    return out


def render_markdown(runs: list[dict]) -> str:
    if not runs:
        return ""
    out = [
        "## Mutation testing",
        "",
        "Each mutant is a small change to the release's multi_connector.py, applied in a copy of the cell's venv; "
        "the suite should fail on it (killed). Survivors are contracts the suite does not check.",
        "",
        "| cell | killed | survived | killed of non-equivalent | not applicable | equivalent | generated | state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        c = _counts(run)
        generated = sum(1 for m in run.get("mutants", []) if m.get("origin") == "generated")
        out.append(
            f"| {run['id']} | {c['killed']} | {c['survived']} | {_score(run)} | {c['not_applicable']} | "
            f"{c['equivalent']} | {generated} | {_state(run)} |"
        )
    out.append("")
    for run in runs:
        survivors = [m for m in run.get("mutants", []) if m["status"] == "survived"]
        if survivors:
            out += [f"Survivors in {run['id']}:", ""]
            out += [f"- `{m['id']}` ({m['contract']}): {m['description']}" for m in survivors]
            out.append("")
        if _uncovered(run):
            out += [f"Methods with no mutant and no reason in {run['id']}: {', '.join(_uncovered(run))}", ""]
    equivalent = {m["id"]: m for run in runs for m in run.get("mutants", []) if m["status"] == "equivalent"}
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
            f"<tr><td>{escape(run['id'])}</td>"
            + "".join(f"<td>{c[k]}</td>" for k in COLUMNS)
            + f"<td>{escape(_score(run))}</td><td>{escape(_state(run))}</td></tr>"
        )
    body.append("</table>")
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
            body.append(f"<tr><td>{escape(run['id'])}</td>" + "".join(f"<td>{v}</td>" for v in cells) + "</tr>")
        body.append("</table>")
    for run in runs:
        if not run.get("mutants"):
            continue
        body.append(
            f"<details><summary>{escape(run['id'])}: every mutant</summary><table>"
            "<tr><th>mutant</th><th>contract</th><th>status</th><th>killed by / why</th></tr>"
        )
        for m in run["mutants"]:
            why = _killer(m) if m["status"] == "killed" else (m.get("reason") or m.get("detail") or "")
            body.append(
                f"<tr><td><code>{escape(m['id'])}</code></td><td>{escape(m['contract'])}</td>"
                f"<td>{escape(m['status'].replace('_', ' '))}</td><td>{escape(why)}</td></tr>"
            )
        body.append("</table></details>")
    return "".join(body)
