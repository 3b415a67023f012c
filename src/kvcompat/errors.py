"""One contract for what the user can fix: a one-line error and an exit status, never a traceback.

Every nox session and every ``kvcompat`` subcommand runs its body under
:func:`one_line_errors`.  Raise a :class:`KvcompatError` (or a subclass) whose
message names the problem and the fix; the wrapper prints ``kvcompat: error: …``
on stderr and exits with the error's ``exit_code``.
"""

from __future__ import annotations

import contextlib
import sys


class KvcompatError(Exception):
    """Bad input, or a refusal the user can act on.  The message is one line naming the fix."""

    exit_code = 2


def report(exc: KvcompatError) -> int:
    """Print ``exc`` as the one-line error and return its exit status."""
    print(f"kvcompat: error: {exc}", file=sys.stderr)
    return exc.exit_code


@contextlib.contextmanager
def one_line_errors():
    """Turn a :class:`KvcompatError` raised inside into its one line on stderr and ``SystemExit(exit_code)``."""
    try:
        yield
    except KvcompatError as exc:
        raise SystemExit(report(exc)) from None
