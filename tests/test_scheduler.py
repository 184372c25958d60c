"""Push scheduler on a real Redis: placement, reservations, backpressure, duplicates, poison."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from kvpush.common.reservations import Reservations
from kvpush.common.runtime import run
from kvpush.common.wire import ScheduleRequest, encode
from tests.sched_util import (
    TP,
    K,
    assert_no_reservations,
    assignments,
    dead_letters,
    engine_status,
    enqueue,
    publish,
    release_all,
    request,
    running,
    settings,
    wait_for,
)


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


def test_assigns_and_reserves(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=100, url="http://d1"))
    publish(redis_client, engine_status("p1", role="prefill", url="http://p1"))

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            req = request(prompt_tokens=100, max_tokens=60)  # 160 tokens = 10 blocks
            enqueue(redis_client, req)
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.ok and a.request_id == req.request_id
            assert (a.decode_engine, a.decode_url) == ("d1", "http://d1")
            assert (a.prefill_engine, a.prefill_url) == ("p1", "http://p1")
            assert a.disaggregated and a.blocks == 10 and a.fencing_token > 0
            assert a.reservation_id == req.request_id
            snap = Reservations(redis_client).snapshot("d1")
            assert [(r.reservation_id, r.fencing_token, r.blocks) for r in snap.reservations] \
                == [(a.reservation_id, a.fencing_token, 10)]
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            assert sched.stats.assigned == 1
            release_all(redis_client, [a])

    run(main())


def test_conditional_disaggregation(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))
    publish(redis_client, engine_status("p1", role="prefill"))

    async def main() -> None:
        async with running(settings(redis_url, scheduler_min_disagg_tokens=64)):
            short, long_ = request(prompt_tokens=63), request(prompt_tokens=64)
            enqueue(redis_client, short)
            enqueue(redis_client, long_)
            await wait_for(lambda: len(assignments(redis_client)) == 2, "assignments")
            got = {a.request_id: a for a in assignments(redis_client)}
            assert not got[short.request_id].disaggregated
            assert got[short.request_id].prefill_engine is None
            assert got[long_.request_id].disaggregated
            assert got[long_.request_id].prefill_engine == "p1"
            release_all(redis_client, list(got.values()))

    run(main())


def test_no_prefill_engine_falls_back_to_decode_alone(redis_url: str,
                                                      redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))

    async def main() -> None:
        async with running(settings(redis_url)):
            enqueue(redis_client, request())
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.ok and not a.disaggregated and a.decode_engine == "d1"
            release_all(redis_client, [a])

    run(main())


def test_the_prefill_a_gateway_started_is_kept_while_it_takes_requests(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A request names the prefill its gateway already sent it to (early prefill): that
    engine is kept over the least-loaded one; one that takes no requests (unknown, draining,
    decode-only) is replaced by the ordinary pick, which the gateway reads as 'cancel yours'."""
    publish(redis_client, engine_status("d1", total=1000))
    publish(redis_client, engine_status("p1", role="prefill", url="http://p1"))
    publish(redis_client, engine_status("p2", role="prefill", url="http://p2", queued=5000))
    publish(redis_client, engine_status("p3", role="prefill", url="http://p3"))
    redis_client.hset(K.engine("p3"), "draining", 1)  # its generation: drained

    async def main() -> None:
        async with running(settings(redis_url, scheduler_refresh_s=3600)) as sched:
            kept = request()
            kept.prefill_on = "p2"  # the busier one: kept all the same, it is computing
            gone = [request(), request(), request()]
            for r, on in zip(gone, ("p9", "p3", "d1"), strict=True):
                r.prefill_on = on
            for r in (kept, *gone):
                enqueue(redis_client, r)
            await wait_for(lambda: len(assignments(redis_client)) == 4, "assignments")
            got = {a.request_id: a for a in assignments(redis_client)}
            a = got[kept.request_id]
            assert a.disaggregated and (a.prefill_engine, a.prefill_url) == ("p2", "http://p2")
            assert [got[r.request_id].prefill_engine for r in gone] == ["p1"] * 3
            assert sched.stats.prefill_kept == 1
            release_all(redis_client, list(got.values()))

    run(main())


def test_spreads_over_engines_and_prefills(redis_url: str, redis_client: redis.Redis) -> None:
    for e in ("d1", "d2", "d3"):
        publish(redis_client, engine_status(e, total=40))
    for p in ("p1", "p2"):
        publish(redis_client, engine_status(p, role="prefill"))

    async def main() -> None:
        async with running(settings(redis_url, scheduler_refresh_s=3600)):
            # 12 requests of 10 blocks onto 3 engines of 40: fills all 120 blocks exactly.
            reqs = [request(prompt_tokens=100, max_tokens=60) for _ in range(12)]
            for r in reqs:
                enqueue(redis_client, r)
            await wait_for(lambda: len(assignments(redis_client)) == 12, "assignments")
            got = assignments(redis_client)
            assert all(a.ok for a in got)
            per_engine = {e: sum(a.decode_engine == e for a in got) for e in ("d1", "d2", "d3")}
            assert per_engine == {"d1": 4, "d2": 4, "d3": 4}
            per_prefill = {p: sum(a.prefill_engine == p for a in got) for p in ("p1", "p2")}
            assert per_prefill == {"p1": 6, "p2": 6}
            release_all(redis_client, got)

    run(main())


