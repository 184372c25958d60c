"""Draining an engine: keep new work off it, wait until it holds nothing, then let it go.

The mark is the ``draining`` field of the engine's status hash (``kvpush:engine:{E}``), set
to the engine generation it applies to. The heartbeat HSETs only its own fields, so it
never overwrites the mark, and an engine that restarts publishes a new generation, which
voids a mark left behind. Schedulers skip a draining engine at their next refresh, and the
reserve script refuses it at once, so a scheduler whose view predates the mark cannot hand
it new decode work.

An engine is drained when a heartbeat published after the mark shows nothing running or
waiting, it holds no live reservation, and that stays so for ``settle_s``. A prefill engine
holds no reservations: the settle time covers requests a scheduler placed on it from a view
older than the mark that are still on their way to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import Reservations

logger = logging.getLogger(__name__)

# Mark only a registered engine, with the generation it runs now. Returns that generation,
# or false when the engine has no status hash.
_MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local gen = redis.call('HGET', KEYS[1], 'generation') or '0'
redis.call('HSET', KEYS[1], 'draining', gen)
return gen
"""

# Activity counters above this are garbage, not load.
_MAX_COUNT = 1 << 31


class UnknownEngine(LookupError):
    """The engine has no status hash in Redis (never registered, stopped, or expired)."""


@dataclass(frozen=True, slots=True)
class Activity:
    """What an engine holds, as its status hash and reservations say right now."""

    draining: bool
    running: int | None  # None: the field is missing or not a sane count
    waiting: int | None
    reservations: int
    updated_ms: int

    @property
    def idle(self) -> bool:
        """Nothing running, nothing waiting, no reservation (unknown counts are not idle)."""
        return self.running == 0 and self.waiting == 0 and self.reservations == 0


@dataclass(frozen=True, slots=True)
class DrainResult:
    """How a wait for an engine to drain ended."""

    drained: bool
    reason: str  # "idle", "gone", "timeout", "aborted" or "exited"
    waited_s: float
    last: Activity | None


def _count(raw: bytes | None, limit: int = _MAX_COUNT) -> int | None:
    try:
        n = int(raw) if raw is not None else None
    except ValueError:
        return None
    return n if n is not None and 0 <= n < limit else None


def mark_draining(client: redis.Redis, keys: RedisKeys, engine_id: str) -> int:
    """Mark ``engine_id`` draining; returns the generation marked. Raises
    :class:`UnknownEngine` when it is not registered (or its id is not a valid one)."""
    try:
        key = keys.engine(engine_id)
    except ValueError:
        raise UnknownEngine(f"invalid engine id {engine_id!r}") from None
    gen = client.eval(_MARK, 1, key)
    if gen is None:
        raise UnknownEngine(f"unknown engine {engine_id!r}: no status in Redis")
    generation = _count(gen, 1 << 63) or 0
    logger.info("engine %s marked draining (generation %d)", engine_id, generation)
    return generation


def clear_draining(client: redis.Redis, keys: RedisKeys, engine_id: str) -> bool:
    """Remove the mark: the engine takes new work again. False when there was none."""
    try:
        key = keys.engine(engine_id)
    except ValueError:
        raise UnknownEngine(f"invalid engine id {engine_id!r}") from None
    return bool(client.hdel(key, "draining"))


def is_draining(fields: dict[bytes, bytes]) -> bool:
    """Whether a status hash carries a drain mark for the generation it publishes."""
    mark = fields.get(b"draining")
    return mark is not None and mark == fields.get(b"generation", b"0")


def read_activity(client: redis.Redis, keys: RedisKeys, engine_id: str) -> Activity | None:
    """The engine's activity, or None when its status hash is gone."""
    try:
        fields = client.hgetall(keys.engine(engine_id))
    except redis.ResponseError as exc:  # not a hash: someone wrote garbage there
        logger.warning("status of engine %s is unreadable: %s", engine_id, exc)
        return None
    if not fields:
        return None
    try:
        n = Reservations(client, keys).count(engine_id)
    except redis.ResponseError as exc:
        logger.warning("reservations of engine %s are unreadable: %s", engine_id, exc)
        n = _MAX_COUNT  # unknown: never looks idle
    return Activity(
        draining=is_draining(fields),
        running=_count(fields.get(b"running")),
        waiting=_count(fields.get(b"waiting")),
        reservations=n,
        updated_ms=_count(fields.get(b"updated_ms"), 1 << 53) or 0,
    )


def wait_drained(
    client: redis.Redis, keys: RedisKeys, engine_id: str, *, timeout_s: float,
    settle_s: float = 2.0, poll_s: float = 0.2, abort: threading.Event | None = None,
    alive: Callable[[], bool] | None = None,
) -> DrainResult:
    """Poll until the engine is drained (see the module docstring) or ``timeout_s`` passes.

    ``abort`` ends the wait early (a second signal); ``alive`` returning False too (the
    engine process died: nothing left to wait for).
    """
    start = time.monotonic()
    first = read_activity(client, keys, engine_id)
    baseline = first.updated_ms if first is not None else 0
    idle_since: float | None = None
    last = first
    while True:
        now = time.monotonic()
        act = read_activity(client, keys, engine_id)
        if act is None:
            return DrainResult(True, "gone", now - start, last)
        last = act
        fresh = act.updated_ms != baseline  # a heartbeat published after the mark
        if act.idle and fresh:
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= settle_s:
                return DrainResult(True, "idle", now - start, act)
        else:
            idle_since = None
        if alive is not None and not alive():
            return DrainResult(False, "exited", now - start, act)
        if now - start >= timeout_s:
            return DrainResult(False, "timeout", now - start, act)
        if abort is not None:
            if abort.wait(poll_s):
                return DrainResult(False, "aborted", time.monotonic() - start, act)
        else:
            time.sleep(poll_s)


def describe(engine_id: str, res: DrainResult) -> str:
    """One line saying how a drain ended."""
    a = res.last
    held = (f"running={a.running} waiting={a.waiting} reservations={a.reservations}"
            if a is not None else "no status")
    if res.reason == "idle":
        return f"engine {engine_id} drained in {res.waited_s:.1f} s: idle, no reservations"
    if res.reason == "gone":
        return f"engine {engine_id} drained in {res.waited_s:.1f} s: its status is gone"
    return f"engine {engine_id} not drained ({res.reason} after {res.waited_s:.1f} s): {held}"
