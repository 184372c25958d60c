"""Prefix affinity: requests sharing a prompt prefix go to the engines that got it before,
when their load allows (the real scheduler on a real Redis; hashes as the gateway makes them)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.prefix_hashes import (
    CHUNK_TOKENS,
    MAX_HASHES,
    REMEMBERED_HASHES,
    prefix_hashes,
)
from kvpush.common.runtime import run
from kvpush.common.settings import SchedulerSettings
from kvpush.common.wire import Assignment, now_ms
from kvpush.services.scheduler.prefix_affinity import (
    WINDOW_S,
    parse_lookup,
    queue_lookups,
    queue_record,
)
from tests.sched_util import (
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

K = RedisKeys()


def test_hashes_cover_whole_prefixes_per_tenant() -> None:
    turn1 = list(range(300))
    turn2 = turn1 + list(range(1000, 1200))
    h1, h2 = prefix_hashes(turn1, "acme"), prefix_hashes(turn2, "acme")
    assert len(h1) == 300 // CHUNK_TOKENS and len(h2) == 500 // CHUNK_TOKENS
    assert h2[:len(h1)] == h1  # the same prefix, the same leading hashes
    assert prefix_hashes(turn1, "other")[0] != h1[0]  # never shared across tenants
    changed = [7, *turn1[1:]]
    assert all(a != b for a, b in zip(prefix_hashes(changed, "acme"), h1, strict=True))
    assert len(prefix_hashes(list(range((MAX_HASHES + 3) * CHUNK_TOKENS)), "acme")) \
        == MAX_HASHES
    assert all(0 <= h < 2**63 for h in h2)


def _engines(r: redis.Redis) -> None:
    for d in ("d1", "d2"):
        publish(r, engine_status(d, total=100, url=f"http://{d}"))
    for p in ("p1", "p2"):
        publish(r, engine_status(p, role="prefill", url=f"http://{p}"))


def test_a_shared_prefix_goes_back_to_its_engines(redis_url: str,
                                                  redis_client: redis.Redis) -> None:
    _engines(redis_client)
    conv = prefix_hashes(list(range(256)), "t")
    follow_up = prefix_hashes(list(range(256)) + list(range(500, 600)), "t")
    stranger = prefix_hashes(list(range(900, 1300)), "t")

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            got = []
            for hashes in (conv, follow_up, stranger):
                req = msgspec.structs.replace(request(prompt_tokens=100, max_tokens=60),
                                              prefix_hashes=hashes)
                enqueue(redis_client, req)
                await wait_for(lambda n=len(got): len(assignments(redis_client)) > n,
                               "assignment")
                got.append(assignments(redis_client)[-1])
            first, second, third = got
            # The first turn holds 10 of d1's 100 blocks, so least-loaded alone would send
            # the follow-up to d2; it shares the prefix, so it goes to d1 and p1 again.
            assert (first.decode_engine, first.prefill_engine) == ("d1", "p1")
            assert (second.decode_engine, second.prefill_engine) == ("d1", "p1")
            assert third.decode_engine == "d2"  # no shared prefix: the least loaded
            assert sched.stats.affinity_hits >= 1
            release_all(redis_client, got)

    run(main())


def test_affinity_yields_to_load_and_can_be_turned_off(redis_url: str,
                                                       redis_client: redis.Redis) -> None:
    _engines(redis_client)
    conv = prefix_hashes(list(range(256)), "t")

    async def main() -> None:
        for on, heavy, want in ((True, True, "d2"), (False, False, "d2")):
            async with running(settings(redis_url, scheduler_prefix_affinity=on)):
                got = []
                # The conversation's first turn; with ``heavy`` it is long: d1 is 70 % full.
                tokens = 1060 if heavy else 100
                for hashes, pt in ((conv, tokens), ([*conv, 12345], 100)):
                    req = msgspec.structs.replace(request(prompt_tokens=pt, max_tokens=60),
                                                  prefix_hashes=hashes)
                    enqueue(redis_client, req)
                    await wait_for(lambda n=len(got): len(assignments(redis_client)) > n,
                                   "assignment")
                    got.append(assignments(redis_client)[-1])
                assert got[0].decode_engine == "d1"
                assert got[1].decode_engine == want, (on, heavy)
                release_all(redis_client, got)
            redis_client.delete(K.assignments("gw1"))

    run(main())


def test_garbage_in_the_affinity_memory_is_ignored(redis_url: str,
                                                   redis_client: redis.Redis) -> None:
    _engines(redis_client)
    conv = prefix_hashes(list(range(256)), "t")
    w = now_ms() // (WINDOW_S * 1000)
    redis_client.hset(K.prefix_affinity(w), mapping={str(conv[-1]): "d}{x|p1",
                                                     str(conv[0]): "x" * 1000})
    redis_client.set(K.prefix_affinity(w - 1), "not a hash")

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            req = msgspec.structs.replace(request(prompt_tokens=100, max_tokens=60),
                                          prefix_hashes=conv)
            enqueue(redis_client, req)
            await wait_for(lambda: assignments(redis_client), "assignment")
            (a,) = assignments(redis_client)
            assert a.ok and a.decode_engine == "d1" and sched.stats.affinity_hits == 0
            release_all(redis_client, [a])

    run(main())


def test_one_engine_per_role_skips_the_lookup_but_still_records(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one decode and one prefill there is no pick to change: no lookup round trip
    delays the assignment, and where the prefix went is still remembered for a bigger
    fleet."""
    from kvpush.services.scheduler import affinity

    lookups: list[int] = []
    real = affinity.queue_lookups
    monkeypatch.setattr(affinity, "queue_lookups",
                        lambda pipe, keys, hashes: (lookups.append(1), real(pipe, keys, hashes)))
    publish(redis_client, engine_status("d1", total=100, url="http://d1"))
    publish(redis_client, engine_status("p1", role="prefill", url="http://p1"))
    conv = prefix_hashes(list(range(256)), "t")

    async def main() -> None:
        async with running(settings(redis_url)):
            req = msgspec.structs.replace(request(prompt_tokens=100, max_tokens=60),
                                          prefix_hashes=conv)
            enqueue(redis_client, req)
            await wait_for(lambda: len(assignments(redis_client)) == 1, "assignment")
            a = assignments(redis_client)[0]
            assert (a.decode_engine, a.prefill_engine) == ("d1", "p1")
            w = now_ms() // (WINDOW_S * 1000)
            await wait_for(lambda: any(redis_client.hget(K.prefix_affinity(x), str(conv[-1]))
                                       for x in (w - 1, w)), "recorded")
            release_all(redis_client, [a])
        assert lookups == []

    run(main())


