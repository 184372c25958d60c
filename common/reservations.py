"""Atomic decode-capacity reservations in Redis (Lua): reserve, release, renew, sweep, snapshot.

A reservation holds ``blocks`` KV blocks of decode engine ``E`` for one request, under a
lease, and carries a fencing token from the counter ``kvpush:fence:{E}`` (see
``next_token`` in the scripts: monotonic even across a failover). Every script touches only
keys tagged ``{E}`` (status hash, reservation hash, lease zset, fence counter), so the scripts
are Redis Cluster safe.

Layout on engine ``E``:

* ``kvpush:resv:{E}`` (hash): ``<reservation id> -> "<token>:<blocks>"``, plus bookkeeping
  fields ``#blocks`` (sum over live entries) and ``#gen`` (engine generation the entries
  belong to). ``#`` never occurs in an id (see :mod:`common.keys`), so they cannot collide.
* ``kvpush:resvexp:{E}`` (zset): reservation id scored by lease expiry, unix ms of the Redis
  server clock (``TIME``), so schedulers on hosts with skewed clocks agree on expiry.

Capacity rule (never over-commit): a reservation of ``n`` blocks is granted only if

* the engine's status hash exists (alive: heartbeat TTL) and its role is ``decode``/``both``;
* the engine is not draining (its ``draining`` field names its current generation; see
  :mod:`services.engine.drain`). Checking here, not only in the schedulers' views, means a
  scheduler whose view predates the mark cannot hand the engine new work;
* ``reserved + n <= total_blocks``, where ``reserved`` sums the unexpired reservations.
  A reservation holds the request's worst case (prompt + ``max_tokens``) for its whole life,
  so reservations alone can never ask for more blocks than the engine has;
* ``n <= free_blocks`` as last reported by the engine. This catches load the reservations
  do not know about (requests sent around the gateway). It lags by one heartbeat, which
  can only refuse a request that would fit (it waits and retries), never admit one that
  does not.

A change of the engine's ``generation`` (it restarted, its KV cache is empty) voids every
older reservation. Both keys get a ``PEXPIREAT`` just past the latest lease, so an engine
whose reservations all expired leaves nothing behind even if no sweep ever runs. The fence
counter never expires: tokens must stay monotonic for the life of the engine id (and they
would even if it were lost: the next one starts from the server clock).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import aload_script, arun_script, load_script, run_script

logger = logging.getLogger(__name__)

# Shared Lua helpers, prepended to every script.
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The next fencing token of an engine: max(last token + 1, server clock in microseconds).
-- A plain INCR is not enough with Redis's asynchronous replication: a replica promoted after
-- the primary died may have missed the last INCRs and would hand the same tokens out again,
-- so a late release or renew of an old holder could act on a new holder's reservation. The
-- clock part makes a token issued after a failover exceed every token issued before it:
-- the old primary's tokens track its clock (one per microsecond at most ahead of it), and a
-- failover takes seconds (Sentinel's down-after, Cluster's node-timeout) while clocks under
-- NTP agree to milliseconds. An epoch bumped on promotion would need a hook Redis does not
-- offer. Precision: Lua numbers are doubles, exact for integers below 2^53 (9.0e15); the
-- clock is ~1.8e15 us until the year 2255, and a counter at or past 2^53 (garbage written
-- there) is refused rather than handing out tokens that no longer grow. The value is
-- written with %d: Lua's own number-to-string conversion keeps only 14 digits.
local function next_token(fence)
  local t = redis.call('TIME')
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', fence)) or 0
  if last ~= last or last >= 9007199254740990 then
    return nil
  end
  local tok = math.max(math.floor(last) + 1, now_us)
  redis.call('SET', fence, string.format('%d', tok))
  return tok
end
local function parse(v)
  local c = string.find(v, ':', 1, true)
  return tonumber(string.sub(v, 1, c - 1)), tonumber(string.sub(v, c + 1))
end
-- Drop expired leases from the hash and the zset; returns the number purged.
local function purge(resv, leases, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  if #expired == 0 then return 0 end
  local freed = 0
  for _, r in ipairs(expired) do
    local v = redis.call('HGET', resv, r)
    if v then
      local _, b = parse(v)
      freed = freed + b
      redis.call('HDEL', resv, r)
    end
  end
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  redis.call('HINCRBY', resv, '#blocks', -freed)
  return #expired
end
-- Delete both keys once no reservation is left, else keep them alive past the last lease.
local function tidy(resv, leases)
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', resv, leases)
    return
  end
  local at = tonumber(last[2]) + 1000
  redis.call('PEXPIREAT', resv, at)
  redis.call('PEXPIREAT', leases, at)
end
"""

