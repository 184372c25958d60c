"""Decode reservations on a real Redis: capacity rule, idempotency, fencing, leases, concurrency."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import (
    AsyncReservations,
    ReleaseStatus,
    Reservations,
    ReserveStatus,
    live_reservations,
)
from kvpush.common.runtime import run

K = RedisKeys()


def put_engine(client: redis.Redis, engine_id: str, total: int, free: int | None = None,
               role: str = "decode", generation: int = 1) -> None:
    """Write an engine status hash the way an engine heartbeat does (plain fields)."""
    client.hset(K.engine(engine_id), mapping={
        "role": role, "total_blocks": total, "free_blocks": total if free is None else free,
        "block_size": 16, "generation": generation,
    })


@pytest.fixture
def res(redis_client: redis.Redis) -> Iterator[Reservations]:
    r = Reservations(redis_client)
    yield r
    assert live_reservations(redis_client) == [], "test left reservations behind"


def test_reserve_release_and_capacity(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10)
    a = res.reserve("d1", "r1", 4, 60_000)
    assert a.status is ReserveStatus.RESERVED and a.reserved_blocks == 4
    b = res.reserve("d1", "r2", 7, 60_000)
    assert b.status is ReserveStatus.NO_CAPACITY and b.reservation is None
    c = res.reserve("d1", "r2", 6, 60_000)
    assert c.ok and c.reserved_blocks == 10
    assert c.reservation.fencing_token > a.reservation.fencing_token
    assert res.reserve("d1", "r3", 11, 60_000).status is ReserveStatus.TOO_LARGE
    assert res.count("d1") == 2
    for x in (a, c):
        assert res.release("d1", x.reservation.reservation_id,
                           x.reservation.fencing_token) is ReleaseStatus.RELEASED
    # Released reservations leave no keys behind, only the monotonic fence counter.
    assert not redis_client.exists(K.reservations("d1"), K.reservation_leases("d1"))


def test_free_blocks_limits_too(res: Reservations, redis_client: redis.Redis) -> None:
    """Load the reservations do not know about (engine's own free count) is respected."""
    put_engine(redis_client, "d1", total=10, free=3)
    assert res.reserve("d1", "r1", 4, 60_000).status is ReserveStatus.NO_CAPACITY
    r = res.reserve("d1", "r1", 3, 60_000)
    assert r.ok
    res.release("d1", "r1", r.reservation.fencing_token)


def test_engine_must_be_alive_decode(res: Reservations, redis_client: redis.Redis) -> None:
    assert res.reserve("gone", "r1", 1, 1000).status is ReserveStatus.ENGINE_GONE
    put_engine(redis_client, "p1", total=10, role="prefill")
    assert res.reserve("p1", "r1", 1, 1000).status is ReserveStatus.NOT_DECODE
    put_engine(redis_client, "b1", total=10, role="both")
    r = res.reserve("b1", "r1", 1, 1000)
    assert r.ok
    res.release("b1", "r1", r.reservation.fencing_token)


def test_duplicate_id_returns_existing(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10)
    a = res.reserve("d1", "r1", 4, 60_000)
    b = res.reserve("d1", "r1", 4, 60_000)
    assert b.status is ReserveStatus.EXISTING and b.reservation == a.reservation
    assert b.reserved_blocks == 4
    res.release("d1", "r1", a.reservation.fencing_token)


def test_stale_token_cannot_release_newer(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10)
    old = res.reserve("d1", "r1", 4, 1).reservation
    while res.count("d1"):  # lease of 1 ms; wait on Redis's clock, not ours
        time.sleep(0.005)
    new = res.reserve("d1", "r1", 4, 60_000)
    assert new.status is ReserveStatus.RESERVED
    assert new.reservation.fencing_token > old.fencing_token
    assert res.release("d1", "r1", old.fencing_token) is ReleaseStatus.STALE_TOKEN
    assert res.renew("d1", "r1", old.fencing_token, 60_000) == -1
    assert res.count("d1") == 1
    assert res.release("d1", "r1", new.reservation.fencing_token) is ReleaseStatus.RELEASED
    assert res.release("d1", "r1", new.reservation.fencing_token) is ReleaseStatus.ABSENT


def _redis_now_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return sec * 1_000_000 + usec


def test_tokens_follow_the_server_clock_exactly(res: Reservations,
                                                redis_client: redis.Redis) -> None:
    """Tokens are clock microseconds (16 digits): stored, returned and compared exactly."""
    put_engine(redis_client, "d1", total=10)
    before = _redis_now_us(redis_client)
    a = res.reserve("d1", "r1", 2, 60_000).reservation
    b = res.reserve("d1", "r2", 2, 60_000).reservation
    after = _redis_now_us(redis_client)
    assert before <= a.fencing_token < b.fencing_token <= after + 1
    assert a.fencing_token > 10**15  # beyond the 14 digits Lua prints a number with
    assert int(redis_client.get(K.fence("d1"))) == b.fencing_token
    assert [r.fencing_token for r in res.snapshot("d1").reservations] == [
        a.fencing_token, b.fencing_token]
    # One microsecond off is another holder's token.
    assert res.release("d1", "r1", a.fencing_token + 1) is ReleaseStatus.STALE_TOKEN
    assert res.renew("d1", "r1", a.fencing_token - 1, 60_000) == -1
    assert res.renew("d1", "r1", a.fencing_token, 60_000) > 0
    for r in (a, b):
        assert res.release("d1", r.reservation_id, r.fencing_token) is ReleaseStatus.RELEASED


def test_tokens_grow_past_a_counter_that_went_back(res: Reservations,
                                                   redis_client: redis.Redis) -> None:
    """What a promoted replica that missed the last writes looks like: the fence counter is
    older than (or missing for) tokens already handed out. New tokens still exceed them."""
    put_engine(redis_client, "d1", total=100)
    issued = []
    for i in range(5):
        r = res.reserve("d1", f"r{i}", 1, 60_000).reservation
        issued.append(r.fencing_token)
        res.release("d1", r.reservation_id, r.fencing_token)
    assert issued == sorted(set(issued))
    for lost in (str(issued[1]), "1", None):  # two writes lost, all but one, the whole key
        if lost is None:
            redis_client.delete(K.fence("d1"))
        else:
            redis_client.set(K.fence("d1"), lost)
        r = res.reserve("d1", "again", 1, 60_000).reservation
        assert r.fencing_token > max(issued)
        issued.append(r.fencing_token)
        res.release("d1", "again", r.fencing_token)
    # A counter ahead of the clock (a fast burst, a clock stepped back) counts on from itself.
    ahead = _redis_now_us(redis_client) + 3_600_000_000
    redis_client.set(K.fence("d1"), ahead)
    r = res.reserve("d1", "ahead", 1, 60_000).reservation
    assert r.fencing_token == ahead + 1
    res.release("d1", "ahead", r.fencing_token)


@pytest.mark.parametrize("garbage", [b"9007199254740990", b"1e300", b"inf", b"nan"])
def test_a_fence_counter_out_of_range_is_refused(res: Reservations, redis_client: redis.Redis,
                                                 garbage: bytes) -> None:
    """Past 2^53 a double cannot count on by one: refuse rather than repeat a token."""
    put_engine(redis_client, "d1", total=10)
    redis_client.set(K.fence("d1"), garbage)
    with pytest.raises(redis.ResponseError, match="out of range"):
        res.reserve("d1", "r1", 1, 60_000)
    assert res.count("d1") == 0
    # Text that is no number at all reads as 0: the clock takes over.
    redis_client.set(K.fence("d1"), b"not a number")
    r = res.reserve("d1", "r1", 1, 60_000).reservation
    assert r.fencing_token > 10**15
    res.release("d1", "r1", r.fencing_token)


def test_renew_extends_and_expired_is_gone(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10)
    r = res.reserve("d1", "r1", 4, 60_000).reservation
    exp = res.renew("d1", "r1", r.fencing_token, 120_000)
    assert exp > r.expiry_ms
    short = res.reserve("d1", "r2", 2, 1).reservation
    while res.count("d1") > 1:
        time.sleep(0.005)
    assert res.renew("d1", "r2", short.fencing_token, 60_000) == 0
    res.release("d1", "r1", r.fencing_token)


def test_sweep_purges_expired(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10)
    res.reserve("d1", "r1", 4, 1)
    res.reserve("d1", "r2", 4, 1)
    while res.snapshot("d1").reservations:
        time.sleep(0.005)
    assert redis_client.exists(K.reservations("d1"))  # expired but not yet purged
    assert res.sweep("d1") >= 1  # the second reserve may already have purged the first
    assert not redis_client.exists(K.reservations("d1"), K.reservation_leases("d1"))


def test_engine_restart_voids_old_reservations(res: Reservations,
                                               redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=10, generation=1)
    res.reserve("d1", "r1", 8, 60_000)
    put_engine(redis_client, "d1", total=10, generation=2)
    r = res.reserve("d1", "r2", 8, 60_000)
    assert r.status is ReserveStatus.RESERVED and r.reserved_blocks == 8
    assert [x.reservation_id for x in res.snapshot("d1").reservations] == ["r2"]
    res.release("d1", "r2", r.reservation.fencing_token)


def test_async_front_end(redis_url: str, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=5)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        res = AsyncReservations(client)
        a = await res.reserve("d1", "r1", 5, 60_000)
        assert a.ok
        assert (await res.reserve("d1", "r2", 1, 60_000)).status is ReserveStatus.NO_CAPACITY
        assert await res.count("d1") == 1
        assert await res.renew("d1", "r1", a.reservation.fencing_token, 60_000) > 0
        assert await res.release("d1", "r1", a.reservation.fencing_token) is ReleaseStatus.RELEASED
        await client.aclose()

    run(main())
    assert live_reservations(redis_client) == []


def test_survives_script_flush(res: Reservations, redis_client: redis.Redis) -> None:
    put_engine(redis_client, "d1", total=5)
    res.load()
    redis_client.script_flush()
    r = res.reserve("d1", "r1", 1, 60_000)
    assert r.ok
    res.release("d1", "r1", r.reservation.fencing_token)


# -- concurrency property ------------------------------------------------------------------

op = st.tuples(
    st.sampled_from(["reserve", "reserve", "release", "renew"]),
    st.integers(min_value=1, max_value=12),  # blocks
    st.sampled_from([1, 5, 60_000]),  # lease ms: some expire mid-run, most do not
    st.integers(min_value=0, max_value=7),  # which request id
)


def _check(res: Reservations, engine_id: str) -> None:
    snap = res.snapshot(engine_id)
    live = sum(r.blocks for r in snap.reservations)
    assert live <= snap.total_blocks, f"over-commit: {live} > {snap.total_blocks}"
    assert snap.reserved_blocks <= snap.total_blocks, snap
    assert len({r.reservation_id for r in snap.reservations}) == len(snap.reservations)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(total=st.integers(min_value=1, max_value=24),
       plans=st.lists(st.lists(op, min_size=5, max_size=30), min_size=2, max_size=6))
def test_concurrent_threads_never_overcommit(redis_url: str, total: int,
                                             plans: list[list[tuple]]) -> None:
    """Threads hammer reserve/release/renew on one engine; a checker never sees over-commit."""
    admin = redis.Redis.from_url(redis_url)
    admin.flushall()
    put_engine(admin, "d1", total=total)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(wid: int, plan: list[tuple]) -> None:
        client = redis.Redis.from_url(redis_url)
        res = Reservations(client)
        held: dict[str, int] = {}
        try:
            for kind, blocks, lease, n in plan:
                rid = f"w{wid}-r{n}" if n % 2 else f"shared-r{n}"  # some ids shared by threads
                if kind == "reserve":
                    r = res.reserve("d1", rid, blocks, lease)
                    if r.ok:
                        held[rid] = r.reservation.fencing_token
                elif kind == "release" and rid in held:
                    res.release("d1", rid, held.pop(rid))
                elif kind == "renew" and rid in held:
                    res.renew("d1", rid, held[rid], lease)
            for rid, tok in held.items():
                res.release("d1", rid, tok)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    def checker() -> None:
        client = redis.Redis.from_url(redis_url)
        res = Reservations(client)
        try:
            while not stop.is_set():
                _check(res, "d1")
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    chk = threading.Thread(target=checker)
    chk.start()
    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    chk.join()
    assert not errors, errors
    res = Reservations(admin)
    _check(res, "d1")
    # Shared ids can be released by one thread while another still "holds" a stale token;
    # whatever is left is only ever reservations whose leases run out on their own.
    for r in res.snapshot("d1").reservations:
        res.release("d1", r.reservation_id, r.fencing_token)
    assert live_reservations(admin) == []
    admin.close()


def test_concurrent_asyncio_never_overcommit(redis_url: str, redis_client: redis.Redis) -> None:
    """Hundreds of coroutines over a few connections race for 3 engines' blocks."""
    totals = {"d1": 7, "d2": 13, "d3": 1}
    for e, t in totals.items():
        put_engine(redis_client, e, total=t)
    rng = random.Random(7)

    async def main() -> None:
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(4)]
        stop = asyncio.Event()
        bad: list[str] = []

        async def one(i: int) -> None:
            res = AsyncReservations(clients[i % len(clients)])
            for j in range(20):
                e = rng.choice(list(totals))
                r = await res.reserve(e, f"a{i}-{j}", rng.randint(1, 5), 60_000)
                if r.ok:
                    await asyncio.sleep(0)
                    await res.release(e, f"a{i}-{j}", r.reservation.fencing_token)

        async def check() -> None:
            res = AsyncReservations(clients[0])
            while not stop.is_set():
                for e, t in totals.items():
                    snap = await res.snapshot(e)
                    if sum(r.blocks for r in snap.reservations) > t:
                        bad.append(f"{e}: {snap}")
                await asyncio.sleep(0)

        checker = asyncio.create_task(check())
        await asyncio.gather(*(one(i) for i in range(200)))
        stop.set()
        await checker
        for c in clients:
            await c.aclose()
        assert not bad, bad[:3]

    run(main())
    assert live_reservations(redis_client) == []
