"""``dense``: the suite's own shape, a dense attention model at TP 1 on both sides (kvcompat.shapes).

``make_engine`` builds it with the suite's own construction (kvcompat.testkit.adapter.kv_cache), as
every contract that is not shaped does, so a shaped contract's ``[dense]`` run is that same engine.
"""

from __future__ import annotations

from kvcompat.testkit.deploy.base import *  # noqa: F403
