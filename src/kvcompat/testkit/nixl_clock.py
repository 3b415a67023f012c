"""The clock NixlConnector's timers read, moved forward by a test instead of waited out.

Nixl's send leases, heartbeats, ``engine_ttl`` and the re-handshake backoff of a broken peer are wall-clock
timers: its modules call ``time.perf_counter()`` / ``time.monotonic()`` through their own ``import time``.
A contract about them would otherwise sleep for seconds, idle, and race a loaded machine.  Like
``fake_nixl`` for the transport, this replaces only the clock those modules see: ``ShiftedTime`` is the
``time`` module with its clocks ahead by an offset the test advances; ``sleep`` and everything else are the
real ones, and the release's own timer logic runs unchanged.  Patched per test (``monkeypatch``), so no
other test and no other module sees it.
"""

from __future__ import annotations

import sys
import time as _time
from typing import Any

# NixlConnector's modules: the package from 0.20 (base_*/pull_* from 0.24), the single file before.
NIXL_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector",
)


class ShiftedTime:
    """``time`` with perf_counter, monotonic and time ``offset`` seconds ahead."""

    def __init__(self) -> None:
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the release's timers (now, without waiting)."""
        if seconds > 0:
            self.offset += seconds

    def advance_to(self, when: float) -> None:
        """Let time pass until this clock's perf_counter reads ``when``."""
        self.advance(when - self.perf_counter())

    def perf_counter(self) -> float:
        return _time.perf_counter() + self.offset

    def monotonic(self) -> float:
        return _time.monotonic() + self.offset

    def time(self) -> float:
        return _time.time() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def install(monkeypatch: Any) -> ShiftedTime:
    """A ShiftedTime as the ``time`` of every NixlConnector module imported now; returns it."""
    clock = ShiftedTime()
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith(NIXL_MODULES) and getattr(module, "time", None) is _time:
            monkeypatch.setattr(module, "time", clock)
            patched += 1
    if not patched:
        raise RuntimeError("no NixlConnector module with `import time` is loaded: build the engines first")
    return clock
