"""Redis faults without engines (fast): the scheduler survives connections cut through a TCP
proxy, a Redis that restarted empty (consumer group gone), and a Redis paused for a while.

Regression for a bug the fault suite found: one ``ConnectionError`` ended
``Scheduler.run()``, so a Redis restart or a connection reset left the cluster with no
scheduler (and ``kvpush up``'s in-process scheduler task died silently).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest
import redis

from kvpush.common.quotas import usage
from kvpush.common.runtime import run
from kvpush.common.tenancy import Quotas, create_tenant
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
from tests.test_gateway import PROMPT, pd, stack, tokenizer_dir  # noqa: F401


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


def test_gateway_rides_out_a_short_redis_outage(redis_url: str, redis_client: redis.Redis,
                                                tokenizer_dir: Path) -> None:  # noqa: F811
    """Redis refuses every connection for a second (a restart, a failover): a request that
    arrives then is admitted and enqueued once Redis is back, within
    ``gateway_redis_outage_s``; with no budget it gets a clean 503."""
    proxy = _proxy(redis_url)
    _, key = create_tenant(redis_client, "rider", tenant_id="rider",
                           quotas=Quotas(concurrent_requests=8))
    auth = {"Authorization": f"Bearer {key}"}
    body = {"prompt": PROMPT, "max_tokens": 3}

    async def main() -> None:
        for budget, want in ((5.0, 200), (0.0, 503)):
            p, d = pd()
            async with stack(proxy.url(), redis_client, tokenizer_dir, p, d, gw={
                    "gateway_auth": True, "gateway_redis_outage_s": budget},
                    sched_survives=True) as s:
                r = await s.client.post("/v1/completions", json=body, headers=auth)
                assert r.status_code == 200, r.text
                proxy.down()
                # With a budget Redis comes back while the request waits for it. Without
                # one it stays down until the answer is in: a timed heal could land before
                # a slow (loaded) gateway first reached Redis, and the request would pass.
                healer = threading.Timer(1.0, proxy.heal) if budget else None
                if healer is not None:
                    healer.start()
                r = await s.client.post("/v1/completions", json=body, headers=auth)
                assert r.status_code == want, (budget, r.text)
                if want == 503:
                    assert r.json()["error"]["message"] == "service temporarily unavailable"
                if healer is not None:
                    healer.join()
                else:
                    proxy.heal()
                await wait_for(lambda: usage(redis_client, "rider")["concurrent_leases"] == 0,
                               "quota leases released", timeout_s=30)
        proxy.stop()

    run(main())


def test_a_cluster_mid_failover_is_a_lost_redis_to_the_scheduler() -> None:
    """CLUSTERDOWN is a ResponseError too: it must not end ``run_scheduler``."""
    from redis.exceptions import ClusterDownError, ResponseError, TryAgainError

    from kvpush.services.scheduler.loop import _lost_redis

    assert _lost_redis(ClusterDownError("The cluster is down"))
    assert _lost_redis(TryAgainError("TRYAGAIN"))
    assert _lost_redis(ResponseError("NOGROUP No such key"))
    assert not _lost_redis(ResponseError("ERR syntax error"))


def test_a_cluster_that_cannot_be_mapped_is_a_lost_redis() -> None:
    """redis-py says "cannot be connected" / "slots not covered" with an exception outside
    ``RedisError``; a gateway handler then answered a bare 500 mid-failover. Both clients
    raise a ``RedisError`` that reads as a lost connection instead."""
    from kvpush.common.redis_client import (
        ClusterUnsettled,
        async_redis,
        lost_connection,
        ride_out,
        sync_redis,
    )
    from kvpush.common.settings import CommonSettings
    from kvpush.services.local.ports import free_port

    settings = CommonSettings(redis_url=f"redis://127.0.0.1:{free_port()}", redis_cluster=True,
                              redis_connect_timeout_s=0.2, redis_socket_timeout_s=0.2)
    with pytest.raises(ClusterUnsettled) as sync_err:
        sync_redis(settings).get("k")
    assert isinstance(sync_err.value, redis.RedisError) and lost_connection(sync_err.value)

    async def main() -> None:
        client = async_redis(settings)
        with pytest.raises(ClusterUnsettled) as err:
            await client.get("k")
        assert lost_connection(err.value)
        # ride_out retries it as an outage, then hands the caller a RedisError.
        with pytest.raises(redis.RedisError):
            await ride_out(lambda: client.get("k"), 0.3, "reading k")
        await client.aclose()

    run(main())
