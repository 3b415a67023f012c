"""A MultiConnector child's answers, observed or scripted, in the release's own protocol.

The lifecycle contracts are MultiConnector's: what it forwards to each child, and
how it combines what the children answer.  On CPU some answers cannot come from
the real child (the CPU-offload worker needs CUDA), so a test scripts them, in
the form this release's MultiConnector asks for them.  Nothing here forwards or
combines on MultiConnector's behalf: a release that drops a child's answer, or
never asks, fails the test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvcompat.testkit import probes
from kvcompat.testkit.adapter.capabilities import V1, multi_classes


@dataclasses.dataclass
class Calls:
    """Every call a spied method received: positional arguments, and what it answered, in order."""

    args: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    returned: list[Any] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.args)


def spy(monkeypatch: Any, obj: Any, name: str, answer: Callable[..., Any] | None = None) -> Calls:
    """Record calls of ``obj.name``; answer with the real method, or with ``answer(*args)``."""
    real = getattr(obj, name)
    calls = Calls()

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.args.append(args)
        calls.returned.append((answer or real)(*args, **kwargs))
        return calls.returned[-1]

    monkeypatch.setattr(obj, name, recorded)
    return calls


def completion_hook() -> str:
    """The method MultiConnector's worker side asks each child for completions.

    get_transfer_results (with failed receives) from 0.30-ish, get_finished before.
    """
    MultiConnector, _ = multi_classes()
    return "get_transfer_results" if "get_transfer_results" in vars(MultiConnector) else "get_finished"


def _completions(hook: str, sending: set[str], recving: set[str]) -> Any:
    """(finished_sending, finished_recving) in the shape this release's completion hook returns."""
    if hook == "get_transfer_results":
        import importlib

        results = importlib.import_module(V1 + ".base").KVConnectorTransferResults
        return results(finished_sending=set(sending), finished_recving=set(recving))
    return (set(sending) or None, set(recving) or None)


def script_completions(
    monkeypatch: Any, child: Any, rounds: list[tuple[set[str], set[str]]], *, add_to_real: bool = False
) -> Calls:
    """Make ``child`` report (finished_sending, finished_recving) per call, one round per call,
    then nothing; answered through the hook and in the shape this release asks for.  With
    ``add_to_real`` the child's own answer is kept and the round's ids are added to it (the child
    goes on reporting its real transfers)."""
    hook = completion_hook()
    real = getattr(child, hook)
    pending = list(rounds)

    def answer(*args: Any) -> Any:
        sending, recving = pending.pop(0) if pending else (set(), set())
        if add_to_real:
            own = real(*args)
            own_sending, own_recving = (
                (own.finished_sending, own.finished_recving) if hook == "get_transfer_results" else own
            )
            sending, recving = set(own_sending or ()) | sending, set(own_recving or ()) | recving
        return _completions(hook, sending, recving)

    return spy(monkeypatch, child, hook, answer)


def finished_of(multi: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
    """MultiConnector's own worker-side answer, as (finished_sending, finished_recving) sets."""
    sending, recving = multi.get_finished(set(finished_req_ids))
    return set(sending or ()), set(recving or ())


def base_class() -> type:
    import importlib

    return importlib.import_module(V1 + ".base").KVConnectorBase_V1


def multi_overrides(name: str) -> bool:
    """Whether the release's MultiConnector defines ``name`` itself (else the base class's runs)."""
    MultiConnector, _ = multi_classes()
    return name in vars(MultiConnector)


def kv_connector_stats_class() -> type | None:
    """KVConnectorStats (kv_connector/v1/metrics.py), where the installed release ships it (RECORD probe)."""
    import importlib

    if not probes.has_module(V1 + ".metrics"):
        return None
    return getattr(importlib.import_module(V1 + ".metrics"), "KVConnectorStats", None)