# -- placement by what engines hold (their KV events, relayed to kvpush:kv:{E}) -----------


def _relaying_engines(r: redis.Redis, total: int = 100) -> None:
    for d in ("d1", "d2"):
        publish(r, engine_status(d, total=total, url=f"http://{d}", kv_events=True))
    for p in ("p1", "p2"):
        publish(r, engine_status(p, role="prefill", url=f"http://{p}", kv_events=True))


async def _place(r: redis.Redis, hashes: list[int], prompt_tokens: int) -> Assignment:
    n = len(assignments(r))
    enqueue(r, msgspec.structs.replace(request(prompt_tokens=prompt_tokens, max_tokens=60),
                                       prefix_hashes=hashes))
    await wait_for(lambda: len(assignments(r)) > n, "assignment")
    return assignments(r)[-1]


def test_requests_go_where_their_prefix_is_held_and_follow_an_eviction(
        redis_url: str, redis_client: redis.Redis) -> None:
    """Exact overlap from the engines' held chunks: the decode and the prefill holding the
    longest prefix win over least-loaded order (d1, p1 by id), nothing is remembered, and
    once the holder's chunks are removed (its KV events after an eviction) placement
    follows the other holder instead of where the prefix went last."""
    _relaying_engines(redis_client)
    conv = prefix_hashes(list(range(512)), "t")  # 8 chunks
    redis_client.sadd(K.kv_chunks("d2"), *conv[:6])
    redis_client.sadd(K.kv_chunks("d1"), *conv[:2])
    redis_client.sadd(K.kv_chunks("p2"), *conv[:3])
    redis_client.sadd(K.kv_chunks("p1"), conv[1], conv[2])  # no first chunk: holds none

    async def main() -> None:
        async with running(settings(redis_url, scheduler_decode_alone_tokens=0)) as sched:
            a = await _place(redis_client, conv, 1000)
            assert (a.decode_engine, a.prefill_engine) == ("d2", "p2")
            assert a.disaggregated and a.cached_tokens == 6 * 64
            assert sched.stats.affinity_hits == 1
            release_all(redis_client, [a])
            # d2 evicts the prefix; d1 still holds two chunks of it.
            redis_client.srem(K.kv_chunks("d2"), *conv[:6])
            redis_client.sadd(K.kv_chunks("d2"), conv[5])  # a leaf without its parents
            b = await _place(redis_client, conv, 1000)
            assert b.decode_engine == "d1" and b.cached_tokens == 2 * 64
            release_all(redis_client, [b])
        assert not list(redis_client.scan_iter(K.prefix_affinity_pattern()))

    run(main())


