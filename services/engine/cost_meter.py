"""What a prefill engine measures for the history cost model (common/history_cost.py): its
prompt throughput and its wait for pushed histories, from the cumulative series of its
/metrics, read once per heartbeat.

Throughput is the marginal rate, the slope of a request's prefill time over the tokens it
computed, fitted over recent heartbeats: a mean rate (tokens over seconds) counts each
request's fixed step cost as compute, so once histories are pushed and prefill computes
only short tails it would read as slow, and the model would go on pushing for that reason.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

_POINTS = 32  # heartbeats with finished prefills the fit looks back over
_SPREAD = 0.1  # least coefficient of variation of the points' tokens for a slope
_WAIT_WEIGHT = 0.3  # of each heartbeat's mean history wait in the running estimate


@dataclass(frozen=True, slots=True)
class Counters:
    """The cumulative series the meter reads (sums and counts since the engine started;
    ``services.engine.status.read_counters`` takes them from /metrics)."""

    prefill_requests: float = 0.0
    prefill_tokens: float = 0.0
    prefill_s: float = 0.0
    history_receives: float = 0.0
    history_wait_s: float = 0.0


class CostMeter:
    """Turns successive :class:`Counters` into ``prefill_tok_s`` and ``history_wait_ms``."""

    def __init__(self) -> None:
        self._last: Counters | None = None
        self._points: deque[tuple[float, float]] = deque(maxlen=_POINTS)  # (tokens, s)
        self._wait_ms = 0.0

    def feed(self, c: Counters) -> None:
        """Take one heartbeat's counters (a counter that went back means a restart)."""
        last, self._last = self._last, c
        if last is None:
            return
        n = c.prefill_requests - last.prefill_requests
        tokens = c.prefill_tokens - last.prefill_tokens
        seconds = c.prefill_s - last.prefill_s
        if n < 0 or tokens < 0 or seconds < 0:
            self._points.clear()  # restarted: its new history starts now
        elif n > 0 and seconds > 0:
            self._points.append((tokens / n, seconds / n))
        k = c.history_receives - last.history_receives
        waited = c.history_wait_s - last.history_wait_s
        if k > 0 and waited >= 0:
            mean_ms = waited / k * 1000
            self._wait_ms = mean_ms if self._wait_ms <= 0 else \
                (1 - _WAIT_WEIGHT) * self._wait_ms + _WAIT_WEIGHT * mean_ms

    @property
    def prefill_tok_s(self) -> int:
        """Marginal prompt tokens per second of a request's prefill (0: not measured)."""
        pts = list(self._points)
        tokens = sum(t for t, _ in pts)
        seconds = sum(s for _, s in pts)
        if tokens <= 0 or seconds <= 0:
            return 0
        mean_rate = tokens / seconds
        xs = [t for t, _ in pts]
        if len(pts) >= 3 and statistics.pstdev(xs) > _SPREAD * statistics.fmean(xs):
            try:
                slope, intercept = statistics.linear_regression(xs, [s for _, s in pts])
            except statistics.StatisticsError:  # the heartbeat thread must not die of it
                slope = intercept = 0.0
            if slope > 0 and intercept >= 0:
                return round(1 / slope)
        # Too little spread for a slope: the mean rate, which understates the marginal one.
        return round(mean_rate)

    @property
    def history_wait_ms(self) -> int:
        """Recent mean wait of a pushed history, in ms (0: none measured)."""
        return round(self._wait_ms)
