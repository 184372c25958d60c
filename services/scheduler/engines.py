"""The scheduler's view of the engines: refresh, reservation levels, tenant weights, sweep."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import NoScriptError

from kvpush.common.engine_view import DECODE_ROLES, PREFILL_ROLES, EngineView, view_from_hash
from kvpush.common.reservations import queue_evalsha
from kvpush.common.tenancy import Tenant, UnknownTenant, get_tenant_async
from kvpush.common.wire import now_ms
from kvpush.services.scheduler.fair_queue import Pending
from kvpush.services.scheduler.intake import counter, engine_ids, warn_once
from kvpush.services.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)

# Engines whose last heartbeat is older than this are not even read on refresh.
_STALE_ENGINE_MS = 60_000
# How long a tenant's weight is used before it is read again.
_WEIGHT_TTL_S = 5.0


class EngineViewPart(SchedulerState):
    """Keeps ``engines``, ``decoders``, ``prefillers`` and the tenant weights current.

    A suspect engine (a dispatch to it just failed) or a draining one stays in ``engines``
    but out of ``decoders`` and ``prefillers``, so it gets no new requests.
    """

    async def refresh(self) -> None:
        """Re-read engine statuses and reservation levels; dead engines drop out (TTL).

        A status or reservation key holding garbage (wrong type, bad fields) leaves that
        engine out, logged; it never stops the refresh."""
        ids = engine_ids(self.keys, await self.redis.zrangebyscore(
            self.keys.engines(), now_ms() - _STALE_ENGINE_MS, "+inf"))
        self.stats.round_trips += 1
        engines: dict[str, EngineView] = {}
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for e in ids:
                pipe.hgetall(self.keys.engine(e))
                pipe.hget(self.keys.reservations(e), "#blocks")
            raw = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            for i, e in enumerate(ids):
                fields, reserved = raw[2 * i], raw[2 * i + 1]
                if isinstance(fields, Exception) or isinstance(reserved, Exception):
                    warn_once(f"keys of {e}", "engine %s left out: its keys are unreadable "
                              "(%s)", e, fields if isinstance(fields, Exception) else reserved)
                    continue
                view = view_from_hash(e, fields)
                if view is not None:
                    view.reserved_blocks = counter(reserved, f"#blocks of {e}")
                    engines[e] = view
        gone = self.engines.keys() - engines.keys()
        if gone:
            logger.info("engines gone: %s", sorted(gone))
        new = engines.keys() - self.engines.keys()
        if new:
            logger.info("engines up: %s", sorted(new))
        self._set_engines(engines)
        await self.load_weights()

    def weight(self, tenant: str) -> float:
        """Fair-share weight of ``tenant`` (1.0 until its tenant record has been read)."""
        hit = self.weights.get(tenant)
        return hit[0] if hit is not None else 1.0

    async def load_weights(self, tenants: list[str] | None = None) -> None:
        """Read the weights of waiting tenants not read in the last ``_WEIGHT_TTL_S``.

        Off the hot path (refresh only) and only for tenants that wait: fairness matters
        only between tenants in the queue. A tenant without a record (``default`` when the
        gateway runs without auth) weighs 1.
        """
        now = time.monotonic()
        todo = [t for t in (tenants if tenants is not None else self.queue.tenants())
                if now - self.weights.get(t, (0.0, -1e9))[1] > _WEIGHT_TTL_S]
        if not todo:
            return
        got = await asyncio.gather(*(get_tenant_async(self.redis, t, keys=self.keys)
                                     for t in todo), return_exceptions=True)
        self.stats.round_trips += 1
        for t, res in zip(todo, got, strict=True):
            if isinstance(res, Tenant):
                self.weights[t] = (max(1e-3, float(res.weight)), now)
            elif isinstance(res, UnknownTenant):
                self.weights[t] = (1.0, now)
            else:
                logger.warning("reading tenant %s's weight failed: %s", t, res)
        if len(self.weights) > 100_000:
            self.weights = {t: w for t, w in self.weights.items() if now - w[1] < _WEIGHT_TTL_S}

    def _set_engines(self, engines: dict[str, EngineView]) -> None:
        self.engines = engines
        # A suspect engine (a dispatch to it just failed) gets nothing until its
        # cool-down lapses; then the next request to it is the breaker's probe. A draining
        # engine gets nothing until its mark is cleared or it restarts (new generation).
        now = now_ms()
        usable = [e for e in engines.values() if e.suspect_until <= now and not e.draining]
        self.decoders = [e for e in usable if e.role in DECODE_ROLES]
        self.prefillers = [e for e in usable if e.role in PREFILL_ROLES]
        self.index.rebuild(self.decoders, self.prefillers)
        # Suspect and draining engines still count for "could this ever fit": they come
        # back (a rolling restart drains each engine in turn).
        self._fit_tokens = max((e.total_blocks * e.block_size for e in engines.values()
                                if e.role in DECODE_ROLES), default=0)

    def _fits_somewhere(self, p: Pending) -> bool:
        return p.request.prompt_tokens + p.request.max_tokens <= self._fit_tokens

    async def refresh_reserved(self) -> None:
        """Re-read only the decode engines' reservation levels (cheap; for waiting requests)."""
        if not self.decoders:
            return
        pipe = self.redis.pipeline(transaction=False)
        for e in self.decoders:
            pipe.hget(self.keys.reservations(e.engine_id), "#blocks")
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
        for e, v in zip(self.decoders, raw, strict=True):
            e.reserved_blocks = counter(v, f"#blocks of {e.engine_id}")
        self.index.rebuild(self.decoders, self.prefillers)

    def add_reserved(self, e: EngineView, blocks: int) -> None:
        """Count ``blocks`` more (or fewer) reserved on ``e`` in the local view."""
        e.reserved_blocks += blocks
        self.index.update(e)

    def set_reserved(self, e: EngineView, blocks: int) -> None:
        """``e``'s reservation level as the reserve script just reported it."""
        e.reserved_blocks = blocks
        self.index.update(e)

    def add_pending_prompt(self, e: EngineView, tokens: int) -> None:
        """Count ``tokens`` more (or fewer) prompt tokens sent to prefill engine ``e``."""
        e.pending_prompt_tokens += tokens
        self.index.update(e)

    async def sweep(self) -> None:
        """Purge expired reservations everywhere; forget engines with nothing left.

        The run loop trims the request stream (``trim``) just before."""
        ids = engine_ids(self.keys, await self.redis.zrange(self.keys.engines(), 0, -1))
        if not ids:
            return
        if "sweep" not in self.resv.shas:
            await self.resv.load()
        pipe = self.redis.pipeline(transaction=False)
        for e in ids:
            queue_evalsha(pipe, self.resv.shas["sweep"],
                          [self.keys.reservations(e), self.keys.reservation_leases(e)], [])
            pipe.exists(self.keys.engine(e))
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 2
        forget = []
        for i, e in enumerate(ids):
            res, alive = raw[2 * i], raw[2 * i + 1]
            if isinstance(res, NoScriptError):
                await self.resv.load()
                continue
            if isinstance(res, Exception) or isinstance(alive, Exception):
                logger.warning("sweep of %s failed: %s", e,
                               res if isinstance(res, Exception) else alive)
                continue
            purged, remaining = int(res[0]), int(res[1])
            if purged:
                logger.info("purged %d expired reservations on %s", purged, e)
                self.stats.swept += purged
            if not alive and remaining == 0:
                forget.append(e)
        if forget:
            # A live engine re-adds itself on its next heartbeat.
            await self.redis.zrem(self.keys.engines(), *forget)
