"""OpenAI-compatible gateway: counts tokens, asks the scheduler, dispatches prefill and decode.

Per request: enqueue a ``ScheduleRequest``; await its ``Assignment`` (one reader task
demultiplexes the gateway's assignment stream); send prefill (one token) and decode
(the client's request) **concurrently**, each with ``kv_transfer_params`` and
``X-Request-Id``; relay decode's tokens. The reservation is renewed while the request runs
and released when it ends however it ends (the decode connector releases it too; release
is idempotent). A client that goes away cancels the decode stream and the prefill request
(closing an HTTP request aborts it in vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from redis.exceptions import RedisError

from common.keys import RedisKeys
from common.redis_client import async_redis
from common.reservations import AsyncReservations
from common.settings import GatewaySettings, SchedulerSettings
from common.wire import Assignment, ScheduleRequest, encode, now_ms
from services.dispatch import (
    AssignmentWaiter,
    EngineFailed,
    SSEStats,
    is_token_event,
    open_stream,
    post_json,
    sse_events,
)
from services.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    ParsedRequest,
    TokenCounter,
    TokenizerUnavailable,
    engine_bodies,
    error_body,
    parse_chat,
    parse_completion,
)
from services.scheduler import run_scheduler

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 4000
# Chat requests without max_tokens get this bound (the reservation must be finite).
_CHAT_DEFAULT_MAX_TOKENS = 256

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GatewayError(RuntimeError):
    """The gateway cannot start (unsupported mode, Redis unreachable)."""


class HTTPFailure(Exception):
    """A request ends with an HTTP error for the client."""

    def __init__(self, status: int, kind: str, message: str,
                 retry_after_s: float | None = None, metric: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.metric = metric or kind

    def response(self) -> JSONResponse:
        """The OpenAI-style error response."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(error_body(str(self), self.kind, self.status), self.status,
                            headers=headers)


# Scheduler rejection kinds -> (HTTP status, OpenAI error type).
_REJECTIONS = {
    "overloaded": (429, "rate_limit_exceeded"),
    "no_engine": (503, "service_unavailable"),
    "too_large": (400, "invalid_request_error"),
    "deadline": (504, "timeout"),
}


class Metrics:
    """The gateway's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpush_gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvpush_gateway_errors", "Failed requests by kind", ["kind"],
                              registry=r)
        self.queue_wait = Histogram("kvpush_gateway_queue_wait_seconds",
                                    "Enqueue to assignment", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.ttft = Histogram("kvpush_gateway_ttft_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvpush_gateway_tpot_seconds", "Time per output token after "
                              "the first", buckets=_LATENCY_BUCKETS, registry=r)
        self.reservations = Gauge("kvpush_gateway_reservations_in_flight",
                                  "Decode reservations held by running requests", registry=r)
        self.in_flight = Gauge("kvpush_gateway_requests_in_flight", "Requests being served",
                               registry=r)


def default_gateway_id() -> str:
    """``gw-<host>-<pid>``, reduced to the characters a Redis key part allows."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"gw-{socket.gethostname()}-{os.getpid()}")[:100]


