"""OpenAI-compatible gateway: authenticates, counts tokens, asks the scheduler, dispatches.

Per request: authenticate the API key to a tenant (``gateway_auth``) and admit it under the
tenant's quotas; enqueue a ``ScheduleRequest``; await its ``Assignment`` (one reader task
demultiplexes the gateway's assignment stream); send prefill (one token) and decode (the
client's request) **concurrently**, each with ``kv_transfer_params`` and ``X-Request-Id``;
relay decode's tokens. The reservation is renewed while the request runs and released when
it ends however it ends (the decode connector releases it too; release is idempotent), and
so is the quota admission, refunding the tokens the request did not use. A client that goes
away cancels the decode stream and the prefill request (closing an HTTP request aborts it in
vLLM).

Tenancy: the tenant comes from the API key only, never from a request field. Its prefix
cache is isolated by ``cache_salt`` (overwriting any client value). A key is checked when a
request arrives: revoking it stops *new* requests within ``gateway_auth_cache_s``, while a
stream already running is allowed to finish (cutting it would waste the work already done
and gains nothing: the request was admitted and charged when the key was still valid).

Tracing (docs: /work/shared/design.md "Spans"): a SERVER span per request, a PRODUCER span
around the ``XADD`` whose context rides in the stream entry's ``tp`` field, and one CLIENT
span per engine call whose context goes out in the ``traceparent`` header and in
``kv_transfer_params.traceparent``, so vLLM's and the connector's spans join the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import (
    DEFAULT_LEASE_S,
    Admission,
    QuotaExceeded,
    QuotaLimiter,
    RequestTooLarge,
)
from kvpush.common.redis_client import async_redis, lost_connection
from kvpush.common.reservations import AsyncReservations
from kvpush.common.settings import GatewaySettings
from kvpush.common.telemetry import (
    TRACER_NAME,
    context_from_headers,
    init_tracing,
    shutdown_tracing,
)
from kvpush.common.tenancy import AuthCache, TenancyError, Tenant, apply_cache_salt, authenticate
from kvpush.common.wire import Assignment, KVTransferParams, ScheduleRequest, encode, now_ms
from kvpush.services.dispatch import (
    AssignmentWaiter,
    EngineFailed,
    SSEStats,
    completion_tokens_of,
    open_stream,
    post_json,
    sse_events,
)
from kvpush.services.edge import (
    HeaderLimit,
    HTTPFailure,
    RelayResponse,
    redis_unavailable,
    server_config,
    sse_error,
)
from kvpush.services.engine_health import EngineBreaker
from kvpush.services.gateway_metrics import Metrics, metrics_app, metrics_route
from kvpush.services.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    ParsedRequest,
    TokenCounter,
    TokenizerUnavailable,
    engine_bodies,
    fit_context,
    parse_chat,
    parse_completion,
)
from kvpush.services.validation import ClientGone, parse_json, read_body

logger = logging.getLogger(__name__)

# Chat requests without max_tokens get this bound (the reservation must be finite).
_CHAT_DEFAULT_MAX_TOKENS = 256

DEFAULT_TENANT = Tenant(id="default", name="default")
"""The tenant of every request while ``gateway_auth`` is off."""
# Label of requests refused before their tenant is known (bad or missing key).
_NO_TENANT = "-"
_UPSTREAM_FAILED = "the model engine failed to serve the request; retry later"


class Reroute(Exception):
    """An engine failed before the client saw a token: place the request again elsewhere."""

    def __init__(self, engine: str, cause: BaseException, failure: HTTPFailure) -> None:
        super().__init__(f"engine {engine} failed before the first token: {cause}")
        self.engine = engine
        self.failure = failure  # what the client gets when no other engine can serve it


class GatewayError(RuntimeError):
    """The gateway cannot start (unsupported mode, Redis unreachable)."""


# Scheduler rejection kinds -> (HTTP status, OpenAI error type).
_REJECTIONS = {
    "overloaded": (429, "rate_limit_exceeded"),
    "no_engine": (503, "service_unavailable"),
    "too_large": (400, "invalid_request_error"),
    "deadline": (504, "timeout"),
}


def default_gateway_id() -> str:
    """``gw-<host>-<pid>``, reduced to the characters a Redis key part allows."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"gw-{socket.gethostname()}-{os.getpid()}")[:100]


