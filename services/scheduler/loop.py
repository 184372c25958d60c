"""The ``Scheduler`` (its parts put together), its run loop, and ``run_scheduler``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from opentelemetry import trace
from prometheus_client import start_http_server
from redis.exceptions import ResponseError

from kvpush.common.backoff import Backoff
from kvpush.common.redis_client import lost_connection
from kvpush.common.runtime import honour_cancellation
from kvpush.common.settings import SchedulerSettings
from kvpush.common.telemetry import TRACER_NAME, init_tracing
from kvpush.services.scheduler.decide import DecidePart
from kvpush.services.scheduler.planner_task import PlannerTask

logger = logging.getLogger(__name__)


class Scheduler(DecidePart):
    """One member of the ``schedulers`` consumer group.

    Its parts: the engine view (``engines.py``), stream I/O (``streams.py``) and the
    decision (``decide.py``), over the shared state (``state.py``).
    """

    # -- lifecycle --------------------------------------------------------------------

    async def setup(self) -> None:
        """Create the group (and stream) if needed, load scripts, read the engines."""
        await self.ensure_group()
        await self.resv.load()
        await self.refresh()

    async def run(self) -> None:
        """Serve until cancelled. Entries in hand stay pending for another scheduler."""
        if self._own_tracing:
            init_tracing("kvpush-scheduler", self.s.otlp_endpoint, self.s.trace_sample_ratio,
                         scheduler_id=self.consumer)
            # Spans cost something per request: build them only when someone collects them.
            self.tracing = not isinstance(trace.get_tracer_provider(),
                                          trace.ProxyTracerProvider)
            self.tracer = trace.get_tracer(TRACER_NAME)
        await self.setup()
        logger.info(
            "scheduler %s on %s group %s (placement %s)",
            self.consumer, ", ".join(self._streams), self._group, self.policy.value,
        )
        self.ready.set()
        loop = asyncio.get_running_loop()
        refresh_s = self.s.scheduler_refresh_s
        retry_s = min(self.s.scheduler_retry_s, refresh_s)
        claim_s = max(0.05, self.s.scheduler_claim_idle_ms / 3000)
        next_refresh = loop.time() + refresh_s
        next_retry = loop.time() + retry_s
        next_claim = loop.time()
        next_sweep = loop.time() + self.s.scheduler_sweep_s
        try:
            while True:
                honour_cancellation()
                now = loop.time()
                if now >= next_claim:
                    await self.reclaim()
                    next_claim = now + claim_s
                if now >= next_sweep:
                    await self.trim()
                    await self.sweep()
                    next_sweep = now + self.s.scheduler_sweep_s
                if now >= next_refresh:
                    await self.refresh()
                    await self.drain()
                    next_refresh = now + refresh_s
                    next_retry = now + retry_s
                elif now >= next_retry:
                    if len(self.queue):
                        await self.refresh_reserved()
                        await self.drain()
                    next_retry = now + retry_s
                wake = min(next_refresh, next_claim, next_sweep)
                if len(self.queue):
                    wake = min(wake, next_retry)
                block_ms = max(1, int((wake - loop.time()) * 1000))
                entries = await self.read(block_ms)
                if entries:
                    # The answers ride with the next read (see streams.py: read()).
                    self._defer = True
                    try:
                        await self.handle_entries(entries)
                    finally:
                        self._defer = False
                    if self._unsent and loop.time() >= min(next_claim, next_sweep,
                                                           next_refresh):
                        await self._flush()  # other work is due first: answer now
        finally:
            self.ready.clear()
            await self.stop_readers()
            if self._unsent:
                # Stopping: answer what was decided (else it waits to be reclaimed).
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._flush())

    async def close(self) -> None:
        """Close the Redis client if this scheduler made it."""
        if self._own_client:
            await self.redis.aclose()


# Longest pause between attempts to get back to an unreachable Redis.
_MAX_BACKOFF_S = 2.0


def _lost_redis(exc: BaseException) -> bool:
    """Errors that mean Redis went away (or restarted empty), not a bug: retry them."""
    if lost_connection(exc):
        # First: a cluster mid-failover answers CLUSTERDOWN, a ResponseError too.
        return True
    if isinstance(exc, ResponseError):
        # A Redis that restarted without persistence lost the stream and the consumer
        # group: NOGROUP, or "UNBLOCKED the stream key no longer exists" for a blocked read.
        # WRONGTYPE: someone replaced one of our keys (the stream, the engine index) with
        # another type; back off and retry until it is repaired rather than exit.
        return str(exc).startswith(("NOGROUP", "UNBLOCKED", "WRONGTYPE"))
    return lost_connection(exc)


async def run_scheduler(settings: SchedulerSettings | None = None,
                        scheduler: Scheduler | None = None) -> None:
    """Run one scheduler until cancelled (for ``kvpush scheduler`` and ``kvpush up``).

    A lost Redis connection (reset, restart, failover) or a consumer group lost with an
    unpersisted Redis does not end it: it backs off and starts over (``setup`` recreates the
    group). Entries it had read stay pending in Redis and are reclaimed as usual.
    """
    settings = settings or SchedulerSettings()
    sched = scheduler or Scheduler(settings)
    backoff = Backoff(first=0.1, cap=_MAX_BACKOFF_S)
    planner = start_planner(sched)
    try:
        while True:
            started = time.monotonic()
            try:
                await sched.run()
                return
            except Exception as exc:
                honour_cancellation()  # a stop request redis-py turned into a timeout
                if not _lost_redis(exc):
                    raise
                if time.monotonic() - started > 10 * _MAX_BACKOFF_S:
                    backoff.reset()  # it ran fine for a while: this is a new outage
                delay = backoff.next()
                logger.warning("scheduler %s lost Redis (%s: %s); retrying in %.1f s",
                               sched.consumer, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
    finally:
        if planner is not None:
            planner.cancel()
            with contextlib.suppress(BaseException):
                await planner
        with contextlib.suppress(Exception):
            await sched.close()


def start_planner(sched: Scheduler) -> asyncio.Task[None] | None:
    """The fleet planner beside ``sched`` (when enabled), and its metrics endpoint (when
    ``scheduler_metrics_port`` is set)."""
    s = sched.s
    if not s.planner_enabled:
        return None
    task = PlannerTask(sched)
    if s.scheduler_metrics_port is not None:
        start_http_server(s.scheduler_metrics_port, registry=task.metrics.registry)
    return asyncio.create_task(task.run(), name="kvpush-planner")


def main() -> None:
    """``kvpush scheduler``: run one scheduler in this process on uvloop."""
    from kvpush.common.log import setup_logging
    from kvpush.common.runtime import freeze_startup_heap, run

    settings = SchedulerSettings()
    setup_logging(settings.log_level)
    freeze_startup_heap()  # the imports: its event loop does not pause to scan them
    with contextlib.suppress(KeyboardInterrupt):
        run(run_scheduler(settings))

