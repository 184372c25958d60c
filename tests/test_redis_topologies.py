"""Reservations, quotas, tenants, heartbeats and the scheduler on a real Redis Cluster exactly
as on one Redis, and failovers (Sentinel, a Cluster master killed) followed by factory clients
without a restart."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvpush.common.acl import ServiceKind, apply_tenant_acl, apply_user, service_user
from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import QuotaExceeded, QuotaLimiter, SyncQuotaLimiter
from kvpush.common.redis_client import (
    RedisTopologyConflict,
    async_redis,
    is_cluster,
    lost_connection,
    sync_redis,
)
from kvpush.common.reservations import (
    AsyncReservations,
    ReleaseStatus,
    Reservations,
    ReserveStatus,
    live_reservations,
)
from kvpush.common.settings import CommonSettings
from kvpush.common.tenancy import (
    Quotas,
    RevokedApiKey,
    authenticate,
    authenticate_sync,
    create_tenant,
    get_tenant,
    revoke_api_key,
)
from kvpush.services.engine.drain import mark_draining, read_activity
from kvpush.services.engine.status import publish_status, remove_status
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_topologies import LocalCluster, LocalSentinels
from kvpush.services.scheduler import Scheduler
from tests import sched_util

K = RedisKeys()


@pytest.fixture(params=["single", "cluster"])
def topo(request: pytest.FixtureRequest, redis_server: LocalRedis) -> Iterator[CommonSettings]:
    """Settings of an empty Redis of each topology; clients come from the factory."""
    if request.param == "single":
        settings = CommonSettings(redis_url=redis_server.url)
    else:
        settings = request.getfixturevalue("redis_cluster").settings()
    client = sync_redis(settings)
    client.flushall()
    client.close()
    yield settings


@pytest.fixture
def client(topo: CommonSettings) -> Iterator[redis.Redis]:
    c = sync_redis(topo)
    yield c
    c.close()


def test_factory_picks_the_topology(topo: CommonSettings, client: redis.Redis) -> None:
    assert is_cluster(client) == topo.redis_cluster
    assert client.ping()


def test_conflicting_topologies_are_refused() -> None:
    with pytest.raises(RedisTopologyConflict):
        sync_redis(CommonSettings(redis_url="redis://x:1", redis_cluster=True,
                                  redis_sentinels="x:1", redis_sentinel_master="m"))
    with pytest.raises(RedisTopologyConflict):
        sync_redis(CommonSettings(redis_sentinels="x:1"))
    with pytest.raises(ValueError):
        CommonSettings(redis_sentinels="x:1,nohost")


def test_settings_credentials_win_over_the_urls() -> None:
    def creds(**kw: object) -> tuple[object, object]:
        c = sync_redis(CommonSettings(**kw))  # type: ignore[arg-type]
        kwargs = c.connection_pool.connection_kwargs
        return kwargs.get("username"), kwargs.get("password")

    url = "redis://url-user:url%21pw@127.0.0.1:1/0"
    assert creds(redis_url=url) == ("url-user", "url!pw")
    assert creds(redis_url=url, redis_username="svc", redis_password="pw") == ("svc", "pw")
    assert creds(redis_url=url, redis_username="svc") == ("svc", "url!pw")
    assert creds(redis_url=url, redis_password="pw") == ("url-user", "pw")
    assert creds(redis_url="redis://127.0.0.1:1/0", redis_username="svc",
                 redis_password="pw") == ("svc", "pw")


def test_heartbeat_publish_and_remove(client: redis.Redis) -> None:
    st = sched_util.engine_status("D1", total=50)
    publish_status(client, K, st, ttl_s=5)
    assert client.zscore(K.engines(), "D1") == st.updated_ms
    assert client.hget(K.engine("D1"), "total_blocks") == b"50"
    assert 0 < client.pttl(K.engine("D1")) <= 5000
    remove_status(client, K, "D1")
    assert client.zscore(K.engines(), "D1") is None
    assert not client.exists(K.engine("D1"))


def test_reservation_scripts(client: redis.Redis) -> None:
    for e in ("D1", "D2", "D3"):  # spread over the cluster's masters
        publish_status(client, K, sched_util.engine_status(e, total=10), ttl_s=30)
    res = Reservations(client, K)
    a = res.reserve("D1", "r1", 6, 10_000)
    assert a.status is ReserveStatus.RESERVED and a.reservation is not None
    assert res.reserve("D1", "r1", 6, 10_000).status is ReserveStatus.EXISTING
    assert res.reserve("D1", "r2", 6, 10_000).status is ReserveStatus.NO_CAPACITY
    assert res.reserve("D2", "r2", 6, 10_000).ok
    assert res.reserve("nope", "r3", 1, 10_000).status is ReserveStatus.ENGINE_GONE
    assert res.renew("D1", "r1", a.reservation.fencing_token, 20_000) > 0
    assert res.snapshot("D1").reserved_blocks == 6
    assert {r.reservation_id for r in live_reservations(client, K)} == {"r1", "r2"}
    assert res.release("D1", "r1", a.reservation.fencing_token) is ReleaseStatus.RELEASED
    assert res.sweep("D1") == 0
    assert res.count("D1") == 0


def test_async_reservations_in_a_pipeline(topo: CommonSettings, client: redis.Redis) -> None:
    """The scheduler's hot path: SET once NX GET and the reserve script, pipelined."""
    for e in ("D1", "D2", "D3"):
        publish_status(client, K, sched_util.engine_status(e, total=10), ttl_s=30)

    async def main() -> list[object]:
        r = async_redis(topo)
        try:
            res = AsyncReservations(r, K)
            await res.load()
            pipe = r.pipeline(transaction=False)
            for i, e in enumerate(("D1", "D2", "D3")):
                pipe.set(K.request_once(f"r{i}"), "x", nx=True, get=True, px=60_000)
                res.queue_reserve(pipe, e, f"r{i}", 4, 10_000)
            return await pipe.execute(raise_on_error=False)
        finally:
            await r.aclose()

    raw = asyncio.run(main())
    assert raw[0::2] == [None, None, None]
    assert [int(x[0]) for x in raw[1::2]] == [ReserveStatus.RESERVED] * 3