def test_a_prompt_decode_holds_but_for_a_short_tail_skips_prefill(
        redis_url: str, redis_client: redis.Redis) -> None:
    """Conditional disaggregation: decode computes a tail shorter than
    ``scheduler_decode_alone_tokens`` itself; a longer tail, or no held prefix, still
    goes through prefill."""
    _relaying_engines(redis_client, total=1000)
    conv = prefix_hashes(list(range(640)), "t")  # 10 chunks
    redis_client.sadd(K.kv_chunks("d2"), *conv[:9])

    async def main() -> None:
        async with running(settings(redis_url, scheduler_decode_alone_tokens=256)) as sched:
            a = await _place(redis_client, conv, 700)  # 700 - 576 = 124 left
            assert a.decode_engine == "d2" and not a.disaggregated
            assert a.prefill_engine is None and a.cached_tokens == 576
            release_all(redis_client, [a])
            b = await _place(redis_client, conv, 900)  # 324 left: prefill computes it
            assert b.decode_engine == "d2" and b.disaggregated and b.prefill_engine
            release_all(redis_client, [b])
            c = await _place(redis_client, prefix_hashes(list(range(900, 1000)), "t"), 100)
            assert c.disaggregated and c.cached_tokens == 0
            assert sched.stats.decode_alone == 1
            release_all(redis_client, [c])

    run(main())


