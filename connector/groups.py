"""KV cache groups: which blocks of each group one push carries (pure, unit-tested).

A model with only full attention has one group. A hybrid model (Gemma 2/3, gpt-oss) has a
full-attention group and a sliding-window group whose layers share one KV tensor; vLLM
lists the blocks of each group separately and puts its null block where a sliding group
no longer holds a block. A sliding group needs only the blocks inside the window of the
tokens decode computes, so a push skips the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# vLLM's BlockPool keeps block 0 as the null block: it stands in for blocks a request does
# not hold (out of a sliding window) and is never a request's own block.
NULL_BLOCK = 0


class GroupMismatch(ValueError):
    """Block ids that do not match the engine's KV cache groups."""


def window_start_block(num_tokens: int, window: int, block_size: int) -> int:
    """First block a sliding window of ``window`` tokens needs for a prompt of
    ``num_tokens``: decode recomputes the last prompt token (position ``n - 1``), which
    attends to positions ``n - window`` onwards; 0 for full attention (``window`` 0)."""
    if window <= 0 or num_tokens <= window:
        return 0
    return (num_tokens - window) // block_size


def push_skips(num_tokens: int, prefix_blocks: int, windows: Sequence[int],
               block_size: int) -> list[int]:
    """Per group, the leading prompt blocks a push leaves out: decode's own prefix hit
    (``prefix_blocks``) and, for a sliding group, the blocks before its window."""
    return [max(prefix_blocks, window_start_block(num_tokens, w, block_size))
            for w in windows]


def region_groups(layer_names: Sequence[str], group_of: Mapping[str, int]) -> list[int]:
    """The KV cache group of each layer, in ``layer_names`` order (0 when not named)."""
    return [group_of.get(name, 0) for name in layer_names]


def as_groups(block_ids: Sequence[Sequence[int]] | Sequence[int], num_groups: int
              ) -> list[list[int]]:
    """vLLM's block ids as one list per group; a flat list is group 0 of a one-group
    model. Raises :class:`GroupMismatch` when the group count is wrong."""
    if block_ids and not isinstance(block_ids[0], (list, tuple)):
        flat = [int(b) for b in block_ids]  # type: ignore[arg-type]
        out = [flat]
    else:
        out = [list(g) for g in block_ids]  # type: ignore[arg-type]
    if not out:
        out = [[] for _ in range(num_groups)]
    if len(out) != num_groups:
        raise GroupMismatch(f"{len(out)} block lists for {num_groups} KV cache groups")
    return out
