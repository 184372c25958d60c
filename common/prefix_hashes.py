"""Prefix hashes: the contract between the gateway, which hashes each prompt's leading token
chunks, the engines' KV-event relays, which hash the blocks an engine holds the same way,
and the schedulers, which place a request where the most of its leading chunks are held.

A chain like vLLM's block hashes: each chunk's hash covers its tokens and the hash of the
chunk before, and the first starts from the request's ``cache_salt`` ("" without one), as
an engine's prefix cache is salted. A relay can therefore continue a chain from a stored
block's parent without seeing the whole prompt again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

CHUNK_TOKENS = 64
"""Tokens per prefix hash (a multiple of every usual KV block size)."""
MAX_HASHES = 2048
"""Prefix hashes per request: the first 131,072 prompt tokens, the longest context of the
models served, so that the schedulers see all of a long conversation's history that an
engine holds (a history push moves all of it)."""
REMEMBERED_HASHES = 64
"""Prefix hashes per request the schedulers remember placements by (engines without KV
events): the first 4,096 prompt tokens, which tell prompts apart, in a memory one Redis hash
write per request keeps bounded."""
MAX_HASH = (1 << 63) - 1


def chain_seed(salt: str) -> int:
    """The hash a prompt's chain starts from, for prompts salted with ``salt``."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(),
                          "big") & MAX_HASH


def chain_next(prev: int, tokens: Sequence[int]) -> int:
    """The hash of the chunk ``tokens`` following the chunk hashed ``prev``; raises
    OverflowError for a token id outside a signed 64-bit integer."""
    h = hashlib.blake2b(prev.to_bytes(8, "big"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "big") & MAX_HASH


def prefix_hashes(ids: Sequence[int], salt: str, chunk: int = CHUNK_TOKENS,
                  limit: int = MAX_HASHES) -> list[int]:
    """One 63-bit hash per whole chunk of ``ids``, each chained to the one before."""
    h = chain_seed(salt)
    out: list[int] = []
    for start in range(0, min(len(ids) // chunk, limit) * chunk, chunk):
        h = chain_next(h, ids[start:start + chunk])
        out.append(h)
    return out


def remembered(hashes: Sequence[int]) -> Sequence[int]:
    """The leading hashes a placement is remembered by (:data:`REMEMBERED_HASHES`)."""
    return hashes[:REMEMBERED_HASHES]


def valid_hashes(hashes: Any) -> bool:
    """Whether a request's ``prefix_hashes`` (read from Redis) are usable."""
    return isinstance(hashes, list) and len(hashes) <= MAX_HASHES and all(
        isinstance(h, int) and 0 <= h <= MAX_HASH for h in hashes)
