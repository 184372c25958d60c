"""What one scheduler holds: settings, Redis handles, the engine view, the queue, counters."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from kvpush.common.engine_view import EngineView
from kvpush.common.history_cost import HistoryCost
from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncRedis, async_redis
from kvpush.common.reservations import AsyncReservations
from kvpush.common.settings import SchedulerSettings
from kvpush.common.telemetry import TRACER_NAME
from kvpush.common.wire import Assignment
from kvpush.services.scheduler.fair_queue import Pending, WaitQueue
from kvpush.services.scheduler.placement import Policy
from kvpush.services.scheduler.placement_index import EngineIndex
from kvpush.services.scheduler.shard_readers import ShardReaders


class SchedulerError(RuntimeError):
    """The scheduler cannot start (bad settings, Redis unreachable)."""


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
    affinity_hits: int = 0  # placed on the engine holding the prompt's prefix over another
    decode_alone: int = 0  # decode held all but a short tail: no prefill, no transfer
    history_pushes: int = 0  # another engine pushes the prompt's held prefix to prefill
    history_declined: int = 0  # histories the cost model would recompute (explored or not)
    prefill_kept: int = 0  # plans that kept the prefill the gateway sent the prompt to
    answered_again: int = 0  # redeliveries answered with their first, vanished, placement
    # Read -> answer sent to Redis, per request; bounded so a long-running scheduler does not
    # grow.
    decision_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))


@dataclass(slots=True)
class Plan:
    """Engines picked for one request by the local view, not yet reserved in Redis."""

    pending: Pending
    decode: EngineView
    blocks: int
    prefill: EngineView | None
    cached_tokens: int = 0  # prompt tokens the decode holds, by its KV events
    history: EngineView | None = None  # pushes the prompt's first history_tokens to prefill
    history_tokens: int = 0
    prefill_held_tokens: int = 0  # what the prefill holds itself, by its KV events
    history_cost: HistoryCost | None = None  # whether a holder pushes it, and why


Entry = tuple[int, bytes, dict[bytes, bytes]]
"""One request stream entry as read: (shard, entry id, fields)."""


@dataclass(slots=True)
class Outbox:
    """Answers of one round, written in one pipeline."""

    assignments: list[tuple[Pending, Assignment]] = field(default_factory=list)
    # (shard, entry id, fields, reason)
    dead: list[tuple[int, str, dict[bytes, bytes], str]] = field(default_factory=list)
    acks: list[tuple[int, str]] = field(default_factory=list)  # (shard, entry id)

    def __bool__(self) -> bool:
        return bool(self.assignments or self.dead or self.acks)


def as_str(v: Any) -> str:
    """A stream entry id (bytes from Redis) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)


class SchedulerState:
    """The state every part of :class:`~kvpush.services.scheduler.Scheduler` shares.

    The parts (engine view, stream I/O, decision) are mixins over this class; one asyncio
    task runs them all, so nothing here needs a lock.
    """

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
        # ``decoders`` and ``prefillers`` in placement order: a pick costs O(log N).
        self.index = EngineIndex(self.policy)
        self._fit_tokens = 0  # largest prompt + max_tokens some decode engine could hold
        # Tenant weights for fair queueing: tenant -> (weight, loaded at, monotonic).
        self.weights: dict[str, tuple[float, float]] = {}
        self.queue = WaitQueue(settings.scheduler_max_queue, self.weight)
        self.stats = SchedulerStats()
        self.lease_ms = int(settings.scheduler_lease_s * 1000)
        self.once_ms = int(settings.scheduler_once_ttl_s * 1000)
        self.ready = asyncio.Event()
        self._streams = self.keys.request_streams(settings.request_shards)
        self._shard_of = {k.encode(): i for i, k in enumerate(self._streams)}
        # XREADGROUP's COUNT is per stream: a read takes about scheduler_batch in all.
        self._read_count = -(-settings.scheduler_batch // len(self._streams))
        self._group = settings.scheduler_group
        self._readers: ShardReaders | None = None  # Cluster with several shards only
        # A provider of its own (tests), else the global one run() installs from settings.
        self._own_tracing = tracer_provider is None
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)
        self.tracing = tracer_provider is not None
        self._defer = False  # answer() leaves its outbox for the next read (run loop only)
        self._unsent: Outbox | None = None

    @property
    def request_streams(self) -> list[str]:
        """The request stream of every shard this scheduler reads."""
        return list(self._streams)

    @property
    def consumer_group(self) -> str:
        """The consumer group this scheduler reads the request streams in."""
        return self._group

    # The parts call each other through ``self``; these are the calls that cross parts.

    def weight(self, tenant: str) -> float:
        """Fair-share weight of ``tenant`` (engine view: ``engines.py``)."""
        raise NotImplementedError

    async def handle_entries(
        self,
        entries: list[Entry],
        deliveries: dict[tuple[int, str], int] | None = None,
    ) -> None:
        """Decode, place, reserve and answer a batch of entries (``decide.py``)."""
        raise NotImplementedError

    async def answer(self, out: Outbox) -> None:
        """Write ``out``'s answers and acknowledge (``streams.py``)."""
        raise NotImplementedError
