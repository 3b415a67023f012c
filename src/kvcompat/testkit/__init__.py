"""The in-cell world: what the connector suite imports inside a cell, next to vLLM.

Nothing here runs in the nox process.  Modules import vLLM lazily (inside
functions), and from the harness only the shared vocabulary
(:mod:`kvcompat.outcomes`, :mod:`kvcompat.atomic`), which is stdlib only.

* adapter              version-adaptive construction of vLLM's objects
* probes               what the installed distribution contains (its RECORD)
* fake_nixl            a fake NIXL agent, for cells without the library
* pytest_plugin        per-test results through pytest's hooks
* cpu_platform_plugin  runs vLLM's own tests (the upstream suite) on CpuPlatform
"""

from __future__ import annotations

from kvcompat.outcomes import NOT_APPLICABLE_PREFIX


def not_applicable(reason: str) -> None:
    """Mark the running test not-applicable to this release and stop it.

    Call this only after an explicit probe found a capability absent (see
    :mod:`kvcompat.testkit.probes`), never because an import or a call raised.
    """
    import pytest

    pytest.skip(NOT_APPLICABLE_PREFIX + reason)