# KEYS: status, resv, leases, fence. ARGV: reservation id, blocks, lease ms.
# Returns {code, token, blocks, expiry_ms, reserved_after, total_blocks, generation}.
_RESERVE = (
    _PRELUDE
    + """
local rid, need, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local st = redis.call('HMGET', KEYS[1], 'role', 'total_blocks', 'free_blocks', 'generation',
                     'draining')
if not st[1] then return {-1, 0, 0, 0, 0, 0, 0} end
if st[1] ~= 'decode' and st[1] ~= 'both' then return {-2, 0, 0, 0, 0, 0, 0} end
local total = tonumber(st[2]) or 0
local free = tonumber(st[3]) or total
local gen = st[4] or '0'
local draining = st[5] == gen  -- false when the field is absent
local now = now_ms()
if redis.call('HGET', KEYS[2], '#gen') ~= gen then
  redis.call('DEL', KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[2], '#gen', gen, '#blocks', 0)
end
purge(KEYS[2], KEYS[3], now)
local reserved = tonumber(redis.call('HGET', KEYS[2], '#blocks')) or 0
local cur = redis.call('HGET', KEYS[2], rid)
if cur then
  local tok, b = parse(cur)
  local exp = tonumber(redis.call('ZSCORE', KEYS[3], rid))
  return {2, tok, b, exp, reserved, total, tonumber(gen) or 0}
end
if draining then
  tidy(KEYS[2], KEYS[3])
  return {-4, 0, 0, 0, reserved, total, tonumber(gen) or 0}
end
if need > total then
  tidy(KEYS[2], KEYS[3])
  return {-3, 0, 0, 0, reserved, total, tonumber(gen) or 0}
end
if reserved + need > total or need > free then
  tidy(KEYS[2], KEYS[3])
  return {0, 0, 0, 0, reserved, total, tonumber(gen) or 0}
end
local tok = next_token(KEYS[4])
if not tok then
  tidy(KEYS[2], KEYS[3])
  return redis.error_reply('fence counter ' .. KEYS[4] .. ' is out of range')
end
local exp = now + lease
redis.call('HSET', KEYS[2], rid, string.format('%d:%d', tok, need))
redis.call('HINCRBY', KEYS[2], '#blocks', need)
redis.call('ZADD', KEYS[3], exp, rid)
tidy(KEYS[2], KEYS[3])
return {1, tok, need, exp, reserved + need, total, tonumber(gen) or 0}
"""
)

# KEYS: resv, leases. ARGV: reservation id, token. Returns 1 released, 0 absent, -1 stale.
_RELEASE = (
    _PRELUDE
    + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local tok, b = parse(v)
if tok ~= tonumber(ARGV[2]) then return -1 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], '#blocks', -b)
tidy(KEYS[1], KEYS[2])
return 1
"""
)

# KEYS: resv, leases. ARGV: reservation id, token, lease ms.
# Returns new expiry ms, 0 absent or expired, -1 stale token.
_RENEW = (
    _PRELUDE
    + """
local now = now_ms()
purge(KEYS[1], KEYS[2], now)
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then
  tidy(KEYS[1], KEYS[2])
  return 0
