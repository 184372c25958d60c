"""Engine heartbeat: scrapes a vLLM server's /metrics and publishes its status to Redis."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import LuaScript, SyncRedis
from kvpush.common.wire import EngineStatus, encode, now_ms
from kvpush.services.engine.cost_meter import CostMeter, Counters

logger = logging.getLogger(__name__)


class MetricsUnavailable(RuntimeError):
    """The engine's /metrics could not be read or lacks the KV cache figures."""


@dataclass(frozen=True)
class Sample:
    """One Prometheus sample: full name (``_total``/``_sum`` suffixes kept), labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample in a Prometheus text exposition."""
    out: list[Sample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append(Sample(s.name, dict(s.labels), float(s.value)))
    return out


def metric_sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0.0 when none)."""
    total = 0.0
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def find_sample(samples: Iterable[Sample], name: str) -> Sample | None:
    """First sample called ``name``, or None."""
    return next((s for s in samples if s.name == name), None)


@dataclass(frozen=True)
class EngineLoad:
    """What the heartbeat reads from vLLM's metrics."""

    block_size: int
    total_blocks: int
    free_blocks: int
    running: int
    waiting: int


def engine_load(samples: list[Sample]) -> EngineLoad:
    """KV capacity and queue depth from vLLM's Prometheus samples."""
    info = find_sample(samples, "vllm:cache_config_info")
    if info is None or not info.labels.get("num_gpu_blocks", "").isdigit():
        raise MetricsUnavailable("vllm:cache_config_info with num_gpu_blocks is missing")
    total = int(info.labels["num_gpu_blocks"])
    block_size = int(info.labels.get("block_size", "0") or 0)
    usage = metric_sum(samples, "vllm:kv_cache_usage_perc")
    free = max(0, min(total, round(total * (1.0 - usage))))
    return EngineLoad(
        block_size=block_size,
        total_blocks=total,
        free_blocks=free,
        running=int(metric_sum(samples, "vllm:num_requests_running")),
        waiting=int(metric_sum(samples, "vllm:num_requests_waiting")),
    )


def read_counters(samples: list[Sample]) -> Counters:
    """What the history cost model's meter reads: vLLM's per-request prefill series and the
    connector's history waits (0 when absent)."""
    return Counters(
        prefill_requests=metric_sum(samples, "vllm:request_prefill_time_seconds_count"),
        prefill_tokens=metric_sum(samples, "vllm:request_prefill_kv_computed_tokens_sum"),
        prefill_s=metric_sum(samples, "vllm:request_prefill_time_seconds_sum"),
        history_receives=metric_sum(samples, "kvpush_kv_history_wait_seconds_count"),
        history_wait_s=metric_sum(samples, "kvpush_kv_history_wait_seconds_sum"),
    )


