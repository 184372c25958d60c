"""Prefix hashes: the contract between the gateway, which hashes each prompt's leading token
chunks, and the schedulers, which read them from the request stream to place by prefix.

Each hash covers the whole prefix up to the end of its chunk and is salted with the tenant,
as the engines' prefix caches are (``cache_salt``)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

CHUNK_TOKENS = 64
"""Tokens per prefix hash (a multiple of every usual KV block size)."""
MAX_HASHES = 64
"""Prefix hashes per request (the first 4096 prompt tokens)."""
MAX_HASH = (1 << 63) - 1


def prefix_hashes(ids: Sequence[int], salt: str, chunk: int = CHUNK_TOKENS,
                  limit: int = MAX_HASHES) -> list[int]:
    """One 63-bit hash per whole chunk of ``ids``, each covering every token before it."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    out: list[int] = []
    for start in range(0, min(len(ids) // chunk, limit) * chunk, chunk):
        h.update(array("q", ids[start:start + chunk]).tobytes())
        out.append(int.from_bytes(h.copy().digest(), "big") & MAX_HASH)
    return out


def valid_hashes(hashes: Any) -> bool:
    """Whether a request's ``prefix_hashes`` (read from Redis) are usable."""
    return isinstance(hashes, list) and len(hashes) <= MAX_HASHES and all(
        isinstance(h, int) and 0 <= h <= MAX_HASH for h in hashes)
