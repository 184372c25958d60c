"""Redis faults without engines (fast): the scheduler survives connections cut through a TCP
proxy, a Redis that restarted empty (consumer group gone), and a Redis paused for a while.

Regression for a bug the fault suite found: one ``ConnectionError`` ended
``Scheduler.run()``, so a Redis restart or a connection reset left the cluster with no
scheduler (and ``kvpush up``'s in-process scheduler task died silently).
"""

from __future__ import annotations

import asyncio
import contextlib

import redis

from kvpush.common.runtime import run
from kvpush.loadtest.faults.tcp_proxy import TcpProxy
from kvpush.services.scheduler import Scheduler, run_scheduler
from tests.sched_util import (
    assignments,
    engine_status,
    enqueue,
    publish,
    release_all,
    request,
    settings,
    wait_for,
)


def _proxy(redis_url: str) -> TcpProxy:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    return TcpProxy(("127.0.0.1", 0), ("127.0.0.1", port)).start()


async def _serve(s, ready: list[Scheduler]) -> None:
    sched = Scheduler(s)
    ready.append(sched)
    await run_scheduler(s, sched)


def _answered(client: redis.Redis, rid: str) -> bool:
    return any(a.request_id == rid and a.ok for a in assignments(client))


def _send(client: redis.Redis) -> str:
    req = request()
    enqueue(client, req)
    return req.request_id


def _engines(client: redis.Redis) -> None:
    publish(client, engine_status("d1", total=1000))
    publish(client, engine_status("p1", role="prefill"))


def test_scheduler_survives_cut_connections_and_an_emptied_redis(
        redis_url: str, redis_client: redis.Redis) -> None:
    proxy = _proxy(redis_url)
    _engines(redis_client)

    async def main() -> None:
        s = settings(proxy.url())
        box: list[Scheduler] = []
        task = asyncio.create_task(_serve(s, box))
        try:
            await wait_for(lambda: box and box[0].ready.is_set(), "scheduler ready")
            rid = _send(redis_client)
            await wait_for(lambda: _answered(redis_client, rid), "first assignment")
            # Every connection reset, three times over.
            for _ in range(3):
                proxy.cut()
                await asyncio.sleep(0.2)
            rid = _send(redis_client)
            await wait_for(lambda: _answered(redis_client, rid), "after the cuts",
                           timeout_s=30)
            assert not task.done()
            # Redis restarted without persistence: stream and consumer group are gone.
            release_all(redis_client, assignments(redis_client))
            redis_client.flushall()
            _engines(redis_client)
            rid = _send(redis_client)
            await wait_for(lambda: _answered(redis_client, rid), "after the flush",
                           timeout_s=30)
            assert not task.done()
            release_all(redis_client, assignments(redis_client))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            proxy.stop()

    run(main())


def test_scheduler_waits_out_a_refused_redis(redis_url: str, redis_client: redis.Redis
                                             ) -> None:
    proxy = _proxy(redis_url)
    _engines(redis_client)

    async def main() -> None:
        s = settings(proxy.url())
        box: list[Scheduler] = []
        task = asyncio.create_task(_serve(s, box))
        try:
            await wait_for(lambda: box and box[0].ready.is_set(), "scheduler ready")
            proxy.down()  # every connection refused for a while
            await asyncio.sleep(1.5)
            assert not task.done()
            proxy.heal()
            rid = _send(redis_client)
            await wait_for(lambda: _answered(redis_client, rid), "after the outage",
                           timeout_s=30)
            release_all(redis_client, assignments(redis_client))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            proxy.stop()

    run(main())
