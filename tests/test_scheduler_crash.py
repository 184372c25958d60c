"""A scheduler SIGKILLed mid-decision: its entries are reclaimed and served exactly once.

The victim is a real subprocess running the real scheduler, with one method overridden to
stop forever at the crash point (after reading, or after reserving but before answering);
the test SIGKILLs it there, so nothing it had in hand is acknowledged.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvpush.common.reservations import Reservations
from kvpush.common.runtime import run
from tests.sched_util import (
    K,
    assert_no_reservations,
    assignments,
    engine_status,
    enqueue,
    publish,
    release_all,
    request,
    running,
    settings,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]

VICTIM = textwrap.dedent(
    """
    import asyncio, sys
    from kvpush.common.runtime import run
    from kvpush.common.settings import SchedulerSettings
    from kvpush.services.scheduler import Scheduler

    POINT = sys.argv[1]

    class Victim(Scheduler):
        async def handle_entries(self, entries, deliveries=None):
            if POINT == "after_read":
                print("CRASHPOINT", len(entries), flush=True)
                await asyncio.Event().wait()
            await super().handle_entries(entries, deliveries)

        async def answer(self, out):
            if POINT == "after_reserve" and out.assignments:
                print("CRASHPOINT", len(out.assignments), flush=True)
                await asyncio.Event().wait()
            await super().answer(out)

    run(Victim(SchedulerSettings()).run())
    """
)


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


def start_victim(redis_url: str, point: str) -> subprocess.Popen[str]:
    env = dict(os.environ, KVPUSH_REDIS_URL=redis_url, KVPUSH_SCHEDULER_ID="victim",
               PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", VICTIM, point], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("point", ["after_read", "after_reserve"])
def test_killed_scheduler_entries_served_exactly_once(
        redis_url: str, redis_client: redis.Redis, point: str) -> None:
    for e in ("d1", "d2", "d3"):
        publish(redis_client, engine_status(e, total=1000))
    publish(redis_client, engine_status("p1", role="prefill"))
    first = [request() for _ in range(20)]
    for r in first:
        enqueue(redis_client, r)
    victim = start_victim(redis_url, point)
    try:
        line = victim.stdout.readline()
        assert line.startswith("CRASHPOINT"), line
        held = int(line.split()[1])
        assert held > 0
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    pend = redis_client.xpending(K.requests(), "schedulers")
    assert pend["pending"] >= held
    if point == "after_reserve":
        # The victim reserved before dying: the reservations exist, no answer was sent.
        assert sum(Reservations(redis_client).count(e) for e in ("d1", "d2", "d3")) == held
        assert assignments(redis_client) == []

    async def main() -> None:
        s = settings(redis_url, scheduler_claim_idle_ms=300)
        async with running(s) as survivor:
            second = [request() for _ in range(20)]
            for r in second:
                enqueue(redis_client, r)
            everyone = {r.request_id for r in first + second}
            await wait_for(lambda: len(assignments(redis_client)) >= 40, "40 assignments")
            got = assignments(redis_client)
            assert len(got) == 40
            assert {a.request_id for a in got} == everyone
            assert all(a.ok for a in got)
            assert survivor.stats.reclaimed >= held
            # One reservation per request, and it is the one the assignment names.
            live = {}
            for e in ("d1", "d2", "d3"):
                for r in Reservations(redis_client).snapshot(e).reservations:
                    assert r.reservation_id not in live
                    live[r.reservation_id] = (e, r.fencing_token)
            assert live == {a.request_id: (a.decode_engine, a.fencing_token) for a in got}
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
            release_all(redis_client, got)

    run(main())


def test_a_redelivered_entry_whose_reservation_is_gone_gets_its_first_answer_again(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The acknowledgement of an answered entry is lost (as in a Redis failover) and its
    reservation is gone by the time the entry is redelivered (its request ended, or the
    reservation died with a Redis master): the redelivery repeats the first placement, with
    its fencing token, and takes no second reservation."""
    from kvpush.services.scheduler import Scheduler

    class LosesFirstAck(Scheduler):
        lost = False

        def _queue_answer(self, pipe, out):  # type: ignore[no-untyped-def]
            if out.assignments and not LosesFirstAck.lost:
                LosesFirstAck.lost = True
                out.acks = []
            super()._queue_answer(pipe, out)

    publish(redis_client, engine_status("d1", total=1000))
    publish(redis_client, engine_status("p1", role="prefill"))
    req = request()

    async def main() -> None:
        s = settings(redis_url, scheduler_claim_idle_ms=1500)
        async with running(s, cls=LosesFirstAck) as sched:
            enqueue(redis_client, req)
            await wait_for(lambda: assignments(redis_client), "the first answer")
            (first,) = assignments(redis_client)
            assert first.ok
            release_all(redis_client, [first])  # the request ended; its ack never landed
            await wait_for(lambda: len(assignments(redis_client)) == 2, "the redelivery")
            again = assignments(redis_client)[1]
            assert again.ok and sched.stats.reclaimed == 1
            assert (again.decode_engine, again.reservation_id, again.fencing_token) == (
                first.decode_engine, first.reservation_id, first.fencing_token)
            assert sched.stats.answered_again == 1
            assert Reservations(redis_client).count("d1") == 0
            assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0

    run(main())
