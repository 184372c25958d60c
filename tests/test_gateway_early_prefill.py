"""Early prefill: the gateway sends the prompt to a prefill engine at admission, before the
scheduler answers, and takes it back when the placement goes elsewhere.

Real Redis, the real scheduler and gateway over real HTTP; the engines are the stand-ins of
tests/test_gateway.py (the push itself, with a prefill that gets its target late, runs on
real vLLM engines in tests/e2e_tiny).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.runtime import run
from kvpush.common.wire import PushTarget, decode
from kvpush.services.gateway.early_prefill import PrefillEngines
from tests.sched_util import engine_status, publish, wait_for
from tests.test_gateway import (  # noqa: F401 (tokenizer_dir: a fixture)
    PROMPT,
    FakeEngine,
    no_leaks,
    pd,
    stack,
    tokenizer_dir,
)

K = RedisKeys()


def _cancels(client: redis.Redis, engine: str) -> list[PushTarget]:
    """The cancels on ``engine``'s push target stream."""
    out = [decode(f[b"m"], PushTarget) for _, f in client.xrange(K.targets(engine))]
    return [t for t in out if t.cancel]


def _metric(text: str, outcome: str) -> float:
    line = f'kvpush_gateway_early_prefill_total{{outcome="{outcome}"}} '
    for row in text.splitlines():
        if row.startswith(line):
            return float(row[len(line):])
    return 0.0


def test_the_prompt_reaches_prefill_before_the_scheduler_answers(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811
    """Prefill answers only once decode has the request, and decode gets it only with an
    assignment: a prefill call that names no decode engine, kept by the placement, is one
    made before the scheduler answered. Nothing is cancelled."""
    p, d = pd()
    p.wait_for, d.wait_for = d.arrived, p.arrived

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            for stream in (False, True):
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "stream": stream})
                assert r.status_code == 200, r.text
            assert len(p.calls) == len(d.calls) == 2
            for pc, dc in zip(p.calls, d.calls, strict=True):
                kp, kd = pc.body["kv_transfer_params"], dc.body["kv_transfer_params"]
                rid = pc.headers["x-request-id"]
                # No decode named: the connector takes the target of the decode that
                # carries the request's push key, which both legs get.
                assert kp == {"kvpush": "prefill", "request_id": rid,
                              "deadline_ms": kp["deadline_ms"], "push_key": kd["push_key"]}
                assert len(kd["push_key"]) == 32
                assert kd["prefill_engine"] == "p1" and kd["request_id"] == rid
                assert kd["fencing_token"] > 0
            assert _cancels(redis_client, "p1") == []
            m = (await s.client.get("/metrics")).text
            assert _metric(m, "kept") == 2.0 and _metric(m, "replaced") == 0.0

    run(main())


def test_a_placement_without_that_prefill_cancels_it(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811
    """The scheduler places a short prompt on decode alone (the gateway was not told the
    threshold): the early call is closed, which aborts it in the engine, and a cancel goes
    to the engine's connector, which frees blocks of a prefill that already answered."""
    p, d = pd()
    p.mode = "hang"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         sched={"scheduler_min_disagg_tokens": 11}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text
            (pc,), (dc,) = p.calls, d.calls
            assert "kv_transfer_params" not in dc.body
            await asyncio.wait_for(p.aborted.wait(), 30)
            rid = pc.headers["x-request-id"]
            await wait_for(lambda: _cancels(redis_client, "p1"), "the cancel")
            (c,) = _cancels(redis_client, "p1")
            assert c.request_id == rid and c.block_ids == [] and c.deadline_ms > 0
            # The request's own key, without which the connector ignores the cancel.
            assert c.push_key == pc.body["kv_transfer_params"]["push_key"]
            m = (await s.client.get("/metrics")).text
            assert _metric(m, "replaced") == 1.0 and _metric(m, "kept") == 0.0

    run(main())


def test_a_refused_request_takes_its_early_prefill_back(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811
    """No decode engine: the scheduler refuses (503), and the prefill already computing
    the prompt is aborted and its push cancelled."""
    p = FakeEngine("p1", "prefill", mode="hang")

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, None,
                         sched={"scheduler_queue_timeout_s": 0.2}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 503, r.text
            await asyncio.wait_for(p.aborted.wait(), 30)
            await wait_for(lambda: _cancels(redis_client, "p1"), "the cancel")
            m = (await s.client.get("/metrics")).text
            assert _metric(m, "refused") == 1.0

    run(main())


def test_a_queue_at_the_schedulers_turns_early_prefill_off(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811
    """A request waiting for its assignment longer than a placement takes means a queue:
    the next request's prompt waits for the schedulers' fair order too."""
    p, d = pd()
    d.total_blocks = 1  # one request at a time: the second waits in the scheduler's queue
    d.mode = "pause_after"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_early_prefill_queue_s": 0.2}) as s:
            first = asyncio.create_task(s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "stream": True}))
            await wait_for(lambda: len(d.calls) == 1, "the first request at decode")
            second = asyncio.create_task(s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4}))
            await wait_for(lambda: s.gateway.waiter.longest_wait_s() > 0.3, "a queue")
            third = asyncio.create_task(s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4}))
            await asyncio.sleep(0.5)
            # The first was sent early; the second too (nothing queued then); not the third.
            assert len(p.calls) == 2
            d.resume.set()
            for t in (first, second, third):
                assert (await t).status_code == 200
            assert [c.body["kv_transfer_params"].get("decode_engine") for c in p.calls] \
                == [None, None, "d1"]

    run(main())


