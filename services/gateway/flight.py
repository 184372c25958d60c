"""One placed request: concurrent prefill and decode calls, prefill race, lease, re-route, close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from opentelemetry.trace import Span, SpanKind
from redis.exceptions import RedisError

from kvpush.common.redis_client import REDIS_CALL_ERRORS, lost_connection
from kvpush.common.runtime import sleep_unless_cancelled
from kvpush.common.wire import Assignment, KVTransferParams, now_ms
from kvpush.services.gateway.context import RequestCtx, fail_span, span_traceparent
from kvpush.services.gateway.continuation_exact import decode_body, goes_on
from kvpush.services.gateway.edge import HTTPFailure
from kvpush.services.gateway.engines import EngineFailed, SSEStats, open_stream, post_json
from kvpush.services.gateway.history import History, HolderUnreachable, holder_call, plan_history
from kvpush.services.gateway.openai_api import ParsedRequest, engine_bodies

if TYPE_CHECKING:
    from kvpush.services.gateway.early_prefill import EarlyPrefill
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

UPSTREAM_FAILED = "the model engine failed to serve the request; retry later"

PREFILL_ANSWERED = object()
"""What :meth:`Flight.race_prefill` returns when prefill answers first and it was asked to."""


class Reroute(Exception):
    """An engine failed before the client saw a token: place the request again elsewhere."""

    def __init__(self, engine: str, cause: BaseException, failure: HTTPFailure) -> None:
        super().__init__(f"engine {engine} failed before the first token: {cause}")
        self.engine = engine
        self.failure = failure  # what the client gets when no other engine can serve it


def engine_failure(gw: Gateway, exc: EngineFailed) -> HTTPFailure:
    """The client's error for a failed engine call."""
    # The detail (engine id, URL, the engine's own body) is for the log and the span;
    # the client hears only what is about its request.
    logger.warning("%s", exc)
    if exc.client_error:
        status = 413 if exc.status == 413 else 400
        return HTTPFailure(status, "invalid_request_error",
                           exc.client_message(tuple(gw.active_engine_names())),
                           metric=f"engine_{exc.role}_refused")
    return HTTPFailure(502, "bad_gateway", UPSTREAM_FAILED, metric=f"engine_{exc.role}")


def _client_span(gw: Gateway, ctx: RequestCtx, request_id: str, role: str, engine: str | None,
                 url: str) -> Span:
    return gw.tracer.start_span(
        f"kvpush.dispatch.{role}", context=ctx.otel_context, kind=SpanKind.CLIENT,
        attributes={"kvpush.request_id": request_id, "kvpush.role": role,
                    "kvpush.engine": engine or "", "url.full": url,
                    "http.request.method": "POST", "kvpush.tenant": ctx.tenant})


def prefill_call(gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest, request_id: str,
                 deadline_ms: int, engine: str, url: str, decode_engine: str | None,
                 history: History | None = None
                 ) -> tuple[Span, asyncio.Task[dict[str, Any]]]:
    """Send ``request_id``'s prompt to prefill engine ``engine`` in the background, its push
    bound for ``decode_engine`` (None: whichever decode publishes the target), its first
    tokens pushed to it by ``history``'s holder when given; its CLIENT span ends with the
    call."""
    full = f"{url}{parsed.path}"
    span = _client_span(gw, ctx, request_id, "prefill", engine, full)
    tp = span_traceparent(span, ctx.incoming_tp)
    # One definition of the params for the gateway and the connector that parses them.
    params = KVTransferParams(kvpush="prefill", request_id=request_id,
                              decode_engine=decode_engine, deadline_ms=deadline_ms,
                              traceparent=tp or None,
                              push_key=gw.push_keys.for_request(request_id),
                              **(history.prefill_fields() if history else {}))
    body, _ = engine_bodies(parsed, params.to_dict(), None)
    headers = {"X-Request-Id": request_id}
    if tp:
        headers["traceparent"] = tp
    task = asyncio.create_task(_traced_prefill(
        span, post_json(gw.http, "prefill", engine, full, body, headers)))
    return span, task


async def _traced_prefill(span: Span, call: Any) -> dict[str, Any]:
    try:
        return await call
    except EngineFailed as exc:
        if exc.status is not None:
            span.set_attribute("http.response.status_code", exc.status)
        fail_span(span, exc)
        raise
    except asyncio.CancelledError:
        # The client left, decode failed first, or the placement went elsewhere: vLLM
        # aborts the request.
        span.set_attribute("kvpush.cancelled", True)
        raise
    finally:
        span.end()