def test_a_prompt_decode_holds_in_full_skips_prefill_by_default(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A retry or a regenerate: decode holds every whole chunk of the prompt, and the
    default threshold (``SchedulerSettings``, not the suite's environment) has it compute the
    few tokens left itself; a tail of 16 or more goes through prefill."""
    _relaying_engines(redis_client, total=1000)
    conv = prefix_hashes(list(range(640)), "t")  # 10 chunks
    redis_client.sadd(K.kv_chunks("d2"), *conv)
    default = SchedulerSettings.model_fields["scheduler_decode_alone_tokens"].default

    async def main() -> None:
        async with running(settings(redis_url, scheduler_decode_alone_tokens=default)):
            a = await _place(redis_client, conv, 641)  # one token past what decode holds
            assert a.decode_engine == "d2" and not a.disaggregated and a.cached_tokens == 640
            release_all(redis_client, [a])
            b = await _place(redis_client, conv, 656)
            assert b.decode_engine == "d2" and b.disaggregated
            release_all(redis_client, [b])

    run(main())


def test_garbage_in_the_held_chunks_reads_as_nothing_held(
        redis_url: str, redis_client: redis.Redis) -> None:
    _relaying_engines(redis_client)
    conv = prefix_hashes(list(range(256)), "t")
    redis_client.set(K.kv_chunks("d1"), "not a set")  # WRONGTYPE for SMISMEMBER
    redis_client.sadd(K.kv_chunks("d2"), "x" * 100, "-1")

    async def main() -> None:
        async with running(settings(redis_url)) as sched:
            a = await _place(redis_client, conv, 300)
            assert a.ok and a.decode_engine == "d1" and a.cached_tokens == 0
            assert a.disaggregated and sched.stats.affinity_hits == 0
            release_all(redis_client, [a])

    run(main())


def test_a_prefix_held_elsewhere_is_pushed_to_the_prefill_picked(
        redis_url: str, redis_client: redis.Redis) -> None:
    """History push: the engine holding the most of the prompt beyond what the prefill
    picked holds pushes it there, in whole blocks of that prefill and never the prompt's
    last token; less than ``scheduler_history_push_tokens`` more, or none, is recomputed."""
    _relaying_engines(redis_client, total=1000)
    conv = prefix_hashes(list(range(640)), "t")  # 10 chunks
    redis_client.sadd(K.kv_chunks("d2"), *conv[:9])  # the last turn's decode
    redis_client.sadd(K.kv_chunks("p1"), *conv[:2])  # a prefill that saw the first turn

    async def main() -> None:
        async with running(settings(redis_url, scheduler_history_push_tokens=256)) as sched:
            a = await _place(redis_client, conv, 700)
            assert (a.decode_engine, a.prefill_engine) == ("d2", "p1")
            assert (a.history_engine, a.history_url) == ("d2", "http://d2")
            assert a.history_tokens == 9 * 64 and a.prefill_held_tokens == 2 * 64
            release_all(redis_client, [a])
            # All of a 576-token prompt is held: the history stops a block short of its
            # last token.
            b = await _place(redis_client, conv[:9], 576)
            assert b.history_engine == "d2" and b.history_tokens == 576 - 16
            release_all(redis_client, [b])
            # p1 now holds 6 chunks: 3 more is less than 256 tokens.
            redis_client.sadd(K.kv_chunks("p1"), *conv[2:6])
            c = await _place(redis_client, conv, 700)
            assert c.prefill_engine == "p1" and c.history_engine is None
            assert c.history_tokens == 0 and c.prefill_held_tokens == 6 * 64
            release_all(redis_client, [c])
            assert sched.stats.history_pushes == 2

    run(main())


def test_a_long_history_is_pushed_whole_and_remembered_by_its_lead(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A conversation of 40,000 tokens: the scheduler sees all of what its holder holds
    (not only the first 4,096 tokens), so all of it is pushed; where a prompt went is
    remembered by its leading hashes only, in one bounded write."""
    _relaying_engines(redis_client, total=5000)
    conv = prefix_hashes(list(range(40_100)), "t")
    assert len(conv) == 626
    redis_client.sadd(K.kv_chunks("d2"), *conv[:625])
    redis_client.sadd(K.kv_chunks("p1"), *conv[:80])

    async def main() -> None:
        async with running(settings(redis_url, scheduler_history_push_tokens=512)) as sched:
            a = await _place(redis_client, conv, 40_100)
            assert (a.decode_engine, a.prefill_engine, a.history_engine) == ("d2", "p1", "d2")
            assert a.history_tokens == 625 * 64 and a.prefill_held_tokens == 80 * 64
            assert a.cached_tokens == 625 * 64
            release_all(redis_client, [a])
            assert sched.stats.history_pushes == 1

    run(main())
    # Engines without KV events: the placement is remembered by the first 64 hashes.
    pipe = redis_client.pipeline()
    queue_record(pipe, K, conv, "d1", "p1")
    pipe.execute()
    (key,) = list(redis_client.scan_iter(K.prefix_affinity_pattern()))
    assert redis_client.hlen(key) == REMEMBERED_HASHES
    pipe = redis_client.pipeline()
    queue_lookups(pipe, K, conv)
    got = parse_lookup(conv, *pipe.execute(), K)
    assert got is not None and (got.decode, got.prefill, got.chunks) == ("d1", "p1", 64)


def test_no_history_is_pushed_while_it_is_off(redis_url: str,
                                              redis_client: redis.Redis) -> None:
    _relaying_engines(redis_client, total=1000)
    conv = prefix_hashes(list(range(640)), "t")
    redis_client.sadd(K.kv_chunks("d2"), *conv[:9])

    async def main() -> None:
        async with running(settings(redis_url, scheduler_history_push_tokens=0)) as sched:
            a = await _place(redis_client, conv, 700)
            assert a.disaggregated and a.history_engine is None and a.history_tokens == 0
            assert sched.stats.history_pushes == 0
            release_all(redis_client, [a])

    run(main())


def test_the_cost_model_pushes_a_history_only_when_its_measured_wait_is_shorter(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The prefill's heartbeat says how fast it computes a prompt and how long a pushed
    history took to arrive: a history whose compute takes longer than that wait is pushed,
    one that computes sooner is recomputed, every ``scheduler_history_explore_every``-th
    of those is pushed anyway, and each assignment carries the choice and its inputs."""
    conv = prefix_hashes(list(range(640)), "t")  # 10 chunks

    def fleet(wait_ms: int) -> None:
        redis_client.flushdb()
        for d in ("d1", "d2"):
            publish(redis_client, engine_status(d, total=1000, url=f"http://{d}",
                                                kv_events=True))
        publish(redis_client, engine_status("p1", role="prefill", url="http://p1",
                                            kv_events=True, prefill_tok_s=2000,
                                            history_wait_ms=wait_ms))
        redis_client.sadd(K.kv_chunks("d2"), *conv[:9])
        redis_client.sadd(K.kv_chunks("p1"), *conv[:2])

    async def placed(**over: object) -> list[Assignment]:
        async with running(settings(redis_url, scheduler_history_push_tokens=256,
                                    scheduler_history_explore_every=3, **over)):
            got = []
            for _ in range(3):
                got.append(a := await _place(redis_client, conv, 700))
                release_all(redis_client, [a])
            return got

    # 448 tokens p1 lacks at 2,000 tokens/s: 224 ms of compute against a 100 ms wait.
    fleet(wait_ms=100)
    pushed = run(placed())
    assert [a.history_choice for a in pushed] == ["push"] * 3
    assert all(a.history_engine == "d2" for a in pushed)
    assert (pushed[0].history_recompute_ms, pushed[0].history_wait_ms) == (224.0, 100.0)
    # The same history against a 400 ms wait is recomputed, but for the third decline.
    fleet(wait_ms=400)
    declined = run(placed())
    assert [a.history_choice for a in declined] == ["slower", "slower", "explore"]
    assert [a.history_engine for a in declined] == [None, None, "d2"]
    assert declined[0].history_tokens == 0 and declined[0].prefill_held_tokens == 128
    assert (declined[0].history_recompute_ms, declined[0].history_wait_ms) == (224.0, 400.0)
    # Off, the threshold alone decides; a prefill that measured nothing yet pushes.
    assert [a.history_choice for a in run(placed(scheduler_history_cost_model=False))] \
        == ["unmeasured"] * 3
    fleet(wait_ms=0)
    assert [a.history_choice for a in run(placed())] == ["unmeasured"] * 3


def test_a_draining_engine_still_pushes_the_histories_it_holds(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A drained decode takes no new request, but while it lives the next turn of a
    conversation it holds is placed elsewhere with its history pushed from it: the
    conversation moves with its KV instead of being recomputed once the drain ends it.
    A suspect engine (a dispatch to it just failed) is no holder."""
    from kvpush.services.engine.drain import mark_draining

    _relaying_engines(redis_client, total=1000)
    conv = prefix_hashes(list(range(640)), "t")
    redis_client.sadd(K.kv_chunks("d2"), *conv[:9])
    mark_draining(redis_client, K, "d2")

    async def main() -> None:
        async with running(settings(redis_url, scheduler_history_push_tokens=256,
                                    scheduler_history_cost_model=False)):
            a = await _place(redis_client, conv, 700)
            assert a.decode_engine == "d1" and a.prefill_engine in ("p1", "p2")
            assert a.history_engine == "d2" and a.history_tokens == 9 * 64
            assert a.cached_tokens == 0  # the new decode receives the whole prompt
            release_all(redis_client, [a])
            redis_client.hset(K.engine("d2"), "suspect_until", now_ms() + 60_000)
            await asyncio.sleep(0.3)  # the schedulers' next refresh
            b = await _place(redis_client, conv, 700)
            assert b.decode_engine == "d1" and b.history_engine is None
            release_all(redis_client, [b])

    run(main())
