"""``hetero-tp``: the dense model with P and D at different TP sizes (kvcompat.shapes).

Nothing to build beyond the base: each side's TP size comes from the shape, each rank's heads from the
release (``ModelConfig.get_num_kv_heads``), the ranks' places from ``make_engine``.  A user can deploy
any pair of TP sizes wherever NixlConnector exists; a release that cannot serve a pair refuses it
(unsupported) or serves it wrongly (fails), so this family is never not applicable.
"""

from __future__ import annotations

from kvcompat.testkit.deploy.base import *  # noqa: F403