def span_traceparent(span: Span, fallback: str | None = None) -> str | None:
    """W3C ``traceparent`` naming ``span``; ``fallback`` when tracing is off (no valid span)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return fallback
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _fail_span(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))


class RequestCtx:
    """What one request carries from arrival to its last byte: tenant, quota, span."""

    def __init__(self, gw: Gateway, endpoint: str, path: str, arrived: float,
                 span: Span, incoming_tp: str | None) -> None:
        self.gw = gw
        self.endpoint = endpoint
        self.path = path
        self.arrived = arrived
        self.span = span
        self.incoming_tp = incoming_tp
        self.tenant = _NO_TENANT
        self.admission: Admission | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.dispatched = False
        self.streaming = False  # the span and the admission now belong to the stream's end
        self._finished = False

    @property
    def otel_context(self) -> Any:
        """Context whose current span is the SERVER span (parent of every child span)."""
        return trace.set_span_in_context(self.span)

    async def finish(self, status: int) -> None:
        """Release the quota admission and end the SERVER span; idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.admission is not None:
            # Refund what the request did not use; nothing was used if it never reached
            # an engine.
            used = self.prompt_tokens + self.completion_tokens if self.dispatched else 0
            try:
                await self.admission.release(used)
            except RedisError as exc:
                logger.warning("releasing the quota admission of tenant %s failed (its "
                               "lease will expire): %s", self.tenant, exc)
        if self.dispatched:
            self.gw.metrics.tokens.labels(self.tenant, "prompt").inc(self.prompt_tokens)
            self.gw.metrics.tokens.labels(self.tenant, "completion").inc(self.completion_tokens)
        sp = self.span
        sp.set_attribute("http.response.status_code", status)
        sp.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if status >= 500:
            sp.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        sp.end()


