"""A frozen engine (accepts connections, answers nothing) loses the requests waiting on it for
their first token: the gateway's health probes give up on it and the requests are placed
again on another engine, instead of waiting out their deadline. Real Redis, real scheduler,
fake engines (tests/test_gateway.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import FastAPI, Request, Response

from kvpush.common.runtime import run
from tests.sched_util import engine_status, publish, wait_for
from tests.test_gateway import (  # noqa: F401 (tokenizer_dir: a fixture)
    PROMPT,
    FakeEngine,
    _disconnect,
    assert_placed_again,
    free_port,
    serve,
    serve_published,
    stack,
    tokenizer_dir,
)


@dataclass
class FrozenEngine(FakeEngine):
    """A fake engine that hangs on everything, its ``/health`` included (SIGSTOPped)."""

    health_calls: list[float] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = super().app()

        async def health(request: Request) -> Response:
            self.health_calls.append(asyncio.get_running_loop().time())
            await _disconnect(request)  # silent until the prober gives up on this call
            return Response(status_code=499)

        app.get("/health")(health)
        return app


@dataclass
class KVWaitingDecode(FakeEngine):
    """A decode engine whose first request waits for KV that never comes (its prefill
    engine froze); later requests are answered."""

    async def _answer(self, path: str, body: dict[str, Any]) -> Response:
        if len(self.calls) == 1:
            await asyncio.Event().wait()
        return await super()._answer(path, body)


# First-byte timeout and deadline far away: only the probes can move a request.
PATIENT = {"gateway_unresponsive_s": 0.6, "gateway_first_byte_timeout_s": 60.0,
           "gateway_request_timeout_s": 60.0}


def test_requests_waiting_on_a_frozen_decode_go_to_the_other(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811 (the fixture)
    p = FakeEngine("p1", "prefill")
    d1 = FrozenEngine("d1", "decode", mode="hang")
    d2 = FakeEngine("d2", "decode")

    async def main() -> None:
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d1, gw=PATIENT) as s:
            # Ties go to the lowest id: the first request lands on the frozen d1.
            for stream in (False, True):
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "stream": stream})
                assert r.status_code == 200, r.text
            assert len(d1.calls) >= 1 and d1.health_calls
            await wait_for(d1.aborted.is_set, "the call to d1 dropped")
            await assert_placed_again(s, redis_client, d1, d2)

    run(main())


@pytest.mark.parametrize("early", [True, False], ids=["early_prefill", "after_assignment"])
def test_a_frozen_prefill_is_routed_around(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path, early: bool) -> None:  # noqa: F811 (the fixture)
    """The first placement lands on the frozen p1, whether the gateway sent it the prompt at
    admission or the schedulers chose it: p2 publishes a queue, so both pick p1."""
    p1 = FrozenEngine("p1", "prefill", mode="hang")
    p2 = FakeEngine("p2", "prefill")
    d = KVWaitingDecode("d1", "decode")

    async def main() -> None:
        p2.port = free_port()
        async with serve(p2.app(), p2.port):
            publish(redis_client, engine_status("p2", role="prefill", url=p2.url, queued=4096))
            async with stack(redis_url, redis_client, tokenizer_dir, p1, d,
                             gw={**PATIENT, "gateway_early_prefill": early}) as s:
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4})
                assert r.status_code == 200, r.text
                assert len(p1.calls) == 1 and [c.headers["x-request-id"] for c in p2.calls] \
                    == [p1.calls[0].headers["x-request-id"] + "-r1"]

    run(main())


def test_without_probes_a_frozen_decode_holds_its_request_to_the_deadline(
        redis_url: str, redis_client: redis.Redis,
        tokenizer_dir: Path) -> None:  # noqa: F811 (the fixture)
    p = FakeEngine("p1", "prefill")
    d1 = FrozenEngine("d1", "decode", mode="hang")
    d2 = FakeEngine("d2", "decode")

    async def main() -> None:
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d1, gw={
                **PATIENT, "gateway_unresponsive_s": 0,
                "gateway_request_timeout_s": 2.0}) as s:
            r = await s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 504
            assert d1.health_calls == [] and d2.calls == []

    run(main())