end
local tok = parse(v)
if tok ~= tonumber(ARGV[2]) then return -1 end
local exp = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], 'XX', exp, ARGV[1])
tidy(KEYS[1], KEYS[2])
return exp
"""
)

# KEYS: resv, leases. Returns {purged, remaining}.
_SWEEP = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  return {0, 0}
end
local n = purge(KEYS[1], KEYS[2], now_ms())
tidy(KEYS[1], KEYS[2])
return {n, redis.call('ZCARD', KEYS[2])}
"""
)

# KEYS: status, resv, leases. Returns {total_blocks, reserved, now, rid, token, blocks,
# expiry, ...} over unexpired entries, one consistent view (for checks and tests).
_SNAPSHOT = (
    _PRELUDE
    + """
local now = now_ms()
local total = tonumber(redis.call('HGET', KEYS[1], 'total_blocks')) or -1
local out = {total, tonumber(redis.call('HGET', KEYS[2], '#blocks')) or 0, now}
local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. now, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  local v = redis.call('HGET', KEYS[2], live[i])
  if v then
    local tok, b = parse(v)
    table.insert(out, live[i])
    table.insert(out, tok)
    table.insert(out, b)
    table.insert(out, tonumber(live[i + 1]))
  end
end
return out
"""
)

_SCRIPTS = {
    "reserve": _RESERVE,
    "release": _RELEASE,
    "renew": _RENEW,
    "sweep": _SWEEP,
    "snapshot": _SNAPSHOT,
}


class ReservationError(RuntimeError):
    """A reservation call failed in a way the caller cannot act on (Redis or script)."""


class ReserveStatus(enum.IntEnum):
    """Outcome of :meth:`Reservations.reserve` (values are the Lua script's codes)."""

    RESERVED = 1
    """A new reservation was made."""
    EXISTING = 2
    """The reservation id already held a live reservation; it is returned unchanged."""
    NO_CAPACITY = 0
    """The engine is alive but has not enough unreserved blocks right now."""
    ENGINE_GONE = -1
    """The engine's status hash is gone (no heartbeat within its TTL)."""
    NOT_DECODE = -2
    """The engine is not a decode engine."""
    TOO_LARGE = -3
    """The request needs more blocks than the engine has at all; it can never fit."""
    DRAINING = -4
    """The engine is draining: it keeps what it holds (an existing reservation is still
    returned) but takes nothing new."""


class ReleaseStatus(enum.IntEnum):
    """Outcome of :meth:`Reservations.release`."""

    RELEASED = 1
    ABSENT = 0
    """Already released or expired (release is idempotent)."""
    STALE_TOKEN = -1
    """The fencing token is older than the reservation's: a newer holder owns it."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A live reservation on a decode engine."""

    engine_id: str
    reservation_id: str
    fencing_token: int
    blocks: int
    expiry_ms: int


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """What a reserve call returned, with the engine's reservation level after it."""

    status: ReserveStatus
    reservation: Reservation | None
    reserved_blocks: int
    total_blocks: int
    generation: int

    @property
    def ok(self) -> bool:
        """True when the caller holds a reservation (new or existing)."""
        return self.reservation is not None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent view of one engine's live reservations."""

    total_blocks: int  # -1 when the engine's status hash is gone
    reserved_blocks: int
    now_ms: int
    reservations: list[Reservation]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_reserve(engine_id: str, reservation_id: str, raw: list[Any]) -> ReserveResult:
    """Turn the reserve script's reply into a :class:`ReserveResult`."""
    code, token, blocks, expiry, reserved, total, gen = (int(x) for x in raw)
    status = ReserveStatus(code)
    resv = None
    if status in (ReserveStatus.RESERVED, ReserveStatus.EXISTING):
        resv = Reservation(engine_id, reservation_id, token, blocks, expiry)
    return ReserveResult(status, resv, reserved, total, gen)