def test_quota_admission(topo: CommonSettings, client: redis.Redis) -> None:
    tenant, _ = create_tenant(client, "acme", quotas=Quotas(requests_per_second=3,
                                                            concurrent_requests=2))
    lim = SyncQuotaLimiter(client, rate_window_s=60.0)
    first = lim.admit(tenant, 10, 10)
    lim.admit(tenant, 10, 10)
    with pytest.raises(QuotaExceeded) as exc:
        lim.admit(tenant, 10, 10)
    assert exc.value.limit_name == "concurrent_requests"
    first.release(5)

    async def main() -> str:
        r = async_redis(topo)
        try:
            alim = QuotaLimiter(r, rate_window_s=60.0)
            await alim.admit(tenant, 10, 10)  # the third request of the window
            try:
                await alim.admit(tenant, 10, 10)
            except QuotaExceeded as e:
                return e.limit_name
            return "admitted"
        finally:
            await r.aclose()

    assert asyncio.run(main()) == "requests_per_second"


def test_tenant_creation_and_keys(topo: CommonSettings, client: redis.Redis) -> None:
    tenant, key = create_tenant(client, "Acme Corp", weight=2.0)
    assert get_tenant(client, tenant.id).weight == 2.0
    assert authenticate_sync(client, f"Bearer {key}", cache=None).id == tenant.id

    async def main() -> str:
        r = async_redis(topo)
        try:
            return (await authenticate(r, key, cache=None)).id
        finally:
            await r.aclose()

    assert asyncio.run(main()) == tenant.id
    revoke_api_key(client, key, cache=None)
    with pytest.raises(RevokedApiKey):
        authenticate_sync(client, key, cache=None)


