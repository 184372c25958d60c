"""Enqueue a ``ScheduleRequest`` (XADD) and await its ``Assignment``; map rejections to HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError

from kvpush.common.history_cost import HistoryChoice
from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncRedis, lost_connection, ride_out, stream_read
from kvpush.common.runtime import honour_cancellation
from kvpush.common.wire import Assignment, ScheduleRequest, WireError, decode, encode, now_ms
from kvpush.services.gateway.context import RequestCtx, span_traceparent
from kvpush.services.gateway.edge import HTTPFailure, redis_unavailable

if TYPE_CHECKING:
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

# Scheduler rejection kinds -> (HTTP status, OpenAI error type).
REJECTIONS = {
    "overloaded": (429, "rate_limit_exceeded"),
    "no_engine": (503, "service_unavailable"),
    "too_large": (400, "invalid_request_error"),
    "deadline": (504, "timeout"),
}

_HISTORY_CHOICES = frozenset(c.value for c in HistoryChoice)


def rejection(a: Assignment) -> HTTPFailure:
    """The client's error for an assignment the scheduler refused."""
    status, kind = REJECTIONS.get(a.error_kind or "", (503, "service_unavailable"))
    return HTTPFailure(status, kind, a.error or "rejected by the scheduler",
                       a.retry_after_s, metric=f"rejected_{a.error_kind}")


async def schedule(gw: Gateway, ctx: RequestCtx, request_id: str, prompt_tokens: int,
                   max_tokens: int, deadline_ms: int, exclude: list[str] | None = None,
                   prefill_on: str | None = None) -> Assignment:
    """Ask the schedulers to place ``request_id`` and wait for the answer (an engine pair
    with a decode reservation) within the deadline; an :class:`HTTPFailure` when none comes
    or the scheduler refuses. ``prefill_on`` names the prefill engine already computing
    the prompt (early_prefill.py)."""
    req = ScheduleRequest(request_id=request_id, gateway_id=gw.gateway_id, tenant=ctx.tenant,
                          prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                          deadline_ms=deadline_ms, enqueued_ms=now_ms(),
                          exclude_engines=list(exclude or ()),
                          avoid_engines=gw.avoided_engines(),
                          prefix_hashes=ctx.prefix_hashes,
                          # A placement that failed there is placed afresh.
                          colocate_on=None if exclude else ctx.colocate_on,
                          prefill_on=prefill_on)
    fut = gw.waiter.expect(request_id)
    stream = gw.keys.requests_for(request_id, gw.s.request_shards)
    try:
        with gw.tracer.start_as_current_span(
                f"send {stream}", kind=SpanKind.PRODUCER, attributes={
                    "messaging.system": "redis", "messaging.destination.name": stream,
                    "messaging.operation.type": "send", "messaging.operation.name": "XADD",
                    "kvpush.request_id": request_id, "kvpush.tenant": ctx.tenant}) as send:
            fields: dict[bytes, bytes | str] = {b"m": encode(req)}
            # The scheduler's CONSUMER span is a child of this one.
            tp = span_traceparent(send, ctx.incoming_tp)
            if tp:
                fields[b"tp"] = tp
            # Bounded like every wait: a Redis that stops answering (a silent
            # partition, no RST) must not hold the request past its deadline.
            async with asyncio.timeout((deadline_ms - now_ms()) / 1000):
                # Safe to repeat: the schedulers reserve once per request id.
                eid = await ride_out(lambda: gw.redis.xadd(stream, fields),
                                     gw.s.gateway_redis_outage_s, "enqueueing")
            send.set_attribute("messaging.message.id", eid.decode())
        sent = time.monotonic()
        async with asyncio.timeout((deadline_ms - now_ms()) / 1000):
            a = await fut
        gw.metrics.queue_wait.labels(ctx.tenant).observe(time.monotonic() - sent)
    except TimeoutError as exc:
        raise HTTPFailure(504, "timeout", "no assignment before the deadline",
                          metric="deadline") from exc
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    finally:
        gw.waiter.forget(request_id)
    if not a.ok:
        raise rejection(a)
    ctx.span.set_attributes({"kvpush.decode_engine": a.decode_engine or "",
                             "kvpush.prefill_engine": a.prefill_engine or "",
                             "kvpush.disaggregated": a.disaggregated,
                             "kvpush.cached_tokens": a.cached_tokens,
                             "kvpush.history_engine": a.history_engine or "",
                             "kvpush.history_tokens": a.history_tokens})
    m = gw.metrics
    if a.history_choice:
        # A scheduler's word: only the choices this gateway knows become a label value.
        choice = a.history_choice if a.history_choice in _HISTORY_CHOICES else "other"
        m.history_decisions.labels(choice).inc()
        ctx.span.set_attributes({"kvpush.history_choice": choice,
                                 "kvpush.history_recompute_ms": a.history_recompute_ms,
                                 "kvpush.history_wait_ms": a.history_wait_ms})
    if a.disaggregated and a.history_engine:
        m.placements.labels("history_push").inc()
        held = min(a.prefill_held_tokens, a.history_tokens)
        m.history_tokens.labels("pushed").inc(a.history_tokens - held)
        m.history_tokens.labels("held_by_prefill").inc(held)
    else:
        m.placements.labels(
            "disaggregated" if a.disaggregated
            else "decode_alone_cached" if a.cached_tokens else "decode_alone").inc()
    return a


