"""Stored ``/v1/responses`` answers in Redis, per tenant, bounded in time, bytes and count.

Each tenant's responses sit in three keys of its Cluster slot (common/keys.py): a hash of
id -> compressed :class:`~kvpush.common.wire.StoredResponse`, a sorted set of ids by
expiry, and the byte count they take. Storing is one Lua script: the expired go, then the
soonest-expiring ones while the tenant would pass its bound in bytes or count. A lookup
only ever reads the caller's own tenant's keys, so another tenant's id is not found,
exactly like an id that never existed.
"""

from __future__ import annotations

import enum
import logging
import re
import zlib

import msgspec

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncLuaScript, AsyncRedis
from kvpush.common.wire import StoredResponse, WireError, decode, encode, now_ms

logger = logging.getLogger(__name__)

# What a response id may look like (vLLM makes "resp_" and 32 hex digits).
_ID = re.compile(r"^resp_[A-Za-z0-9_\-]{1,96}$")

# KEYS: items hash, expiry zset, bytes counter.
# ARGV: id, blob, now (unix ms), ttl (ms), tenant's max bytes, tenant's max count.
# Returns how many stored responses were dropped to make room (-1: the blob alone is
# over the tenant's bound).
_PUT = """
local items, expiry, total = KEYS[1], KEYS[2], KEYS[3]
local id, blob = ARGV[1], ARGV[2]
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_bytes, max_count = tonumber(ARGV[5]), tonumber(ARGV[6])
local size = string.len(blob)
if size > max_bytes then return -1 end
local function drop(old)
  local n = redis.call('HSTRLEN', items, old)
  redis.call('HDEL', items, old)
  redis.call('ZREM', expiry, old)
  if n > 0 then redis.call('DECRBY', total, n) end
end
drop(id)
for _, old in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now)) do drop(old) end
local dropped = 0
while true do
  local used = tonumber(redis.call('GET', total) or '0')
  local count = redis.call('ZCARD', expiry)
  if count == 0 or (used + size <= max_bytes and count < max_count) then break end
  drop(redis.call('ZRANGE', expiry, 0, 0)[1])
  dropped = dropped + 1
end
redis.call('HSET', items, id, blob)
redis.call('ZADD', expiry, now + ttl, id)
redis.call('INCRBY', total, size)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
return dropped
"""

# KEYS as _PUT's; ARGV: id, now (unix ms). Returns 1 if a live response was deleted.
_DELETE = """
local items, expiry, total = KEYS[1], KEYS[2], KEYS[3]
local expires = tonumber(redis.call('ZSCORE', expiry, ARGV[1]) or '0')
local n = redis.call('HSTRLEN', items, ARGV[1])
redis.call('HDEL', items, ARGV[1])
redis.call('ZREM', expiry, ARGV[1])
if n > 0 then redis.call('DECRBY', total, n) end
if expires > tonumber(ARGV[2]) and n > 0 then return 1 end
return 0
"""


class StoreResult(enum.Enum):
    """What became of a response the client asked to store."""

    STORED = "stored"
    TOO_LARGE = "too_large"  # over gateway_response_max_bytes or the tenant's bound
    FAILED = "failed"  # Redis refused or was gone


def valid_response_id(response_id: str) -> bool:
    """Whether ``response_id`` has the shape of a response id (anything else is never
    stored, so it is answered as not found without a Redis call)."""
    return bool(_ID.fullmatch(response_id))


class ResponseStore:
    """One gateway's access to its tenants' stored responses."""

    def __init__(self, r: AsyncRedis, keys: RedisKeys, ttl_s: float, tenant_max_bytes: int,
                 tenant_max_count: int, max_bytes: int) -> None:
        self.r, self.keys = r, keys
        self.ttl_ms = int(ttl_s * 1000)
        self.tenant_max_bytes, self.tenant_max_count = tenant_max_bytes, tenant_max_count
        self.max_bytes = max_bytes  # one response's conversation, uncompressed
        self._put = AsyncLuaScript(r, _PUT)
        self._delete = AsyncLuaScript(r, _DELETE)

    @property
    def enabled(self) -> bool:
        """Whether responses are stored at all (a TTL of 0 turns storing off)."""
        return self.ttl_ms > 0

    def _keys(self, tenant: str) -> list[str]:
        k = self.keys
        return [k.tenant_responses(tenant), k.tenant_response_expiry(tenant),
                k.tenant_response_bytes(tenant)]

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s live response ``response_id``; None when it has none by that id
        (never stored, expired, deleted, dropped for room, or another tenant's)."""
        if not self.enabled or not valid_response_id(response_id):
            return None
        items, expiry, _ = self._keys(tenant)
        async with self.r.pipeline(transaction=False) as p:
            p.hget(items, response_id)
            p.zscore(expiry, response_id)
            blob, until = await p.execute()
        if blob is None or until is None or until <= now_ms():
            return None
        try:
            # Bounded: a corrupt or hostile blob cannot inflate past what is ever stored.
            inflate = zlib.decompressobj()
            raw = inflate.decompress(blob, self.max_bytes + 1)
            if inflate.unconsumed_tail or not inflate.eof:
                raise WireError("stored response inflates past its bound")
            return decode(raw, StoredResponse, max_bytes=self.max_bytes)
        except (zlib.error, WireError) as exc:
            # Written only by gateways, so this is corruption or a schema from another
            # release: the response is as good as gone.
            logger.warning("stored response %s of tenant %s is unreadable: %s",
                           response_id, tenant, exc)
            return None

    async def put(self, tenant: str, stored: StoredResponse) -> StoreResult:
        """Keep ``stored`` for ``tenant`` (the caller checked it is worth keeping)."""
        raw = encode(stored)
        if len(raw) > self.max_bytes:
            return StoreResult.TOO_LARGE
        blob = zlib.compress(raw, 1)
        dropped = await self._put(self._keys(tenant), [
            stored.id, blob, now_ms(), self.ttl_ms, self.tenant_max_bytes,
            self.tenant_max_count])
        if dropped == -1:
            return StoreResult.TOO_LARGE
        if dropped:
            logger.info("tenant %s is at its bound of stored responses: %d dropped for %s",
                        tenant, dropped, stored.id)
        return StoreResult.STORED

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget ``tenant``'s response ``response_id``; False when it had none by it."""
        if not self.enabled or not valid_response_id(response_id):
            return False
        return bool(await self._delete(self._keys(tenant), [response_id, now_ms()]))


def history_bytes(history: list[object]) -> int:
    """Bytes of a conversation's items, encoded as the bound counts them."""
    return len(msgspec.msgpack.encode(history))