def _parse_snapshot(engine_id: str, raw: list[Any]) -> Snapshot:
    total, reserved, now = int(raw[0]), int(raw[1]), int(raw[2])
    items = [
        Reservation(engine_id, _s(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]))
        for i in range(3, len(raw), 4)
    ]
    return Snapshot(total, reserved, now, items)


def queue_evalsha(pipe: Any, sha: str, keys: list[str], args: list[Any]) -> None:
    """Queue EVALSHA on a pipeline of any topology.

    redis-py's Cluster pipelines refuse the ``evalsha`` helper, yet route a raw EVALSHA by
    its keys; the scripts are loaded on every node (:func:`aload_script`).
    """
    pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)


class _Base:
    """Key layout and script texts shared by the sync and asyncio front ends."""

    def __init__(self, keys: RedisKeys | None = None) -> None:
        self.keys = keys or RedisKeys()
        self.shas: dict[str, str] = {}

    def reserve_call(
        self, engine_id: str, reservation_id: str, blocks: int, lease_ms: int
    ) -> tuple[str, list[str], list[Any]]:
        """(script name, keys, args) of a reserve, for callers that pipeline it."""
        k = self.keys
        return (
            "reserve",
            [k.engine(engine_id), k.reservations(engine_id), k.reservation_leases(engine_id),
             k.fence(engine_id)],
            [reservation_id, int(blocks), int(lease_ms)],
        )

    def _pair(self, engine_id: str) -> list[str]:
        return [self.keys.reservations(engine_id), self.keys.reservation_leases(engine_id)]

    def _snapshot_keys(self, engine_id: str) -> list[str]:
        return [self.keys.engine(engine_id), *self._pair(engine_id)]


