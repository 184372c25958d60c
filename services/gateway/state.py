"""Gateway: what all requests share (Redis, assignment reader, HTTP client, tokenizer, metrics)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from opentelemetry import trace
from redis.exceptions import RedisError

from kvpush.common.backoff import Backoff
from kvpush.common.keys import RedisKeys
from kvpush.common.push_key import PushKeys
from kvpush.common.quotas import DEFAULT_LEASE_S, QuotaLimiter
from kvpush.common.redis_client import REDIS_CALL_ERRORS, AsyncRedis, async_redis, lost_connection
from kvpush.common.reservations import AsyncReservations
from kvpush.common.runtime import freeze_startup_heap, watch_loop_lag
from kvpush.common.settings import GatewaySettings
from kvpush.common.telemetry import TRACER_NAME, init_tracing, shutdown_tracing
from kvpush.common.tenancy import AuthCache
from kvpush.common.wire import Assignment, now_ms
from kvpush.services.engine.health import EngineBreaker
from kvpush.services.gateway import assignment
from kvpush.services.gateway.assignment import AssignmentWaiter
from kvpush.services.gateway.context import RequestCtx
from kvpush.services.gateway.early_prefill import PrefillEngines
from kvpush.services.gateway.edge import HTTPFailure
from kvpush.services.gateway.engines import EngineClient
from kvpush.services.gateway.liveness import EngineProbes
from kvpush.services.gateway.metrics import Metrics
from kvpush.services.gateway.openai_api import TokenCounter, TokenizerUnavailable
from kvpush.services.gateway.response_store import ResponseStore
from kvpush.services.gateway.shedding import LoadShedder
from kvpush.services.gateway.slo_report import SloWindow, publish_slo

logger = logging.getLogger(__name__)


class GatewayError(RuntimeError):
    """The gateway cannot start (unsupported mode, Redis unreachable)."""


def default_gateway_id() -> str:
    """``gw-<host>-<pid>``, reduced to the characters a Redis key part allows."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"gw-{socket.gethostname()}-{os.getpid()}")[:100]


