"""Prefix affinity: a request whose prompt starts like an earlier one goes where that KV is.

The gateway hashes the prompt's leading token chunks (``common/prefix_hashes.py``). The
schedulers remember in Redis which decode and prefill engine
last got each prefix hash and prefer them for a request whose longest known prefix they hold,
weighed against their load: that decode then finds those blocks in its prefix cache and asks
prefill only for the rest (``skip_blocks``), and that prefill recomputes only what its own
cache lacks.

Approximate by design, like llm-d's and NVIDIA Dynamo's approximate KV routing: an engine may
have evicted the blocks since, which costs only the hit, never correctness. The memory is one
Redis hash per ``WINDOW_S`` window (a slot of its own), read for the current and the previous
window and expiring after both, so it stays bounded; a lookup is one round trip per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush.common.keys import InvalidKeyPart, RedisKeys
from kvpush.common.prefix_hashes import remembered
from kvpush.common.wire import now_ms

WINDOW_S = 600
"""How long a placement is remembered: the current and the previous window are read."""
# A preferred engine may be this much less free (share of its blocks) than the least loaded.
DECODE_SLACK = 0.25
# A preferred prefill may have this many more prompt tokens queued than the least loaded.
PREFILL_SLACK_TOKENS = 8192


@dataclass(frozen=True)
class Affinity:
    """Where the longest known prefix of a request is: held (from the engines' KV events,
    ``held``) or, as a fallback, remembered (where it was last sent)."""

    decode: str | None
    prefill: str | None
    chunks: int  # how many leading chunks matched
    held: Mapping[str, int] = field(default_factory=dict)
    """Leading prompt chunks each engine holds, by its KV events (absent: none)."""


def leading_held(reply: object) -> int:
    """How many leading chunks an ``SMISMEMBER`` reply says are held (0 when malformed)."""
    if not isinstance(reply, list):
        return 0
    n = 0
    for x in reply:
        if x not in (1, b"1", "1", True):
            break
        n += 1
    return n


def held_affinity(held: Mapping[str, int], decoders: Sequence[str],
                  prefillers: Sequence[str]) -> Affinity | None:
    """The decode and the prefill of ``decoders`` and ``prefillers`` holding the longest
    prefix (None where none of them holds any), and what every engine of ``held`` holds
    (None when no engine holds any)."""
    dec = max(decoders, key=lambda e: held.get(e, 0), default=None)
    pre = max(prefillers, key=lambda e: held.get(e, 0), default=None)
    dec = dec if dec is not None and held.get(dec, 0) else None
    pre = pre if pre is not None and held.get(pre, 0) else None
    if not any(held.values()):
        return None
    return Affinity(dec, pre, max(held.values()), dict(held))


def _window(ms: int) -> int:
    return ms // (WINDOW_S * 1000)


def queue_lookups(pipe: Any, keys: RedisKeys, hashes: Sequence[int]) -> None:
    """Add the reads of one request's remembered prefix hashes to ``pipe`` (two
    commands)."""
    w = _window(now_ms())
    fields = [str(h) for h in reversed(remembered(hashes))]  # longest prefix first
    pipe.hmget(keys.prefix_affinity(w), fields)
    pipe.hmget(keys.prefix_affinity(w - 1), fields)


def parse_lookup(hashes: Sequence[int], current: Any, previous: Any,
                 keys: RedisKeys) -> Affinity | None:
    """The longest remembered prefix from the two replies :func:`queue_lookups` queued;
    anything malformed (another writer's garbage) reads as not remembered."""
    n = len(remembered(hashes))
    for i in range(n):
        for replies in (current, previous):
            if not isinstance(replies, list) or i >= len(replies):
                continue
            hit = _parse_value(replies[i], keys)
            if hit is not None:
                return Affinity(hit[0], hit[1], n - i)
    return None


def _parse_value(raw: Any, keys: RedisKeys) -> tuple[str, str | None] | None:
    if not isinstance(raw, bytes | str) or len(raw) > 300:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    dec, _, pre = text.partition("|")
    try:
        keys.engine(dec)
        if pre:
            keys.engine(pre)
    except InvalidKeyPart:
        return None
    return dec, pre or None


def queue_record(pipe: Any, keys: RedisKeys, hashes: Sequence[int], decode: str,
                 prefill: str | None) -> None:
    """Add remembering where these prefix hashes (their leading ones) went to ``pipe``
    (two commands)."""
    key = keys.prefix_affinity(_window(now_ms()))
    value = f"{decode}|{prefill or ''}"
    pipe.hset(key, mapping={str(h): value for h in remembered(hashes)})
    pipe.pexpire(key, 2 * WINDOW_S * 1000 + 60_000)
