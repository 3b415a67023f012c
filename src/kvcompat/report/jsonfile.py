"""reports/compat.json: the model as data (the grid, why each square is not green, episodes), including the flat
outcome map the next report diffs against."""

from __future__ import annotations

import dataclasses
import json

from kvcompat.report import notrun, why
from kvcompat.report.model import Report


def render_json(rep: Report) -> str:
    return json.dumps(
        {
            "generated": rep.generated,
            "totals": rep.totals(),
            "rows": rep.rows,
            "columns": rep.columns,
            "footnotes": rep.footnotes(),
            "grid": [
                {
                    "row": gc.row,
                    "column": rep.column(gc),
                    "cell": gc.result.id,
                    "suite": gc.suite,
                    "outcome": gc.outcome.value,
                    "text": gc.text(),
                    "name": rep.name(gc),
                    "notes": rep.notes(gc),
                }
                for gc in rep.ordered()
            ],
            "why": [
                {
                    "cell": f.gc.result.id,
                    "suite": f.gc.suite,
                    "name": f.name,
                    "outcome": f.gc.outcome.value,
                    "fails_run": f.fails_run,
                    "reds": [
                        {
                            "test": r.test.nodeid,
                            "outcome": r.test.outcome.value,
                            "message": r.message,
                            "known_bug": r.bug and {"id": r.bug.id, "impact": r.bug.impact, "link": r.bug.link},
                            "bisect": r.bisect,
                        }
                        for r in f.reds
                    ],
                    "gone": [b.id for b in f.gone],
                    "reason": f.reason,
                    "show": f.show,
                    "drawer": f"compat.html{f.anchor}",
                }
                for f in why.findings(rep)
            ],
            "episodes": [dataclasses.asdict(e) for e in rep.episodes()],
            "changes": rep.changes(),
            "outcomes": rep.outcomes(),
            "cells": [r.to_json() for r in rep.results],
            "not_run": notrun.data(rep),  # cells whose result file could not be read
        },
        indent=2,
        sort_keys=True,
    )