class Gateway:
    """State shared by all requests: Redis, the assignment reader, the HTTP client, metrics."""

    def __init__(self, settings: GatewaySettings, client: AsyncRedis | None = None,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.s = settings
        self.keys = RedisKeys(settings.key_prefix)
        self.gateway_id = settings.gateway_id or default_gateway_id()
        self.keys.assignments(self.gateway_id)  # reject a bad id before serving anything
        self.redis = client if client is not None else async_redis(settings)
        self._own_client = client is None
        self.resv = AsyncReservations(self.redis, self.keys)
        self.responses = ResponseStore(
            self.redis, self.keys, settings.gateway_responses_ttl_s,
            settings.gateway_responses_max_bytes, settings.gateway_responses_max_count,
            settings.gateway_response_max_bytes)
        self.push_keys = PushKeys()
        self.breaker = EngineBreaker(self.redis, self.keys,
                                     base_ms=int(settings.gateway_suspect_cooldown_s * 1000))
        # engine id -> loop time until which this gateway asks schedulers to avoid it
        self.suspects: dict[str, float] = {}
        self.metrics = Metrics()
        self.waiter = AssignmentWaiter(self.redis, self.keys, self.gateway_id, self._orphan)
        self.prefill_engines = PrefillEngines(self.redis, self.keys,
                                              settings.gateway_early_prefill_refresh_s)
        # The engines' internal token rides on every call to them (never to clients).
        key = settings.engine_api_key
        self.http = EngineClient(key.get_secret_value() if key else None)
        self.probes = EngineProbes(self.http, settings.gateway_unresponsive_s)
        self.counter: TokenCounter | None = None
        # This process serves the gateway alone: freeze what it loaded (create_app).
        self.freeze_heap = False
        self._lag_watch: asyncio.Task[None] | None = None
        # What the fleet planner sizes the fleet toward (services/gateway/slo_report.py).
        self.slo = SloWindow()
        self._slo_report: asyncio.Task[None] | None = None
        self.shedder = (LoadShedder(settings.gateway_shed_ttft_s,
                                    settings.gateway_shed_over_share,
                                    tpot_objective_s=settings.gateway_shed_tpot_s,
                                    headroom=settings.gateway_shed_headroom,
                                    learn=settings.gateway_shed_learn)
                        if settings.gateway_shed_ttft_s > 0 else None)
        self.model: str | None = settings.gateway_model
        # request id (of the attempt in flight) -> its assignment
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
        if self.s.gateway_early_prefill:
            await self.prefill_engines.start()
        if self.shedder is not None:
            self._lag_watch = asyncio.create_task(
                watch_loop_lag(self.shedder.observe_lag, period_s=0.05))
        self._slo_report = asyncio.create_task(
            publish_slo(self.slo, self.redis, self.keys, self.gateway_id))
        if self.model is not None:
            # Importing transformers and loading the tokenizer takes seconds: do it before
            # the gateway reports ready, not on the first request's clock.
            await self._preload_tokenizer()
        if self.freeze_heap:
            freeze_startup_heap()
        logger.info("gateway %s up", self.gateway_id)

    async def _preload_tokenizer(self) -> None:
        try:
            await self.token_counter()
        except HTTPFailure as exc:
            logger.warning("tokenizer not loaded yet: %s", exc)

    async def stop(self) -> None:
        """Stop reading, let cleanups finish, close clients."""
        for task in (self._lag_watch, self._slo_report):
            if task is not None:
                task.cancel()
        await self.waiter.stop()
        await self.prefill_engines.stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        await self.probes.close()
        await self.http.close()
        if self._own_client:
            await self.redis.aclose()
        if self._own_tracing:
            shutdown_tracing()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in a task that outlives the request that started it."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def release_later(self, what: str, release: Callable[[], Awaitable[Any]],
                      until_ms: int) -> None:
        """Retry, in the background, a release that met a lost Redis connection (a
        failover, a restart) until it lands or ``until_ms`` (its lease's end: after that
        the lease frees it anyway). Without it a 2 s failover holds a tenant's quota slot
        for the whole quota lease (minutes)."""
        self.spawn(self._release_later(what, release, until_ms))

    async def _release_later(self, what: str, release: Callable[[], Awaitable[Any]],
                             until_ms: int) -> None:
        backoff = Backoff(first=0.2, cap=2.0, jitter=0.5)
        while now_ms() < until_ms:
            await asyncio.sleep(backoff.next())
            try:
                await release()
            except REDIS_CALL_ERRORS as exc:
                if lost_connection(exc):
                    continue
                logger.warning("releasing %s failed: %s", what, exc)
                return
            logger.info("released %s after a lost Redis connection", what)
            return

    # -- placement --------------------------------------------------------------------

    async def schedule(self, ctx: RequestCtx, request_id: str, prompt_tokens: int,
                       max_tokens: int, deadline_ms: int, exclude: list[str] | None = None,
                       prefill_on: str | None = None) -> Assignment:
        """Place ``request_id`` through the schedulers (see :func:`assignment.schedule`)."""
        return await assignment.schedule(self, ctx, request_id, prompt_tokens, max_tokens,
                                         deadline_ms, exclude, prefill_on)

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

    def mark_suspect(self, engine: str, why: str) -> None:
        """Keep every scheduler off ``engine`` for its cool-down, this gateway's too."""
        # Locally at once, the Redis mark in the background: the very next request of
        # this gateway already steers around it.
        if not self.breaker.base_ms:
            return
        loop = asyncio.get_running_loop()
        self.suspects[engine] = loop.time() + self.breaker.base_ms / 1000
        self.spawn(self._mark_suspect(engine, why))

    async def _mark_suspect(self, engine: str, why: str) -> None:
        cool_ms = await self.breaker.mark_suspect(engine, why)
        loop = asyncio.get_running_loop()
        self.suspects[engine] = loop.time() + max(cool_ms, self.breaker.base_ms) / 1000

    def avoided_engines(self) -> list[str]:
        """Engines this gateway saw fail within their cool-down."""
        if not self.suspects:
            return []
        now = asyncio.get_running_loop().time()
        for e in [e for e, until in self.suspects.items() if until <= now]:
            del self.suspects[e]
        return list(self.suspects)

    def active_engine_names(self) -> set[str]:
        """Engine ids of the requests in flight (scrubbed from messages sent to clients)."""
        return {n for a in self.active.values()
                for n in (a.decode_engine, a.prefill_engine) if n}

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
                    if self.freeze_heap:
                        freeze_startup_heap()  # the tokenizer is most of the heap
        return self.counter
