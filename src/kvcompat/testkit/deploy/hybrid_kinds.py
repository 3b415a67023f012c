"""How a hybrid model's caches look to the suite: a Mamba2 layer's state blocks and a sliding-window layer's blocks.

Both answer the questions of :class:`kvcompat.testkit.adapter.forward.AttentionKind` (a block's view, what a
step writes, the bytes a prefix leaves, which blocks of a request hold content after a prompt).

A Mamba layer holds no per-token KV but one recurrent state per request, in ``mamba_cache_mode="align"``
one state per block column: column ``p`` of the request's Mamba blocks holds the state after ``(p + 1) *
block_size`` tokens, the running state sits in column ``cdiv(num_computed, block_size) - 1`` and the release's
model runner copies it forward when a step crosses a block boundary (``v1/worker/cpu/model_states/
mamba_hybrid.py`` 0.34.0 ``preprocess_state``; the GPU runner's ``mamba_utils``), and the Mamba2 kernel exports
an internal prefill checkpoint into column ``cdiv(end, block_size) - 2`` where the release's own rule says so
(``model_executor/layers/mamba/checkpoint.py`` ``compute_mamba_prefill_checkpoints``, 0.33+).  A state's
bytes are a pattern of the layer and the tokens it has consumed, like attention's; unlike attention's, a step
that continues a state derives it from the state it starts from: a step whose starting state does not hold
exactly the state of the tokens before it (a state never loaded, loaded from the wrong block, or a block the
release nulled) writes a corrupt state, as a real recurrence does.  So a decode that continues from a state a
connector failed to move, or moved wrong, ends with a state no single engine would hold.

A sliding-window layer writes like attention; after a prompt only the blocks inside the window of the next
token must hold content (the release frees and nulls the others, ``SlidingWindowManager.remove_skipped_blocks``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from kvcompat.testkit.adapter.forward import NULL_BLOCK, AttentionKind, same_bytes
from kvcompat.testkit.adapter.kv_cache import layer_tensors


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StateStep(list):
    """The tokens a state has consumed (a list, as a write's prefix), with where the step took its starting
    state from: ``source`` (a block id, None for a fresh state) holding the state after ``start`` tokens."""

    def __init__(self, tokens: list[int], source: int | None, start: int) -> None:
        super().__init__(tokens)
        self.source = source
        self.start = start


def _base(tag: str, layer: str, tokens: list[int]) -> int:
    digest = hashlib.sha256(f"{tag}|{layer}|{','.join(map(str, tokens))}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 + 1


class MambaStateKind:
    """A Mamba layer's cache in align mode (see the module docstring).

    ``checkpoint(start, end)``: the token position whose state the release's model runner exports inside a
    step computing ``[start, end)`` (0: none), by the release's own rule."""

    name = "mamba-state"

    def __init__(self, checkpoint: Callable[[int, int], int] | None = None) -> None:
        self.checkpoint = checkpoint or (lambda start, end: 0)

    @staticmethod
    def _words(cache: Any, block_id: int) -> list[Any]:
        """Block ``block_id``'s state bytes as int32 words, one view per state: the page view the release's
        allocator gives (``[num_blocks, 1, 1, state bytes]`` int8, 0.33+) or its per-state tensors (a list
        ``[conv_state, ssm_state]``, each ``[num_blocks, *shape]``, before)."""
        import torch

        return [s[block_id].reshape(-1).view(torch.int8).view(torch.int32) for s in layer_tensors(cache)]

    def block(self, cache: Any, block_id: int, block_size: int) -> Any:
        """Block ``block_id``'s state (every state of the layer), as one tensor of int32 words (a copy)."""
        import torch

        return torch.cat([w.clone() for w in self._words(cache, block_id)])

    def _pattern(self, cache: Any, base: int) -> Any:
        import torch

        n = sum(w.numel() for w in self._words(cache, NULL_BLOCK))
        return (base * 8192 + torch.arange(n, dtype=torch.float32)).view(torch.int32)

    def expected(self, cache: Any, layer: str, prefix: list[int], first_head: int, block_size: int) -> Any:
        """The state after ``prefix`` (what any engine that consumed exactly those tokens holds)."""
        return self._pattern(cache, _base("state", layer, list(prefix)))

    def writes(self, start: int, end: int, ids: list[int], block_size: int, tokens: list[int]) -> list:
        """A step computing ``[start, end)``: the running state after ``end`` tokens into column ``cdiv(end,
        bs) - 1``, started from the state in column ``(start - 1) // bs`` (none when ``start`` is 0), and the
        internal checkpoint the release exports, into column ``cdiv(end, bs) - 2``."""
        source = None
        if start > 0:
            col = (start - 1) // block_size
            source = ids[col] if col < len(ids) else NULL_BLOCK
        out = []
        cur = cdiv(end, block_size) - 1
        if cur < len(ids) and ids[cur] != NULL_BLOCK:
            out.append((ids[cur], StateStep(tokens[:end], source, start)))
        position = self.checkpoint(start, end)
        if position:
            col = cdiv(end, block_size) - 2
            if 0 <= col < len(ids) and ids[col] != NULL_BLOCK:
                out.append((ids[col], StateStep(tokens[:position], source, start)))
        return out

    def fill(self, cache: Any, block_id: int, block_size: int, layer: str, prefix: list[int], first_head: int) -> None:
        """Write the state a step leaves: the state after ``prefix`` if the step started from the state of its
        first ``start`` tokens (or from nothing), else a corrupt one derived from what it started from."""
        tokens = list(prefix)
        source = getattr(prefix, "source", None)
        start = getattr(prefix, "start", 0)
        base = _base("state", layer, tokens)
        if start > 0:
            held = self.block(cache, NULL_BLOCK if source is None else source, block_size)
            if not same_bytes(held, self.expected(cache, layer, tokens[:start], first_head, block_size)):
                digest = hashlib.sha256(held.numpy().tobytes()).hexdigest()
                base = _base("corrupt:" + digest, layer, tokens)
        words = self._pattern(cache, base)
        offset = 0
        for w in self._words(cache, block_id):
            w.copy_(words[offset : offset + w.numel()])
            offset += w.numel()

    def held(self, ids: list[int], prompt: list[int], block_size: int, full: int) -> list[tuple[int, int, list[int]]]:
        """After an engine computed the whole ``prompt``: its running state, in column ``cdiv(len(prompt), bs) -
        1`` (the only state a continuing decode reads)."""
        col = cdiv(len(prompt), block_size) - 1
        return [(col, ids[col] if col < len(ids) else NULL_BLOCK, list(prompt))]


class SlidingWindowKind(AttentionKind):
    """A sliding-window attention layer: written as attention; after a prompt, the blocks that must hold
    content are those the next token attends to (the window), every one of them (a nulled one fails)."""

    name = "sliding-window"

    def __init__(self, window: int) -> None:
        self.window = window

    def held(self, ids: list[int], prompt: list[int], block_size: int, full: int) -> list[tuple[int, int, list[int]]]:
        first = max(0, len(prompt) - self.window + 1) // block_size
        return [(j, ids[j], prompt[: (j + 1) * block_size]) for j in range(first, min(full, len(ids)))]