def test_tenant_acl_user_reaches_every_node(topo: CommonSettings, client: redis.Redis) -> None:
    tenant, _ = create_tenant(client, "acme", quotas=Quotas(requests_per_second=5))
    user = apply_tenant_acl(client, tenant.id, "pw-acme")
    scoped = sync_redis(topo.model_copy(update={"redis_username": user,
                                                "redis_password": "pw-acme"}))
    try:
        # The quota script runs on whichever node owns the tenant's slot.
        SyncQuotaLimiter(scoped).admit(tenant, 1, 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            scoped.set(K.tenant("other"), "x")
    finally:
        scoped.close()
        client.execute_command("ACL", "DELUSER", user,
                               **({"target_nodes": "all"} if is_cluster(client) else {}))


def _acl_refusals(client: redis.Redis) -> list[Any]:
    """ACL LOG entries of every node but CLIENT SETINFO's (see test_redis_acl_services)."""
    if is_cluster(client):
        logs = client.acl_log(target_nodes="all")  # type: ignore[call-arg]
        entries = [e for node_log in logs.values() for e in node_log]
    else:
        entries = client.acl_log()
    return [e for e in entries if e["object"] != "client|setinfo"]


def test_service_users_work_on_every_node(topo: CommonSettings, client: redis.Redis) -> None:
    """Engine, scheduler and gateway users do their jobs through the factory's clients, on
    whichever node holds each key (the Cluster client's own commands included), starting
    from nodes that hold no script, as after a restart: a script a node lacks is loaded on
    every node (SCRIPT LOAD, which every service user may call; the scheduler and gateway
    may not EVAL) and run by EVALSHA again."""
    users = {k: service_user(k) for k in (ServiceKind.ENGINE, ServiceKind.SCHEDULER,
                                          ServiceKind.GATEWAY)}
    for user in users.values():
        apply_user(client, user.name, user.rules(f"pw-{user.name}"))
    every_node = {"target_nodes": "all"} if is_cluster(client) else {}
    client.execute_command("SCRIPT", "FLUSH", **every_node)
    client.execute_command("ACL", "LOG", "RESET", **every_node)

    def as_(kind: ServiceKind) -> CommonSettings:
        name = users[kind].name
        return topo.model_copy(update={"redis_username": name, "redis_password": f"pw-{name}"})

    tenant, _ = create_tenant(client, "acme", quotas=Quotas(concurrent_requests=5))
    eng = sync_redis(as_(ServiceKind.ENGINE))
    gw = sync_redis(as_(ServiceKind.GATEWAY))
    engines = ("D1", "D2", "D3")  # spread over the cluster's masters
    for e in engines:
        publish_status(eng, K, sched_util.engine_status(e, total=100), ttl_s=30)
    publish_status(eng, K, sched_util.engine_status("P1", role="prefill"), ttl_s=30)
    s = sched_util.settings(topo.redis_url or "", redis_cluster=topo.redis_cluster,
                            redis_username=users[ServiceKind.SCHEDULER].name,
                            redis_password=f"pw-{users[ServiceKind.SCHEDULER].name}")

    async def main() -> None:
        sched = Scheduler(s)  # its client comes from the factory, with its user
        task = asyncio.create_task(sched.run())
        gw_async = async_redis(as_(ServiceKind.GATEWAY))
        try:
            await asyncio.wait_for(sched.ready.wait(), 30)
            adm = await QuotaLimiter(gw_async).admit(tenant, 1, 1)
            for _ in range(6):
                sched_util.enqueue(gw, sched_util.request())
            await sched_util.wait_for(lambda: len(sched_util.assignments(client)) == 6,
                                      "six assignments", 30)
            for a in sched_util.assignments(client):
                assert a.ok
                assert await AsyncReservations(gw_async, K).release(
                    a.decode_engine, a.reservation_id, a.fencing_token) is ReleaseStatus.RELEASED
            await adm.release(1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await sched.close()
            await gw_async.aclose()

    try:
        asyncio.run(main())
        sched_util.assert_no_reservations(client)
        for e in engines:
            assert mark_draining(eng, K, e) == 1
            activity = read_activity(eng, K, e)
            assert activity is not None and activity.draining and activity.reservations == 0
        assert _acl_refusals(client) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            eng.xadd(K.requests(), {"m": b"x"})
        assert [e["object"] for e in _acl_refusals(client)] == [K.requests()]  # log is read
    finally:
        eng.close()
        gw.close()
        for user in users.values():
            client.execute_command("ACL", "DELUSER", user.name,
                                   **({"target_nodes": "all"} if is_cluster(client) else {}))


def test_scheduler_assigns(topo: CommonSettings, client: redis.Redis) -> None:
    publish_status(client, K, sched_util.engine_status("D1", total=100), ttl_s=30)
    publish_status(client, K, sched_util.engine_status("P1", role="prefill"), ttl_s=30)
    s = sched_util.settings(topo.redis_url or "", redis_cluster=topo.redis_cluster)

    async def main() -> None:
        r = async_redis(s)
        sched = Scheduler(s, r)
        task = asyncio.create_task(sched.run())
        try:
            await asyncio.wait_for(sched.ready.wait(), 30)
            rids = [f"cmpl-{uuid.uuid4().hex}" for _ in range(5)]
            for rid in rids:
                sched_util.enqueue(client, sched_util.request(rid=rid))
            await sched_util.wait_for(lambda: len(sched_util.assignments(client)) == 5,
                                      "five assignments", 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await r.aclose()

    asyncio.run(main())
    got = sched_util.assignments(client)
    assert all(a.ok and a.decode_engine == "D1" and a.prefill_engine == "P1" for a in got)
    sched_util.release_all(client, got)
    sched_util.assert_no_reservations(client)


def _write_until_it_lands(client: redis.Redis, key: str, value: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.set(key, value)
            return
        except redis.RedisError as exc:
            if not lost_connection(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_sentinel_failover_is_followed_without_restart(redis_sentinels: LocalSentinels) -> None:
    settings = redis_sentinels.settings()
    client = sync_redis(settings)
    publish_status(client, K, sched_util.engine_status("D1"), ttl_s=30)
    old = redis_sentinels.master_port()

    new = redis_sentinels.failover()

    assert new != old
    # The same client object: its next connection asks the Sentinels for the master again.
    _write_until_it_lands(client, "after-failover", "1", timeout_s=20)
    direct = redis.Redis(port=new)
    assert direct.get("after-failover") == b"1"
    publish_status(client, K, sched_util.engine_status("D1", total=7), ttl_s=30)
    assert direct.hget(K.engine("D1"), "total_blocks") == b"7"

    async def main() -> None:
        r = async_redis(settings)
        try:
            await r.set("async-after-failover", "2")
        finally:
            await r.aclose()

    asyncio.run(main())
    assert direct.get("async-after-failover") == b"2"
    client.close()


def test_sentinels_promote_the_replica_of_a_killed_master(
        redis_sentinels: LocalSentinels) -> None:
    client = sync_redis(redis_sentinels.settings())
    _write_until_it_lands(client, "before-kill", "1", timeout_s=20)
    client.execute_command("WAIT", 1, 5000)  # replicated: it must survive the kill

    old = redis_sentinels.kill_master()
    new = redis_sentinels.wait_promoted(old)

    assert new != old
    _write_until_it_lands(client, "after-kill", "2", timeout_s=20)
    direct = redis.Redis(port=new)
    assert direct.get("before-kill") == b"1"
    assert direct.get("after-kill") == b"2"
    direct.close()
    client.close()


def test_cluster_replica_takes_over_a_killed_master(tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    """The promoted replica serves the slot, the engine heartbeat and XREAD reach it, and the Lua
    scripts (quotas, reservations, also from a pipeline) run on it through the same
    clients: Redis does not replicate the script cache, and redis-py's asyncio cluster
    client would load a missing script on its stale masters only (regression: every
    admission failed with NOSCRIPT after a failover, until a restart)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster-replicas"), replicas=1).start()
    try:
        shards = cluster.shards()
        assert len(shards) == LocalCluster.MASTERS
        assert all(len(reps) == 1 for _, reps in shards.values())
        settings = cluster.settings()
        client = sync_redis(settings)
        publish_status(client, K, sched_util.engine_status("D1", total=100), ttl_s=60)
        key = K.fence("D1")
        master, (replica,) = cluster.shard_of(key)
        # A tenant whose quota keys live on the master that will be killed.
        tid = next(t for t in (f"acme{i}" for i in range(200))
                   if cluster.master_of(K.tenant_quota(t, "leases")) == master)
        tenant, _ = create_tenant(client, tid, tenant_id=tid,
                                  quotas=Quotas(concurrent_requests=10))

        # The blocking client asks its default node which keys an XREAD names: make that
        # the node to be killed (regression: XREAD then failed forever, even on a stream
        # of another master, and prefill never saw a push target again).
        stream = next(s for s in (K.targets(f"P{i}") for i in range(200))
                      if cluster.master_of(s) != master)
        client.xadd(stream, {"m": b"x"})
        client.set_default_node(client.get_node(host="127.0.0.1", port=master))

        async def main() -> None:
            r = async_redis(settings)
            stop = asyncio.Event()
            odd: list[BaseException] = []
            # Callers handle a lost Redis, not redis-py's own races: what many tasks see
            # through one client mid-failover must all be lost-connection RedisErrors
            # (regression: an AttributeError from a connection redis-py closed under a
            # task still connecting it became a gateway 500).
            load = [asyncio.create_task(hammer(r, i, stop, odd)) for i in range(24)]
            try:
                await use_scripts(r, "before")
                redis.Redis(port=master).execute_command("WAIT", 1, 5000)
                assert await asyncio.to_thread(cluster.kill_master, key) == master
                assert await asyncio.to_thread(cluster.wait_promoted, key, master) == replica
                await use_scripts(r, "after")
            finally:
                stop.set()
                await asyncio.gather(*load)
                await r.aclose()
            assert odd == [], odd[:3]

        async def hammer(r: object, i: int, stop: asyncio.Event,
                         odd: list[BaseException]) -> None:
            k = f"hammer:{{{i % 6}}}"
            while not stop.is_set():
                try:
                    await r.set(k, i)  # type: ignore[attr-defined]
                    pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
                    pipe.get(k)
                    pipe.incr(f"{k}:n")
                    await pipe.execute()
                except redis.RedisError as exc:
                    if not lost_connection(exc):
                        odd.append(exc)
                except Exception as exc:
                    odd.append(exc)
                await asyncio.sleep(0.01)

        async def use_scripts(r: object, rid: str) -> None:
            res, quotas = AsyncReservations(r, K), QuotaLimiter(r)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    await (await quotas.admit(tenant, 1, 1)).release(1)
                    assert (await res.reserve("D1", rid, 1, 10_000)).ok
                    pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
                    res.queue_reserve(pipe, "D1", f"{rid}-p", 1, 10_000)
                    (raw,) = await pipe.execute(raise_on_error=False)
                    if isinstance(raw, redis.exceptions.NoScriptError):
                        await res.load()  # what the scheduler does
                        continue
                    assert int(raw[0]) == ReserveStatus.RESERVED
                    return
                except redis.RedisError as exc:
                    if not lost_connection(exc):
                        raise
                    await asyncio.sleep(0.1)
            raise AssertionError(f"scripts did not run {rid} the failover within 20 s")

        asyncio.run(main())
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.xread({stream: "0-0"}, count=1, block=100)
                break
            except redis.RedisError as exc:
                if not lost_connection(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        # The same blocking client follows the slot to the promoted replica, the heartbeat
        # first (regression: its MULTI kept going to the dead master, so the engine
        # vanished from Redis for good).
        deadline = time.monotonic() + 20
        while True:
            try:
                publish_status(client, K, sched_util.engine_status("D1", total=9), ttl_s=60)
                break
            except redis.RedisError as exc:
                if not lost_connection(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert redis.Redis(port=replica).hget(K.engine("D1"), "total_blocks") == b"9"
        _write_until_it_lands(client, "after-kill", "x", timeout_s=20)
        assert client.incr(key) > 1
        client.close()
    finally:
        cluster.stop()


def test_an_embedded_redis_starts_under_a_relative_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpush up`` with a relative ``KVPUSH_RUN_DIR`` (``kvpush bench autoscale --out
    out/x``): redis-server enters its ``--dir`` before it opens its log file there."""
    monkeypatch.chdir(tmp_path)
    server = LocalRedis(Path("run") / "redis").start()
    try:
        assert redis.Redis(port=server.port).ping()
        assert (tmp_path / "run" / "redis" / "redis.log").exists()
    finally:
        server.stop()