class Flight:
    """One admitted request: its assignment, engine calls, lease keeper and cleanup."""

    def __init__(self, gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest, rid: str,
                 deadline_ms: int, assignment: Assignment) -> None:
        self.gw = gw
        self.ctx = ctx
        self.p = parsed
        self.rid = rid
        self.deadline_ms = deadline_ms
        self.arrived = ctx.arrived
        self.a = assignment
        self.prefill_task: asyncio.Task[dict[str, Any]] | None = None
        self.decode_resp: httpx.Response | None = None
        self.decode_span: Span | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = SSEStats()
        self.status = 200
        gw.metrics.reservations.labels(assignment.decode_engine).inc()
        lease_ms = max(1000, assignment.lease_expiry_ms - now_ms())
        self._renew_task = asyncio.create_task(self._keep_lease(lease_ms))

    @property
    def deadline_at(self) -> float:
        """The request's deadline on the loop clock."""
        return asyncio.get_running_loop().time() + (self.deadline_ms - now_ms()) / 1000

    def _headers(self, tp: str | None) -> dict[str, str]:
        h = {"X-Request-Id": self.rid}
        if tp:
            h["traceparent"] = tp
        return h

    def _client_span(self, role: str, engine: str | None, url: str) -> Span:
        return self.gw.tracer.start_span(
            f"kvpush.dispatch.{role}", context=self.ctx.otel_context, kind=SpanKind.CLIENT,
            attributes={"kvpush.request_id": self.rid, "kvpush.role": role,
                        "kvpush.engine": engine or "", "url.full": url,
                        "http.request.method": "POST", "kvpush.tenant": self.ctx.tenant})

    def dispatch(self) -> tuple[Span | None, dict[str, Any], Span, dict[str, Any]]:
        """Open the CLIENT spans and build both bodies with their ``kv_transfer_params``
        (docs/contracts.md); each leg carries its own span's traceparent."""
        a = self.a
        self.ctx.dispatched = True
        dec_span = self.decode_span = self._client_span(
            "decode", a.decode_engine, f"{a.decode_url}{self.p.path}")
        dec_tp = span_traceparent(dec_span, self.ctx.incoming_tp)
        if not a.disaggregated:
            _, dec = engine_bodies(self.p, None, None)
            return None, {}, dec_span, dec
        pre_span = self._client_span("prefill", a.prefill_engine,
                                     f"{a.prefill_url}{self.p.path}")
        pre_tp = span_traceparent(pre_span, self.ctx.incoming_tp)
        # One definition of the params for the gateway and the connector that parses them.
        pre = KVTransferParams(kvpush="prefill", request_id=self.rid,
                               decode_engine=a.decode_engine, deadline_ms=self.deadline_ms,
                               traceparent=pre_tp or None)
        dec_p = KVTransferParams(kvpush="decode", request_id=self.rid,
                                 prefill_engine=a.prefill_engine,
                                 reservation_id=a.reservation_id,
                                 fencing_token=a.fencing_token, deadline_ms=self.deadline_ms,
                                 traceparent=dec_tp or None)
        pre_body, dec_body = engine_bodies(self.p, pre.to_dict(), dec_p.to_dict())
        return pre_span, pre_body, dec_span, dec_body

    def start_prefill(self, span: Span | None, body: dict[str, Any]) -> None:
        """Send the prefill request in the background (disaggregated assignments only)."""
        if span is None:
            return
        url = f"{self.a.prefill_url}{self.p.path}"
        self.prefill_task = asyncio.create_task(self._traced_prefill(
            span, post_json(self.gw.http, "prefill", self.a.prefill_engine, url, body,
                            self._headers(span_traceparent(span, self.ctx.incoming_tp)))))

    @staticmethod
    async def _traced_prefill(span: Span, call: Any) -> dict[str, Any]:
        try:
            return await call
        except EngineFailed as exc:
            if exc.status is not None:
                span.set_attribute("http.response.status_code", exc.status)
            _fail_span(span, exc)
            raise
        except asyncio.CancelledError:
            # The client left or decode failed first: vLLM aborts the request.
            span.set_attribute("kvpush.cancelled", True)
            raise
        finally:
            span.end()

    def fail_decode(self, exc: BaseException) -> None:
        """Mark the decode CLIENT span failed (it ends when the flight closes)."""
        if self.decode_span is not None:
            if isinstance(exc, EngineFailed) and exc.status is not None:
                self.decode_span.set_attribute("http.response.status_code", exc.status)
            _fail_span(self.decode_span, exc)

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
        tp = span_traceparent(self.decode_span, self.ctx.incoming_tp) \
            if self.decode_span is not None else self.ctx.incoming_tp
        return await post_json(self.gw.http, "decode", self.a.decode_engine, url, body,
                               self._headers(tp))

    async def open_decode(self, body: dict[str, Any]) -> httpx.Response:
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
        if self.decode_span is not None:
            self.decode_span.end()
        self.gw.active.pop(self.rid, None)
        a = self.a
        try:
            await self.gw.resv.release(a.decode_engine, a.reservation_id, a.fencing_token)
        except RedisError as exc:
            logger.warning("releasing %s failed (its lease will expire): %s",
                           a.reservation_id, exc)
        m = self.gw.metrics
        m.reservations.labels(a.decode_engine).dec()
        s = self.stats
        self.ctx.completion_tokens = s.completion_tokens or s.events
        if s.first_token_at is not None:
            m.ttft.labels(self.ctx.tenant).observe(s.first_token_at - self.arrived)
            if s.last_token_at is not None and s.events > 1:
                m.tpot.labels(self.ctx.tenant).observe(
                    (s.last_token_at - s.first_token_at) / (s.events - 1))
        if self.ctx.streaming:
            await self.ctx.finish(self.status)


