"""The verbs, one module each: what the nox sessions (noxfile.py) and the ``kvcompat`` command (cli.py) do.

Only the two front doors import these modules (tests/harness/test_layout.py checks it).  Every function takes
parsed values (see :mod:`kvcompat.options`), raises :class:`~kvcompat.errors.KvcompatError` for what the user
can fix, and returns its result; printing and exit codes belong to the front doors.
"""
