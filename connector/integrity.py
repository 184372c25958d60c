"""End-to-end KV integrity: per-layer, per-block CRCs of pushed KV, computed on both sides.

Prefill checksums the prompt's blocks in its own cache once every WRITE completed; decode
checksums the blocks it received when PushDone arrives, before vLLM schedules the request.
Each CRC covers exactly the bytes that hold the block's prompt tokens' K and V (or MLA
latent), located through the page geometry (``page_layout``) and read in one canonical
order, so a partial last block compares what the push owns and two engines with different
KV cache layouts compare the same logical bytes.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from kvpush.common.wire import KVChecksums
from kvpush.connector import page_layout
from kvpush.connector.page_layout import PageGeometry

# KVLayout.page values: what one block's page holds.
HEADS = "heads"  # K and V of each KV head (their places: the page geometry)
LATENT = "latent"  # [tokens][latent]: MLA, one latent per token and layer


def sampled(rid: str, rate: float) -> bool:
    """Whether request ``rid`` is verified at ``rate`` (a pure function of the id, so a
    retried request keeps its verdict)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return zlib.crc32(rid.encode()) < rate * 2**32


def _storage_bytes(layer: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(every byte of ``layer``'s storage, origin of its block 0, bytes between blocks)."""
    raw = torch.empty(0, dtype=torch.uint8, device=layer.device)
    raw.set_(layer.untyped_storage())
    size = layer.element_size()
    return raw, layer.storage_offset() * size, layer.stride(0) * size


def _crcs(raw: torch.Tensor, origins: np.ndarray, index: np.ndarray) -> list[int]:
    """CRC-32 of the bytes at ``index`` from each page origin."""
    if not len(origins):
        return []
    where = torch.from_numpy((origins[:, None] + index[None, :]).reshape(-1))
    data = raw[where.to(raw.device)].reshape(len(origins), -1)
    if data.device.type != "cpu":
        data = data.cpu()
    rows = data.numpy()
    return [zlib.crc32(memoryview(row)) for row in rows]


def block_crc(layer: torch.Tensor, block: int, n_tokens: int, geometry: PageGeometry,
              heads: tuple[int, int] | None = None) -> int:
    """CRC-32 of the K and V (or latent) bytes of the first ``n_tokens`` tokens of
    ``block`` in one layer's cache, of KV heads ``heads`` (first, count) only when given,
    read in the canonical order (``page_layout.byte_index``)."""
    raw, base, stride = _storage_bytes(layer)
    index = page_layout.byte_index(geometry, heads, (0, n_tokens))
    return _crcs(raw, np.asarray([base + block * stride], dtype=np.int64), index)[0]


def checksums(layers: Sequence[torch.Tensor], groups: Sequence[int],
              block_ids: Sequence[Sequence[int]], skips: Sequence[int], num_tokens: int,
              geometry: PageGeometry, heads: tuple[int, int] | None = None) -> KVChecksums:
    """CRCs of a prompt of ``num_tokens``: layer ``i`` (of KV cache group ``groups[i]``)
    over blocks ``block_ids[g][skips[g]:]`` of its group ``g``, each over exactly the
    bytes of its prompt tokens (a partial last block: its first tokens only), of KV heads
    ``heads`` (first, count) only when given."""
    block_size = geometry.tokens
    full = page_layout.byte_index(geometry, heads)
    crcs: list[list[int]] = []
    firsts: list[int] = []
    for layer, g in zip(layers, groups, strict=True):
        ids, first = block_ids[g], skips[g]
        raw, base, stride = _storage_bytes(layer)
        whole = [b for i, b in enumerate(ids) if i >= first
                 and num_tokens - i * block_size >= block_size]
        row = _crcs(raw, base + np.asarray(whole, dtype=np.int64) * stride, full)
        for i in range(first + len(whole), len(ids)):
            n = max(min(block_size, num_tokens - i * block_size), 0)
            index = page_layout.byte_index(geometry, heads, (0, n))
            row += _crcs(raw, np.asarray([base + ids[i] * stride], dtype=np.int64), index)
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
