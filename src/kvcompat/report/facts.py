"""How each cell ran, in words: the facts a suite recorded (kvcompat.testkit.record_fact), per suite.

A fact is a string, often with a Python literal inside (``{'prefill': {'steps': 34, …}}``, ``[96, 128]``);
:func:`in_words` writes those as words (``prefill (steps 34, …)``, ``96, 128``).  :func:`by_suite` groups the
report's facts per suite: the facts every cell of the suite shares, said once, and per cell the rest.
"""

from __future__ import annotations

import ast
import dataclasses

from kvcompat.report.cells import GridCell
from kvcompat.report.model import Report

# Facts a report leaves out: how the platform was set up (the same for every cell of a runner).
HIDDEN = ("platform",)


def _literal(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(
            f"{k} ({_literal(v)})" if isinstance(v, dict) else f"{k} {_literal(v)}" for k, v in value.items()
        )
    if isinstance(value, (list, tuple, set)):
        return ", ".join(_literal(v) for v in value) if value else "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def in_words(text: str) -> str:
    """``text`` with every Python dict or list literal in it written as words (the rest as it is)."""
    out, i = [], 0
    while i < len(text):
        if text[i] in "{[":
            end = _closing(text, i)
            if end is not None:
                try:
                    value = ast.literal_eval(text[i : end + 1])
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    value = None
                if isinstance(value, (dict, list)):
                    words = _literal(value)
                    # a dict after other words keeps its parentheses; at the start of a clause it needs none
                    before = text[:i].rstrip()
                    bare = isinstance(value, list) or not before or before.endswith((";", ":", ","))
                    out.append(words if bare else f"({words})")
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _closing(text: str, start: int) -> int | None:
    """The index of the bracket closing the one at ``start`` (quotes respected), None if it never closes."""
    depth, quote = 0, None
    for j in range(start, len(text)):
        ch = text[j]
        if quote:
            if ch == quote and text[j - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j
    return None


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def _name(suite: str, fact: str) -> str:
    """A fact's name without its suite's prefix (``e2e P/D`` in the e2e suite: ``P/D``)."""
    return fact.removeprefix(f"{suite} ") or fact


@dataclasses.dataclass
class SuiteFacts:
    """One suite's facts across the report's cells: per fact, each value and the cells that had it."""

    suite: str
    cells: list[GridCell]
    facts: list[tuple[str, list[tuple[str, list[GridCell]]]]]  # (name, [(value in words, cells)])

    def summary(self, few: int = 3, width: int = 48) -> str:
        """The first few facts in one line (a long value cut, several values: ``differs``), and how many more."""
        parts = [
            f"{name} {_cut(values[0][0], width) if len(values) == 1 else 'differs'}"
            for name, values in self.facts[:few]
        ]
        more = len(self.facts) - few
        return "; ".join(parts) + (f"; {more} more" if more > 0 else "")


def by_suite(rep: Report) -> list[SuiteFacts]:
    """Per suite (in the order the grid shows them), its facts in words, each value with its cells."""
    return rep.memo("facts by suite", lambda: _by_suite(rep))


def _by_suite(rep: Report) -> list[SuiteFacts]:
    cells = [gc for gc in rep.ordered() if gc.facts]
    out = []
    for suite in dict.fromkeys(gc.suite for gc in cells):
        mine = [gc for gc in cells if gc.suite == suite]
        facts: dict[str, dict[str, list[GridCell]]] = {}
        for gc in mine:
            for key, value in gc.facts.items():
                if key not in HIDDEN:
                    facts.setdefault(_name(suite, key), {}).setdefault(in_words(value), []).append(gc)
        out.append(SuiteFacts(suite, mine, [(k, list(v.items())) for k, v in facts.items()]))
    return out
