"""Agent registry in Redis: publish this worker's ``AgentInfo`` under a TTL, fetch peers'."""

from __future__ import annotations

import contextlib
import logging
import threading

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, WireError, decode, encode, now_ms

logger = logging.getLogger(__name__)


class AgentNotFound(LookupError):
    """A peer's agent metadata is not in Redis (engine down, or not started yet)."""


class StaleAgent(LookupError):
    """The peer in Redis is not the generation a push target names (it restarted)."""


class AgentRegistry:
    """Publishes one local ``AgentInfo`` and caches the peers' ones.

    Peers are fetched lazily on first use and cached; a target that names another
    generation than the cached one causes one refetch, so a restarted peer is picked up
    without polling Redis on every push.
    """

    def __init__(self, client: redis.Redis, keys: RedisKeys, ttl_s: float = 10.0,
                 heartbeat_s: float = 2.0) -> None:
        self._r = client
        self._keys = keys
        self._ttl_ms = int(ttl_s * 1000)
        self._heartbeat_s = heartbeat_s
        self._cache: dict[tuple[str, int], AgentInfo] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._local: AgentInfo | None = None

    # -- local ---------------------------------------------------------------------------
    def publish(self, info: AgentInfo) -> None:
        """Publish ``info`` now and keep refreshing it until :meth:`close`."""
        self._local = info
        self._write()
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, name="kvpush-agent-hb",
                                            daemon=True)
            self._thread.start()

    def _write(self) -> None:
        assert self._local is not None
        info = self._local
        info.published_ms = now_ms()
        self._r.set(self._keys.agent(info.engine_id, info.rank), encode(info), px=self._ttl_ms)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self._write()
            except redis.RedisError as exc:
                logger.warning("agent heartbeat to Redis failed: %s", exc)

    def close(self) -> None:
        """Stop the heartbeat and remove the local entry (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._local is not None:
            with contextlib.suppress(redis.RedisError):
                self._r.delete(self._keys.agent(self._local.engine_id, self._local.rank))

    # -- peers ---------------------------------------------------------------------------
    def fetch(self, engine_id: str, rank: int, generation: int | None = None) -> AgentInfo:
        """The peer's ``AgentInfo``: cached, refetched when ``generation`` differs."""
        key = (engine_id, rank)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and (generation is None or cached.generation == generation):
            return cached
        raw = self._r.get(self._keys.agent(engine_id, rank))
        if raw is None:
            raise AgentNotFound(f"no agent metadata for engine {engine_id!r} rank {rank}")
        try:
            info = decode(raw, AgentInfo)
        except WireError as exc:
            raise AgentNotFound(f"bad agent metadata for {engine_id!r}: {exc}") from exc
        if generation is not None and info.generation != generation:
            raise StaleAgent(
                f"engine {engine_id!r} rank {rank} is generation {info.generation}, "
                f"target wants {generation}"
            )
        with self._lock:
            self._cache[key] = info
        return info

    def forget(self, engine_id: str, rank: int) -> None:
        """Drop a cached peer (after a transfer error) so the next use refetches it."""
        with self._lock:
            self._cache.pop((engine_id, rank), None)
