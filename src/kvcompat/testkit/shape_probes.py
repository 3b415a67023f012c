"""Whether the installed release can have a deployment shape at all: explicit probes, the only source
of a shape's not-applicable (kvcompat.shapes names the shapes).

A shape is not applicable only where its scenario cannot arise in the release: the model kind or the
connector path does not exist there (probed in the installed distribution and its classes, never by a
construction that raised).  Where a user can ask for the shape and the release refuses it, the test is
``unsupported``; where it serves it wrongly, it fails.
"""

from __future__ import annotations

from kvcompat.shapes import Shape


def missing(shape: Shape) -> str | None:
    """Why this release cannot have ``shape`` (the test is then not applicable), else None."""
    return _PROBES.get(shape.family, _always)(shape)


def _always(shape: Shape) -> str | None:
    return None


# Heterogeneous TP needs nothing a release with NixlConnector lacks: a user can always deploy P and D with
# different TP sizes; a release that cannot serve them refuses (unsupported) or breaks (fails).
_PROBES = {"dense": _always, "hetero-tp": _always}
