"""reports/compat.json: the model as data, including the flat outcome map the next report diffs against."""

from __future__ import annotations

import dataclasses
import json

from kvcompat.report import notrun
from kvcompat.report.model import Report


def render_json(rep: Report) -> str:
    return json.dumps(
        {
            "generated": rep.generated,
            "totals": rep.totals(),
            "rows": rep.rows,
            "columns": rep.columns,
            "grid": [
                {
                    "row": gc.row,
                    "column": rep.column(gc),
                    "cell": gc.result.id,
                    "suite": gc.suite,
                    "outcome": gc.outcome.value,
                    "text": gc.text(),
                }
                for gc in rep.ordered()
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
