"""The fleet planner: its decision on a manual clock, and the task beside a real scheduler on a
real Redis (lease, inputs, the published plan, its gauges, hostile reports). The planner's
counts applied to real engines are in tests/test_autoscale.py."""

from __future__ import annotations

import asyncio

import pytest
import redis
from prometheus_client import generate_latest

from kvpush.common.wire import FleetPlan, GatewaySlo, decode, encode, now_ms
from kvpush.services.gateway.slo_report import SloWindow
from kvpush.services.scheduler.planner import (
    Objectives,
    Planner,
    Pressure,
    RoleLoad,
    Signals,
)
from kvpush.services.scheduler.planner_task import PlannerTask, merge_slo
from tests.sched_util import K, engine_status, enqueue, publish, request, running, settings

OBJ = Objectives(ttft_s=1.0, itl_s=0.1, kv_high=0.8, kv_low=0.4, up_stable_s=5,
                 down_stable_s=20, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3)


def sig(pre: int = 1, dec: int = 1, used: int = 0, total: int = 100, queued: int = 0,
        backlog: int = 0, requests: int = 10, ttft: float = 0.2, itl: float = 0.02,
        shed: int = 0) -> Signals:
    return Signals(prefill=RoleLoad(ready=pre, queued_prompt_tokens=queued),
                   decode=RoleLoad(ready=dec, total_blocks=total * dec, used_blocks=used),
                   stream_backlog=backlog, requests=requests, ttft_p90_s=ttft, itl_s=itl,
                   shed=shed)


def test_decode_grows_once_pressure_holds_and_not_again_while_an_engine_boots() -> None:
    p = Planner(OBJ)
    full = sig(used=90)  # 90 % of decode's blocks reserved
    assert p.decide(full, 0)["decode"].desired == 1
    d = p.decide(full, 4.9)["decode"]
    assert (d.pressure, d.desired) == (Pressure.UP, 1)  # not held 5 s yet
    d = p.decide(full, 5.0)["decode"]
    assert d.desired == 2 and d.reason.startswith("up: decode KV usage 90%")
    # Still one engine serving (the second boots): asked for once, however long it takes.
    assert p.decide(full, 60)["decode"].desired == 2
    both = sig(dec=2, used=170)
    assert p.decide(both, 61)["decode"].desired == 2  # the pressure must hold again
    assert p.decide(both, 66)["decode"].desired == 3
    assert p.decide(sig(dec=3, used=270), 100)["decode"].desired == 3  # the maximum
    assert p.decide(full, 100)["prefill"].desired == 1  # prefill was never short


def test_slow_tokens_and_requests_waiting_for_a_slot_grow_decode() -> None:
    p = Planner(OBJ)
    p.decide(sig(itl=0.3), 0)
    assert p.decide(sig(itl=0.3), 5)["decode"].desired == 2
    p = Planner(OBJ)
    p.decide(sig(backlog=4), 0)
    d = p.decide(sig(backlog=4), 5)["decode"]
    assert d.desired == 2 and "waiting for a decode slot" in d.reason
    # Requests waiting while prompts queue on prefill: prefill's shortage, not decode's.
    assert Planner(OBJ).decide(sig(backlog=4, queued=5000), 0)["decode"].pressure \
        is Pressure.HOLD


def test_prefill_grows_for_a_slow_first_token_only_where_prompts_queue_on_prefill() -> None:
    p = Planner(OBJ)
    p.decide(sig(ttft=3.0, queued=4000), 0)
    d = p.decide(sig(ttft=3.0, queued=4000), 5)["prefill"]
    assert d.desired == 2 and "4000 prompt tokens queued on prefill" in d.reason
    # Slow first tokens with nothing queued on prefill: another prefill would not help.
    q = Planner(OBJ)
    q.decide(sig(ttft=3.0), 0)
    assert q.decide(sig(ttft=3.0), 5)["prefill"].desired == 1
    # Shedding counts as a slow first token.
    r = Planner(OBJ)
    r.decide(sig(shed=3, queued=10), 0)
    assert r.decide(sig(shed=3, queued=10), 5)["prefill"].desired == 2


def test_a_role_shrinks_after_room_holds_one_engine_at_a_time_to_its_minimum() -> None:
    p = Planner(OBJ)
    idle = sig(pre=3, dec=3, used=30, total=100)  # 30 of 300 blocks
    p.decide(idle, 0)
    assert p.decide(idle, 19)["decode"].desired == 3
    out = p.decide(idle, 20)
    assert out["decode"].desired == 2 and out["prefill"].desired == 2
    assert out["decode"].reason.startswith("down:")
    assert p.decide(sig(pre=2, dec=2, used=30), 39)["decode"].desired == 2
    assert p.decide(sig(pre=2, dec=2, used=30), 40)["decode"].desired == 1
    assert p.decide(sig(pre=1, dec=1, used=30), 100)["decode"].desired == 1  # the minimum