def new_traceparent() -> str:
    """A fresh W3C traceparent (not sampled; the tracing layer may replace it)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"


class Flight:
    """One admitted request: its assignment, engine calls, lease keeper and cleanup."""

    def __init__(self, gw: Gateway, parsed: ParsedRequest, rid: str, tp: str,
                 deadline_ms: int, arrived: float, assignment: Assignment) -> None:
        self.gw = gw
        self.p = parsed
        self.rid = rid
        self.tp = tp
        self.deadline_ms = deadline_ms
        self.arrived = arrived
        self.a = assignment
        self.prefill_task: asyncio.Task[dict[str, Any]] | None = None
        self.decode_resp: httpx.Response | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = SSEStats()
        gw.metrics.reservations.inc()
        lease_ms = max(1000, assignment.lease_expiry_ms - now_ms())
        self._renew_task = asyncio.create_task(self._keep_lease(lease_ms))

    @property
    def deadline_at(self) -> float:
        """The request's deadline on the loop clock."""
        return asyncio.get_running_loop().time() + (self.deadline_ms - now_ms()) / 1000

    def _headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.rid, "traceparent": self.tp}

    def bodies(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Prefill and decode bodies with their ``kv_transfer_params`` (docs/contracts.md)."""
        a = self.a
        if not a.disaggregated:
            return engine_bodies(self.p, None, None)
        pre = {"kvpush": "prefill", "request_id": self.rid, "decode_engine": a.decode_engine,
               "deadline_ms": self.deadline_ms, "traceparent": self.tp}
        dec = {"kvpush": "decode", "request_id": self.rid, "prefill_engine": a.prefill_engine,
               "reservation_id": a.reservation_id, "fencing_token": a.fencing_token,
               "deadline_ms": self.deadline_ms, "traceparent": self.tp}
        return engine_bodies(self.p, pre, dec)

    def start_prefill(self, body: dict[str, Any]) -> None:
        """Send the prefill request in the background (disaggregated assignments only)."""
        if not self.a.disaggregated:
            return
        url = f"{self.a.prefill_url}{self.p.path}"
        self.prefill_task = asyncio.create_task(
            post_json(self.gw.http, "prefill", self.a.prefill_engine, url, body, self._headers())
        )

    async def _keep_lease(self, lease_ms: int) -> None:
        # Long generations outlive one lease; renew at a third of it so a slow Redis
        # round trip never lets it lapse.
        a = self.a
        while True:
            await asyncio.sleep(lease_ms / 3000)
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
        return await post_json(self.gw.http, "decode", self.a.decode_engine, url, body,
                               self._headers())

    async def open_decode(self, body: dict[str, Any]) -> httpx.Response:
        """Streaming decode call, open once its headers are in."""
        url = f"{self.a.decode_url}{self.p.path}"
        self.decode_resp = await open_stream(self.gw.http, self.a.decode_engine, url, body,
                                             self._headers())
        return self.decode_resp

    async def race_prefill(self, work: asyncio.Future[Any]) -> Any:
        """Await ``work``; a prefill failure before it finishes fails the request at once."""
        try:
            return await self._race_prefill(work)
        except BaseException:
            # asyncio.wait does not cancel what it waits on: a deadline or a client that
            # left must not leave the decode call running.
            work.cancel()
            raise

    async def _race_prefill(self, work: asyncio.Future[Any]) -> Any:
        if self.prefill_task is None or self.prefill_task.done():
            if self.prefill_task is not None and self.prefill_task.exception() is not None:
                work.cancel()
                raise self.prefill_task.exception()  # type: ignore[misc]
            return await work
        done, _ = await asyncio.wait({work, self.prefill_task},
                                     return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        exc = self.prefill_task.exception()
        if exc is not None:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            raise exc
        return await work

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
        if self.decode_resp is not None:
            with contextlib.suppress(Exception):
                await self.decode_resp.aclose()
        self.gw.active.pop(self.rid, None)
        a = self.a
        try:
            await self.gw.resv.release(a.decode_engine, a.reservation_id, a.fencing_token)
        except RedisError as exc:
            logger.warning("releasing %s failed (its lease will expire): %s",
                           a.reservation_id, exc)
        self.gw.metrics.reservations.dec()
        s = self.stats
        if s.first_token_at is not None:
            self.gw.metrics.ttft.observe(s.first_token_at - self.arrived)
            if s.last_token_at is not None and s.events > 1:
                self.gw.metrics.tpot.observe(
                    (s.last_token_at - s.first_token_at) / (s.events - 1))


class Gateway:
    """State shared by all requests: Redis, the assignment reader, the HTTP client, metrics."""

    def __init__(self, settings: GatewaySettings, client: aioredis.Redis | None = None) -> None:
        if settings.gateway_mode != "push":
            raise GatewayError(
                f"gateway_mode {settings.gateway_mode!r} is not implemented; use 'push'")
        self.s = settings
        self.keys = RedisKeys(settings.key_prefix)
        self.gateway_id = settings.gateway_id or default_gateway_id()
        self.keys.assignments(self.gateway_id)  # reject a bad id before serving anything
        self.redis = client if client is not None else async_redis(settings)
        self._own_client = client is None
        self.resv = AsyncReservations(self.redis, self.keys)
        self.metrics = Metrics()
        self.waiter = AssignmentWaiter(self.redis, self.keys, self.gateway_id, self._orphan)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
        )
        self.counter: TokenCounter | None = None
        self.model: str | None = settings.gateway_model
        self.active: dict[str, Assignment] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._model_lock = asyncio.Lock()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to Redis and start the assignment reader."""
        try:
            await self.redis.ping()
            await self.resv.load()
        except RedisError as exc:
            raise GatewayError(f"Redis is not reachable: {exc}") from exc
        await self.waiter.start()
        if self.model is not None:
            # Importing transformers and loading the tokenizer takes seconds: not on the
            # first request's clock.
            self.spawn(self._preload_tokenizer())
        logger.info("gateway %s up", self.gateway_id)

    async def _preload_tokenizer(self) -> None:
        try:
            await self.token_counter()
        except HTTPFailure as exc:
            logger.warning("tokenizer not loaded yet: %s", exc)

    async def stop(self) -> None:
        """Stop reading, let cleanups finish, close clients."""
        await self.waiter.stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        await self.http.aclose()
        if self._own_client:
            await self.redis.aclose()

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in a task that outlives the request that started it."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _orphan(self, a: Assignment) -> None:
        if not a.ok or a.decode_engine is None or a.reservation_id is None:
            return
        cur = self.active.get(a.request_id)
        if cur is not None and (cur.decode_engine, cur.fencing_token) == (
                a.decode_engine, a.fencing_token):
            return  # a repeated answer for the reservation in use
        logger.info("releasing orphan assignment of %s on %s", a.request_id, a.decode_engine)
        try:
            await self.resv.release(a.decode_engine, a.reservation_id, a.fencing_token)
        except RedisError as exc:
            logger.warning("releasing orphan %s failed: %s", a.reservation_id, exc)

    # -- model and tokenizer ----------------------------------------------------------

    async def engine_models(self) -> list[str]:
        """Model names the live engines report."""
        ids = await self.redis.zrange(self.keys.engines(), 0, -1)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for e in ids:
            pipe.hget(self.keys.engine(e.decode()), "model")
        return sorted({m.decode() for m in await pipe.execute() if m})

    async def resolve_model(self) -> str:
        """The served model name: configured, or the one the engines report."""
        if self.model is None:
            models = await self.engine_models()
            if not models:
                raise HTTPFailure(503, "service_unavailable", "no engine is up yet", 1.0)
            self.model = models[0]
        return self.model

    async def token_counter(self) -> TokenCounter:
        """The tokenizer of the served model, loaded once (off the event loop)."""
        if self.counter is None:
            async with self._model_lock:
                if self.counter is None:
                    model = await self.resolve_model()
                    path = self.s.gateway_tokenizer
                    if path is None:
                        local = Path(self.s.model_dir) / model
                        path = str(local) if local.exists() else model
                    counter = TokenCounter(path)
                    try:
                        await asyncio.to_thread(counter.load)
                    except TokenizerUnavailable as exc:
                        raise HTTPFailure(503, "service_unavailable", str(exc)) from exc
                    self.counter = counter
        return self.counter

    # -- one request ------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        """Serve one OpenAI request; every failure becomes a clear HTTP error."""
        arrived = time.monotonic()
        endpoint = "completions" if path == COMPLETIONS else "chat"
        self.metrics.in_flight.inc()
        status = 500
        try:
            # The body is read before the disconnect watcher starts: both read ``receive``.
            raw = await request.body()
            resp = await self._with_disconnect(request, self._admit(raw, path, arrived))
            status = resp.status_code
            return resp
        except HTTPFailure as exc:
            status = exc.status
            self.metrics.errors.labels(exc.metric).inc()
            return exc.response()
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.in_flight.dec()

    async def _with_disconnect(self, request: Request, work: Any) -> Response:
        # Until the response starts, nothing notices a client that left: watch for it, so
        # a queued or prefilling request is dropped (and its reservation released) at once.
        task = asyncio.create_task(work)
        watch = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watch.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise HTTPFailure(499, "client_disconnect", "client closed the connection")

    async def _admit(self, raw: bytes, path: str, arrived: float) -> Response:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise HTTPFailure(400, "invalid_request_error", f"body is not JSON: {exc}",
                              metric="bad_request") from exc
        try:
            if path == COMPLETIONS:
                parsed = parse_completion(body)
            else:
                parsed = parse_chat(body, _CHAT_DEFAULT_MAX_TOKENS)
        except BadRequest as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc),
                              metric="bad_request") from exc
        model = await self.resolve_model()
        if parsed.model is not None and parsed.model != model:
            raise HTTPFailure(404, "model_not_found", f"model {parsed.model!r} is not served "
                              f"here (serving {model!r})")
        counter = await self.token_counter()
        try:
            if len(str(parsed.body.get("prompt") or parsed.body.get("messages"))) \
                    > _INLINE_TOKENIZE_CHARS:
                prompt_tokens = await asyncio.to_thread(counter.count, parsed)
            else:
                prompt_tokens = counter.count(parsed)
        except BadRequest as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc),
                              metric="bad_request") from exc

        rid = f"cmpl-{uuid.uuid4().hex}"
        tp = new_traceparent()
        deadline_ms = now_ms() + int(self.s.gateway_request_timeout_s * 1000)
        a = await self._schedule(rid, tp, prompt_tokens, parsed.max_tokens, deadline_ms)
        self.metrics.queue_wait.observe(time.monotonic() - arrived)
        flight = Flight(self, parsed, rid, tp, deadline_ms, arrived, a)
        self.active[rid] = a
        try:
            if parsed.stream:
                return await self._stream(flight)
            return await self._unary(flight)
        except BaseException:
            flight.close_soon()
            raise

    async def _schedule(self, rid: str, tp: str, prompt_tokens: int, max_tokens: int,
                        deadline_ms: int) -> Assignment:
        req = ScheduleRequest(request_id=rid, gateway_id=self.gateway_id,
                              prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                              deadline_ms=deadline_ms, enqueued_ms=now_ms())
        fut = self.waiter.expect(rid)
        try:
            await self.redis.xadd(self.keys.requests(), {b"m": encode(req), b"tp": tp})
            async with asyncio.timeout((deadline_ms - now_ms()) / 1000):
                a = await fut
        except TimeoutError as exc:
            raise HTTPFailure(504, "timeout", "no assignment before the deadline",
                              metric="deadline") from exc
        except RedisError as exc:
            raise HTTPFailure(503, "service_unavailable", f"Redis: {exc}", 1.0,
                              metric="redis") from exc
        finally:
            self.waiter.forget(rid)
        if not a.ok:
            status, kind = _REJECTIONS.get(a.error_kind or "", (503, "service_unavailable"))
            raise HTTPFailure(status, kind, a.error or "rejected by the scheduler",
                              a.retry_after_s, metric=f"rejected_{a.error_kind}")
        return a

    def _engine_failure(self, exc: EngineFailed) -> HTTPFailure:
        if exc.client_error:
            return HTTPFailure(400, "invalid_request_error", str(exc),
                               metric=f"engine_{exc.role}_refused")
        return HTTPFailure(502, "bad_gateway", str(exc), metric=f"engine_{exc.role}")

    async def _unary(self, f: Flight) -> Response:
        pre_body, dec_body = f.bodies()
        try:
            async with asyncio.timeout_at(f.deadline_at):
                f.start_prefill(pre_body)
                result = await f.race_prefill(asyncio.ensure_future(f.decode_json(dec_body)))
                if f.prefill_task is not None:
                    with contextlib.suppress(EngineFailed):
                        await f.prefill_task  # decode answered, so the KV did arrive
        except TimeoutError as exc:
            raise HTTPFailure(504, "timeout", "request deadline passed",
                              metric="deadline") from exc
        except EngineFailed as exc:
            raise self._engine_failure(exc) from exc
        finally:
            f.close_soon()
        f.stats.first_token_at = f.stats.last_token_at = time.monotonic()
        return JSONResponse(result)

    async def _stream(self, f: Flight) -> Response:
        pre_body, dec_body = f.bodies()
        try:
            async with asyncio.timeout_at(f.deadline_at):
                f.start_prefill(pre_body)
                resp = await f.race_prefill(asyncio.ensure_future(f.open_decode(dec_body)))
                events = sse_events(resp, f.a.decode_engine)
                # Hold the status line back until the first token: a transfer that fails
                # before it still gets a proper 502 instead of a broken 200 stream.
                first = await f.race_prefill(asyncio.ensure_future(anext(events, b"")))
        except TimeoutError as exc:
            raise HTTPFailure(504, "timeout", "request deadline passed",
                              metric="deadline") from exc
        except EngineFailed as exc:
            raise self._engine_failure(exc) from exc
        f.stats.first_token_at = f.stats.last_token_at = time.monotonic()
        f.stats.events = 1 if is_token_event(first) else 0
        return StreamingResponse(self._relay(f, first, events), media_type="text/event-stream",
                                 background=_Cleanup(f))

    async def _relay(self, f: Flight, first: bytes, events: AsyncIterator[bytes]
                     ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async with asyncio.timeout_at(f.deadline_at):
                async for ev in events:
                    if is_token_event(ev):
                        f.stats.events += 1
                        f.stats.last_token_at = time.monotonic()
                    yield ev
            if f.prefill_task is not None:
                with contextlib.suppress(EngineFailed):
                    await f.prefill_task  # decode finished, so the KV arrived
        except TimeoutError:
            self.metrics.errors.labels("deadline").inc()
            yield _sse_error("request deadline passed", "timeout", 504)
        except EngineFailed as exc:
            self.metrics.errors.labels(f"engine_{exc.role}").inc()
            yield _sse_error(str(exc), "bad_gateway", 502)
        except asyncio.CancelledError:
            self.metrics.errors.labels("client_disconnect").inc()
            raise
        finally:
            f.close_soon()


class _Cleanup:
    """Starlette background task that closes a flight even if its stream never started."""

    def __init__(self, flight: Flight) -> None:
        self.flight = flight

    async def __call__(self) -> None:
        self.flight.close_soon()


def _sse_error(message: str, kind: str, code: int) -> bytes:
    return b"data: " + json.dumps(error_body(message, kind, code)).encode() + b"\n\n"


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(settings: GatewaySettings | None = None, gateway: Gateway | None = None,
               scheduler: SchedulerSettings | None = None) -> FastAPI:
    """The FastAPI app; the gateway starts and stops with the app's lifespan.

    With ``scheduler`` settings, a push scheduler runs in the same event loop too (one
    process for the local stack; real deployments run ``kvpush scheduler`` separately).
    """
    gw = gateway or Gateway(settings or GatewaySettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sched = None
        if scheduler is not None:
            sched = asyncio.create_task(run_scheduler(scheduler), name="kvpush-scheduler")
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()
            if sched is not None:
                sched.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sched

    app = FastAPI(title="kvpush gateway", lifespan=lifespan)
    app.state.gateway = gw

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await gw.handle(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await gw.handle(request, CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        names = [gw.model] if gw.model else await gw.engine_models()
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "kvpush"} for n in names]})

    @app.get("/health")
    async def health() -> Response:
        try:
            await gw.redis.ping()
        except RedisError as exc:
            return JSONResponse({"status": "error", "detail": f"Redis: {exc}"}, 503)
        if not gw.waiter.running:
            return JSONResponse({"status": "error", "detail": "assignment reader stopped"}, 503)
        return JSONResponse({"status": "ok", "gateway_id": gw.gateway_id})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def create_stack_app(ctx: Any) -> FastAPI:
    """The push front of ``kvpush up``: gateway plus an in-process scheduler.

    ``ctx`` is a :class:`services.stack.StackContext` (redis_url, model, settings).
    """
    model = str(ctx.model)
    tokenizer = None
    if Path(model).is_dir():
        tokenizer, model = model, Path(model).name
    common: dict[str, Any] = {
        "redis_url": ctx.redis_url,
        "key_prefix": ctx.settings.key_prefix,
        "model_dir": ctx.settings.model_dir,
        "log_level": ctx.settings.log_level,
    }
    gs = GatewaySettings(**common).model_copy(update={
        "gateway_model": model, "gateway_tokenizer": tokenizer,
        "gateway_port": ctx.settings.stack_port})
    ss = SchedulerSettings(**common)
    return create_app(gs, scheduler=ss)


def uvicorn_server(settings: GatewaySettings, app: FastAPI | None = None) -> uvicorn.Server:
    """A uvicorn server for the gateway app (httptools; the loop is the caller's uvloop)."""
    config = uvicorn.Config(
        app or create_app(settings), host=settings.gateway_host, port=settings.gateway_port,
        http="httptools", lifespan="on", access_log=False, log_level="warning",
        timeout_keep_alive=30,
    )
    return uvicorn.Server(config)


async def serve_gateway(settings: GatewaySettings | None = None) -> None:
    """Serve the gateway until the server stops (for ``kvpush gateway`` and ``kvpush up``)."""
    settings = settings or GatewaySettings()
    server = uvicorn_server(settings)
    logger.info("gateway on http://%s:%d", settings.gateway_host, settings.gateway_port)
    await server.serve()


def main() -> None:
    """``kvpush gateway``: serve the OpenAI API in this process on uvloop."""
    from common.log import setup_logging
    from common.runtime import run

    settings = GatewaySettings()
    setup_logging(settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_gateway(settings))


if __name__ == "__main__":
    main()
