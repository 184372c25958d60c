"""Sharded request streams on a real Redis and a real three-master Cluster: requests spread
over the shards, every one is served, and reclaim, dead letters, trimming and backpressure
work across shards."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis

from kvpush.common.keys import RedisKeys, request_shard
from kvpush.common.redis_client import SyncRedis, sync_redis
from kvpush.common.runtime import run
from kvpush.common.settings import CommonSettings, SchedulerSettings
from kvpush.common.wire import encode
from kvpush.services.engine.status import publish_status
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_topologies import LocalCluster
from tests.sched_util import (
    TP,
    assert_no_reservations,
    assignments,
    dead_letters,
    engine_status,
    release_all,
    request,
    running,
    wait_for,
)

K = RedisKeys()
GROUP = "schedulers"


def test_request_ids_spread_evenly_and_stay_put() -> None:
    ids = [f"cmpl-{i:06d}" for i in range(4000)]
    for shards in (2, 4):
        counts = [0] * shards
        for rid in ids:
            counts[request_shard(rid, shards)] += 1
        assert min(counts) > 0.9 * len(ids) / shards, counts
    assert {request_shard(rid, 1) for rid in ids} == {0}
    # The same id goes to the same shard in any process (CRC-32, not hash()).
    assert [request_shard("cmpl-abc", 4) for _ in range(3)] == [request_shard("cmpl-abc", 4)] * 3
    assert K.requests_for("cmpl-abc", 1) == K.requests() == "kvpush:requests"


def ids_by_shard(shards: int, per_shard: int) -> dict[int, list[str]]:
    """Request ids, ``per_shard`` of them landing on each shard (deterministic)."""
    out: dict[int, list[str]] = {i: [] for i in range(shards)}
    i = 0
    while any(len(v) < per_shard for v in out.values()):
        rid = f"cmpl-shardtest-{i}"
        i += 1
        if len(out[request_shard(rid, shards)]) < per_shard:
            out[request_shard(rid, shards)].append(rid)
    return out


@pytest.fixture(params=["single", "cluster"])
def topo(request: pytest.FixtureRequest, redis_server: LocalRedis) -> Iterator[CommonSettings]:
    """Settings of an empty Redis of each topology."""
    if request.param == "single":
        settings = CommonSettings(redis_url=redis_server.url)
    else:
        settings = request.getfixturevalue("redis_cluster").settings()
    c = sync_redis(settings)
    c.flushall()
    c.close()
    yield settings


@pytest.fixture
def client(topo: CommonSettings) -> Iterator[SyncRedis]:
    c = sync_redis(topo)
    yield c
    assert_no_reservations(c)
    c.close()


def sched_settings(topo: CommonSettings, shards: int, **kw: object) -> SchedulerSettings:
    base: dict[str, object] = {
        "redis_url": topo.redis_url, "redis_cluster": topo.redis_cluster,
        "request_shards": shards, "scheduler_id": f"s-{uuid.uuid4().hex[:6]}",
        "scheduler_refresh_s": 0.05, "scheduler_queue_timeout_s": 30.0,
    }
    base.update(kw)
    return SchedulerSettings(**base)


def put(client: SyncRedis, rid: str, shard: int) -> str:
    req = request(rid=rid)
    return client.xadd(K.requests(shard), {b"m": encode(req), b"tp": TP}).decode()


def pending(client: SyncRedis, shard: int) -> int:
    return int(client.xpending(K.requests(shard), GROUP)["pending"])


def added(client: SyncRedis, shard: int) -> int:
    return int(client.xinfo_stream(K.requests(shard))["entries-added"])


@pytest.mark.parametrize("shards", [2, 4])
def test_two_schedulers_serve_every_shard(topo: CommonSettings, client: SyncRedis,
                                          shards: int) -> None:
    publish_status(client, K, engine_status("D1", total=10_000), ttl_s=60)
    publish_status(client, K, engine_status("P1", role="prefill"), ttl_s=60)
    by_shard = ids_by_shard(shards, 5)
    rids = [r for ids in by_shard.values() for r in ids]

    async def main() -> None:
        async with running(sched_settings(topo, shards)) as a, \
                running(sched_settings(topo, shards)) as b:
            for shard, ids in by_shard.items():
                for rid in ids:
                    assert K.requests_for(rid, shards) == K.requests(shard)
                    put(client, rid, shard)
            await wait_for(lambda: len(assignments(client)) >= len(rids), "every answer", 60)
            assert a.stats.assigned + b.stats.assigned == len(rids)
            assert [pending(client, s) for s in range(shards)] == [0] * shards
            await a.trim()  # every shard, behind the group
            assert [client.xlen(K.requests(s)) for s in range(shards)] == [0] * shards

    run(main())
    got = assignments(client)
    assert sorted(g.request_id for g in got) == sorted(rids) and all(g.ok for g in got)
    assert [added(client, s) for s in range(shards)] == [5] * shards
    release_all(client, got)


def test_poison_entry_on_shard_2_is_dead_lettered(topo: CommonSettings,
                                                  client: SyncRedis) -> None:
    publish_status(client, K, engine_status("D1"), ttl_s=60)
    by_shard = ids_by_shard(4, 1)

    async def main() -> None:
        async with running(sched_settings(topo, 4)):
            client.xadd(K.requests(2), {b"m": b"\x00garbage", b"tp": TP})
            for shard, (rid,) in by_shard.items():
                put(client, rid, shard)
            await wait_for(lambda: dead_letters(client) and len(assignments(client)) == 4,
                           "the dead letter and four answers")
            assert [pending(client, s) for s in range(4)] == [0] * 4

    run(main())
    (d,) = dead_letters(client)
    assert d[b"stream"] == K.requests(2).encode()
    assert b"malformed ScheduleRequest" in d[b"reason"] and d[b"f_m"] == b"\x00garbage"
    release_all(client, assignments(client))


def test_idle_entry_on_another_shard_is_reclaimed(topo: CommonSettings,
                                                  client: SyncRedis) -> None:
    publish_status(client, K, engine_status("D1"), ttl_s=60)
    (rid,) = ids_by_shard(4, 1)[3]
    for s in range(4):
        client.xgroup_create(K.requests(s), GROUP, id="0", mkstream=True)
    eid = put(client, rid, 3)
    # A scheduler that died read it and never answered: pending, idle for an hour.
    client.xreadgroup(GROUP, "ghost", {K.requests(3): ">"})
    client.xclaim(K.requests(3), GROUP, "ghost", 0, [eid], idle=3_600_000, justid=True)
    assert pending(client, 3) == 1

    async def main() -> None:
        async with running(sched_settings(topo, 4, scheduler_claim_idle_ms=1000)) as sched:
            await wait_for(lambda: assignments(client), "the reclaimed entry answered")
            assert sched.stats.reclaimed == 1
            assert pending(client, 3) == 0

    run(main())
    (a,) = assignments(client)
    assert a.ok and a.request_id == rid
    release_all(client, [a])


def test_an_entry_id_two_shards_share_is_no_redelivery(topo: CommonSettings,
                                                       client: SyncRedis) -> None:
    """Entry ids are per stream: the same id on two shards are two entries. A request id
    written to both (a hostile or misconfigured writer) is a duplicate, not a retry that
    may take the first one's reservation."""
    publish_status(client, K, engine_status("D1"), ttl_s=60)
    req = request()
    for s in (0, 3):
        client.xadd(K.requests(s), {b"m": encode(req), b"tp": TP}, id="1-1")

    async def main() -> None:
        async with running(sched_settings(topo, 4)):
            await wait_for(lambda: dead_letters(client) and assignments(client),
                           "one answer and one dead letter")
            assert [pending(client, s) for s in range(4)] == [0] * 4

    run(main())
    (a,) = assignments(client)
    (d,) = dead_letters(client)
    assert a.ok and b"duplicate request id" in d[b"reason"] and d[b"entry"] == b"1-1"
    release_all(client, [a])