def test_a_turn_after_an_answer_waits_for_its_placement_while_histories_are_pushed(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811
    """With history push on, a chat that carries an earlier answer goes to prefill only
    with its assignment, which may name a holder of that answer; a first turn, or the
    same turn with history push off, is sent at admission."""
    p, d = pd()
    turn = [{"role": "user", "content": PROMPT}]
    later = [*turn, {"role": "assistant", "content": "a b c"},
             {"role": "user", "content": "d e"}]
    decode_named = []

    async def main() -> None:
        for push in (2, 0):
            async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                             sched={"scheduler_history_push_tokens": push},
                             gw={"scheduler_history_push_tokens": push}) as s:
                for messages in (turn, later):
                    r = await s.client.post("/v1/chat/completions", json={
                        "messages": messages, "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    named = p.calls[-1].body["kv_transfer_params"].get("decode_engine")
                    decode_named.append(named is not None)

    run(main())
    assert decode_named == [False, True, False, False]


def test_the_engine_view_reads_live_dedicated_prefill_engines(
        redis_url: str, redis_client: redis.Redis) -> None:
    """Only dedicated prefill engines that take requests; a burst spreads by what this
    gateway sent since its last read; a malformed status is left out, never fatal."""
    publish(redis_client, engine_status("pa", role="prefill", url="http://pa", queued=100))
    publish(redis_client, engine_status("pb", role="prefill", url="http://pb"))
    publish(redis_client, engine_status("pc", role="prefill", url="http://pc"))
    redis_client.hset(K.engine("pc"), "draining", 1)
    publish(redis_client, engine_status("both", role="both", url="http://both"))
    publish(redis_client, engine_status("dec", role="decode", url="http://dec"))
    publish(redis_client, engine_status("sus", role="prefill", url="http://sus"))
    redis_client.hset(K.engine("sus"), "suspect_until", 2 ** 50)
    publish(redis_client, engine_status("bad", role="prefill", url="http://bad"))
    redis_client.hset(K.engine("bad"), "total_blocks", "lots")

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        view = PrefillEngines(client, K, refresh_s=3600)
        try:
            await view.start()
            assert sorted(view.engines) == ["pa", "pb"]
            assert view.pick(60).engine_id == "pb"
            assert view.pick(60).engine_id == "pb"  # 120 sent: now past pa's 100
            assert view.pick(60).engine_id == "pa"
            assert view.pick(60, avoid={"pa"}).engine_id == "pb"
            assert view.pick(1, avoid={"pa", "pb"}) is None
        finally:
            await view.stop()
            await client.aclose()

    run(main())



def test_the_engine_view_stops_when_redis_py_loses_its_cancel(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A ``cancel()`` that lands inside a redis-py call can come out as a timeout redis-py
    retries (redis/redis-py#2551): the reader must still end at its next round, or the
    gateway's shutdown waits for it forever (a CI run hung so, its Redis behind a proxy
    that had just healed)."""
    import contextlib

    publish(redis_client, engine_status("pa", role="prefill", url="http://pa"))

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        view = PrefillEngines(client, K, refresh_s=0.01)
        real_refresh = view.refresh
        in_refresh = asyncio.Event()

        async def refresh_that_loses_a_cancel() -> None:
            if in_refresh.is_set():  # one cancel lost: a second one, at teardown, lands
                await real_refresh()
                return
            in_refresh.set()
            with contextlib.suppress(asyncio.CancelledError):  # the library bug
                await asyncio.sleep(0.5)
            await real_refresh()

        try:
            await view.start()
            view.refresh = refresh_that_loses_a_cancel  # type: ignore[method-assign]
            await asyncio.wait_for(in_refresh.wait(), 10)
            # Not wait_for: its own cancel on timeout would be a second one, which lands.
            stopping = asyncio.create_task(view.stop())  # cancels inside the lossy round
            done, _ = await asyncio.wait({stopping}, timeout=10)
            assert done, "the engine view kept reading after its cancel was lost"
            assert view._task is not None and view._task.cancelled()
            assert sorted(view.engines) == ["pa"]  # the round the cancel hit completed
        finally:
            await view.stop()
            await client.aclose()

    run(main())
