"""What a forward pass writes into the KV cache, deterministic from the tokens, so a moved block can be checked.

The suite runs no model.  In a step that schedules tokens, each attention layer writes the KV of the
positions it computes into the request's blocks; here a block's KV is a pattern that depends only on
the layer and the tokens up to the block's end (as a real model's KV depends on the prefix), so the
same prefix gives the same bytes in any block, on any rank.  A block that a connector loaded from
somewhere else must hold exactly :func:`expected_block` for its tokens, byte for byte.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvcompat.testkit.adapter.config import BLOCK_SIZE
from kvcompat.testkit.adapter.kv_cache import group_block_ids, head_axis, kv_cache_block

NULL_BLOCK = 0  # vLLM's null block (block pool id 0): never written


def _base(layer: str, tokens: list[int], head: int) -> int:
    digest = hashlib.sha256(f"{layer}|{head}|{','.join(map(str, tokens))}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 + 1


def fill_block(view: Any, layer: str, tokens: list[int], first_head: int = 0, block_size: int = BLOCK_SIZE) -> None:
    """Write the KV of ``tokens`` (the prefix up to this block's end) into one block's view of a layer.

    Each KV head's slice gets its own pattern, from the model's global head index (``first_head`` is
    the global index of the rank's first head), so a TP rank's slice equals the same heads of a rank
    of another TP size.  Values ``base * 8192 + i`` are exact in float32 and differ per element, so a
    copy of the wrong block or head, a shifted copy or a copy of part of one all read back differently.
    """
    import torch

    axis = head_axis(block_size)
    for h in range(view.shape[axis]):
        head = view.select(axis, h)
        base = _base(layer, tokens, first_head + h)
        head.copy_((base * 8192 + torch.arange(head.numel(), dtype=torch.float32)).view(head.shape))


def expected_block(cache: Any, layer: str, tokens: list[int], first_head: int = 0) -> Any:
    """The block a forward pass over ``tokens`` leaves in ``cache`` (a layer's KV cache tensor on a rank
    whose first KV head is ``first_head``)."""
    view = kv_cache_block(cache, NULL_BLOCK, BLOCK_SIZE).clone()
    fill_block(view, layer, tokens, first_head)
    return view


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two blocks hold the same bytes (compared as raw 32-bit words, so any bit counts)."""
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


class AttentionKind:
    """How an attention layer's KV cache looks to the suite: block ``j`` of a request holds the KV of the
    request's tokens in that block, a pattern that depends on the prefix up to the block's end (and per
    KV head, see :func:`fill_block`).  Other layer kinds (a Mamba state, an MLA latent) are defined with
    the shapes that bring them (kvcompat.testkit.deploy) and answer the same four questions."""

    name = "attention"

    def block(self, cache: Any, block_id: int, block_size: int) -> Any:
        """Block ``block_id`` of a layer's cache on a rank."""
        return kv_cache_block(cache, block_id, block_size)

    def writes(self, start: int, end: int, ids: list[int], block_size: int, tokens: list[int]) -> list:
        """What a step computing tokens ``[start, end)`` writes: (block id, the prefix its content depends on)."""
        out = []
        for j in range(start // block_size, -(-end // block_size)):
            if j < len(ids) and ids[j] != NULL_BLOCK:
                out.append((ids[j], tokens[: min(end, (j + 1) * block_size)]))
        return out

    def fill(self, cache: Any, block_id: int, block_size: int, layer: str, prefix: list[int], first_head: int) -> None:
        fill_block(kv_cache_block(cache, block_id, block_size), layer, prefix, first_head, block_size)

    def expected(self, cache: Any, layer: str, prefix: list[int], first_head: int, block_size: int) -> Any:
        view = kv_cache_block(cache, NULL_BLOCK, block_size).clone()
        fill_block(view, layer, prefix, first_head, block_size)
        return view

    def held(self, ids: list[int], prompt: list[int], block_size: int, full: int) -> list[tuple[int, int, list[int]]]:
        """The blocks of a request whose first ``full`` blocks were computed over ``prompt`` that hold
        content, as (prompt block index, block id, the prefix it depends on)."""
        return [(j, ids[j], prompt[: (j + 1) * block_size]) for j in range(min(full, len(ids)))]


ATTENTION = AttentionKind()


class Forward:
    """The KV writes of one scheduled step: for each scheduled request, the blocks it computes.

    ``kinds`` says how each layer's cache looks (:class:`AttentionKind` for every layer unless given)."""

    def __init__(
        self, scheduler: Any, scheduler_output: Any, kv_cache_config: Any, kinds: dict[str, Any] | None = None
    ) -> None:
        # (layer, block id, the prefix its content depends on, the layer's block size: engines of a pair may differ)
        self.writes: list[tuple[str, int, list[int], int]] = []
        self.kinds = kinds or {}
        group_of = {name: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for name in grp.layer_names}
        groups = kv_cache_config.kv_cache_groups
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests.get(req_id)
            if request is None or not n:
                continue
            end = request.num_computed_tokens  # schedule() has already counted this step's tokens
            start = end - n
            tokens = list(request.all_token_ids)
            block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
            for layer in group_of:
                ids = group_block_ids(block_ids, group_of[layer])
                bs = groups[group_of[layer]].kv_cache_spec.block_size
                for block_id, prefix in self.kind(layer).writes(start, end, ids, bs, tokens):
                    self.writes.append((layer, block_id, prefix, bs))

    def kind(self, layer: str) -> Any:
        return self.kinds.get(layer, ATTENTION)

    def write_kv(self, layer: str, cache: Any, first_head: int = 0) -> None:
        """What layer ``layer`` writes into its KV cache ``cache`` in this step, on a rank whose first KV
        head is ``first_head``."""
        kind = self.kind(layer)
        for name, block_id, prefix, bs in self.writes:
            if name == layer:
                kind.fill(cache, block_id, bs, layer, prefix, first_head)