class Gateway:
    """State shared by all requests: Redis, the assignment reader, the HTTP client, metrics."""

    def __init__(self, settings: GatewaySettings, client: aioredis.Redis | None = None,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.s = settings
        self.keys = RedisKeys(settings.key_prefix)
        self.gateway_id = settings.gateway_id or default_gateway_id()
        self.keys.assignments(self.gateway_id)  # reject a bad id before serving anything
        self.redis = client if client is not None else async_redis(settings)
        self._own_client = client is None
        self.resv = AsyncReservations(self.redis, self.keys)
        self.breaker = EngineBreaker(self.redis, self.keys)
        # engine id -> loop time until which this gateway asks schedulers to avoid it
        self.suspects: dict[str, float] = {}
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
        self.auth_cache = AuthCache(ttl_s=settings.gateway_auth_cache_s)
        # The quota lease must outlast the longest request, so only a crash lets it lapse.
        self.limiter = QuotaLimiter(
            self.redis, keys=self.keys,
            lease_s=max(DEFAULT_LEASE_S, settings.gateway_request_timeout_s + 60))
        # A provider of its own (tests run gateway and scheduler in one process, each with
        # its service name); otherwise the global one that start() installs.
        self._own_tracing = tracer_provider is None
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Install tracing, connect to Redis and start the assignment reader."""
        if self._own_tracing and init_tracing(
                "kvpush-gateway", self.s.otlp_endpoint, self.s.trace_sample_ratio,
                gateway_id=self.gateway_id):
            # The global provider now exists; a ProxyTracer follows it, but take the real
            # tracer so the hot path skips the proxy.
            self.tracer = trace.get_tracer(TRACER_NAME)
        try:
            await self.redis.ping()
            await self.resv.load()
        except RedisError as exc:
            raise GatewayError(f"Redis is not reachable: {exc}") from exc
        await self.waiter.start()
        if self.model is not None:
            # Importing transformers and loading the tokenizer takes seconds: do it before
            # the gateway reports ready, not on the first request's clock.
            await self._preload_tokenizer()
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
        if self._own_tracing:
            shutdown_tracing()

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
                        logger.error("%s", exc)
                        raise HTTPFailure(503, "service_unavailable",
                                          "the tokenizer is not available yet", 5.0) from exc
                    self.counter = counter
        return self.counter

    # -- one request ------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        """Serve one OpenAI request; every failure becomes a clear HTTP error."""
        arrived = time.monotonic()
        endpoint = "completions" if path == COMPLETIONS else "chat"
        incoming_tp = request.headers.get("traceparent")
        span = self.tracer.start_span(
            f"POST {path}", context=context_from_headers(request.headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path,
                        "http.route": path, "gen_ai.system": "vllm",
                        "gen_ai.operation.name": "text_completion" if path == COMPLETIONS
                        else "chat"})
        ctx = RequestCtx(self, endpoint, path, arrived, span, incoming_tp)
        self.metrics.in_flight.inc()
        status = 500
        try:
            # The body is read before the disconnect watcher starts: both read ``receive``.
            try:
                raw = await read_body(request, self.s.gateway_max_body_bytes,
                                      self.s.gateway_body_timeout_s)
            except BadRequest as exc:
                raise HTTPFailure.bad_request(exc) from exc
            except ClientGone as exc:
                raise HTTPFailure(499, "client_disconnect", "client closed the connection",
                                  metric="client_disconnect") from exc
            with trace.use_span(span, end_on_exit=False):
                resp = await self._with_disconnect(
                    request, self._admit(ctx, request.headers.get("authorization"), raw, path))
            status = resp.status_code
            return resp
        except HTTPFailure as exc:
            status = exc.status
            self.metrics.errors.labels(exc.metric, ctx.tenant).inc()
            if status >= 500:
                _fail_span(span, exc)
            else:
                span.set_attribute("error.type", exc.kind)
            return exc.response()
        except BaseException as exc:
            _fail_span(span, exc)
            raise
        finally:
            self.metrics.requests.labels(endpoint, str(status), ctx.tenant).inc()
            self.metrics.in_flight.dec()
            if not ctx.streaming:
                await ctx.finish(status)

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

    async def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of the request's API key (``default`` while auth is off); 401 else."""
        if not self.s.gateway_auth:
            return DEFAULT_TENANT
        try:
            return await authenticate(self.redis, authorization, keys=self.keys,
                                      cache=self.auth_cache)
        except TenancyError as exc:
            raise HTTPFailure(401, "authentication_error", f"invalid API key: {exc}",
                              metric="unauthorized",
                              headers={"WWW-Authenticate": "Bearer"}) from exc
        except RedisError as exc:
            raise redis_unavailable(exc) from exc

    async def _admit_quota(self, tenant: Tenant, prompt_tokens: int,
                           max_tokens: int) -> Admission | None:
        if not self.s.gateway_auth:
            return None  # one anonymous tenant: nothing to share fairly
        try:
            return await self.limiter.admit(tenant, prompt_tokens, max_tokens)
        except RequestTooLarge as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc),
                              metric=f"quota_{exc.limit_name}") from exc
        except QuotaExceeded as exc:
            raise HTTPFailure(429, "rate_limit_exceeded", str(exc), exc.retry_after_s or 1.0,
                              metric=f"quota_{exc.limit_name}") from exc
        except RedisError as exc:
            raise redis_unavailable(exc) from exc

    async def _admit(self, ctx: RequestCtx, authorization: str | None, raw: bytes,
                     path: str) -> Response:
        tenant = await self.authenticate(authorization)
        ctx.tenant = tenant.id
        ctx.span.set_attribute("kvpush.tenant", tenant.id)
        parsed = self._parse(raw, path)
        model = await self.resolve_model()
        if parsed.model is not None and parsed.model != model:
            raise HTTPFailure(404, "model_not_found", f"model {parsed.model!r} is not served "
                              f"here (serving {model!r})", param="model")
        counter = await self.token_counter()
        try:
            # Always off the event loop: a chat template over many messages or tools takes
            # long enough to stall every other request.
            prompt_tokens = await asyncio.to_thread(counter.count, parsed)
            parsed = fit_context(parsed, prompt_tokens,
                                 self.s.gateway_max_model_len or counter.model_max_length)
        except BadRequest as exc:
            raise HTTPFailure.bad_request(exc) from exc
        ctx.prompt_tokens = prompt_tokens
        ctx.span.set_attributes({"gen_ai.request.model": model,
                                 "gen_ai.request.max_tokens": parsed.max_tokens,
                                 "gen_ai.usage.input_tokens": prompt_tokens})
        if self.s.gateway_auth:
            # Both legs get the tenant's salt: prefix-cache blocks are shared within the
            # tenant only (and a client cannot pick another tenant's salt).
            apply_cache_salt(parsed.body, tenant)
        ctx.admission = await self._admit_quota(tenant, prompt_tokens, parsed.max_tokens)

        rid = f"cmpl-{uuid.uuid4().hex}"
        ctx.span.set_attributes({"kvpush.request_id": rid, "gen_ai.response.id": rid})
        deadline_ms = now_ms() + int(self.s.gateway_request_timeout_s * 1000)
        exclude: list[str] = []
        failure: HTTPFailure | None = None
        for attempt in range(self.s.gateway_dispatch_retries + 1):
            # Each attempt is a request of its own to the engines and the scheduler: a new
            # assignment, reservation and fencing token; the failed attempt's are released.
            arid = rid if attempt == 0 else f"{rid}-r{attempt}"
            try:
                a = await self._schedule(ctx, arid, prompt_tokens, parsed.max_tokens,
                                         deadline_ms, exclude)
            except HTTPFailure:
                if failure is None:
                    raise
                raise failure from None  # no other engine: the client hears what failed
            flight = Flight(self, ctx, parsed, arid, deadline_ms, a)
            self.active[arid] = a
            try:
                if parsed.stream:
                    return await self._stream(flight)
                return await self._unary(flight)
            except Reroute as r:
                flight.close_soon()
                exclude.append(r.engine)
                failure = r.failure
                last = attempt == self.s.gateway_dispatch_retries
                if last or now_ms() >= deadline_ms:
                    raise r.failure from r
                logger.warning("%s; placing %s again (attempt %d)", r, rid, attempt + 2)
                self.metrics.errors.labels("rerouted", ctx.tenant).inc()
                ctx.span.add_event("kvpush.reroute", {"kvpush.failed_engine": r.engine})
            except BaseException:
                flight.close_soon()
                raise
        raise AssertionError("unreachable")

    def _parse(self, raw: bytes, path: str) -> ParsedRequest:
        s = self.s
        try:
            body = parse_json(raw, s.gateway_max_json_depth)
            if path == COMPLETIONS:
                return parse_completion(body, max_tokens_cap=s.gateway_max_tokens)
            return parse_chat(body, _CHAT_DEFAULT_MAX_TOKENS, s.gateway_max_tokens)
        except BadRequest as exc:
            raise HTTPFailure.bad_request(exc) from exc

    async def _schedule(self, ctx: RequestCtx, rid: str, prompt_tokens: int,
                        max_tokens: int, deadline_ms: int, exclude: list[str] | None = None
                        ) -> Assignment:
        req = ScheduleRequest(request_id=rid, gateway_id=self.gateway_id, tenant=ctx.tenant,
                              prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                              deadline_ms=deadline_ms, enqueued_ms=now_ms(),
                              exclude_engines=list(exclude or ()), avoid_engines=self._avoid())
        fut = self.waiter.expect(rid)
        stream = self.keys.requests()
        try:
            with self.tracer.start_as_current_span(
                    f"send {stream}", kind=SpanKind.PRODUCER, attributes={
                        "messaging.system": "redis", "messaging.destination.name": stream,
                        "messaging.operation.type": "send", "messaging.operation.name": "XADD",
                        "kvpush.request_id": rid, "kvpush.tenant": ctx.tenant}) as send:
                fields: dict[bytes, bytes | str] = {b"m": encode(req)}
                # The scheduler's CONSUMER span is a child of this one.
                tp = span_traceparent(send, ctx.incoming_tp)
                if tp:
                    fields[b"tp"] = tp
                # Bounded like every wait: a Redis that stops answering (a silent
                # partition, no RST) must not hold the request past its deadline.
                async with asyncio.timeout((deadline_ms - now_ms()) / 1000):
                    try:
                        eid = await self.redis.xadd(stream, fields)
                    except RuntimeError as exc:
                        if not lost_connection(exc):
                            raise
                        raise RedisConnectionError(str(exc)) from exc
                send.set_attribute("messaging.message.id", eid.decode())
            sent = time.monotonic()
            async with asyncio.timeout((deadline_ms - now_ms()) / 1000):
                a = await fut
            self.metrics.queue_wait.labels(ctx.tenant).observe(time.monotonic() - sent)
        except TimeoutError as exc:
            raise HTTPFailure(504, "timeout", "no assignment before the deadline",
                              metric="deadline") from exc
        except RedisError as exc:
            raise redis_unavailable(exc) from exc
        finally:
            self.waiter.forget(rid)
        if not a.ok:
            status, kind = _REJECTIONS.get(a.error_kind or "", (503, "service_unavailable"))
            raise HTTPFailure(status, kind, a.error or "rejected by the scheduler",
                              a.retry_after_s, metric=f"rejected_{a.error_kind}")
        ctx.span.set_attributes({"kvpush.decode_engine": a.decode_engine or "",
                                 "kvpush.prefill_engine": a.prefill_engine or "",
                                 "kvpush.disaggregated": a.disaggregated})
        return a

    def _dispatch_failure(self, f: Flight, exc: TimeoutError | EngineFailed
                          ) -> HTTPFailure | Reroute:
        """What a dispatch that failed before any token reached the client becomes: the
        HTTP error, or a :class:`Reroute` when another engine may serve the request."""
        if isinstance(exc, TimeoutError):
            f.fail_decode(exc)
            return HTTPFailure(504, "timeout", "request deadline passed", metric="deadline")
        if exc.role == "decode":
            f.fail_decode(exc)
        failure = self._engine_failure(exc)
        if exc.client_error or not exc.engine:
            return failure
        # The engine is broken, not the request: keep every scheduler off it at once.
        self.spawn(self._suspect(exc.engine, str(exc)))
        return Reroute(exc.engine, exc, failure)

    async def _suspect(self, engine: str, why: str) -> None:
        cool_ms = await self.breaker.mark_suspect(engine, why)
        loop = asyncio.get_running_loop()
        self.suspects[engine] = loop.time() + max(cool_ms, self.breaker.base_ms) / 1000

    def _avoid(self) -> list[str]:
        """Engines this gateway saw fail within their cool-down."""
        if not self.suspects:
            return []
        now = asyncio.get_running_loop().time()
        for e in [e for e, until in self.suspects.items() if until <= now]:
            del self.suspects[e]
        return list(self.suspects)

    def _engine_failure(self, exc: EngineFailed) -> HTTPFailure:
        # The detail (engine id, URL, the engine's own body) is for the log and the span;
        # the client hears only what is about its request.
        logger.warning("%s", exc)
        if exc.client_error:
            status = 413 if exc.status == 413 else 400
            return HTTPFailure(status, "invalid_request_error",
                               exc.client_message(tuple(self.active_engine_names())),
                               metric=f"engine_{exc.role}_refused")
        return HTTPFailure(502, "bad_gateway", _UPSTREAM_FAILED, metric=f"engine_{exc.role}")

    def active_engine_names(self) -> set[str]:
        """Engine ids of the requests in flight (scrubbed from messages sent to clients)."""
        return {n for a in self.active.values()
                for n in (a.decode_engine, a.prefill_engine) if n}

    async def _unary(self, f: Flight) -> Response:
        pre_span, pre_body, _, dec_body = f.dispatch()
        try:
            async with asyncio.timeout_at(f.deadline_at):
                f.start_prefill(pre_span, pre_body)
                result = await f.race_prefill(asyncio.ensure_future(f.decode_json(dec_body)))
                if f.prefill_task is not None:
                    with contextlib.suppress(EngineFailed):
                        await f.prefill_task  # decode answered, so the KV did arrive
        except (TimeoutError, EngineFailed) as exc:
            raise self._dispatch_failure(f, exc) from exc
        finally:
            f.close_soon()
        f.stats.first_token_at = f.stats.last_token_at = time.monotonic()
        f.stats.completion_tokens = f.ctx.completion_tokens = completion_tokens_of(result)
        return JSONResponse(result)

    async def _stream(self, f: Flight) -> Response:
        pre_span, pre_body, _, dec_body = f.dispatch()
        try:
            async with asyncio.timeout_at(f.deadline_at):
                f.start_prefill(pre_span, pre_body)
                resp = await f.race_prefill(asyncio.ensure_future(f.open_decode(dec_body)))
                events = sse_events(resp, f.a.decode_engine)
                # Hold the status line back until the first token: a transfer that fails
                # before it still gets a proper 502 instead of a broken 200 stream.
                first = await f.race_prefill(asyncio.ensure_future(anext(events, b"")))
        except (TimeoutError, EngineFailed) as exc:
            raise self._dispatch_failure(f, exc) from exc
        f.stats.first_token_at = f.stats.last_token_at = time.monotonic()
        f.stats.observe(first)
        # From here the stream's end (Flight.close) ends the SERVER span and the admission.
        f.ctx.streaming = True
        return RelayResponse(self._relay(f, first, events), self.s.gateway_write_timeout_s,
                             lambda: self._write_timed_out(f), media_type="text/event-stream",
                             background=_Cleanup(f))

    def _write_timed_out(self, f: Flight) -> None:
        logger.info("client of %s stopped reading; cutting its stream", f.rid)
        self.metrics.errors.labels("client_write_timeout", f.ctx.tenant).inc()
        f.status = 499
        f.ctx.span.set_attribute("error.type", "client_write_timeout")

    async def _relay(self, f: Flight, first: bytes, events: AsyncIterator[bytes]
                     ) -> AsyncIterator[bytes]:
        tenant = f.ctx.tenant
        try:
            if first:
                yield first
            async with asyncio.timeout_at(f.deadline_at):
                async for ev in events:
                    if f.stats.observe(ev):
                        f.stats.last_token_at = time.monotonic()
                    yield ev
            if f.prefill_task is not None:
                with contextlib.suppress(EngineFailed):
                    await f.prefill_task  # decode finished, so the KV arrived
        except TimeoutError as exc:
            self.metrics.errors.labels("deadline", tenant).inc()
            f.status = 504
            f.fail_decode(exc)
            yield sse_error("request deadline passed", "timeout", 504)
        except EngineFailed as exc:
            self.metrics.errors.labels(f"engine_{exc.role}", tenant).inc()
            f.status = 502
            f.fail_decode(exc)
            logger.warning("%s", exc)
            yield sse_error(_UPSTREAM_FAILED, "bad_gateway", 502)
        except asyncio.CancelledError:
            self.metrics.errors.labels("client_disconnect", tenant).inc()
            f.status = 499
            f.ctx.span.set_attribute("error.type", "client_disconnect")
            raise
        except Exception as exc:
            # The status line is already out: whatever broke, the client must see an error
            # event rather than a stream that just stops.
            logger.exception("stream of %s broke", f.rid)
            self.metrics.errors.labels("internal", tenant).inc()
            f.status = 500
            f.fail_decode(exc)
            yield sse_error("internal error", "internal_error", 500)
        finally:
            f.close_soon()


