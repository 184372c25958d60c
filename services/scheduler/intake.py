"""What the scheduler reads from Redis, checked before it is believed: stream entries, counters.

Anyone who can write to the request stream or an engine's keys can put anything there. A
malformed entry is dead-lettered with its reason, a malformed counter reads as unusable,
and the scheduler keeps serving; nothing read from Redis may end its loop.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import ResponseError

from kvpush.common.keys import InvalidKeyPart, RedisKeys
from kvpush.common.prefix_hashes import MAX_HASHES, valid_hashes
from kvpush.common.redis_client import AsyncRedis
from kvpush.common.wire import ScheduleRequest, WireError, decode

logger = logging.getLogger(__name__)

# prompt_tokens and max_tokens above this describe no model's context window: garbage.
MAX_TOKENS = 1 << 24
# A deadline further ahead than this is garbage (no client waits a day for a first token).
MAX_DEADLINE_AHEAD_MS = 24 * 3600 * 1000
# exclude_engines / avoid_engines name engines a request failed on: a handful at most.
MAX_ENGINE_LIST = 256
# A W3C traceparent is 55 characters; anything much longer is dropped (the request is kept).
MAX_TRACEPARENT = 512
# Dead letters keep the entry for replay, but not a huge field copied in full.
MAX_DEAD_FIELD = 64 * 1024
MAX_DEAD_FIELDS = 32


class BadEntry(ValueError):
    """A request stream entry that no gateway would write: dead-lettered with this reason."""


def parse_entry(fields: dict[bytes, bytes], keys: RedisKeys,
                now: int) -> tuple[ScheduleRequest, bytes]:
    """The request and traceparent of one stream entry; raises :class:`BadEntry`.

    A deadline already past is not an error here: the request is answered "deadline" so its
    gateway stops waiting.
    """
    data = fields.get(b"m")
    if data is None:
        raise BadEntry("entry has no 'm' field")
    try:
        req = decode(data, ScheduleRequest)
    except WireError as exc:
        raise BadEntry(str(exc)) from None
    try:
        keys.assignments(req.gateway_id)
        keys.request_once(req.request_id)
        keys.tenant(req.tenant)
        if req.colocate_on is not None:
            keys.engine(req.colocate_on)
    except InvalidKeyPart as exc:
        raise BadEntry(str(exc)) from None
    if req.prompt_tokens < 0 or req.max_tokens < 0:
        raise BadEntry("negative prompt_tokens or max_tokens")
    if req.prompt_tokens > MAX_TOKENS or req.max_tokens > MAX_TOKENS:
        raise BadEntry(f"prompt_tokens or max_tokens above {MAX_TOKENS}")
    if req.deadline_ms > now + MAX_DEADLINE_AHEAD_MS:
        raise BadEntry(f"deadline_ms {req.deadline_ms} is more than a day ahead")
    if len(req.exclude_engines) > MAX_ENGINE_LIST or len(req.avoid_engines) > MAX_ENGINE_LIST:
        raise BadEntry(f"exclude_engines or avoid_engines longer than {MAX_ENGINE_LIST}")
    if req.prefix_hashes and not valid_hashes(req.prefix_hashes):
        raise BadEntry(f"prefix_hashes: more than {MAX_HASHES} or not 63-bit integers")
    tp = fields.get(b"tp", b"")
    if len(tp) > MAX_TRACEPARENT:
        logger.warning("request %s: traceparent of %d bytes dropped", req.request_id, len(tp))
        tp = b""
    return req, tp


def dead_letter_fields(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The entry's fields as a dead letter keeps them, each bounded in size and number."""
    out: dict[bytes, bytes] = {}
    for k, v in list(fields.items())[:MAX_DEAD_FIELDS]:
        name = b"f_" + k[:64]
        out[name] = v if len(v) <= MAX_DEAD_FIELD else b"<%d bytes, dropped>" % len(v)
    return out


# What warn_once() already said, so garbage read on every refresh costs one warning.
_WARNED: set[str] = set()


def warn_once(what: str, msg: str, *args: Any) -> None:
    """Log ``msg`` as a warning the first time for ``what``, at debug level after that."""
    if what in _WARNED:
        logger.debug(msg, *args)
        return
    if len(_WARNED) > 10_000:
        _WARNED.clear()
    _WARNED.add(what)
    logger.warning(msg, *args)


def counter(raw: Any, what: str = "counter") -> int:
    """A non-negative integer Redis holds for us (``#blocks``); 0 when it is garbage."""
    if raw is None or isinstance(raw, Exception):
        if raw is not None:
            warn_once(what, "cannot read %s: %s", what, raw)
        return 0
    try:
        n = int(raw)
    except ValueError:
        warn_once(what, "%s holds %r, not a number; read as 0", what, raw[:32])
        return 0
    return max(0, n)


def text(raw: Any) -> str:
    """A Redis value as text, whatever bytes someone left there."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable (ms, seq) pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def engine_ids(keys: RedisKeys, raw: list[Any]) -> list[str]:
    """Ids from the engine index that can name a key; anything else is skipped."""
    ids = []
    for x in raw:
        e = text(x)
        try:
            keys.engine(e)
        except InvalidKeyPart:
            warn_once(f"index id {e[:80]}", "engine index holds an invalid id %r: skipped",
                      e[:80])
            continue
        ids.append(e)
    return ids


async def trim_behind_groups(client: AsyncRedis, stream: str) -> int:
    """Delete the request stream's entries every consumer group is done with; returns how many.

    ``XTRIM MINID`` to the oldest entry some group still owes an answer for: its lowest
    pending entry, else the first one after its last delivered. Unlike ``MAXLEN`` this can
    never drop a request not yet answered, however long a backlog grows (a cap would lose
    exactly the requests that waited longest); what stays is bounded by the backlog itself,
    and pending entries leave it within ``scheduler_max_deliveries`` reclaims (answered or
    dead-lettered). Every group on the stream counts, not only ours.
    """
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError as exc:  # no stream yet, or not a stream: nothing to trim
        logger.debug("cannot trim %s: %s", stream, exc)
        return 0
    if not groups:
        return 0
    floor: tuple[int, int] | None = None
    for g in groups:
        last = text(g.get("last-delivered-id", "0-0"))
        ms, seq = entry_id_key(last)
        low = (ms, seq + 1)
        if int(g.get("pending", 0)):
            summary = await client.xpending(stream, text(g["name"]))
            if summary.get("min") is not None:
                low = min(low, entry_id_key(text(summary["min"])))
        floor = low if floor is None else min(floor, low)
    if floor is None or floor <= (0, 1):
        return 0
    n = int(await client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))
    if n:
        logger.debug("trimmed %d answered entries from %s", n, stream)
    return n
