"""Helpers for the scheduler and gateway tests: fake engine heartbeats, enqueue, read answers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import async_redis
from kvpush.common.reservations import Reservations, live_reservations
from kvpush.common.settings import SchedulerSettings
from kvpush.common.wire import Assignment, EngineStatus, ScheduleRequest, decode, encode, now_ms
from kvpush.services.scheduler import Scheduler, run_scheduler

K = RedisKeys()
TP = b"00-0123456789abcdef0123456789abcdef-0123456789abcdef-01"


def engine_status(engine_id: str, role: str = "decode", total: int = 100,
                  free: int | None = None, url: str = "http://127.0.0.1:1",
                  block_size: int = 16, generation: int = 1, queued: int = 0,
                  model: str = "tiny", kv_events: bool = False, prefill_tok_s: int = 0,
                  history_wait_ms: int = 0) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id, role=role, url=url, model=model, block_size=block_size,
        total_blocks=total, free_blocks=total if free is None else free,
        generation=generation, queued_prompt_tokens=queued, updated_ms=now_ms(),
        kv_events=kv_events, prefill_tok_s=prefill_tok_s, history_wait_ms=history_wait_ms,
    )


def publish(client: redis.Redis, st: EngineStatus, ttl_ms: int = 600_000) -> None:
    """One heartbeat, laid out as docs/contracts.md says (plain fields + ``m``, TTL, index)."""
    key = K.engine(st.engine_id)
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, mapping={
        "role": st.role, "url": st.url, "model": st.model, "block_size": st.block_size,
        "total_blocks": st.total_blocks, "free_blocks": st.free_blocks, "running": st.running,
        "waiting": st.waiting, "generation": st.generation, "connector": st.connector,
        "updated_ms": st.updated_ms, "kv_events": int(st.kv_events),
        "prefill_tok_s": st.prefill_tok_s, "history_wait_ms": st.history_wait_ms,
        "m": encode(st),
    })
    pipe.pexpire(key, ttl_ms)
    pipe.zadd(K.engines(), {st.engine_id: st.updated_ms})
    pipe.execute()


def request(prompt_tokens: int = 100, max_tokens: int = 16, gateway: str = "gw1",
            rid: str | None = None, deadline_s: float = 300.0,
            tenant: str = "default") -> ScheduleRequest:
    return ScheduleRequest(
        request_id=rid or f"cmpl-{uuid.uuid4().hex}", gateway_id=gateway, tenant=tenant,
        prompt_tokens=prompt_tokens, max_tokens=max_tokens,
        deadline_ms=now_ms() + int(deadline_s * 1000), enqueued_ms=now_ms(),
    )


def enqueue(client: redis.Redis, req: ScheduleRequest, shards: int = 1) -> str:
    """What a gateway does: XADD to the request's shard."""
    return client.xadd(K.requests_for(req.request_id, shards),
                       {b"m": encode(req), b"tp": TP}).decode()


def assignments(client: redis.Redis, gateway: str = "gw1") -> list[Assignment]:
    return [decode(f[b"m"], Assignment) for _, f in client.xrange(K.assignments(gateway))]


def dead_letters(client: redis.Redis) -> list[dict[bytes, bytes]]:
    return [f for _, f in client.xrange(K.dead_letters())]


async def wait_for(pred, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``pred`` until true; the timeout only keeps a broken build from hanging."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def settings(redis_url: str, **kw: object) -> SchedulerSettings:
    base: dict[str, object] = {
        "redis_url": redis_url, "scheduler_id": f"s-{uuid.uuid4().hex[:6]}",
        "scheduler_refresh_s": 0.05, "scheduler_queue_timeout_s": 30.0,
    }
    base.update(kw)
    return SchedulerSettings(**base)


@contextlib.asynccontextmanager
async def running(s: SchedulerSettings, cls: type[Scheduler] = Scheduler,
                  tracer_provider: Any = None, survive: bool = False
                  ) -> AsyncIterator[Scheduler]:
    """A scheduler task in this loop, cancelled (entries left pending) on exit; with
    ``survive`` it rides out a lost Redis as ``kvpush scheduler`` does."""
    client = async_redis(s)
    sched = cls(s, client, tracer_provider=tracer_provider)
    task = asyncio.create_task(run_scheduler(s, scheduler=sched) if survive else sched.run())
    ready = asyncio.create_task(sched.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()
    try:
        yield sched
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


def release_all(client: redis.Redis, got: list[Assignment]) -> None:
    """What the gateway does at request end."""
    res = Reservations(client)
    for a in got:
        if a.ok:
            res.release(a.decode_engine, a.reservation_id, a.fencing_token)


def assert_no_reservations(client: redis.Redis) -> None:
    left = live_reservations(client)
    assert left == [], f"reservations left in Redis: {left}"


async def enqueue_async(client: aioredis.Redis, req: ScheduleRequest, shards: int = 1) -> str:
    return (await client.xadd(K.requests_for(req.request_id, shards),
                              {b"m": encode(req), b"tp": TP})).decode()


class SimEngine:
    """Simulated decode capacity for scheduler tests: serves each assignment on one gateway
    stream by holding its reservation ``service_s`` seconds, then releasing it (what the
    gateway does when the request ends). CPU-cheap stand-in for a decode engine's slots.

    ``gate`` (set by default) pauses service while cleared; ``order`` records assignments
    in the order the scheduler wrote them.
    """

    def __init__(self, client: aioredis.Redis, gateway: str = "gw1",
                 service_s: float = 0.0) -> None:
        from kvpush.common.reservations import AsyncReservations

        self.client = client
        self.key = K.assignments(gateway)
        self.service_s = service_s
        self.resv = AsyncReservations(client, K)
        self.order: list[Assignment] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self._done: dict[str, asyncio.Future[float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def done(self, rid: str) -> asyncio.Future[float]:
        """Resolves with the loop time at which ``rid`` finished (released or rejected)."""
        fut = self._done.get(rid)
        if fut is None:
            fut = self._done[rid] = asyncio.get_running_loop().create_future()
        return fut

    async def __aenter__(self) -> SimEngine:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in [self._task, *self._tasks]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    async def _run(self) -> None:
        last = "0-0"
        while True:
            reply = await self.client.xread({self.key: last}, count=512, block=100)
            for _key, entries in reply or []:
                for eid, fields in entries:
                    last = eid.decode()
                    a = decode(fields[b"m"], Assignment)
                    self.order.append(a)
                    t = asyncio.create_task(self._serve(a))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)

    async def _serve(self, a: Assignment) -> None:
        if a.ok:
            await self.gate.wait()
            if self.service_s:
                await asyncio.sleep(self.service_s)
            await self.resv.release(a.decode_engine, a.reservation_id, a.fencing_token)
        fut = self.done(a.request_id)
        if not fut.done():
            fut.set_result(asyncio.get_running_loop().time())