class Reservations(_Base):
    """Reservations through a blocking ``redis.Redis`` client (threads, vLLM connector)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys | None = None) -> None:
        super().__init__(keys)
        self.client = client

    def load(self) -> None:
        """SCRIPT LOAD every script (done lazily; call it to fail fast at startup)."""
        for name, text in _SCRIPTS.items():
            self.shas[name] = load_script(self.client, text)

    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if name not in self.shas:
            self.load()
        return run_script(self.client, self.shas[name], _SCRIPTS[name], keys, args)

    def reserve(
        self, engine_id: str, reservation_id: str, blocks: int, lease_ms: int
    ) -> ReserveResult:
        """Reserve ``blocks`` on ``engine_id`` for ``lease_ms`` (idempotent per id)."""
        name, keys, args = self.reserve_call(engine_id, reservation_id, blocks, lease_ms)
        return parse_reserve(engine_id, reservation_id, self._call(name, keys, args))

    def release(self, engine_id: str, reservation_id: str, fencing_token: int) -> ReleaseStatus:
        """Release a reservation if ``fencing_token`` still owns it (idempotent)."""
        raw = self._call("release", self._pair(engine_id), [reservation_id, int(fencing_token)])
        return ReleaseStatus(int(raw))

    def renew(
        self, engine_id: str, reservation_id: str, fencing_token: int, lease_ms: int
    ) -> int:
        """Extend a live lease to now + ``lease_ms``; new expiry ms, 0 if gone, -1 if stale."""
        return int(
            self._call(
                "renew", self._pair(engine_id), [reservation_id, int(fencing_token), lease_ms]
            )
        )

    def sweep(self, engine_id: str) -> int:
        """Purge expired reservations on ``engine_id``; returns how many were purged."""
        return int(self._call("sweep", self._pair(engine_id), [])[0])

    def snapshot(self, engine_id: str) -> Snapshot:
        """Live reservations of ``engine_id`` in one atomic read."""
        return _parse_snapshot(
            engine_id, self._call("snapshot", self._snapshot_keys(engine_id), [])
        )

    def count(self, engine_id: str) -> int:
        """Number of live reservations on ``engine_id``."""
        return len(self.snapshot(engine_id).reservations)


class AsyncReservations(_Base):
    """Reservations through a ``redis.asyncio.Redis`` client (scheduler, gateway)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys | None = None) -> None:
        super().__init__(keys)
        self.client = client

    async def load(self) -> None:
        """SCRIPT LOAD every script (done lazily; call it to fail fast at startup). On a
        cluster it reaches every node, so it also repairs a promoted replica."""
        for name, text in _SCRIPTS.items():
            self.shas[name] = await aload_script(self.client, text)

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if name not in self.shas:
            await self.load()
        return await arun_script(self.client, self.shas[name], _SCRIPTS[name], keys, args)

    def queue_reserve(
        self, pipe: Any, engine_id: str, reservation_id: str, blocks: int, lease_ms: int
    ) -> None:
        """Queue a reserve on a pipeline (scripts must be loaded: call :meth:`load` first).

        Parse its reply with :func:`parse_reserve`. A ``NoScriptError`` in the reply means
        Redis lost its scripts: :meth:`load` again and retry (reserve is idempotent).
        """
        name, keys, args = self.reserve_call(engine_id, reservation_id, blocks, lease_ms)
        queue_evalsha(pipe, self.shas[name], keys, args)

    async def reserve(
        self, engine_id: str, reservation_id: str, blocks: int, lease_ms: int
    ) -> ReserveResult:
        """Reserve ``blocks`` on ``engine_id`` for ``lease_ms`` (idempotent per id)."""
        name, keys, args = self.reserve_call(engine_id, reservation_id, blocks, lease_ms)
        return parse_reserve(engine_id, reservation_id, await self._call(name, keys, args))

    async def release(
        self, engine_id: str, reservation_id: str, fencing_token: int
    ) -> ReleaseStatus:
        """Release a reservation if ``fencing_token`` still owns it (idempotent)."""
        raw = await self._call(
            "release", self._pair(engine_id), [reservation_id, int(fencing_token)]
        )
        return ReleaseStatus(int(raw))

    async def renew(
        self, engine_id: str, reservation_id: str, fencing_token: int, lease_ms: int
    ) -> int:
        """Extend a live lease to now + ``lease_ms``; new expiry ms, 0 if gone, -1 if stale."""
        return int(
            await self._call(
                "renew", self._pair(engine_id), [reservation_id, int(fencing_token), lease_ms]
            )
        )

    async def sweep(self, engine_id: str) -> int:
        """Purge expired reservations on ``engine_id``; returns how many were purged."""
        return int((await self._call("sweep", self._pair(engine_id), []))[0])

    async def snapshot(self, engine_id: str) -> Snapshot:
        """Live reservations of ``engine_id`` in one atomic read."""
        return _parse_snapshot(
            engine_id, await self._call("snapshot", self._snapshot_keys(engine_id), [])
        )

    async def count(self, engine_id: str) -> int:
        """Number of live reservations on ``engine_id``."""
        return len((await self.snapshot(engine_id)).reservations)


def engine_of_reservation_key(keys: RedisKeys, key: str) -> str:
    """Engine id inside a ``kvpush:resv:{E}`` key name."""
    return key[len(keys.reservations_pattern()) - 1 :].strip("{}")


def live_reservations(client: redis.Redis, keys: RedisKeys | None = None) -> list[Reservation]:
    """Every live reservation on every engine (SCAN; for operators, sweeps and leak checks)."""
    res = Reservations(client, keys)
    out: list[Reservation] = []
    for key in client.scan_iter(match=res.keys.reservations_pattern(), count=1000):
        try:
            out.extend(res.snapshot(engine_of_reservation_key(res.keys, _s(key))).reservations)
        except (redis.ResponseError, ValueError) as exc:  # garbage under our prefix
            logger.warning("reservations at %s are unreadable: %s", _s(key), exc)
    return out