def test_backpressure_counts_every_shard(topo: CommonSettings, client: SyncRedis) -> None:
    """One wait queue per scheduler, whatever shard a request came from: with room for two,
    two of four requests on four shards wait (and stay this scheduler's), two are refused."""
    publish_status(client, K, engine_status("D1", total=100, free=0), ttl_s=60)
    by_shard = ids_by_shard(4, 1)

    async def main() -> None:
        s = sched_settings(topo, 4, scheduler_max_queue=2, scheduler_claim_idle_ms=300)
        async with running(s) as sched:
            for shard, (rid,) in by_shard.items():
                put(client, rid, shard)
            await wait_for(lambda: len(assignments(client)) == 2, "two refusals")
            assert all(not a.ok and a.error_kind == "overloaded" for a in assignments(client))
            assert len(sched.queue) == 2
            assert len({p.shard for p in sched.queue}) == 2
            held = {(p.shard, p.entry_id) for p in sched.queue}
            # Another scheduler must not take the waiting entries, whatever their shard.
            async with running(sched_settings(topo, 4, scheduler_claim_idle_ms=300)) as other:
                await asyncio.sleep(1.5)  # several of the other's reclaim rounds
                assert other.stats.reclaimed == 0
            assert {(p.shard, p.entry_id) for p in sched.queue} == held
            assert sum(pending(client, sh) for sh in range(4)) == 2
            publish_status(client, K, engine_status("D1", total=100), ttl_s=60)
            await wait_for(lambda: len(assignments(client)) == 4, "the waiting two served")
            assert [pending(client, sh) for sh in range(4)] == [0] * 4

    run(main())
    got = [a for a in assignments(client) if a.ok]
    assert len(got) == 2
    release_all(client, got)


def test_redis_refuses_a_read_across_cluster_slots(redis_cluster: LocalCluster) -> None:
    """Why the Cluster path reads each shard on its own: one XREADGROUP over two shards is
    a CROSSSLOT error there."""
    c = sync_redis(redis_cluster.settings())
    c.flushall()
    try:
        for s in (0, 1):
            c.xgroup_create(K.requests(s), GROUP, id="0", mkstream=True)
        node = c.get_node_from_key(K.requests(0))
        direct = redis.Redis(host=node.host, port=node.port)
        with pytest.raises(redis.ResponseError, match="same slot"):
            direct.xreadgroup(GROUP, "x", {K.requests(0): ">", K.requests(1): ">"})
        direct.close()
    finally:
        c.flushall()
        c.close()
