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

import contextlib
import traceback
from collections.abc import Iterator

from kvcompat.outcomes import BLOCKED_PREFIX, NOT_APPLICABLE_PREFIX, UNSUPPORTED_PREFIX

# What the suite learnt about how it ran this release (e.g. which worker the CPU-offload child ran):
# the pytest plugin writes it into the suite's results, the report shows it beside the verdict.
FACTS: dict[str, str] = {}


def record_fact(name: str, value: str) -> None:
    """Say how this release was run (``offload worker``, ``model runner``, ...), for the report."""
    FACTS[name] = str(value)


def not_applicable(reason: str) -> None:
    """Mark the running test not-applicable to this release and stop it.

    Call this only after an explicit probe found a capability absent (see
    :mod:`kvcompat.testkit.probes`), never because an import or a call raised.
    """
    import pytest

    pytest.skip(NOT_APPLICABLE_PREFIX + reason)


# While a user's configuration is being built (user_configuration), vLLM refusing it is the verdict
# (unsupported): a setup step inside, which another contract owns otherwise, does not claim it.
_BUILDING_USER_CONFIGURATION: list[str] = []


@contextlib.contextmanager
def user_configuration(what: str) -> Iterator[None]:
    """Build a configuration a user would deploy; vLLM refusing it makes the test ``unsupported``.

    Only an exception raised inside vLLM's own code counts as the release refusing (its
    innermost frame is in the vllm package): one raised by the adapter is ours, and stays a
    test error.  Unsupported is a red verdict, never n/a: the scenario can arise, the user
    asked for it, and the release cannot serve it.
    """
    refused = None
    _BUILDING_USER_CONFIGURATION.append(what)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised when not vLLM's
        frames = traceback.extract_tb(exc.__traceback__)
        if not (frames and "/vllm/" in frames[-1].filename.replace("\\", "/")):
            raise
        where = f"vllm/{frames[-1].filename.split('/vllm/', 1)[-1]}:{frames[-1].lineno}"
        refused = f"{what}: {type(exc).__name__}: {exc} ({where})"
    finally:
        _BUILDING_USER_CONFIGURATION.pop()
    if refused is not None:
        import pytest

        # from None: the failure carries vLLM's error in one line, not the chain it came from
        raise pytest.fail.Exception(UNSUPPORTED_PREFIX + refused, pytrace=False) from None


@contextlib.contextmanager
def setup_owned_by(contract: str) -> Iterator[None]:
    """A setup step whose contract another test owns: its failure is that test's finding, not this one's.

    Inside the block, any exception makes this test an *error blocked by* ``contract`` (the
    owning test's name), with the exception in the message.  The owner fails on its own
    contract; the timeline and the bisect step over the blocked test, so a row's first fail is
    its own.  Use it only around a step that the named test checks as its contract.
    """
    blocked = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported as blocked, with the exception
        if _BUILDING_USER_CONFIGURATION:  # vLLM refusing the user's configuration is the verdict there
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" ({frames[-1].filename.split('/site-packages/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
        blocked = f"{type(exc).__name__}: {exc}{where}"
    if blocked is not None:
        import pytest

        raise pytest.fail.Exception(f"{BLOCKED_PREFIX}{contract}\n{blocked}", pytrace=False) from None