class AssignmentWaiter:
    """Reads ``kvpush:assign:{gateway}`` with one task and resolves one future per request.

    An assignment nobody waits for any more (its request timed out, or a duplicate answer)
    goes to ``on_orphan``, which releases its reservation unless it is the one in use.
    """

    def __init__(
        self,
        client: AsyncRedis,
        keys: RedisKeys,
        gateway_id: str,
        on_orphan: Callable[[Assignment], Awaitable[None]],
    ) -> None:
        self.client = client
        self.key = keys.assignments(gateway_id)
        self.on_orphan = on_orphan
        self._waiting: dict[str, asyncio.Future[Assignment]] = {}
        # When each waiting request was registered, oldest first (insertion order).
        self._since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_id = "0-0"
        self.healthy = False

    async def start(self) -> None:
        """Start reading after the stream's current end (older answers are not ours)."""
        last = await self.client.xrevrange(self.key, "+", "-", count=1)
        self._last_id = last[0][0].decode() if last else "0-0"
        self._task = asyncio.create_task(self._run(), name="kvpush-assignments")

    async def stop(self) -> None:
        """Stop the reader; every waiter gets cancelled."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()
        self._since.clear()

    @property
    def running(self) -> bool:
        """The reader task is alive."""
        return self._task is not None and not self._task.done()

    def longest_wait_s(self) -> float:
        """How long the oldest of this gateway's requests still waiting for its assignment
        has waited (0 when none waits): a long one means the schedulers have a queue."""
        for since in self._since.values():
            return time.monotonic() - since
        return 0.0

    def expect(self, request_id: str) -> asyncio.Future[Assignment]:
        """A future for ``request_id``'s assignment; register it before enqueueing."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        self._since[request_id] = time.monotonic()
        return fut

    def forget(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` (its assignment, if any comes, is an orphan)."""
        fut = self._waiting.pop(request_id, None)
        self._since.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def _run(self) -> None:
        trimmed = 0
        while True:
            honour_cancellation()
            try:
                args, kw = stream_read(self.client, {self.key: self._last_id}, count=512,
                                       block=1000)
                reply = await self.client.execute_command(*args, **kw)
                self.healthy = True
            except Exception as exc:
                # This task is the gateway's only ear for assignments: whatever happens, it
                # must keep reading, or every request times out from here on.
                honour_cancellation()
                self.healthy = False
                if isinstance(exc, RedisError) or lost_connection(exc):
                    logger.warning("reading %s failed: %s; retrying", self.key, exc)
                else:
                    logger.exception("reading %s failed; retrying", self.key)
                await asyncio.sleep(0.5)
                continue
            if not reply:
                continue
            entries = reply[0][1]
            for eid, fields in entries:
                self._last_id = eid.decode()
                try:
                    a = decode(fields.get(b"m", b""), Assignment)
                except WireError as exc:
                    logger.error("bad assignment %s on %s: %s", self._last_id, self.key, exc)
                    continue
                fut = self._waiting.pop(a.request_id, None)
                self._since.pop(a.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(a)
                else:
                    await self.on_orphan(a)
            trimmed += len(entries)
            if trimmed >= 1000:
                # This gateway is the stream's only reader: what it has read can go.
                trimmed = 0
                with contextlib.suppress(RedisError):
                    await self.client.xtrim(self.key, minid=self._last_id, approximate=True)
