"""How each deployment shape is built in a cell: one module per shape family (kvcompat.shapes).

``builder(shape)`` is the module of the shape's family (``hetero-tp`` -> :mod:`.hetero_tp`); every
family module offers what :mod:`.base` defines, overriding what its shape changes: the probe that says
whether the release can have the shape at all (:func:`missing`), the tiny model's config, the VllmConfig
(built, then configured as EngineCore leaves it), each rank's layer specs for the release's planner, how
each layer's cache looks to the suite (a layer kind: attention, a Mamba state, an MLA latent) and how
a rank allocates its caches.  The connector suite's ``make_engine`` asks the builder for each of these
in turn (tests/connectors/conftest.py).

Nothing here binds, forwards or merges anything of MultiConnector's: a builder only says what a user's
deployment of that shape is, and builds it with the release's own constructors and planner.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvcompat.shapes import Shape


def builder(shape: Shape) -> ModuleType:
    """The module that builds ``shape``'s family."""
    return importlib.import_module(f"{__name__}.{shape.family.replace('-', '_')}")


def missing(shape: Shape) -> str | None:
    """Why the installed release cannot have ``shape`` at all (its tests are then not applicable), else
    None: the family's explicit probe of the release, the only source of a shape's n/a."""
    return builder(shape).missing(shape)
