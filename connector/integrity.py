"""End-to-end KV integrity: per-layer, per-block CRCs of pushed KV, computed on both sides.

Prefill checksums the prompt's blocks in its own cache once every WRITE completed; decode
checksums the blocks it received when PushDone arrives, before vLLM schedules the request.
Each CRC covers exactly the bytes that hold the block's prompt tokens' K and V (or MLA
latent), whatever the page layout, so a partial last block compares what the push owns.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from kvpush.common.wire import KVChecksums

# KVLayout.page values: what one block's page holds.
HEADS = "heads"  # [heads][K, V][tokens][head_dim]: vLLM's CPU attention (LBHNC)
LATENT = "latent"  # [tokens][latent]: MLA, one latent per token and layer


class UnknownPage(ValueError):
    """A page layout the checksums cannot address by token."""


def sampled(rid: str, rate: float) -> bool:
    """Whether request ``rid`` is verified at ``rate`` (a pure function of the id, so a
    retried request keeps its verdict)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return zlib.crc32(rid.encode()) < rate * 2**32


def token_slots(page: torch.Tensor, n_tokens: int, block_size: int, kind: str,
                heads: tuple[int, int] | None = None) -> torch.Tensor:
    """The bytes of ``page`` (one block of one layer) that hold its first ``n_tokens``,
    of KV heads ``heads`` (first, count) only when given (a head slice under
    heterogeneous TP; an MLA latent has no heads).

    A CPU attention page is viewed as ``[heads, tokens, 2 * head_dim]`` but laid out per
    head as K of every slot, then V of every slot (``cpu_attn_reshape_and_cache``):
    narrowing the view's token dimension would cover K of the first ``2 * n`` slots and no
    V at all, so the page is re-viewed as ``[heads, 2, tokens, head_dim]`` first."""
    if kind == HEADS and heads is not None:
        page = page.narrow(0, heads[0], heads[1])
    if n_tokens >= block_size:
        return page
    if kind == LATENT:
        # vLLM's CPU MLA cache pages are [1, tokens, latent]; others [tokens, latent].
        return page.reshape(block_size, -1).narrow(0, 0, n_tokens)
    if kind == HEADS:
        heads = page.shape[0]
        return page.reshape(heads, 2, block_size, -1).narrow(2, 0, n_tokens)
    raise UnknownPage(f"no token addressing for page kind {kind!r}")


def block_crc(layer: torch.Tensor, block: int, n_tokens: int, block_size: int,
              kind: str = HEADS, heads: tuple[int, int] | None = None) -> int:
    """CRC-32 of the first ``n_tokens`` token slots of ``block`` in one layer's cache."""
    page = token_slots(layer[block], n_tokens, block_size, kind, heads)
    if page.device.type != "cpu":
        page = page.cpu()
    data = page.contiguous().view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def checksums(layers: Sequence[torch.Tensor], groups: Sequence[int],
              block_ids: Sequence[Sequence[int]], skips: Sequence[int], num_tokens: int,
              block_size: int, kind: str = HEADS, heads: tuple[int, int] | None = None
              ) -> KVChecksums:
    """CRCs of a prompt of ``num_tokens``: layer ``i`` (of KV cache group ``groups[i]``)
    over blocks ``block_ids[g][skips[g]:]`` of its group ``g``, of KV heads ``heads``
    (first, count) only when given."""
    crcs: list[list[int]] = []
    firsts: list[int] = []
    for layer, g in zip(layers, groups, strict=True):
        ids, first = block_ids[g], skips[g]
        row = []
        for i in range(first, len(ids)):
            n = min(block_size, num_tokens - i * block_size)
            row.append(block_crc(layer, ids[i], max(n, 0), block_size, kind, heads))
        crcs.append(row)
        firsts.append(first)
    return KVChecksums(first_blocks=firsts, num_tokens=num_tokens, crcs=crcs)


def first_mismatch(want: KVChecksums, got: KVChecksums) -> tuple[int, int] | None:
    """(layer, request block index) of the first differing CRC; None when all match."""
    if len(want.crcs) != len(got.crcs) or want.first_blocks != got.first_blocks:
        return (min(len(want.crcs), len(got.crcs)), min(want.first_blocks or [0]))
    for layer, (a, b) in enumerate(zip(want.crcs, got.crcs, strict=True)):
        if len(a) != len(b):
            return (layer, want.first_blocks[layer] + min(len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return (layer, want.first_blocks[layer] + i)
    return None
