"""Engine shutdowns that run beside the next tests instead of before them.

Nixl's scheduler half joins its handshake listener on shutdown, and the listener sees the stop only
when its one-second receive times out (``nixl/base_scheduler.py`` 0.34.0 L358, the same loop in
``nixl_connector.py`` before 0.23): about a second asleep after every test that builds a prefill
engine, half of a warm cell's own suite.  The release's shutdown still runs, whole and in the order
EngineCore runs it, on a thread of its own; the session waits for every one before it ends, and one
that raises or hangs is reported as an error of the test whose engines it shut down, as a teardown
error is.

A forked mutation child (``kvcompat.mutation.incell.forkrun``) exits without a session end, so there every
shutdown runs in line (``INLINE``): a mutant that breaks a shutdown is seen the same way in both runs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

INLINE = False
JOIN_TIMEOUT_S = 60.0


@dataclasses.dataclass
class _Pending:
    owner: str
    thread: threading.Thread
    errors: list[BaseException]


@dataclasses.dataclass
class ShutdownFailure:
    owner: str  # the node id of the test whose engines these were
    message: str


class DeferredShutdowns:
    """The shutdowns started and not yet waited for, in the order they were started."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def start(self, owner: str, shutdown: Callable[[], None]) -> None:
        """Run ``shutdown`` on its own thread (in line when ``INLINE``, where it raises as usual)."""
        if INLINE:
            shutdown()
            return
        errors: list[BaseException] = []

        def run() -> None:
            try:
                shutdown()
            except BaseException as exc:  # noqa: BLE001 - reported against its owner by join()
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"kvcompat-shutdown {owner}", daemon=True)
        thread.start()
        self._pending.append(_Pending(owner, thread, errors))

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> list[ShutdownFailure]:
        """Wait for every shutdown started; one failure per shutdown that raised or outlived ``timeout``."""
        failures: list[ShutdownFailure] = []
        deadline = time.monotonic() + timeout
        while self._pending:
            pending = self._pending.pop(0)
            pending.thread.join(max(0.0, deadline - time.monotonic()))
            if pending.thread.is_alive():
                failures.append(ShutdownFailure(pending.owner, f"engine shutdown still running after {timeout:.0f}s"))
            elif pending.errors:
                exc = pending.errors[0]
                failures.append(ShutdownFailure(pending.owner, f"engine shutdown raised {type(exc).__name__}: {exc}"))
        return failures


def report(config: Any, failures: list[ShutdownFailure]) -> None:
    """Each failure as a teardown error of its owner, through pytest's own report hook (so the terminal,
    the exit status and the results JSON all see it where they see any teardown error)."""
    import pytest

    for failure in failures:
        path, _, name = failure.owner.partition("::")
        report = pytest.TestReport(
            nodeid=failure.owner,
            location=(path, None, name),
            keywords={},
            outcome="failed",
            longrepr=failure.message,
            when="teardown",
        )
        config.hook.pytest_runtest_logreport(report=report)
