"""pytest plugin for vLLM's own connector tests (the upstream suite): run them on CpuPlatform.

Loaded with ``-p kvcompat.testkit.cpu_platform_plugin``; it selects vLLM's
CpuPlatform before upstream's conftest imports vLLM, and stops the run (usage
error) if it cannot, so a platform problem never reads as a test verdict.
"""

from __future__ import annotations

import pytest

from kvcompat.testkit.adapter.platform import select_cpu_platform

_how: str | None = None


def pytest_load_initial_conftests(early_config, parser, args) -> None:  # noqa: ARG001 - pytest's hook signature
    global _how
    try:
        _how = select_cpu_platform()
    except Exception as exc:  # noqa: BLE001 - any failure here must stop the run, visibly
        raise pytest.UsageError(f"kvcompat: cannot select CpuPlatform: {type(exc).__name__}: {exc}") from exc


def pytest_report_header(config) -> str | None:  # noqa: ARG001
    return f"kvcompat upstream platform: CpuPlatform via {_how}" if _how else None
