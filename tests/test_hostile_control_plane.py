"""Hostile writes to Redis: the real scheduler logs and skips or dead-letters each, and serves on.

Each case writes one piece of garbage where the scheduler reads (request stream, engine
index, engine status, reservation keys) next to a good decode engine ``d1`` and a good
prefill engine ``p1``. The garbage is built to win if it were believed: hostile engines are
bigger and idler than the good ones. After it, a well-formed request must be placed on
``d1`` and ``p1``, the scheduler task must still run, and no reservation may be left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from kvpush.common import engine_view
from kvpush.common.runtime import run
from kvpush.common.wire import SCHEMA_VERSION, encode, now_ms
from kvpush.services.scheduler import Scheduler, intake, run_scheduler
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
    settings,
    wait_for,
)


@dataclass(frozen=True)
class Case:
    name: str
    write: Callable[[redis.Redis], None]
    expect: str  # "dead", "skip" (read, left out), "reject" (answered) or "served"
    says: str  # in the dead letter's reason, or in what was logged
    repair: Callable[[redis.Redis], None] | None = None
    engine_skipped: bool = True  # the hostile engine (if any) is out of placement


def entry(**fields: bytes) -> Callable[[redis.Redis], None]:
    return lambda r: r.xadd(K.requests(), {k.encode(): v for k, v in fields.items()})


def req(**kw: object) -> Callable[[redis.Redis], None]:
    """A request entry with some fields replaced (msgspec would refuse most on encode)."""
    def write(r: redis.Redis) -> None:
        body = msgspec.structs.asdict(request())
        body.update(kw)
        r.xadd(K.requests(), {b"m": msgspec.msgpack.encode(body), b"tp": TP})
    return write


def bad_engine(engine_id: str = "ax", as_role: str = "decode", **fields: object
               ) -> Callable[[redis.Redis], None]:
    """A status that would win placement if believed ("ax" sorts before "d1" on ties),
    with ``fields`` made hostile."""
    def write(r: redis.Redis) -> None:
        publish(r, engine_status(engine_id, role=as_role, total=100_000))
        r.hset(K.engine(engine_id), mapping=fields)  # type: ignore[arg-type]
    return write


def wrong_type(key: str) -> Callable[[redis.Redis], None]:
    def write(r: redis.Redis) -> None:
        publish(r, engine_status("ax", total=100_000))
        r.delete(key)
        r.set(key, b"not a hash")
    return write


def garbage_resv(r: redis.Redis) -> None:
    publish(r, engine_status("ax", total=100_000))
    r.hset(K.reservations("ax"), mapping={"#blocks": "lots", "#gen": "1", "r0": "nonsense"})


def bad_index(r: redis.Redis) -> None:
    r.zadd(K.engines(), {"bad id {with} braces": now_ms(), "\xff\xfe": now_ms()})


def stream_replaced(r: redis.Redis) -> None:
    r.delete(K.requests())
    r.set(K.requests(), b"surprise")


def stream_repaired(r: redis.Redis) -> None:
    r.delete(K.requests())


CASES = [
    # -- request stream entries ---------------------------------------------------------
    Case("no m field", entry(x=b"1"), "dead", "no 'm' field"),
    Case("not msgpack", entry(m=b"\xc1\xc1\xc1", tp=TP), "dead", "malformed"),
    Case("msgpack of a list", entry(m=msgspec.msgpack.encode([1, 2, 3])), "dead", "malformed"),
    Case("a schema version from the future", req(v=SCHEMA_VERSION + 1), "dead",
         f"schema version {SCHEMA_VERSION + 1}"),
    Case("missing fields", entry(m=msgspec.msgpack.encode({"v": 1, "request_id": "r"})),
         "dead", "malformed"),
    Case("tokens as text", req(prompt_tokens="many"), "dead", "malformed"),
    Case("negative prompt_tokens", req(prompt_tokens=-1), "dead", "negative"),
    Case("huge max_tokens", req(max_tokens=2**62), "dead", "above"),
    Case("huge payload", entry(m=b"\x00" * (2 << 20)), "dead", "exceeds"),
    Case("deadline years ahead", req(deadline_ms=now_ms() + 10 * 365 * 86_400_000), "dead",
         "day ahead"),
    Case("deadline long past", req(deadline_ms=1), "reject", "deadline"),
    Case("gateway id breaks keys", req(gateway_id="gw}{evil"), "dead", "invalid id"),
    Case("tenant id breaks keys", req(tenant="a b"), "dead", "invalid id"),
    Case("request id empty", req(request_id=""), "dead", "invalid id"),
    Case("10k excluded engines", req(exclude_engines=[f"e{i}" for i in range(10_000)]),
         "dead", "longer than"),
    Case("huge traceparent", lambda r: r.xadd(K.requests(), {
        b"m": encode(request()), b"tp": b"x" * 10_000}), "served", "traceparent"),
    Case("stream replaced by a string", stream_replaced, "skip", "lost Redis",
         repair=stream_repaired),
    # -- engine statuses ----------------------------------------------------------------
    Case("role not known", bad_engine(role="boss"), "skip", "role"),
    Case("url not http", bad_engine(url="file:///etc/passwd"), "skip", "http(s)"),
    Case("url port not a number", bad_engine(url="http://h:port"), "skip", "url"),
    Case("total_blocks not a number", bad_engine(total_blocks="abc"), "skip", "integer"),
    Case("total_blocks absurd", bad_engine(total_blocks=10**30, free_blocks=10**30),
         "skip", "outside"),
    Case("free_blocks negative", bad_engine(free_blocks=-5), "skip", "outside"),
    Case("free above total", bad_engine(free_blocks=200_000), "skip", "exceeds"),
    Case("block_size zero", bad_engine(block_size=0), "skip", "outside"),
    Case("running negative", bad_engine(running=-3), "skip", "outside"),
    Case("suspect_until text", bad_engine(suspect_until="soon"), "skip", "integer"),
    Case("prefill with bad url", bad_engine("apx", as_role="prefill", url="javascript:x"),
         "skip", "http(s)"),
    Case("status key not a hash", wrong_type(K.engine("ax")), "skip", "unreadable"),
    Case("reservation key not a hash", wrong_type(K.reservations("ax")), "engine",
         "unreadable"),
    Case("garbage in reservation hash", garbage_resv, "skip", "not a number",
         engine_skipped=False),
    Case("invalid ids in engine index", bad_index, "skip", "invalid id"),
]


@pytest.fixture(autouse=True)
def fresh_warnings(redis_client: redis.Redis) -> Iterator[None]:
    engine_view._WARNED.clear()
    intake._WARNED.clear()
    yield
    assert_no_reservations(redis_client)


@contextlib.asynccontextmanager
async def scheduler(redis_url: str):
    """The real scheduler, as ``kvpush scheduler`` runs it (retries included)."""
    s = settings(redis_url, scheduler_sweep_s=0.1)
    client = aioredis.Redis.from_url(redis_url)
    sched = Scheduler(s, client)
    task = asyncio.create_task(run_scheduler(s, scheduler=sched))
    try:
        yield sched, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scheduler_survives(case: Case, redis_url: str, redis_client: redis.Redis,
                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvpush")
    publish(redis_client, engine_status("d1", total=100, url="http://d1"))
    publish(redis_client, engine_status("p1", role="prefill", url="http://p1", queued=10**6))
    redis_client.xgroup_create(K.requests(), "schedulers", id="0", mkstream=True)
    case.write(redis_client)
    def logged(level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= level]

    async def main() -> None:
        async with scheduler(redis_url) as (sched, task):
            if case.expect == "dead":
                await wait_for(lambda: dead_letters(redis_client), "the dead letter")
                (dead,) = dead_letters(redis_client)
                assert case.says in dead[b"reason"].decode()
                assert all(len(v) <= 64 * 1024 for v in dead.values())
                assert any("dead-lettering" in m for m in logged())
            elif case.expect == "skip":
                await wait_for(lambda: any(case.says in m for m in logged(logging.DEBUG)),
                               "it to be logged")
                if case.repair is not None:
                    assert not task.done()
                    case.repair(redis_client)
                await sched.ready.wait()
                await wait_for(lambda: "d1" in sched.engines, "a refresh")
                usable = {e.engine_id for e in sched.decoders + sched.prefillers}
                assert usable - {"d1", "p1"} == (set() if case.engine_skipped else {"ax"})
            elif case.expect in ("reject", "served"):
                await wait_for(lambda: assignments(redis_client), "its answer")
                (a,) = assignments(redis_client)
                assert a.ok == (case.expect == "served")
                if case.expect == "reject":
                    assert a.error_kind == case.says
                else:
                    assert a.decode_engine == "d1"
                    assert not case.says or any(case.says in m for m in logged())
            before = list(assignments(redis_client))
            good = request(prompt_tokens=100, max_tokens=16)
            enqueue(redis_client, good)
            await wait_for(lambda: any(a.request_id == good.request_id
                                       for a in assignments(redis_client)), "the good one")
            (a,) = [a for a in assignments(redis_client) if a.request_id == good.request_id]
            assert a.ok, a.error
            assert (a.decode_engine, a.decode_url) == ("d1", "http://d1")
            assert (a.prefill_engine, a.prefill_url) == ("p1", "http://p1")
            assert not task.done() and sched.ready.is_set()
            release_all(redis_client, [*before, a])
            if case.expect != "skip":
                assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0

    run(main())


def test_request_stream_trimmed_behind_the_group(redis_url: str,
                                                 redis_client: redis.Redis) -> None:
    """Answered entries leave the stream; ones still pending (waiting) stay."""
    publish(redis_client, engine_status("d1", total=10))

    async def main() -> None:
        async with scheduler(redis_url) as (sched, _task):
            await sched.ready.wait()
            done = [request(prompt_tokens=16, max_tokens=0) for _ in range(5)]
            for r in done:
                enqueue(redis_client, r)
            await wait_for(lambda: len(assignments(redis_client)) == 5, "assignments")
            # Fill the engine, then one more that has to wait (stays pending).
            release_all(redis_client, assignments(redis_client))
            big = request(prompt_tokens=160, max_tokens=0)
            enqueue(redis_client, big)
            await wait_for(lambda: len(assignments(redis_client)) == 6, "the big one")
            waiting = request(prompt_tokens=16, max_tokens=0)
            wid = enqueue(redis_client, waiting)
            await wait_for(lambda: len(sched.queue) == 1, "one waiting")
            await wait_for(lambda: redis_client.xlen(K.requests()) == 1, "the trim")
            ((eid, _),) = redis_client.xrange(K.requests())
            assert eid.decode() == wid
            release_all(redis_client, assignments(redis_client)[5:])
            await wait_for(lambda: len(assignments(redis_client)) == 7, "the waiting one")
            release_all(redis_client, assignments(redis_client)[6:])
            await wait_for(lambda: redis_client.xlen(K.requests()) == 0, "the last trim")

    run(main())


def test_entry_with_fake_gateway_leaves_no_stream_forever(redis_url: str,
                                                          redis_client: redis.Redis) -> None:
    publish(redis_client, engine_status("d1"))
    enqueue(redis_client, request(gateway="nobody-reads-this", deadline_s=-1))

    async def main() -> None:
        async with scheduler(redis_url):
            await wait_for(lambda: assignments(redis_client, "nobody-reads-this"), "answer")
            assert redis_client.pttl(K.assignments("nobody-reads-this")) > 0

    run(main())

