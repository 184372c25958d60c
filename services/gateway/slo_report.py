"""The latencies this gateway measured over its last window, reported into ``kvpush:slo`` for
the fleet planner (services/scheduler/planner_task.py): p90 time to first token, mean time
per output token, and requests shed.

Samples are taken once per request (at its end), never per token, and the window is
bounded however many requests pass.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from redis.exceptions import RedisError

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncRedis
from kvpush.common.runtime import sleep_unless_cancelled
from kvpush.common.wire import GatewaySlo, encode, now_ms

logger = logging.getLogger(__name__)

_MAX_SAMPLES = 4096


class SloWindow:
    """First-token and per-token latencies, and sheds, of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)
        self._shed: deque[float] = deque(maxlen=_MAX_SAMPLES)

    def request(self, ttft_s: float, itl_s: float | None) -> None:
        """One request that reached its first token, with its mean time per output token
        when it streamed more than one."""
        now = time.monotonic()
        self._ttft.append((now, ttft_s))
        if itl_s is not None:
            self._itl.append((now, itl_s))

    def shed(self) -> None:
        """One request shed at admission."""
        self._shed.append(time.monotonic())

    def report(self, gateway_id: str) -> GatewaySlo:
        """The window as the planner reads it."""
        since = time.monotonic() - self.window_s
        for q in (self._ttft, self._itl):
            while q and q[0][0] < since:
                q.popleft()
        while self._shed and self._shed[0] < since:
            self._shed.popleft()
        ttfts = sorted(v for _, v in self._ttft)
        p90 = ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)] if ttfts else 0.0
        itl = sum(v for _, v in self._itl) / len(self._itl) if self._itl else 0.0
        return GatewaySlo(gateway_id=gateway_id, updated_ms=now_ms(), window_s=self.window_s,
                          requests=len(ttfts), ttft_p90_s=min(p90, 1e6),
                          itl_mean_s=min(itl, 1e6), shed=len(self._shed))


async def publish_slo(window: SloWindow, redis: AsyncRedis, keys: RedisKeys,
                      gateway_id: str, period_s: float = 2.0) -> None:
    """Write this gateway's report every ``period_s`` until cancelled (Redis errors are
    logged and the next round tries again)."""
    failing = False
    while True:
        try:
            await redis.hset(keys.slo_reports(), gateway_id, encode(window.report(gateway_id)))
            failing = False
        except (RedisError, OSError) as exc:
            if not failing:
                logger.warning("SLO report not written: %s", exc)
            failing = True
        await sleep_unless_cancelled(period_s)
