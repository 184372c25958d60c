"""Push scheduler: reads requests from a Redis Streams consumer group, places and reserves them.

One asyncio task runs the whole loop, so the local engine view and the waiting queue need no
locks. Per batch of entries the hot path costs two Redis round trips: one pipeline of
``SET once NX GET`` + reserve script per request; one pipeline of the assignment ``XADD``\\s,
dead letters and ``XACK`` followed by the next ``XREADGROUP``.

Requests that find no free decode slot wait in a per-tenant queue served by weighted fair
queueing (:class:`WaitQueue`), with weights from the tenant records: a tenant that floods
lengthens only its own queue. Spans (``process kvpush:requests``, ``kvpush.match``) are
built only when tracing is on.

Exactly-once, as far as the gateway can tell:

* An entry is acknowledged only after its answer (assignment or dead letter) is written.
  A scheduler that dies in between leaves it pending; another one ``XAUTOCLAIM``\\s it after
  ``scheduler_claim_idle_ms`` and answers it again.
* The reservation id is the request id and reserving is idempotent per engine, so a retried
  entry gets the same reservation back as long as it lands on the same engine. The marker
  ``kvpush:once:{RID}`` = ``"<entry id>|<decode engine>"`` (plain text, read only here)
  records that engine, so a reclaimed entry goes back to it first, and an entry with a
  request id another entry already holds is a duplicate: it is dead-lettered, and a
  reservation it made by accident is released.
* Entries waiting for capacity stay pending under this consumer; their idle time is reset
  (``XCLAIM ... JUSTID``, which does not count as a delivery) so nobody steals them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from redis.exceptions import NoScriptError, ResponseError

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncRedis, async_redis, lost_connection
from kvpush.common.reservations import (
    AsyncReservations,
    ReserveResult,
    ReserveStatus,
    parse_reserve,
    queue_evalsha,
)
from kvpush.common.settings import SchedulerSettings
from kvpush.common.telemetry import TRACER_NAME, context_from_traceparent, init_tracing
from kvpush.common.tenancy import Tenant, UnknownTenant, get_tenant_async
from kvpush.common.wire import Assignment, ScheduleRequest, encode, now_ms
from kvpush.services.placement import (
    DECODE_ROLES,
    PREFILL_ROLES,
    EngineView,
    Policy,
    best_decode,
    blocks_needed,
    pick_prefill,
    view_from_hash,
)
from kvpush.services.scheduler_input import (
    BadEntry,
    counter,
    dead_letter_fields,
    engine_ids,
    entry_id_key,
    parse_entry,
    text,
    trim_behind_groups,
    warn_once,
)

logger = logging.getLogger(__name__)

# Engines whose last heartbeat is older than this are not even read on refresh.
_STALE_ENGINE_MS = 60_000
_TOO_LARGE = "prompt_tokens + max_tokens exceed every decode engine's KV cache"
# An assignment stream nobody wrote to for this long goes away (see _queue_answer).
_ASSIGN_TTL_MS = 24 * 3600 * 1000
# How long a tenant's weight is used before it is read again.
_WEIGHT_TTL_S = 5.0


class SchedulerError(RuntimeError):
    """The scheduler cannot start (bad settings, Redis unreachable)."""


@dataclass(slots=True)
class Pending:
    """A request this scheduler holds: read from the stream, not yet answered."""

    entry_id: str
    request: ScheduleRequest
    traceparent: bytes
    arrived: float  # monotonic
    wait_until: float  # monotonic: queue timeout or the request's deadline, whichever first
    seq: int = 0
    redelivered: bool = False
    preferred_engine: str | None = None
    vstart: float = 0.0  # virtual start tag while it waits (WaitQueue)
    read_ns: int = 0  # wall clock when read, for the spans


@dataclass(slots=True)
class SchedulerStats:
    """Counters a benchmark or test can read."""

    read: int = 0
    assigned: int = 0
    rejected: int = 0
    dead: int = 0
    duplicates: int = 0
    reclaimed: int = 0
    round_trips: int = 0
    swept: int = 0
    # Read -> answer written, per request; bounded so a long-running scheduler does not grow.
    decision_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))


class WaitQueue:
    """Requests held back for lack of a decode slot: one FIFO per tenant, weighted fair.

    Start-time fair queueing over the tenants' FIFOs. A request pushed by tenant ``t`` gets
    a virtual start tag ``S = max(V, F[t])`` and advances ``F[t] = S + cost / weight(t)``,
    where ``cost`` is what it takes of the decode engine (prompt + max tokens) and ``V`` is
    the start tag of the last request served. The next request served is the tenants' head
    with the smallest start tag (ties: arrival order). So while several tenants wait, each
    gets decode capacity in proportion to its weight however many requests it queues, a
    tenant that floods only lengthens its own FIFO, and a tenant back from idle starts at
    ``V`` (no credit saved up while away). Within a tenant, order stays FIFO.

    Requests that do not fit stop the drain (no overtaking by smaller ones), so a large
    request is never starved either.
    """

    def __init__(self, max_len: int,
                 weight_of: Callable[[str], float] = lambda _t: 1.0) -> None:
        self.max_len = max_len
        self.weight_of = weight_of
        self._by_tenant: dict[str, deque[Pending]] = {}
        self._finish: dict[str, float] = {}  # F[t]: virtual finish of t's last request
        self._heads: list[tuple[float, int, str]] = []  # (start tag, seq, tenant) heap
        self._vtime = 0.0  # V
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def full(self) -> bool:
        """No room for another request."""
        return self._len >= self.max_len

    def push(self, p: Pending) -> None:
        """Queue ``p`` behind its tenant's earlier requests, tagged for fair service."""
        tenant = p.request.tenant
        p.seq = next(self._seq)
        start = max(self._vtime, self._finish.get(tenant, 0.0))
        cost = max(1, p.request.prompt_tokens + p.request.max_tokens)
        self._finish[tenant] = start + cost / max(1e-6, self.weight_of(tenant))
        p.vstart = start
        q = self._by_tenant.get(tenant)
        if q is None:
            q = self._by_tenant[tenant] = deque()
        q.append(p)
        if len(q) == 1:
            heapq.heappush(self._heads, (start, p.seq, tenant))
        self._len += 1

    def peek(self) -> Pending | None:
        """The request to serve next: the head with the smallest virtual start tag."""
        if not self._heads:
            return None
        return self._by_tenant[self._heads[0][2]][0]

    def pop(self, p: Pending) -> None:
        """Remove ``p``, which :meth:`peek` returned."""
        _, _, tenant = heapq.heappop(self._heads)
        q = self._by_tenant[tenant]
        assert q[0] is p, "pop() takes what peek() returned"
        q.popleft()
        self._len -= 1
        self._vtime = max(self._vtime, p.vstart)
        if q:
            heapq.heappush(self._heads, (q[0].vstart, q[0].seq, tenant))
        else:
            del self._by_tenant[tenant]
            if len(self._finish) > 4 * len(self._by_tenant) + 1024:
                # Tags at or below V carry no information (max() with V wins): forget them
                # so a scheduler that saw many tenants does not grow.
                self._finish = {t: f for t, f in self._finish.items() if f > self._vtime}

    def remove_where(self, pred: Callable[[Pending], bool]) -> list[Pending]:
        """Remove and return every request matching ``pred`` (order kept for the rest)."""
        out: list[Pending] = []
        for tenant in list(self._by_tenant):
            q = self._by_tenant[tenant]
            keep = deque(p for p in q if not pred(p))
            if len(keep) == len(q):
                continue
            out.extend(p for p in q if pred(p))
            if keep:
                self._by_tenant[tenant] = keep
            else:
                del self._by_tenant[tenant]
        if out:
            self._len -= len(out)
            self._heads = [(q[0].vstart, q[0].seq, t) for t, q in self._by_tenant.items()]
            heapq.heapify(self._heads)
        return out

    def expire(self, now: float) -> list[Pending]:
        """Remove and return every request whose wait is over."""
        return self.remove_where(lambda p: p.wait_until <= now)

    def tenants(self) -> list[str]:
        """Tenants with requests waiting."""
        return list(self._by_tenant)

    def __iter__(self) -> Iterator[Pending]:
        for q in self._by_tenant.values():
            yield from q