class _Cleanup:
    """Starlette background task that closes a flight even if its stream never started."""

    def __init__(self, flight: Flight) -> None:
        self.flight = flight

    async def __call__(self) -> None:
        self.flight.close_soon()


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


BackgroundTask = Callable[[], Coroutine[Any, Any, None]]
"""A coroutine factory the app runs beside the gateway for its whole lifespan."""


def create_app(settings: GatewaySettings | None = None, gateway: Gateway | None = None,
               background: Sequence[BackgroundTask] = ()) -> FastAPI:
    """The FastAPI app; the gateway starts and stops with the app's lifespan.

    Each of ``background`` runs as a task in the app's event loop from before the gateway
    starts until after it stops (``kvpush up`` runs its push scheduler this way; real
    deployments run ``kvpush scheduler`` separately).
    """
    gw = gateway or Gateway(settings or GatewaySettings())
    s = gw.s

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(fn(), name=f"kvpush-gateway-background-{i}")
                 for i, fn in enumerate(background)]
        try:
            await gw.start()
            try:
                yield
            finally:
                await gw.stop()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    docs = s.gateway_expose_docs
    app = FastAPI(title="kvpush gateway", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.gateway = gw
    app.add_middleware(HeaderLimit, max_bytes=s.gateway_max_header_bytes)

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
            logger.warning("health: Redis ping failed: %s", exc)
            return JSONResponse({"status": "error", "detail": "Redis unreachable"}, 503)
        if not gw.waiter.running:
            return JSONResponse({"status": "error", "detail": "assignment reader stopped"}, 503)
        return JSONResponse({"status": "ok", "gateway_id": gw.gateway_id})

    if s.gateway_expose_metrics:
        app.router.routes.append(metrics_route(gw.metrics.registry))
    return app


def uvicorn_server(settings: GatewaySettings, app: FastAPI | None = None) -> uvicorn.Server:
    """A uvicorn server for the gateway app, with the settings' connection and size bounds."""
    return uvicorn.Server(server_config(app or create_app(settings), settings))


async def serve_gateway(settings: GatewaySettings | None = None) -> None:
    """Serve the gateway until the server stops (for ``kvpush gateway``); with
    ``gateway_metrics_port``, ``/metrics`` on a listener of its own too."""
    settings = settings or GatewaySettings()
    app = create_app(settings)
    server = uvicorn_server(settings, app)
    logger.info("gateway on http://%s:%d", settings.gateway_host, settings.gateway_port)
    if settings.gateway_metrics_port is None:
        await server.serve()
        return
    mserver = uvicorn.Server(server_config(
        metrics_app(app.state.gateway.metrics.registry), settings,
        settings.gateway_metrics_port))
    logger.info("gateway metrics on http://%s:%d/metrics", settings.gateway_host,
                settings.gateway_metrics_port)
    # Signals belong to the API server; the metrics listener stops when it does.
    mserver.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    mtask = asyncio.create_task(mserver.serve(), name="kvpush-gateway-metrics")
    try:
        await server.serve()
    finally:
        mserver.should_exit = True
        await mtask


def main() -> None:
    """``kvpush gateway``: serve the OpenAI API in this process on uvloop."""
    from kvpush.common.log import setup_logging
    from kvpush.common.runtime import run

    settings = GatewaySettings()
    setup_logging(settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_gateway(settings))


if __name__ == "__main__":
    main()
