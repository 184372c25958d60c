"""Draining an engine on a real Redis: the mark, the scheduler skipping it, ``kvpush drain``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from kvpush.common.reservations import Reservations, ReserveStatus
from kvpush.common.runtime import run
from kvpush.services.cli.main import main as kvpush
from kvpush.services.engine.drain import (
    UnknownEngine,
    clear_draining,
    mark_draining,
    read_activity,
    wait_drained,
)
from kvpush.services.engine.status import publish_status
from kvpush.services.local.stack import engine_rows
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


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


def test_mark_survives_heartbeats_and_dies_with_the_generation(
        redis_url: str, redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", generation=7))
    assert mark_draining(redis_client, K, "d1") == 7
    # The heartbeat writes its own fields only: the mark stays.
    publish_status(redis_client, K, engine_status("d1", generation=7), ttl_s=60)
    assert read_activity(redis_client, K, "d1").draining
    assert {r["engine_id"]: r["state"] for r in engine_rows(redis_url)} == {"d1": "draining"}
    # A restarted engine (new generation) is not draining.
    publish_status(redis_client, K, engine_status("d1", generation=8), ttl_s=60)
    assert not read_activity(redis_client, K, "d1").draining
    with pytest.raises(UnknownEngine):
        mark_draining(redis_client, K, "nope")
    with pytest.raises(UnknownEngine):
        mark_draining(redis_client, K, "bad id")


def test_reserve_script_refuses_a_draining_engine(redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=10))
    res = Reservations(redis_client, K)
    held = res.reserve("d1", "r1", 2, 60_000)
    assert held.status is ReserveStatus.RESERVED
    mark_draining(redis_client, K, "d1")
    assert res.reserve("d1", "r2", 2, 60_000).status is ReserveStatus.DRAINING
    # What it already holds stays its own (a redelivered entry gets it back).
    again = res.reserve("d1", "r1", 2, 60_000)
    assert again.status is ReserveStatus.EXISTING and again.reservation == held.reservation
    clear_draining(redis_client, K, "d1")
    r2 = res.reserve("d1", "r2", 2, 60_000)
    assert r2.status is ReserveStatus.RESERVED
    for r in (held, r2):
        res.release("d1", r.reservation.reservation_id, r.reservation.fencing_token)


def test_scheduler_skips_draining_engines_until_cleared(redis_url: str,
                                                         redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1", total=1000))
    publish(redis_client, engine_status("d2", total=1000))
    publish(redis_client, engine_status("p1", role="prefill"))
    publish(redis_client, engine_status("p2", role="prefill"))
    mark_draining(redis_client, K, "d1")
    mark_draining(redis_client, K, "p1")

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            await wait_for(lambda: {e.engine_id for e in sched.decoders} == {"d2"}, "view")
            for _ in range(8):
                enqueue(redis_client, request(prompt_tokens=100, max_tokens=16))
            await wait_for(lambda: len(assignments(redis_client)) == 8, "assignments")
            got = assignments(redis_client)
            assert {(a.decode_engine, a.prefill_engine) for a in got} == {("d2", "p2")}
            release_all(redis_client, got)

            clear_draining(redis_client, K, "d1")
            clear_draining(redis_client, K, "p1")
            mark_draining(redis_client, K, "d2")
            mark_draining(redis_client, K, "p2")
            await wait_for(lambda: {e.engine_id for e in sched.decoders} == {"d1"}, "view")
            enqueue(redis_client, request(prompt_tokens=100, max_tokens=16))
            await wait_for(lambda: len(assignments(redis_client)) == 9, "assignment")
            last = assignments(redis_client)[-1]
            assert (last.decode_engine, last.prefill_engine) == ("d1", "p1")
            release_all(redis_client, [last])

    run(main())


def test_stale_view_cannot_place_on_a_draining_engine(redis_url: str,
                                                      redis_client: redis.Redis) -> None:
    """Marked after the scheduler's last refresh: the reserve script refuses it, the
    request goes to the other engine at once."""
    publish(redis_client, engine_status("d1", total=1000))
    publish(redis_client, engine_status("d2", total=10))

    async def main() -> None:
        async with running(settings(redis_url, scheduler_refresh_s=3600)) as sched:
            mark_draining(redis_client, K, "d1")  # least loaded: the view would pick it
            enqueue(redis_client, request(prompt_tokens=16, max_tokens=16))
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.ok and a.decode_engine == "d2"
            assert [e.engine_id for e in sched.decoders] == ["d2"]
            release_all(redis_client, [a])

    run(main())


def test_draining_only_engine_holds_requests_until_cleared(redis_url: str,
                                                           redis_client: redis.Redis) -> None:
    """A rolling restart of the only decode engine: requests wait, they are not refused."""
    publish(redis_client, engine_status("d1", total=1000))
    mark_draining(redis_client, K, "d1")

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            enqueue(redis_client, request())
            await wait_for(lambda: len(sched.queue) == 1, "the request to wait")
            assert assignments(redis_client) == []
            clear_draining(redis_client, K, "d1")
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.ok and a.decode_engine == "d1"
            release_all(redis_client, [a])

    run(main())


@pytest.fixture
def cli(redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("KVPUSH_REDIS_URL", redis_url)

    def call(*argv: str) -> tuple[int, str, str]:
        code = kvpush(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def test_drain_unknown_engine_is_one_line(cli) -> None:
    code, out, err = cli("drain", "nope")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "unknown engine 'nope'" in err
    assert "Traceback" not in err
    code, _, err = cli("drain", "bad id", "--wait")
    assert code == 2 and err.count("\n") == 1


def test_drain_wait_returns_once_idle_and_no_reservation(cli, redis_client: redis.Redis) -> None:
    busy = engine_status("d1", total=10)
    busy.running, busy.waiting = 2, 1
    publish(redis_client, busy)
    res = Reservations(redis_client, K)
    held = res.reserve("d1", "r1", 2, 60_000).reservation
    beats = threading.Event()

    def heartbeat() -> None:
        """The engine: busy for a while, then idle; the gateway releases at request end."""
        t0 = time.monotonic()
        while not beats.is_set():
            st = engine_status("d1", total=10)
            if time.monotonic() - t0 < 0.6:
                st.running, st.waiting = 2, 1
            elif time.monotonic() - t0 > 0.9 and held is not None:
                res.release("d1", held.reservation_id, held.fencing_token)
            publish_status(redis_client, K, st, ttl_s=60)
            time.sleep(0.05)

    t = threading.Thread(target=heartbeat)
    t.start()
    try:
        t0 = time.monotonic()
        code, out, err = cli("drain", "d1", "--wait", "--timeout", "20", "--settle", "0.3")
        waited = time.monotonic() - t0
    finally:
        beats.set()
        t.join()
    assert code == 0, (out, err)
    assert out.count("\n") == 1 and "drained" in out and "not drained" not in out
    assert waited >= 1.1  # busy until 0.6 s, reservation until 0.9 s, then 0.3 s settled
    assert res.count("d1") == 0


def test_drain_wait_times_out_while_busy(cli, redis_client: redis.Redis) -> None:
    busy = engine_status("d1", total=10)
    busy.running = 1
    publish(redis_client, busy)
    code, out, _ = cli("drain", "d1", "--wait", "--timeout", "0.5")
    assert code == 1 and "not drained (timeout" in out and "running=1" in out
    code, out, _ = cli("drain", "d1", "--clear")
    assert code == 0 and not read_activity(redis_client, K, "d1").draining


def test_wait_drained_aborts_on_second_signal(redis_client: redis.Redis) -> None:
    busy = engine_status("d1", total=10)
    busy.running = 1
    publish(redis_client, busy)
    mark_draining(redis_client, K, "d1")
    now = threading.Event()
    threading.Timer(0.3, now.set).start()
    r = wait_drained(redis_client, K, "d1", timeout_s=30, abort=now)
    assert not r.drained and r.reason == "aborted" and r.waited_s < 5
    # An engine whose status vanished (stopped, expired) has nothing left to drain.
    redis_client.delete(K.engine("d1"))
    assert wait_drained(redis_client, K, "d1", timeout_s=5).reason == "gone"