@dataclass(slots=True)
class _Plan:
    pending: Pending
    decode: EngineView
    blocks: int
    prefill: EngineView | None


@dataclass(slots=True)
class _Outbox:
    """Answers of one round, written in one pipeline."""

    assignments: list[tuple[Pending, Assignment]] = field(default_factory=list)
    dead: list[tuple[str, dict[bytes, bytes], str]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.assignments or self.dead or self.acks)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Scheduler:
    """One member of the ``schedulers`` consumer group."""

    def __init__(
        self, settings: SchedulerSettings, client: AsyncRedis | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.s = settings
        self.keys = RedisKeys(settings.key_prefix)
        self.redis = client if client is not None else async_redis(settings)
        self._own_client = client is None
        self.resv = AsyncReservations(self.redis, self.keys)
        self.consumer = settings.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.policy = Policy.parse(settings.scheduler_placement)
        self.engines: dict[str, EngineView] = {}
        # Derived from ``engines`` on every refresh, for the per-request hot path.
        self.decoders: list[EngineView] = []
        self.prefillers: list[EngineView] = []
        self._fit_tokens = 0  # largest prompt + max_tokens some decode engine could hold
        # Tenant weights for fair queueing: tenant -> (weight, loaded at, monotonic).
        self.weights: dict[str, tuple[float, float]] = {}
        self.queue = WaitQueue(settings.scheduler_max_queue, self.weight)
        self.stats = SchedulerStats()
        self.lease_ms = int(settings.scheduler_lease_s * 1000)
        self.once_ms = int(settings.scheduler_once_ttl_s * 1000)
        self.ready = asyncio.Event()
        self._stream = self.keys.requests()
        self._group = settings.scheduler_group
        # A provider of its own (tests), else the global one run() installs from settings.
        self._own_tracing = tracer_provider is None
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)
        self.tracing = tracer_provider is not None
        self._defer = False  # answer() leaves its outbox for the next read (run loop only)
        self._unsent: _Outbox | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def setup(self) -> None:
        """Create the group (and stream) if needed, load scripts, read the engines."""
        try:
            await self.redis.xgroup_create(self._stream, self._group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
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
            self.consumer, self._stream, self._group, self.policy.value,
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
                now = loop.time()
                if now >= next_claim:
                    await self.reclaim()
                    next_claim = now + claim_s
                if now >= next_sweep:
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
                    # The answers ride with the next read (see read()).
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
            if self._unsent:
                # Stopping: answer what was decided (else it waits to be reclaimed).
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._flush())

    async def close(self) -> None:
        """Close the Redis client if this scheduler made it."""
        if self._own_client:
            await self.redis.aclose()

    # -- engine view ------------------------------------------------------------------

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

    async def sweep(self) -> None:
        """Purge expired reservations everywhere; forget engines with nothing left."""
        await trim_behind_groups(self.redis, self._stream)
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

    # -- reading ----------------------------------------------------------------------

    async def read(self, block_ms: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """New entries for this consumer (blocks up to ``block_ms``).

        Answers the run loop deferred are written first, in the same round trip: Redis runs
        the writes before the read blocks, so they are not delayed, and a busy loop costs
        two round trips per batch instead of three.
        """
        flush, self._unsent = self._unsent, None
        if flush:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_answer(pipe, flush)
            pipe.xreadgroup(self._group, self.consumer, {self._stream: ">"},
                            count=self.s.scheduler_batch, block=block_ms)
            res = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            for r in res[:-1]:
                if isinstance(r, Exception):
                    raise r  # like answer(): the entries stay pending, reclaimed later
            self._answered(flush)
            reply = res[-1]
            if isinstance(reply, Exception):
                raise reply
        else:
            reply = await self.redis.xreadgroup(
                self._group, self.consumer, {self._stream: ">"},
                count=self.s.scheduler_batch, block=block_ms,
            )
            self.stats.round_trips += 1
        if not reply:
            return []
        return reply[0][1]

    async def reclaim(self) -> None:
        """Keep our waiting entries ours; take over entries a dead scheduler left pending."""
        waiting = [p.entry_id for p in self.queue]
        if waiting:
            await self.redis.xclaim(
                self._stream, self._group, self.consumer, 0, waiting, justid=True
            )
            self.stats.round_trips += 1
        reply = await self.redis.xautoclaim(
            self._stream, self._group, self.consumer, self.s.scheduler_claim_idle_ms,
            start_id="0-0", count=self.s.scheduler_batch,
        )
        self.stats.round_trips += 1
        mine = {p.entry_id for p in self.queue}
        claimed = [(eid, f) for eid, f in reply[1] if f is not None and _s(eid) not in mine]
        if not claimed:
            return
        ids = sorted((_s(eid) for eid, _ in claimed), key=entry_id_key)
        info = await self.redis.xpending_range(
            self._stream, self._group, min=ids[0], max=ids[-1], count=len(ids) + len(self.queue),
            consumername=self.consumer,
        )
        self.stats.round_trips += 1
        deliveries = {_s(x["message_id"]): int(x["times_delivered"]) for x in info}
        self.stats.reclaimed += len(claimed)
        logger.info("reclaimed %d entries left pending by another scheduler", len(claimed))
        await self.handle_entries(claimed, deliveries=deliveries)

    # -- the decision -----------------------------------------------------------------

    async def handle_entries(
        self,
        entries: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[str, int] | None = None,
    ) -> None:
        """Decode, place, reserve and answer a batch of entries."""
        t0 = time.monotonic()
        out = _Outbox()
        fresh: list[Pending] = []
        for raw_id, fields in entries:
            eid = _s(raw_id)
            self.stats.read += 1
            n = (deliveries or {}).get(eid, 1)
            if n > self.s.scheduler_max_deliveries:
                out.dead.append((eid, fields, f"delivered {n} times (max "
                                              f"{self.s.scheduler_max_deliveries})"))
                continue
            p = self._parse(eid, fields, t0, out)
            if p is None:
                continue
            p.redelivered = deliveries is not None
            fresh.append(p)
        if any(p.redelivered for p in fresh):
            await self._load_markers(fresh)
        plans: list[_Plan] = []
        for p in fresh:
            if now_ms() >= p.request.deadline_ms:
                self._reject(p, out, "deadline", "deadline passed before scheduling")
            elif self.decoders and not self._fits_somewhere(p):
                self._reject(p, out, "too_large", _TOO_LARGE)
            elif not self._has_other_decode(p):
                self._reject(p, out, "no_engine", "no other decode engine is alive")
            elif len(self.queue) or not self._plan_into(p, plans):
                if self.queue.full():
                    self._reject(p, out, "overloaded", "scheduler queue is full")
                else:
                    self.queue.push(p)
        if len(self.queue):
            # Whatever still fits goes now, in fair order: a light tenant's new request
            # overtakes a flooding tenant's backlog without waiting for the next retry.
            self._plan_queue(plans)
        await self._execute(plans, out)
        await self.answer(out)

    def _parse(self, eid: str, fields: dict[bytes, bytes], t0: float,
               out: _Outbox) -> Pending | None:
        now = now_ms()
        try:
            req, tp = parse_entry(fields, self.keys, now)
        except BadEntry as exc:
            out.dead.append((eid, fields, str(exc)))
            return None
        left_s = (req.deadline_ms - now) / 1000
        wait = min(self.s.scheduler_queue_timeout_s, max(0.0, left_s))
        return Pending(eid, req, tp, t0, t0 + wait, read_ns=time.time_ns())

    async def _load_markers(self, items: list[Pending]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for p in items:
            pipe.get(self.keys.request_once(p.request.request_id))
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
        for p, v in zip(items, raw, strict=True):
            if v is not None and not isinstance(v, Exception):
                entry, _, engine = text(v).partition("|")
                if entry == p.entry_id:
                    p.preferred_engine = engine or None

    def _plan_into(self, p: Pending, plans: list[_Plan], skip: frozenset[str] = frozenset()
                   ) -> bool:
        """Pick engines for ``p`` by the local view and book them there; False if none fits."""
        req = p.request
        if req.exclude_engines:
            skip = skip | frozenset(req.exclude_engines)
        pref = self.engines.get(p.preferred_engine or "")
        if pref is not None and pref.role in DECODE_ROLES and pref.engine_id not in skip:
            # A redelivered entry goes back where its first attempt may hold a reservation:
            # the local view counts that reservation as taken, the script returns it.
            dec = pref
            blocks = blocks_needed(req.prompt_tokens, req.max_tokens, pref.block_size)
        else:
            best = None
            if req.avoid_engines:
                best = best_decode(self.decoders, req.prompt_tokens, req.max_tokens,
                                   self.policy, skip | frozenset(req.avoid_engines))
            best = best or best_decode(self.decoders, req.prompt_tokens, req.max_tokens,
                                       self.policy, skip)
            if best is None:
                return False
            dec, blocks = best
        pre = None
        if req.prompt_tokens >= self.s.scheduler_min_disagg_tokens:
            never = {dec.engine_id, *req.exclude_engines}
            pre = (pick_prefill(self.prefillers, exclude=never | set(req.avoid_engines))
                   or pick_prefill(self.prefillers, exclude=never))
            if pre is not None:
                pre.pending_prompt_tokens += req.prompt_tokens
        dec.reserved_blocks += blocks
        plans.append(_Plan(p, dec, blocks, pre))
        return True

    async def _execute(self, plans: list[_Plan], out: _Outbox) -> None:
        """Reserve every plan in one pipeline; retry the ones that lost a race elsewhere."""
        tried: dict[str, set[str]] = {}
        while plans:
            pipe = self.redis.pipeline(transaction=False)
            for pl in plans:
                rid = pl.pending.request.request_id
                pipe.set(self.keys.request_once(rid), f"{pl.pending.entry_id}|"
                         f"{pl.decode.engine_id}", nx=True, get=True, px=self.once_ms)
                self.resv.queue_reserve(pipe, pl.decode.engine_id, rid, pl.blocks, self.lease_ms)
            raw = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            if any(isinstance(x, NoScriptError) for x in raw):
                await self.resv.load()  # reserve and SET NX GET are both safe to repeat
                continue
            retry: list[_Plan] = []
            fixups = []
            for i, pl in enumerate(plans):
                marker, res = raw[2 * i], raw[2 * i + 1]
                if isinstance(res, Exception) or isinstance(marker, Exception):
                    logger.error("reserve for %s on %s failed: %s",
                                 pl.pending.request.request_id, pl.decode.engine_id,
                                 res if isinstance(res, Exception) else marker)
                    self._undo_local(pl)
                    if isinstance(marker, Exception):
                        self._requeue_or_reject(pl.pending, out)
                        continue
                    # The engine's reservation keys are broken (garbage written there):
                    # try the others rather than come back to it on every retry.
                    skip = tried.setdefault(pl.pending.entry_id, set())
                    skip.add(pl.decode.engine_id)
                    if not self._plan_into(pl.pending, retry, frozenset(skip)):
                        self._requeue_or_reject(pl.pending, out)
                    continue
                result = parse_reserve(pl.decode.engine_id, pl.pending.request.request_id, res)
                pl.decode.reserved_blocks = result.reserved_blocks
                owner = None
                if marker is not None:
                    owner, _, _ = text(marker).partition("|")
                if owner is not None and owner != pl.pending.entry_id:
                    await self._duplicate(pl, result, owner, out)
                    continue
                if result.ok:
                    if owner is not None:
                        fixups.append(pl)  # redelivery: make the marker name this engine
                    self._assign(pl, result, out)
                    continue
                self._undo_prefill(pl)
                if result.status in (ReserveStatus.ENGINE_GONE, ReserveStatus.NOT_DECODE):
                    rest = dict(self.engines)
                    rest.pop(pl.decode.engine_id, None)
                    self._set_engines(rest)
                elif result.status is ReserveStatus.DRAINING:
                    pl.decode.draining = True  # marked since our last refresh
                    self._set_engines(self.engines)
                skip = tried.setdefault(pl.pending.entry_id, set())
                skip.add(pl.decode.engine_id)
                pl.pending.preferred_engine = None
                if not self._plan_into(pl.pending, retry, frozenset(skip)):
                    self._requeue_or_reject(pl.pending, out)
            if fixups:
                pipe = self.redis.pipeline(transaction=False)
                for pl in fixups:
                    pipe.set(self.keys.request_once(pl.pending.request.request_id),
                             f"{pl.pending.entry_id}|{pl.decode.engine_id}", px=self.once_ms)
                await pipe.execute()
                self.stats.round_trips += 1
            plans = retry

    async def _duplicate(self, pl: _Plan, result: ReserveResult, owner: str,
                         out: _Outbox) -> None:
        """``pl``'s request id belongs to another entry: undo what we took, dead-letter it."""
        self.stats.duplicates += 1
        self._undo_prefill(pl)
        if result.status is ReserveStatus.RESERVED and result.reservation is not None:
            # The original holds nothing on this engine, so this reservation is ours alone.
            await self.resv.release(pl.decode.engine_id, result.reservation.reservation_id,
                                    result.reservation.fencing_token)
            self.stats.round_trips += 1
            pl.decode.reserved_blocks -= pl.blocks
        out.dead.append((pl.pending.entry_id, self._fields(pl.pending),
                         f"duplicate request id {pl.pending.request.request_id} "
                         f"(first seen in entry {owner})"))

    def _undo_prefill(self, pl: _Plan) -> None:
        if pl.prefill is not None:
            pl.prefill.pending_prompt_tokens -= pl.pending.request.prompt_tokens

    def _undo_local(self, pl: _Plan) -> None:
        self._undo_prefill(pl)
        pl.decode.reserved_blocks -= pl.blocks

    def _has_other_decode(self, p: Pending) -> bool:
        """False when the request excludes every live decode engine (a re-route after a
        failure): waiting cannot help it, its gateway answers at once."""
        ex = p.request.exclude_engines
        return not ex or any(e.engine_id not in ex for e in self.decoders)

    def _requeue_or_reject(self, p: Pending, out: _Outbox) -> None:
        if self.queue.full():
            self._reject(p, out, "overloaded", "scheduler queue is full")
        else:
            self.queue.push(p)

    def _fields(self, p: Pending) -> dict[bytes, bytes]:
        return {b"m": encode(p.request), b"tp": p.traceparent}

    def _assign(self, pl: _Plan, result: ReserveResult, out: _Outbox) -> None:
        r = result.reservation
        assert r is not None
        pre = pl.prefill
        a = Assignment(
            request_id=pl.pending.request.request_id,
            prefill_engine=pre.engine_id if pre else None,
            prefill_url=pre.url if pre else None,
            decode_engine=pl.decode.engine_id,
            decode_url=pl.decode.url,
            reservation_id=r.reservation_id,
            fencing_token=r.fencing_token,
            blocks=r.blocks,
            lease_expiry_ms=r.expiry_ms,
            disaggregated=pre is not None,
        )
        out.assignments.append((pl.pending, a))
        out.acks.append(pl.pending.entry_id)
        self.stats.assigned += 1

    def _reject(self, p: Pending, out: _Outbox, kind: str, error: str) -> None:
        retry = None if kind in ("too_large", "deadline") else self.s.scheduler_retry_after_s
        a = Assignment(request_id=p.request.request_id, ok=False, error=error,
                       error_kind=kind, retry_after_s=retry)
        out.assignments.append((p, a))
        out.acks.append(p.entry_id)
        self.stats.rejected += 1
        logger.info("rejected %s (%s): %s", p.request.request_id, kind, error)

    async def drain(self) -> None:
        """Serve waiting requests in order while they fit; reject the ones that waited out."""
        if not len(self.queue):
            return
        out = _Outbox()
        if self.decoders:
            # Engines that showed up since these requests arrived may all be too small.
            for p in self.queue.remove_where(lambda p: not self._fits_somewhere(p)):
                self._reject(p, out, "too_large", _TOO_LARGE)
        for p in self.queue.expire(time.monotonic()):
            if now_ms() >= p.request.deadline_ms:
                self._reject(p, out, "deadline", "deadline passed while waiting for a slot")
            elif not self.decoders:
                self._reject(p, out, "no_engine", "no decode engine is alive")
            else:
                self._reject(p, out, "overloaded",
                             "no decode slot freed up within the queue timeout")
        plans: list[_Plan] = []
        self._plan_queue(plans)
        await self._execute(plans, out)
        await self.answer(out)

    def _plan_queue(self, plans: list[_Plan]) -> None:
        while (p := self.queue.peek()) is not None and self._plan_into(p, plans):
            self.queue.pop(p)

    async def answer(self, out: _Outbox) -> None:
        """Write assignments and dead letters, then acknowledge, in one pipeline.

        Inside the run loop's batch handling the write is deferred to the next read."""
        if not out:
            return
        if self._defer:
            if self._unsent is None:
                self._unsent = out
            else:
                u = self._unsent
                u.assignments += out.assignments
                u.dead += out.dead
                u.acks += out.acks
            return
        pipe = self.redis.pipeline(transaction=False)
        self._queue_answer(pipe, out)
        await pipe.execute()
        self.stats.round_trips += 1
        self._answered(out)

    async def _flush(self) -> None:
        out, self._unsent = self._unsent, None
        if out:
            await self.answer(out)

    def _queue_answer(self, pipe: Any, out: _Outbox) -> None:
        gateways = set()
        for p, a in out.assignments:
            pipe.xadd(self.keys.assignments(p.request.gateway_id), {b"m": encode(a)},
                      maxlen=self.s.scheduler_assign_maxlen, approximate=True)
            gateways.add(p.request.gateway_id)
        for g in gateways:
            # A gateway id nobody reads (gone for good, or made up by whoever wrote the
            # entry) must not leave a stream behind forever; a live gateway's XREAD cursor
            # works on a stream created again after it expired.
            pipe.pexpire(self.keys.assignments(g), _ASSIGN_TTL_MS)
        for eid, fields, reason in out.dead:
            logger.warning("dead-lettering entry %s: %s", eid, reason)
            entry = {b"entry": eid, b"reason": reason, b"consumer": self.consumer}
            entry.update(dead_letter_fields(fields))
            pipe.xadd(self.keys.dead_letters(), entry, maxlen=self.s.scheduler_dead_maxlen,
                      approximate=True)
        acks = out.acks + [eid for eid, _, _ in out.dead]
        if acks:
            pipe.xack(self._stream, self._group, *acks)

    def _answered(self, out: _Outbox) -> None:
        self.stats.dead += len(out.dead)
        done = time.monotonic()
        self.stats.decision_s.extend(done - p.arrived for p, _ in out.assignments)
        if self.tracing:
            end_ns = time.time_ns()
            for p, a in out.assignments:
                self._trace(p, a, end_ns, done)

    def _trace(self, p: Pending, a: Assignment, end_ns: int, done: float) -> None:
        """CONSUMER span (child of the gateway's PRODUCER span via ``tp``) and the match."""
        req = p.request
        consumer = self.tracer.start_span(
            f"process {self._stream}", context=context_from_traceparent(p.traceparent),
            kind=SpanKind.CONSUMER, start_time=p.read_ns or end_ns, attributes={
                "messaging.system": "redis", "messaging.destination.name": self._stream,
                "messaging.operation.type": "process",
                "messaging.consumer.group.name": self._group,
                "messaging.message.id": p.entry_id, "kvpush.request_id": req.request_id,
                "kvpush.tenant": req.tenant, "kvpush.scheduler": self.consumer,
                "kvpush.redelivered": p.redelivered})
        attrs: dict[str, Any] = {
            "kvpush.request_id": req.request_id, "kvpush.tenant": req.tenant,
            "kvpush.prompt_tokens": req.prompt_tokens, "kvpush.max_tokens": req.max_tokens,
            # Read -> answered (held back for capacity, if it waited) and XADD -> read.
            "kvpush.queue_wait_ms": round((done - p.arrived) * 1000, 3),
            "kvpush.stream_wait_ms": max(0, p.read_ns // 1_000_000 - req.enqueued_ms)
            if req.enqueued_ms and p.read_ns else 0,
        }
        if a.ok:
            attrs.update({
                "kvpush.decode_engine": a.decode_engine or "",
                "kvpush.prefill_engine": a.prefill_engine or "",
                "kvpush.blocks": a.blocks, "kvpush.reservation_id": a.reservation_id or "",
                "kvpush.fencing_token": a.fencing_token,
                "kvpush.disaggregated": a.disaggregated})
        else:
            attrs["kvpush.rejected"] = a.error_kind or "rejected"
        match = self.tracer.start_span("kvpush.match", context=trace.set_span_in_context(
            consumer), start_time=p.read_ns or end_ns, attributes=attrs)
        if not a.ok:
            status = Status(StatusCode.ERROR, a.error or a.error_kind or "rejected")
            match.set_status(status)
            consumer.set_status(status)
        match.end(end_ns)
        consumer.end(end_ns)


# Longest pause between attempts to get back to an unreachable Redis.
_MAX_BACKOFF_S = 2.0


def _lost_redis(exc: BaseException) -> bool:
    """Errors that mean Redis went away (or restarted empty), not a bug: retry them."""
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
    backoff = 0.1
    try:
        while True:
            started = time.monotonic()
            try:
                await sched.run()
                return
            except Exception as exc:
                if not _lost_redis(exc):
                    raise
                if time.monotonic() - started > 10 * _MAX_BACKOFF_S:
                    backoff = 0.1  # it ran fine for a while: this is a new outage
                logger.warning("scheduler %s lost Redis (%s: %s); retrying in %.1f s",
                               sched.consumer, type(exc).__name__, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
    finally:
        with contextlib.suppress(Exception):
            await sched.close()


def main() -> None:
    """``kvpush scheduler``: run one scheduler in this process on uvloop."""
    from kvpush.common.log import setup_logging
    from kvpush.common.runtime import run

    settings = SchedulerSettings()
    setup_logging(settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        run(run_scheduler(settings))


if __name__ == "__main__":
    main()
