"""Circuit breaker on engines: a failed dispatch marks the engine suspect in Redis at once.

The mark lives in the engine's own status hash (one key, one slot), so every scheduler
sees it in the HGETALL it already does and skips the engine until ``suspect_until``.
Repeated failures double the cool-down (up to ``cap``); once it lapses the engine is
routable again and the next request is the half-open probe: a success leaves it be, a
failure marks it again for twice as long. Strikes older than ``decay`` are forgotten.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncLuaScript, AsyncRedis
from kvpush.common.wire import now_ms

logger = logging.getLogger(__name__)

_MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now, base, cap, decay = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
    tonumber(ARGV[4])
local last = tonumber(redis.call('HGET', KEYS[1], 'suspect_at') or '0') or 0
local strikes = tonumber(redis.call('HGET', KEYS[1], 'suspect_strikes') or '0') or 0
if now - last > decay then strikes = 0 end
strikes = strikes + 1
local cool = math.min(base * 2 ^ (strikes - 1), cap)
redis.call('HSET', KEYS[1], 'suspect_at', now, 'suspect_strikes', strikes,
           'suspect_until', now + cool)
return cool
"""


class EngineBreaker:
    """Marks engines suspect after a failed dispatch (the gateway's side of the breaker)."""

    def __init__(self, client: AsyncRedis, keys: RedisKeys, *, base_ms: int = 2_000,
                 cap_ms: int = 30_000, decay_ms: int = 60_000) -> None:
        self.keys = keys
        self.base_ms, self.cap_ms, self.decay_ms = base_ms, cap_ms, decay_ms
        self._script = AsyncLuaScript(client, _MARK)

    async def mark_suspect(self, engine_id: str, why: str) -> int:
        """Keep schedulers off ``engine_id`` for a cool-down; returns it in ms (0: the
        engine is not registered, or Redis could not be reached)."""
        try:
            cool = int(await self._script(keys=[self.keys.engine(engine_id)], args=[
                now_ms(), self.base_ms, self.cap_ms, self.decay_ms]))
        except (RedisError, OSError) as exc:
            logger.warning("cannot mark engine %s suspect: %s", engine_id, exc)
            return 0
        if cool:
            logger.warning("engine %s suspect for %d ms: %s", engine_id, cool, why)
        return cool
