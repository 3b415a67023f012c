"""A worker rank's place in its tensor-parallel group, as the release reads it.

Every rank of an engine lives in this one process, whose real process group has one member
(``tests/connectors/conftest.py``'s ``single_rank_distributed``).  A TP rank reads its rank and the
group's size through ``vllm.distributed.parallel_state.get_tp_group()`` (``get_tensor_model_parallel_rank``
and ``get_tensor_model_parallel_world_size`` are ``get_tp_group().rank_in_group`` / ``.world_size`` in every
release); the Nixl worker reads them once, when it is built (``nixl/base_worker.py`` 0.34.0 L847-848).
While a rank is built or runs, :func:`tp_rank` puts a view of the real group in its place that answers
that rank's ``rank_in_group`` and the engine's TP size; everything else goes to the real group.  Nothing
of vLLM's is changed: a rank is told who it is, as its own worker process would be.

How many KV heads a rank holds, and which, is the release's rule for attention layers
(``model_executor/layers/linear.py`` ``QKVParallelLinear``): ``total // tp`` each when the heads divide
among the ranks, else one head each, replicated on ``tp // total`` consecutive ranks.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any


class _RankView:
    """The real TP group coordinator, answering as rank ``rank`` of ``world_size``."""

    def __init__(self, real: Any, rank: int, world_size: int) -> None:
        self._real = real
        self.rank_in_group = rank
        self.world_size = world_size

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def tp_rank(rank: int, world_size: int) -> Iterator[None]:
    """While inside, this process is TP rank ``rank`` of ``world_size`` to the release's code.

    With one rank nothing changes (the real group is already rank 0 of 1)."""
    if world_size == 1:
        yield
        return
    ps = importlib.import_module("vllm.distributed.parallel_state")
    real = ps._TP
    assert real is not None, "the TP group is not initialised (single_rank_distributed)"
    ps._TP = _RankView(real, rank, world_size)
    try:
        yield
    finally:
        ps._TP = real


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first global KV head, number of KV heads) that TP rank ``rank`` of ``tp_size`` holds."""
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return rank * per_rank, per_rank
    replicas = tp_size // total_kv_heads
    return rank // replicas, 1
