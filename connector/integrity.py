"""End-to-end KV integrity: per-layer, per-block CRCs of pushed KV, computed on both sides.

Prefill checksums the prompt's blocks in its own cache once every WRITE completed; decode
checksums the blocks it received when PushDone arrives, before vLLM schedules the request.
Only the prompt's token slots count, so a partial last block compares what the push owns.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from kvpush.common.wire import KVChecksums


def sampled(rid: str, rate: float) -> bool:
    """Whether request ``rid`` is verified at ``rate`` (a pure function of the id, so a
    retried request keeps its verdict)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return zlib.crc32(rid.encode()) < rate * 2**32


def _token_dim(page: torch.Tensor, block_size: int) -> int | None:
    """The dimension of one block's page that indexes token slots (None: not found).

    The connector's block-major layout pages are [heads, tokens, ...]; other shapes are
    searched for a dimension of ``block_size`` slots."""
    if page.ndim >= 2 and page.shape[1] == block_size:
        return 1
    for dim in range(page.ndim):
        if page.shape[dim] == block_size:
            return dim
    return None


def block_crc(layer: torch.Tensor, block: int, n_tokens: int, block_size: int) -> int:
    """CRC-32 of the first ``n_tokens`` token slots of ``block`` in one layer's cache."""
    page = layer[block]
    if n_tokens < block_size:
        dim = _token_dim(page, block_size)
        if dim is not None:
            page = page.narrow(dim, 0, n_tokens)
    if page.device.type != "cpu":
        page = page.cpu()
    data = page.contiguous().view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def checksums(layers: Sequence[torch.Tensor], block_ids: Sequence[int], first_block: int,
              num_tokens: int, block_size: int) -> KVChecksums:
    """CRCs of blocks ``block_ids[first_block:]`` holding a prompt of ``num_tokens``."""
    crcs: list[list[int]] = []
    for layer in layers:
        row = []
        for i in range(first_block, len(block_ids)):
            n = min(block_size, num_tokens - i * block_size)
            row.append(block_crc(layer, block_ids[i], max(n, 0), block_size))
        crcs.append(row)
    return KVChecksums(first_block=first_block, num_tokens=num_tokens, crcs=crcs)


def first_mismatch(want: KVChecksums, got: KVChecksums) -> tuple[int, int] | None:
    """(layer, request block index) of the first differing CRC; None when all match."""
    if len(want.crcs) != len(got.crcs):
        return (min(len(want.crcs), len(got.crcs)), want.first_block)
    for layer, (a, b) in enumerate(zip(want.crcs, got.crcs, strict=True)):
        if len(a) != len(b):
            return (layer, want.first_block + min(len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return (layer, want.first_block + i)
    return None