def test_dead_engine_drops_out(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=1000), ttl_ms=200)
    publish(redis_client, engine_status("d2", total=10))

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            await wait_for(lambda: not redis_client.exists(K.engine("d1")), "d1 to expire")
            await wait_for(lambda: "d1" not in sched.engines, "d1 to leave the view")
            enqueue(redis_client, request())
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.decode_engine == "d2"
            release_all(redis_client, [a])

    run(main())


def test_backpressure_bounded_wait_then_rejection(redis_url: str,
                                                  redis_client: redis.Redis) -> None:
    """Zero free slots: requests wait (bounded by time and length), then get a clean 'no'."""
    publish(redis_client, engine_status("d1", total=10))
    holder = Reservations(redis_client).reserve("d1", "someone-else", 10, 600_000).reservation

    async def main() -> None:
        s = settings(redis_url, scheduler_queue_timeout_s=0.5, scheduler_max_queue=2,
                     scheduler_retry_after_s=2.5)
        async with running(s) as sched:
            reqs = [request(prompt_tokens=10, max_tokens=6) for _ in range(5)]
            for r in reqs:
                enqueue(redis_client, r)
            # The 3 that find the queue full are refused at once, the 2 queued ones later.
            await wait_for(lambda: len(assignments(redis_client)) == 5, "5 rejections")
            got = assignments(redis_client)
            assert not any(a.ok for a in got)
            assert all(a.error_kind == "overloaded" and a.retry_after_s == 2.5 for a in got)
            full = [a for a in got if "full" in a.error]
            waited = [a for a in got if "queue timeout" in a.error]
            assert len(full) == 3 and len(waited) == 2
            # Queued requests are answered after the refused ones, in their arrival order.
            assert [a.request_id for a in got[3:]] == [r.request_id for r in reqs[:2]]
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            assert len(sched.queue) == 0

    run(main())
    Reservations(redis_client).release("d1", "someone-else", holder.fencing_token)


def test_waiting_requests_served_in_order_when_capacity_frees(
        redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=10))
    res = Reservations(redis_client)
    holder = res.reserve("d1", "someone-else", 10, 600_000).reservation

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            reqs = [request(prompt_tokens=10, max_tokens=6) for _ in range(4)]  # 1 block each
            for r in reqs:
                enqueue(redis_client, r)
            await wait_for(lambda: len(sched.queue) == 4, "4 waiting")
            assert assignments(redis_client) == []
            res.release("d1", "someone-else", holder.fencing_token)
            await wait_for(lambda: len(assignments(redis_client)) == 4, "4 assignments")
            got = assignments(redis_client)
            assert all(a.ok for a in got)
            assert [a.request_id for a in got] == [r.request_id for r in reqs]
            release_all(redis_client, got)

    run(main())


def test_no_decode_engine_rejects_with_503_kind(redis_url: str,
                                                redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with running(settings(redis_url, scheduler_queue_timeout_s=0.2)):
            enqueue(redis_client, request())
            await wait_for(lambda: assignments(redis_client), "rejection")
            (a,) = assignments(redis_client)
            assert not a.ok and a.error_kind == "no_engine" and a.retry_after_s

    run(main())


def test_too_large_and_past_deadline_rejected_at_once(redis_url: str,
                                                      redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=10))

    async def main() -> None:
        async with running(settings(redis_url)):
            big = request(prompt_tokens=150, max_tokens=20)  # 11 blocks > 10
            late = request(deadline_s=-1)
            enqueue(redis_client, big)
            enqueue(redis_client, late)
            await wait_for(lambda: len(assignments(redis_client)) == 2, "rejections")
            got = {a.request_id: a for a in assignments(redis_client)}
            assert got[big.request_id].error_kind == "too_large"
            assert got[late.request_id].error_kind == "deadline"
            assert not got[big.request_id].retry_after_s

    run(main())


def test_duplicate_request_id_reserves_once(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=100))
    publish(redis_client, engine_status("d2", total=100))

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            req = request()
            first = enqueue(redis_client, req)
            await wait_for(lambda: assignments(redis_client), "first assignment")
            enqueue(redis_client, req)  # same request id again, later
            enqueue(redis_client, req)  # and twice
            await wait_for(lambda: len(dead_letters(redis_client)) == 2, "duplicates dead")
            (a,) = assignments(redis_client)
            assert a.ok
            for d in dead_letters(redis_client):
                assert b"duplicate request id" in d[b"reason"]
                assert first.encode() in d[b"reason"]
            total = sum(Reservations(redis_client).count(e) for e in ("d1", "d2"))
            assert total == 1
            assert sched.stats.duplicates == 2
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            release_all(redis_client, [a])

    run(main())