def scrape(url: str, client: httpx.Client | None = None, timeout_s: float = 2.0) -> list[Sample]:
    """Samples from ``url``/metrics."""
    try:
        if client is not None:
            resp = client.get(f"{url}/metrics", timeout=timeout_s)
        else:
            resp = httpx.get(f"{url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise MetricsUnavailable(f"cannot read {url}/metrics: {exc}") from exc
    return parse_metrics(resp.text)


def status_fields(status: EngineStatus) -> dict[str, bytes | str | int]:
    """The hash fields of ``kvpush:engine:{E}``: plain copies for Lua and humans, plus ``m``."""
    return {
        "role": status.role,
        "url": status.url,
        "model": status.model,
        "block_size": status.block_size,
        "total_blocks": status.total_blocks,
        "free_blocks": status.free_blocks,
        "running": status.running,
        "waiting": status.waiting,
        "generation": status.generation,
        "connector": status.connector,
        "updated_ms": status.updated_ms,
        "kv_events": int(status.kv_events),
        "continues": int(status.continues),
        "prefill_tok_s": status.prefill_tok_s,
        "history_wait_ms": status.history_wait_ms,
        "m": encode(status),
    }


# The hash and its TTL in one step (one key, one slot): never a status without a TTL. A
# script rather than MULTI: redis-py's cluster client re-routes a command after a failover,
# but a MULTI pipeline keeps going to the dead master's address (it reloads the slot map
# only after several failures within one pipeline, and every beat makes a new one).
_BEAT = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""


def publish_status(
    client: SyncRedis, keys: RedisKeys, status: EngineStatus, ttl_s: float
) -> None:
    """Write one heartbeat: the hash with its TTL (one slot, atomic), then the index score.

    The hash and the index live in different Cluster slots, so no script may span them.
    Writing the hash first means a reader never finds a fresh index entry without its hash;
    readers still skip an entry whose hash is gone (it expired, or the engine withdrew).
    """
    fields = [x for kv in status_fields(status).items() for x in kv]
    LuaScript(client, _BEAT)(keys=[keys.engine(status.engine_id)],
                             args=[max(1, int(ttl_s * 1000)), *fields])
    client.zadd(keys.engines(), {status.engine_id: status.updated_ms})


def remove_status(client: SyncRedis, keys: RedisKeys, engine_id: str) -> None:
    """Withdraw an engine: its index entry first, then its status hash (separate slots)."""
    client.zrem(keys.engines(), engine_id)
    client.delete(keys.engine(engine_id))


class StatusPublisher:
    """Background thread that publishes an engine's status every ``interval_s``.

    It starts publishing only once the engine answers /metrics, keeps going through
    scrape errors (the TTL makes a dead engine vanish on its own) and removes the status
    on :meth:`stop`.
    """

    def __init__(
        self,
        client: SyncRedis,
        *,
        engine_id: str,
        role: str,
        url: str,
        model: str,
        connector: str,
        generation: int,
        kv_events: bool = False,
        continues: bool = False,
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
        key_prefix: str = "kvpush",
    ) -> None:
        self.client = client
        self.keys = RedisKeys(key_prefix)
        self.engine_id = engine_id
        self.role = role
        self.url = url
        self.model = model
        self.connector = connector
        self.generation = generation
        self.kv_events = kv_events
        self.continues = continues
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.published = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client()
        self.meter = CostMeter()

    def status(self, load: EngineLoad) -> EngineStatus:
        """The :class:`EngineStatus` for ``load`` as of now."""
        return EngineStatus(
            engine_id=self.engine_id,
            role=self.role,
            url=self.url,
            model=self.model,
            block_size=load.block_size,
            total_blocks=load.total_blocks,
            free_blocks=load.free_blocks,
            running=load.running,
            waiting=load.waiting,
            generation=self.generation,
            connector=self.connector,
            updated_ms=now_ms(),
            kv_events=self.kv_events,
            continues=self.continues,
            prefill_tok_s=self.meter.prefill_tok_s,
            history_wait_ms=self.meter.history_wait_ms,
        )

    def publish_once(self) -> EngineStatus:
        """Scrape and publish one heartbeat now."""
        samples = scrape(self.url, self._http)
        load = engine_load(samples)
        self.meter.feed(read_counters(samples))
        status = self.status(load)
        publish_status(self.client, self.keys, status, self.ttl_s)
        self.published += 1
        return status

    def start(self) -> StatusPublisher:
        """Start the heartbeat thread."""
        self._thread = threading.Thread(
            target=self._run, name=f"kvpush-heartbeat-{self.engine_id}", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.publish_once()
                failures = 0
            except (MetricsUnavailable, redis.RedisError) as exc:
                failures += 1
                # One line per outage rather than one per beat.
                if failures == 1:
                    logger.warning("heartbeat of %s failed: %s", self.engine_id, exc)
            self._stop.wait(self.interval_s)

    def stop(self, remove: bool = True) -> None:
        """Stop the thread and, on a clean shutdown, withdraw the engine's status."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if remove:
            try:
                remove_status(self.client, self.keys, self.engine_id)
            except redis.RedisError as exc:
                logger.warning("could not remove status of %s: %s", self.engine_id, exc)
        self._http.close()