def test_load_that_would_not_fit_on_one_engine_fewer_keeps_the_engines() -> None:
    p = Planner(OBJ)
    busy = sig(dec=2, used=90, total=100)  # 90 of 200: one engine fewer would be at 90 %
    p.decide(busy, 0)
    assert p.decide(busy, 100)["decode"].desired == 2
    # A moment of pressure restarts the count of the room.
    p2 = Planner(OBJ)
    p2.decide(sig(dec=2, used=10), 0)
    p2.decide(sig(dec=2, used=10, itl=0.3), 15)
    assert p2.decide(sig(dec=2, used=10), 30)["decode"].desired == 2
    assert p2.decide(sig(dec=2, used=10), 50)["decode"].desired == 1


def test_a_count_the_fleet_never_reached_does_not_keep_it_from_shrinking() -> None:
    p = Planner(OBJ)
    full = sig(used=90)
    p.decide(full, 0)
    assert p.decide(full, 5)["decode"].desired == 2  # the engine never comes
    idle = sig(dec=1, used=0)
    p.decide(idle, 6)
    assert p.decide(idle, 26)["decode"].desired == 1


def test_gateway_reports_merge_to_the_worst_p90_and_a_request_weighted_itl() -> None:
    reps = [GatewaySlo(gateway_id="a", updated_ms=1, window_s=30, requests=30,
                       ttft_p90_s=0.5, itl_mean_s=0.02, shed=1),
            GatewaySlo(gateway_id="b", updated_ms=1, window_s=30, requests=10,
                       ttft_p90_s=1.5, itl_mean_s=0.06, shed=2),
            GatewaySlo(gateway_id="c", updated_ms=1, window_s=30, requests=0,
                       ttft_p90_s=9.0, itl_mean_s=9.0)]
    requests, ttft, itl, shed = merge_slo(reps)
    assert (requests, ttft, shed) == (40, 1.5, 3)
    assert itl == pytest.approx(0.03)


def test_slo_window_reports_p90_and_mean_and_forgets_old_samples() -> None:
    w = SloWindow(window_s=60)
    for i in range(1, 11):
        w.request(i / 10, 0.01 * i if i % 2 else None)
    w.shed()
    rep = w.report("gw1")
    assert (rep.requests, rep.ttft_p90_s, rep.shed) == (10, 0.9, 1)
    assert rep.itl_mean_s == pytest.approx(0.05)  # 0.01, 0.03, ..., 0.09
    w.window_s = 0.0
    rep = w.report("gw1")
    assert (rep.requests, rep.ttft_p90_s, rep.itl_mean_s, rep.shed) == (0, 0.0, 0.0, 0)


def _desired(task: PlannerTask) -> str:
    return "\n".join(line for line in generate_latest(task.metrics.registry).decode()
                     .splitlines() if line.startswith("kvpush_planner_desired_replicas{"))


def test_one_scheduler_leads_and_publishes_a_plan_from_redis(
        redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("p1", role="prefill", queued=3000))
    publish(redis_client, engine_status("d1", total=100, free=5))  # 95 % in use
    # Gateway reports: one fresh, one garbage, one long gone, one of another version.
    slo = K.slo_reports()
    redis_client.hset(slo, "gw-ok", encode(GatewaySlo(
        gateway_id="gw-ok", updated_ms=now_ms(), window_s=30, requests=20, ttft_p90_s=3.0,
        itl_mean_s=0.05)))
    redis_client.hset(slo, "gw-junk", b"\xc1not msgpack")
    redis_client.hset(slo, "gw-old", encode(GatewaySlo(
        gateway_id="gw-old", updated_ms=now_ms() - 3_600_000, window_s=30, requests=99,
        ttft_p90_s=99.0)))
    future = GatewaySlo(gateway_id="gw-v9", updated_ms=now_ms(), window_s=30, requests=1)
    future.v = 99
    redis_client.hset(slo, "gw-v9", encode(future))

    async def main() -> None:
        s1 = settings(redis_url, planner_period_s=0.2, planner_up_stable_s=0,
                      planner_ttft_s=1.0, planner_kv_high=0.9)
        s2 = settings(redis_url, planner_period_s=0.2)
        async with running(s1) as a, running(s2) as b:
            # No decode slot for a request this large: it waits in a scheduler's queue.
            enqueue(redis_client, request(prompt_tokens=1500, max_tokens=16))
            await asyncio.sleep(0.3)
            ta, tb = PlannerTask(a), PlannerTask(b)
            first = await ta.once()
            assert first is not None and await tb.once() is None  # b follows
            sig = await ta.signals()
            assert sig.stream_backlog == 1
            assert (sig.requests, sig.ttft_p90_s) == (20, 3.0)  # only the fresh, sound report
            assert sig.decode.kv_usage == pytest.approx(0.95)
            assert set(redis_client.hkeys(slo)) == {b"gw-ok"}  # junk and the long gone deleted
            plan = await ta.once()
            assert plan is not None
            assert plan["decode"].desired == 2 and plan["prefill"].desired == 2
            msg = decode(redis_client.get(K.fleet_plan()), FleetPlan)
            assert (msg.planner_id, msg.decode.desired, msg.prefill.desired) == (a.consumer, 2, 2)
            assert 'role="decode"} 2.0' in _desired(ta) and _desired(tb) == ""
            # The leader stops renewing (its scheduler died): the follower takes over.
            redis_client.delete(K.planner_lead())
            assert await tb.once() is not None and tb.leading
            assert await ta.once() is None and _desired(ta) == ""

    asyncio.run(main())