def test_duplicates_in_one_batch(redis_url: str, redis_client: redis.Redis) -> None:
    for e in ("d1", "d2", "d3"):
        publish(redis_client, engine_status(e, total=100))

    async def main() -> None:
        req = request()
        for _ in range(5):
            enqueue(redis_client, req)
        async with running(settings(redis_url)):
            await wait_for(lambda: len(dead_letters(redis_client)) == 4, "duplicates dead")
            got = assignments(redis_client)
            assert len(got) == 1 and got[0].ok
            assert sum(Reservations(redis_client).count(e) for e in ("d1", "d2", "d3")) == 1
            release_all(redis_client, got)

    run(main())


def test_malformed_entries_dead_lettered_at_once(redis_url: str,
                                                 redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))
    bad_version = ScheduleRequest(v=99, request_id="r", gateway_id="gw1", prompt_tokens=1,
                                  max_tokens=1, deadline_ms=0)
    bad_gateway = request(gateway="no spaces allowed")
    entries = [
        {b"m": b"\x00garbage", b"tp": TP},
        {b"other": b"1"},
        {b"m": encode(bad_version)},
        {b"m": encode(bad_gateway)},
        {b"m": encode(request(prompt_tokens=-5))},
    ]

    async def main() -> None:
        for f in entries:
            redis_client.xadd(K.requests(), f)
        good = request()
        enqueue(redis_client, good)
        async with running(settings(redis_url)):
            await wait_for(lambda: len(dead_letters(redis_client)) == 5, "dead letters")
            await wait_for(lambda: assignments(redis_client), "good one served")
            reasons = [d[b"reason"].decode() for d in dead_letters(redis_client)]
            assert "malformed ScheduleRequest" in reasons[0]
            assert "no 'm' field" in reasons[1]
            assert "schema version 99" in reasons[2]
            assert "invalid id" in reasons[3]
            assert "negative" in reasons[4]
            assert dead_letters(redis_client)[0][b"f_m"] == b"\x00garbage"
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            (a,) = assignments(redis_client)
            assert a.ok and a.request_id == good.request_id
            release_all(redis_client, [a])

    run(main())


def test_entry_past_max_deliveries_dead_lettered(redis_url: str,
                                                 redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))
    redis_client.xgroup_create(K.requests(), "schedulers", id="0", mkstream=True)
    req = request()
    eid = enqueue(redis_client, req)
    # A "ghost" consumer got it 3 times (read, then two claims) and never acked.
    redis_client.xreadgroup("schedulers", "ghost", {K.requests(): ">"})
    for _ in range(2):
        redis_client.xclaim(K.requests(), "schedulers", "ghost", 0, [eid])
    redis_client.xclaim(K.requests(), "schedulers", "ghost", 0, [eid], idle=3_600_000,
                        justid=True)

    async def main() -> None:
        async with running(settings(redis_url, scheduler_max_deliveries=3,
                                    scheduler_claim_idle_ms=1000)) as sched:
            await wait_for(lambda: dead_letters(redis_client), "dead letter")
            (d,) = dead_letters(redis_client)
            assert b"delivered 4 times" in d[b"reason"]
            assert assignments(redis_client) == []
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            await wait_for(lambda: sched.stats.dead == 1, "stats")

    run(main())


def test_sweep_purges_expired_reservations(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))
    res = Reservations(redis_client)
    for i in range(3):
        res.reserve("d1", f"r{i}", 1, 1)

    async def main() -> None:
        async with running(settings(redis_url, scheduler_sweep_s=0.05)) as sched:
            await wait_for(lambda: not redis_client.exists(K.reservations("d1")), "sweep")
            await wait_for(lambda: sched.stats.swept >= 1, "sweep stats")

    run(main())


def test_sweep_forgets_dead_engines(redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("gone"), ttl_ms=1)
    publish(redis_client, engine_status("d1"))

    async def main() -> None:
        async with running(settings(redis_url, scheduler_sweep_s=0.05)):
            await wait_for(lambda: redis_client.zscore(K.engines(), "gone") is None, "forget")
            assert redis_client.zscore(K.engines(), "d1") is not None

    run(main())


def test_several_schedulers_share_the_stream(redis_url: str, redis_client: redis.Redis) -> None:
    for e in ("d1", "d2"):
        publish(redis_client, engine_status(e, total=1000))
    publish(redis_client, engine_status("p1", role="prefill"))

    async def main() -> None:
        async with running(settings(redis_url)) as a, running(settings(redis_url)) as b:
            reqs = [request(gateway=f"gw{i % 3}") for i in range(150)]
            for r in reqs:
                enqueue(redis_client, r)
                await asyncio.sleep(0)
            got = []

            def collect() -> bool:
                got[:] = [x for g in ("gw0", "gw1", "gw2") for x in assignments(redis_client, g)]
                return len(got) >= 150

            await wait_for(collect, "150 assignments")
            assert sorted(x.request_id for x in got) == sorted(r.request_id for r in reqs)
            assert all(x.ok for x in got)
            assert a.stats.assigned + b.stats.assigned == 150
            assert sum(Reservations(redis_client).count(e) for e in ("d1", "d2")) == 150
            release_all(redis_client, got)

    run(main())