class Flight:
    """One admitted request on one placement: its assignment, engine calls, lease keeper
    and cleanup.

    ``request_id`` names this placement to the scheduler and the engines: the client's
    request id, suffixed ``-r<n>`` when the request is placed again after a failure.
    """

    def __init__(self, gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest, request_id: str,
                 deadline_ms: int, assignment: Assignment,
                 early: EarlyPrefill | None = None) -> None:
        self.gw = gw
        self.ctx = ctx
        self.p = parsed
        self.request_id = request_id
        self.deadline_ms = deadline_ms
        self.arrived = ctx.arrived
        self.a = assignment
        self.prefill_task: asyncio.Task[dict[str, Any]] | None = None
        self.history_task: asyncio.Task[None] | None = None  # the holder's leg (history.py)
        self.history: History | None = None
        # When prefill answered: its first token was sampled then (a unary answer's TTFT).
        self.prefill_answered_at: float | None = None
        self.decode_resp: aiohttp.ClientResponse | None = None
        self.decode_span: Span | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._closed = False
        self.handed_over = False  # the request went on in another flight (a migration)
        self.stats = SSEStats()
        self.status = 200
        # Decode goes on from prefill's first token (continuation_exact.py).
        self.goes_on = assignment.disaggregated and assignment.decode_continues \
            and gw.s.gateway_continue_from_prefill and goes_on(parsed)
        gw.metrics.reservations.labels(assignment.decode_engine).inc()
        if assignment.disaggregated:
            ctx.placed_on = assignment.decode_engine
        else:
            # No prefill to spare: the request's other samples are placed like it, now.
            ctx.placed_on = None
            self.kv_in()
        self.lease_ms = max(1000, assignment.lease_expiry_ms - now_ms())
        self._renew_task = asyncio.create_task(self._keep_lease(self.lease_ms))
        self.early = False  # prefill runs since admission (early_prefill.py), kept here
        if early is not None:
            if assignment.disaggregated and assignment.prefill_engine == early.engine:
                self.early = True
                gw.metrics.early_prefill.labels("kept").inc()
                self._adopt(early.task)
            else:
                early.abandon("replaced")

    @property
    def deadline_at(self) -> float:
        """The request's deadline on the loop clock."""
        return asyncio.get_running_loop().time() + (self.deadline_ms - now_ms()) / 1000

    def _headers(self, tp: str | None) -> dict[str, str]:
        h = {"X-Request-Id": self.request_id}
        if tp:
            h["traceparent"] = tp
        return h

    def dispatch(self) -> dict[str, Any]:
        """Open decode's CLIENT span and build its body with its ``kv_transfer_params``
        (docs/contracts.md), carrying that span's traceparent."""
        a = self.a
        self.ctx.dispatched = True
        dec_span = self.decode_span = _client_span(
            self.gw, self.ctx, self.request_id, "decode", a.decode_engine,
            f"{a.decode_url}{self.p.path}")
        dec_tp = span_traceparent(dec_span, self.ctx.incoming_tp)
        if not a.disaggregated:
            return engine_bodies(self.p, None, None)[1]
        dec_p = KVTransferParams(kvpush="decode", request_id=self.request_id,
                                 prefill_engine=a.prefill_engine,
                                 reservation_id=a.reservation_id,
                                 fencing_token=a.fencing_token, deadline_ms=self.deadline_ms,
                                 traceparent=dec_tp or None,
                                 push_key=self.gw.push_keys.for_request(self.request_id),
                                 continues=self.goes_on)
        body = engine_bodies(self.p, None, dec_p.to_dict())[1]
        return decode_body(body, self.p) if self.goes_on else body

    def start_prefill(self) -> None:
        """Send the prompt to the assigned prefill engine in the background (disaggregated
        assignments whose prefill is not running since admission already)."""
        a = self.a
        if not a.disaggregated or self.prefill_task is not None:
            return
        assert a.prefill_engine is not None and a.prefill_url is not None
        history = plan_history(self.gw, self.ctx, a, self.request_id)
        span, task = prefill_call(self.gw, self.ctx, self.p, self.request_id,
                                  self.deadline_ms, a.prefill_engine, a.prefill_url,
                                  a.decode_engine, history)
        if history is not None:
            self.history = history
            span.set_attributes({"kvpush.history_engine": history.engine,
                                 "kvpush.history_tokens": history.tokens})
            self.history_task = holder_call(
                self.gw, self.ctx, self.p, history, a.prefill_engine, self.deadline_ms,
                span_traceparent(span, self.ctx.incoming_tp) or None)
        self._adopt(task)

    def _adopt(self, task: asyncio.Task[dict[str, Any]]) -> None:
        self.prefill_task = task
        task.add_done_callback(self._prefill_done)

    def _prefill_done(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if not task.cancelled() and task.exception() is None:
            # The prompt is computed and its first token sampled: out of the backlog.
            self.prefill_answered_at = time.monotonic()
            self.ctx.reached_first_token()

    def kv_in(self) -> None:
        """The prompt's KV is on the decode engine (prefill answered, or decode did)."""
        if self.ctx.kv_ready is not None:
            self.ctx.kv_ready.set()

    def fail_decode(self, exc: BaseException) -> None:
        """Mark the decode CLIENT span failed (it ends when the flight closes)."""
        if self.decode_span is not None:
            if isinstance(exc, EngineFailed) and exc.status is not None:
                self.decode_span.set_attribute("http.response.status_code", exc.status)
            fail_span(self.decode_span, exc)

    def failure(self, exc: TimeoutError | EngineFailed) -> HTTPFailure | Reroute:
        """What a dispatch that failed before any token reached the client becomes: the
        HTTP error, or a :class:`Reroute` when another engine may serve the request."""
        if isinstance(exc, TimeoutError):
            self.fail_decode(exc)
            return HTTPFailure(504, "timeout", "request deadline passed", metric="deadline")
        if exc.role == "decode":
            self.fail_decode(exc)
        failure = engine_failure(self.gw, exc)
        if exc.client_error or not exc.engine:
            return failure
        # The engine is broken, not the request: keep every scheduler off it at once.
        self.gw.mark_suspect(exc.engine, str(exc))
        return Reroute(exc.engine, exc, failure)

    async def _keep_lease(self, lease_ms: int) -> None:
        # Long generations outlive one lease; renew at a third of it so a slow Redis
        # round trip never lets it lapse.
        a = self.a
        while True:
            await sleep_unless_cancelled(lease_ms / 3000)
            try:
                exp = await self.gw.resv.renew(a.decode_engine, a.reservation_id,
                                               a.fencing_token, lease_ms)
            except RedisError as exc:
                logger.warning("renewing %s failed: %s", a.reservation_id, exc)
                continue
            if exp <= 0:
                logger.warning("reservation %s on %s is gone (%s); not renewing",
                               a.reservation_id, a.decode_engine, exp)
                return

    async def decode_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """Non-streaming decode call."""
        url = f"{self.a.decode_url}{self.p.path}"
        tp = span_traceparent(self.decode_span, self.ctx.incoming_tp) \
            if self.decode_span is not None else self.ctx.incoming_tp
        return await post_json(self.gw.http, "decode", self.a.decode_engine, url, body,
                               self._headers(tp))

    async def open_decode(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """Streaming decode call, open once its headers are in."""
        url = f"{self.a.decode_url}{self.p.path}"
        tp = span_traceparent(self.decode_span, self.ctx.incoming_tp) \
            if self.decode_span is not None else self.ctx.incoming_tp
        first_byte = self.gw.s.gateway_first_byte_timeout_s
        try:
            async with asyncio.timeout(first_byte):
                self.decode_resp = await open_stream(self.gw.http, self.a.decode_engine, url,
                                                     body, self._headers(tp))
        except TimeoutError as exc:
            raise EngineFailed("decode", self.a.decode_engine,
                               f"no response headers in {first_byte:g} s") from exc
        return self.decode_resp

    async def race_prefill(self, work: asyncio.Future[Any], or_prefill: bool = False) -> Any:
        """Await ``work``; a prefill failure before it finishes fails the request at once.
        With ``or_prefill``, prefill answering first returns :data:`PREFILL_ANSWERED` and
        leaves ``work`` running."""
        try:
            return await self._race_prefill(work, or_prefill)
        except BaseException:
            # asyncio.wait does not cancel what it waits on: a deadline or a client that
            # left must not leave the decode call running.
            work.cancel()
            raise

    async def _race_prefill(self, work: asyncio.Future[Any], or_prefill: bool) -> Any:
        a, probes = self.a, self.gw.probes
        # Until the first token, an engine that stops answering fails the request (it is
        # placed again elsewhere) instead of holding it to its deadline.
        gone = {"decode": probes.watch(a.decode_engine, a.decode_url)}
        h = self.history
        if self.prefill_task is not None and not self.prefill_task.done():
            gone["prefill"] = probes.watch(a.prefill_engine, a.prefill_url)
            if h is not None:
                # Prefill waits for the holder's push: a holder that stops answering
                # will not write it, nor tell prefill so (history.py).
                gone["history"] = probes.watch(h.engine, h.url)
        try:
            while True:
                pre = self.prefill_task
                if pre is not None and pre.done():
                    if pre.exception() is not None:
                        work.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await work
                        raise pre.exception()  # type: ignore[misc]
                    if not self.p.stream:
                        # A stream says so with decode's first event, which is later but
                        # certain (relay.stream); a unary answer has nothing sooner.
                        self.kv_in()
                    if or_prefill and not work.done():
                        return PREFILL_ANSWERED
                    # The KV is in: what the prefill engine does now is no concern.
                    probes.unwatch(a.prefill_engine, gone.pop("prefill", None))
                    if h is not None:
                        probes.unwatch(h.engine, gone.pop("history", None))
                racers: set[asyncio.Future[Any]] = {work}
                racers.update(f for f in gone.values() if f is not None)
                holder = self.history_task
                if pre is not None and not pre.done():
                    racers.add(pre)
                    if holder is not None and not holder.done():
                        racers.add(holder)
                done, _ = await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    return work.result()
                if holder is not None and holder in done and not holder.cancelled() \
                        and isinstance(holder.exception(), HolderUnreachable):
                    # Prefill would wait for a history that can never come: place the
                    # request again, off the holder (history.py).
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await work
                    raise holder.exception()  # type: ignore[misc]
                for role, fut in gone.items():
                    if fut is not None and fut in done:
                        work.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await work
                        if role == "history" and h is not None:
                            raise HolderUnreachable(role, h.engine, fut.result())
                        engine = a.decode_engine if role == "decode" else a.prefill_engine
                        raise EngineFailed(role, engine, fut.result())
                # Prefill ended: on a failure the next turn raises it, else decode goes on.
        finally:
            probes.unwatch(a.decode_engine, gone["decode"])
            probes.unwatch(a.prefill_engine, gone.get("prefill"))
            if h is not None:
                probes.unwatch(h.engine, gone.get("history"))

    def close_soon(self) -> None:
        """Schedule :meth:`close` in a task of its own, safe from the caller's cancellation."""
        if not self._closed:
            self.gw.spawn(self.close())

    async def close(self) -> None:
        """Stop everything this request holds; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._renew_task is not None:
            self._renew_task.cancel()
        if self.prefill_task is not None and not self.prefill_task.done():
            # Closing the connection aborts the request inside vLLM.
            self.prefill_task.cancel()
        if self.prefill_task is not None:
            with contextlib.suppress(BaseException):
                await self.prefill_task
        if self.history_task is not None:
            # Done by now unless prefill failed or the client left: the holder's connector
            # then frees what it holds once prefill's receive ends.
            self.history_task.cancel()
            with contextlib.suppress(BaseException):
                await self.history_task
        if self.decode_resp is not None:
            # Closed, not released: a stream cut short must drop its connection, which
            # is what makes vLLM abort the request.
            self.decode_resp.close()
        if self.decode_span is not None:
            self.decode_span.end()
        self.gw.active.pop(self.request_id, None)
        a = self.a
        try:
            await self.gw.resv.release(a.decode_engine, a.reservation_id, a.fencing_token)
        except REDIS_CALL_ERRORS as exc:
            logger.warning("releasing %s failed: %s", a.reservation_id, exc)
            if lost_connection(exc):
                resv = self.gw.resv
                self.gw.release_later(
                    f"reservation {a.reservation_id}",
                    lambda: resv.release(a.decode_engine, a.reservation_id, a.fencing_token),
                    now_ms() + self.lease_ms)  # a renewed lease ends by then
        m = self.gw.metrics
        m.reservations.labels(a.decode_engine).dec()
        if self.handed_over:
            return  # the flight that took the request over reports it and finishes it
        s = self.stats
        self.ctx.completion_tokens = s.completion_tokens or s.events
        if s.first_token_at is not None:
            ttft = s.first_token_at - self.arrived
            m.ttft.labels(self.ctx.tenant).observe(ttft)
            tpot = None
            if s.last_token_at is not None and s.events > 1:
                tpot = (s.last_token_at - s.first_token_at) / (s.events - 1)
                m.tpot.labels(self.ctx.tenant).observe(tpot)
            self.gw.slo.request(ttft, tpot)
        if self.ctx.streaming:
            await self.ctx.finish(self.status)
