"""Gateway over real HTTP, real Redis and the real scheduler, against stand-in engines.

The engines here are small real HTTP servers that answer like vLLM's OpenAI endpoints
(SSE streaming, JSON errors, aborting a request when its connection closes). They exist
ONLY to test the gateway's dispatch, error mapping and disconnect handling; the real vLLM
engines with the push connector are exercised in tests/test_e2e_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoTokenizer

from kvpush.common.keys import RedisKeys, request_shard
from kvpush.common.reservations import Reservations
from kvpush.common.runtime import run
from kvpush.common.settings import GatewaySettings
from kvpush.common.wire import Assignment, encode
from kvpush.services.gateway import Gateway, create_app
from kvpush.services.gateway.engines import MAX_ERROR_BYTES, MAX_REPLY_BYTES
from kvpush.services.local.local_redis import free_port
from tests.sched_util import (
    assert_no_reservations,
    engine_status,
    publish,
    running,
    settings,
    wait_for,
)

K = RedisKeys()
WORDS = "hello world the a of and to in is it user assistant system"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer with a chat template (real transformers tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i, w in enumerate(WORDS.split()):
        vocab[w] = i + 3
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    out = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeEngine:
    """Stand-in for a vLLM OpenAI server (see the module docstring)."""

    name: str
    role: str
    # ok | fail | refuse | hang | hang_after | pause_after | endless | endless_error
    mode: str = "ok"
    tokens: int = 5
    hang_after: int = 2
    resume: asyncio.Event = field(default_factory=asyncio.Event)  # ends a pause_after pause
    wait_for: asyncio.Event | None = None  # answer only once this is set (concurrency)
    calls: list[Call] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    total_blocks: int = 1000
    sent_bytes: int = 0  # of an endless body, before the gateway stopped reading

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request) -> Response:
            body = await request.json()
            self.calls.append(Call(request.url.path, body, dict(request.headers)))
            self.arrived.set()
            # Like vLLM's with_cancellation: a closed connection aborts the request.
            work = asyncio.create_task(self._answer(request.url.path, body))
            watch = asyncio.create_task(_disconnect(request))
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                watch.cancel()
                return work.result()
            work.cancel()
            self.aborted.set()
            return Response(status_code=499)

        app.post("/v1/completions")(handle)
        app.post("/v1/chat/completions")(handle)
        return app

    async def _answer(self, path: str, body: dict[str, Any]) -> Response:
        if self.wait_for is not None:
            try:
                await asyncio.wait_for(self.wait_for.wait(), 30)
            except TimeoutError:
                return JSONResponse({"error": "the other leg never arrived"}, 500)
        if self.mode == "fail":
            return JSONResponse({"error": {"message": "engine exploded"}}, 500)
        if self.mode == "refuse":
            return JSONResponse({"error": {"message": "prompt too long"}}, 400)
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode in ("endless", "endless_error"):
            # A reply body (for a stream, one SSE event) that never ends: bounded at 512 MiB
            # so that a gateway that reads it all fails on the byte count, not out of memory.
            sse = self.mode == "endless" and body.get("stream")
            return StreamingResponse(
                self._endless(b"data: {" if sse else b'{"error": {"message": "', 512 << 20),
                media_type="text/event-stream" if sse else "application/json",
                status_code=500 if self.mode == "endless_error" else 200)
        n = min(self.tokens, int(body.get("max_tokens") or self.tokens))
        chat = path.endswith("chat/completions")
        if body.get("stream"):
            return StreamingResponse(self._sse(n, chat), media_type="text/event-stream")
        text = "".join(f"t{i} " for i in range(n))
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text})
        return JSONResponse({"id": f"{self.name}-x", "object": "x", "created": 0,
                             "model": "tiny", "choices": [choice],
                             "usage": {"completion_tokens": n}})

    async def _endless(self, head: bytes, limit: int) -> AsyncIterator[bytes]:
        try:
            yield head
            while self.sent_bytes < limit:
                self.sent_bytes += 65536
                yield b"a" * 65536
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.aborted.set()
            raise

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        try:
            for i in range(n):
                if self.mode == "hang_after" and i == self.hang_after:
                    await asyncio.Event().wait()
                if self.mode == "pause_after" and i == self.hang_after:
                    await self.resume.wait()
                part = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                ev = {"id": f"{self.name}-x", "created": 0, "model": "tiny",
                      "choices": [{"index": 0, **part}]}
                yield f"data: {json.dumps(ev)}\n\n".encode()
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.aborted.set()
            raise


async def _disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def serve(app: Any, port: int) -> AsyncIterator[uvicorn.Server]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="on", access_log=False))
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started or task.done(), "server start")
    if task.done():
        task.result()
    try:
        yield server
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve_published(redis_client: redis.Redis, e: FakeEngine) -> AsyncIterator[FakeEngine]:
    """``e`` served on a port of its own and published to the schedulers."""
    e.port = free_port()
    async with serve(e.app(), e.port):
        publish(redis_client, engine_status(e.name, role=e.role, url=e.url,
                                            total=e.total_blocks))
        yield e


@dataclass
class Stack:
    url: str
    client: httpx.AsyncClient
    prefill: FakeEngine | None
    decode: FakeEngine | None
    gateway: Gateway


@contextlib.asynccontextmanager
async def stack(redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,
                prefill: FakeEngine | None = None, decode: FakeEngine | None = None,
                sched: dict[str, Any] | None = None, gw: dict[str, Any] | None = None,
                gw_tracer: Any = None, sched_tracer: Any = None,
                sched_survives: bool = False,
                gw_redis_url: str | None = None) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as ex:
        for e in (prefill, decode):
            if e is None:
                continue
            await ex.enter_async_context(serve_published(redis_client, e))
        await ex.enter_async_context(running(settings(redis_url, **(sched or {})),
                                             tracer_provider=sched_tracer,
                                             survive=sched_survives))
        # These tests read /metrics on the API port; deployments scrape a port of its own.
        gs = GatewaySettings(redis_url=gw_redis_url or redis_url, gateway_id="gwtest",
                             gateway_port=free_port(),
                             gateway_model="tiny", gateway_tokenizer=str(tokenizer_dir),
                             **{"gateway_expose_metrics": True, **(gw or {})})
        g = Gateway(gs, tracer_provider=gw_tracer)
        await ex.enter_async_context(serve(create_app(gs, g), gs.gateway_port))
        client = await ex.enter_async_context(
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{gs.gateway_port}", timeout=60))
        yield Stack(f"http://127.0.0.1:{gs.gateway_port}", client, prefill, decode, g)


def pd() -> tuple[FakeEngine, FakeEngine]:
    return FakeEngine("p1", "prefill"), FakeEngine("d1", "decode")


PROMPT = "hello world the a of and to in is it"  # 10 tokens with the test tokenizer


def test_completion_dispatches_prefill_and_decode_concurrently(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    """Both legs once the assignment is in (a placement again after a failure, or early
    prefill off; the early call is tests/test_gateway_early_prefill.py's)."""
    p, d = pd()
    # Each leg answers only once the other has arrived: a sequential gateway would hang.
    p.wait_for, d.wait_for = d.arrived, p.arrived

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_early_prefill": False}) as s:
            r = await s.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
            (pc,), (dc,) = p.calls, d.calls
            rid = pc.headers["x-request-id"]
            assert rid.startswith("cmpl-") and dc.headers["x-request-id"] == rid
            # One trace, one CLIENT span per leg (tracing is off here, so the gateway
            # only forwards what it got; tests/test_tracing_gateway.py checks the spans).
            assert "traceparent" not in pc.headers and "traceparent" not in dc.headers
            assert pc.body["max_tokens"] == 1 and pc.body["stream"] is False
            # Tokenized once, by the gateway: both legs carry the same token ids.
            assert dc.body["max_tokens"] == 4 and dc.body["prompt"] == pc.body["prompt"]
            assert dc.body["prompt"] == list(AutoTokenizer.from_pretrained(
                tokenizer_dir)(PROMPT).input_ids) and len(dc.body["prompt"]) == 10
            kp, kd = pc.body["kv_transfer_params"], dc.body["kv_transfer_params"]
            assert kp == {"kvpush": "prefill", "request_id": rid, "decode_engine": "d1",
                          "deadline_ms": kp["deadline_ms"], "push_key": kd["push_key"]}
            assert kd["kvpush"] == "decode" and kd["request_id"] == rid
            assert kd["prefill_engine"] == "p1" and kd["reservation_id"] == rid
            assert kd["fencing_token"] > 0 and kd["deadline_ms"] == kp["deadline_ms"]
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_chat_streaming_relays_tokens(redis_url: str, redis_client: redis.Redis,
                                      tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            events = []
            async with s.client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello world"}],
                    "max_tokens": 5, "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
            assert text == "t0 t1 t2 t3 t4 "
            (pc,), (dc,) = p.calls, d.calls
            assert pc.body["max_tokens"] == 1 and pc.body["max_completion_tokens"] == 1
            assert "stream_options" not in pc.body and pc.body["stream"] is False
            assert dc.body["stream"] is True and dc.body["max_completion_tokens"] == 5
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_ttft_seconds_count{tenant="default"} 1.0' in m
            assert 'kvpush_tpot_seconds_count{tenant="default"} 1.0' in m
            assert 'kvpush_queue_wait_seconds_count{tenant="default"} 1.0' in m
            assert ('kvpush_gateway_requests_total{endpoint="chat",status="200",'
                    'tenant="default"} 1.0') in m
            assert 'kvpush_reservations_in_use{engine="d1"} 0.0' in m

    run(main())


def test_prompt_tokens_counted_with_the_tokenizer(redis_url: str, redis_client: redis.Redis,
                                                  tokenizer_dir: Path) -> None:
    """10 prompt + 6 max tokens = exactly one 16-token block; one more token needs two."""
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            seen = []
            orig = s.gateway.schedule

            async def spy(ctx: Any, rid: str, pt: int, mt: int, dl: int,
                          *rest: Any) -> Assignment:
                a = await orig(ctx, rid, pt, mt, dl, *rest)
                seen.append((pt, mt, a.blocks))
                return a

            s.gateway.schedule = spy  # type: ignore[method-assign]
            for mt in (6, 7):
                r = await s.client.post("/v1/completions", json={"prompt": PROMPT,
                                                                 "max_tokens": mt})
                assert r.status_code == 200
            r = await s.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12})
            assert r.status_code == 200
            assert seen == [(10, 6, 1), (10, 7, 2), (4, 12, 1)]

    run(main())


def test_prefill_failure_is_502_and_aborts_decode(redis_url: str, redis_client: redis.Redis,
                                                  tokenizer_dir: Path) -> None:
    p, d = pd()
    p.mode, d.mode = "fail", "hang"  # decode would wait for KV that never comes
    # Prefill fails only once decode has the request: there is a decode call to abort.
    p.wait_for = d.arrived

    async def main() -> None:
        # Without re-routing (tested below): the failure itself reaches the client.
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_dispatch_retries": 0,
                             "gateway_suspect_cooldown_s": 0}) as s:
            for stream in (False, True):
                d.aborted.clear()
                d.arrived.clear()
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "stream": stream})
                assert r.status_code == 502, r.text
                assert "p1" not in r.text and "127.0.0.1" not in r.text
                await asyncio.wait_for(d.aborted.wait(), 30)
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_errors_total{kind="engine_prefill",tenant="default"} 2.0' in m

    run(main())


def test_decode_failure_is_502_and_engine_refusal_400(redis_url: str, redis_client: redis.Redis,
                                                      tokenizer_dir: Path) -> None:
    p, d = pd()
    d.mode = "fail"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            for stream in (False, True):
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "stream": stream})
                assert r.status_code == 502
                assert "d1" not in r.text and "exploded" not in r.text
            d.mode = "refuse"
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 400
            # The engine's own words about the request, not its JSON nested in ours.
            assert r.json()["error"]["message"] == "prompt too long"

    run(main())


def test_an_event_that_never_ends_breaks_the_stream(redis_url: str, redis_client: redis.Redis,
                                                    tokenizer_dir: Path) -> None:
    """A decode that streams one endless event is a broken engine: the request fails
    (502, nothing else can serve it here) and the gateway drops the connection, instead of
    buffering what the engine sends until memory runs out."""
    p, d = pd()
    d.mode = "endless"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
            assert r.status_code == 502, r.text
            await asyncio.wait_for(d.aborted.wait(), 30)

    run(main())


@pytest.mark.parametrize(("leg", "mode", "stream"), [
    ("prefill", "endless", False), ("prefill", "endless_error", True),
    ("decode", "endless", False), ("decode", "endless_error", True)])
def test_a_reply_that_never_ends_is_cut_off(redis_url: str, redis_client: redis.Redis,
                                            tokenizer_dir: Path, leg: str, mode: str,
                                            stream: bool) -> None:
    """An engine whose reply body (an answer, or an error's) never ends fails its call once
    the gateway has read its bound (64 MiB of answer, 64 KiB of error), rather than holding
    the request and growing the gateway's memory until the engine stops."""
    p, d = pd()
    broken = p if leg == "prefill" else d
    broken.mode = mode
    if leg == "prefill":
        d.mode = "hang"  # decode would wait for KV that never comes
        # Prefill fails only once decode has the request (its call starts at admission):
        # there is a decode call to abort.
        p.wait_for = d.arrived
    bound = MAX_REPLY_BYTES if mode == "endless" else MAX_ERROR_BYTES

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_dispatch_retries": 0}) as s:
            r = await s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "stream": stream})
            assert r.status_code == 502, r.text
            assert "aaaa" not in r.text
            await asyncio.wait_for(broken.aborted.wait(), 30)
            if leg == "prefill":
                await asyncio.wait_for(d.aborted.wait(), 30)
        # What was sent but not read sits in socket buffers (a few MiB at most).
        assert broken.sent_bytes < bound + (32 << 20), broken.sent_bytes

    run(main())


def test_dead_engine_port_is_502(redis_url: str, redis_client: redis.Redis,
                                 tokenizer_dir: Path) -> None:
    async def main() -> None:
        publish(redis_client, engine_status("d1", url=f"http://127.0.0.1:{free_port()}"))
        async with stack(redis_url, redis_client, tokenizer_dir) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 502 and "ConnectError" not in r.text

    run(main())


def test_overload_is_429_with_retry_after(redis_url: str, redis_client: redis.Redis,
                                          tokenizer_dir: Path) -> None:
    p, d = pd()
    d.total_blocks = 4

    async def main() -> None:
        # Early prefill off: this is the engines untouched by a refusal from the queue (a
        # refused early call is taken back: tests/test_gateway_early_prefill.py).
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         sched={"scheduler_queue_timeout_s": 0.2,
                                "scheduler_retry_after_s": 3},
                         gw={"gateway_early_prefill": False}) as s:
            res = Reservations(redis_client)
            held = res.reserve("d1", "other", 4, 600_000).reservation
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
            assert p.calls == [] and d.calls == []
            res.release("d1", "other", held.fencing_token)

    run(main())


def test_no_engine_503_and_too_large_400(redis_url: str, redis_client: redis.Redis,
                                         tokenizer_dir: Path) -> None:
    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir,
                         sched={"scheduler_queue_timeout_s": 0.2}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 503 and "retry-after" in r.headers
            publish(redis_client, engine_status("d1", total=2))
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT,
                                                             "max_tokens": 100})
            for _ in range(100):  # the scheduler may not have seen d1 yet: still 503
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.05)
                r = await s.client.post("/v1/completions", json={"prompt": PROMPT,
                                                                 "max_tokens": 100})
            assert r.status_code == 400 and "exceed" in r.json()["error"]["message"]

    run(main())


def test_deadline_is_504_and_aborts_engines(redis_url: str, redis_client: redis.Redis,
                                            tokenizer_dir: Path) -> None:
    p, d = pd()
    p.mode = d.mode = "hang"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_request_timeout_s": 1.0}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
            assert r.status_code == 504
            await asyncio.wait_for(d.aborted.wait(), 30)
            await asyncio.wait_for(p.aborted.wait(), 30)

    run(main())


def test_malformed_requests_are_400(redis_url: str, redis_client: redis.Redis,
                                    tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            bad = [
                ("/v1/completions", b"{not json"),
                ("/v1/completions", {"max_tokens": 3}),
                ("/v1/completions", {"prompt": ""}),
                ("/v1/completions", {"prompt": ["a", [1]]}),  # strings and ids mixed
                ("/v1/completions", {"prompt": PROMPT, "n": 0}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
                ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}),
                ("/v1/completions", {"prompt": PROMPT, "kv_transfer_params": {}}),
                ("/v1/chat/completions", {"messages": []}),
                ("/v1/chat/completions", {"messages": [{"content": "x"}]}),
                ("/v1/completions", [1, 2]),
            ]
            for path, body in bad:
                if isinstance(body, bytes):
                    r = await s.client.post(path, content=body)
                else:
                    r = await s.client.post(path, json=body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "model": "x"})
            assert r.status_code == 404
            assert p.calls == [] and d.calls == []
            r = await s.client.post("/v1/completions", json={"prompt": [3, 4, 5]})
            assert r.status_code == 200

    run(main())


def test_client_disconnect_mid_stream(redis_url: str, redis_client: redis.Redis,
                                      tokenizer_dir: Path) -> None:
    p, d = pd()
    p.mode = "hang"  # still prefilling when the client leaves
    d.mode = "hang_after"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            async with s.client.stream("POST", "/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 50, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                assert Reservations(redis_client).count("d1") == 1
            # Leaving the block closed the connection mid-stream.
            await asyncio.wait_for(d.aborted.wait(), 30)
            await asyncio.wait_for(p.aborted.wait(), 30)
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")
            m = (await s.client.get("/metrics")).text
            assert ('kvpush_gateway_errors_total{kind="client_disconnect",tenant="default"} 1.0'
                    in m)

    run(main())


def test_client_disconnect_while_queued(redis_url: str, redis_client: redis.Redis,
                                        tokenizer_dir: Path) -> None:
    p, d = pd()
    d.total_blocks = 4
    p.mode = "hang"
    d.mode = "hang"

    async def main() -> None:
        # Early prefill off, as above: no engine is called for a request that left while
        # queued (one that left with its early call out takes it back, see
        # tests/test_gateway_early_prefill.py).
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_early_prefill": False}) as s:
            res = Reservations(redis_client)
            held = res.reserve("d1", "other", 4, 600_000).reservation
            task = asyncio.create_task(s.client.post("/v1/completions", json={"prompt": PROMPT}))
            await wait_for(lambda: s.gateway.metrics.in_flight._value.get() == 1, "in flight")
            await wait_for(lambda: redis_client.xlen(K.requests()) == 1, "enqueued")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_for(lambda: s.gateway.metrics.in_flight._value.get() == 0, "dropped")
            res.release("d1", "other", held.fencing_token)
            # The scheduler now assigns it; the gateway no longer waits and releases it.
            await wait_for(lambda: redis_client.xlen(K.assignments("gwtest")) == 1, "assigned")
            await wait_for(lambda: not res.count("d1"), "orphan released")
            assert d.calls == [] and p.calls == []

    run(main())


def test_short_prompt_goes_to_decode_alone(redis_url: str, redis_client: redis.Redis,
                                           tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        # One environment for both, as an operator's: the gateway sends no prompt early
        # below the schedulers' threshold either.
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         sched={"scheduler_min_disagg_tokens": 11},
                         gw={"scheduler_min_disagg_tokens": 11}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text
            assert p.calls == []
            (dc,) = d.calls
            assert "kv_transfer_params" not in dc.body
            assert dc.headers["x-request-id"].startswith("cmpl-")
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_models_health_metrics(redis_url: str, redis_client: redis.Redis,
                               tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            m = (await s.client.get("/v1/models")).json()
            assert m["object"] == "list" and [x["id"] for x in m["data"]] == ["tiny"]
            h = await s.client.get("/health")
            assert h.status_code == 200 and h.json()["gateway_id"] == "gwtest"
            text = (await s.client.get("/metrics")).text
            # The names the Grafana dashboard queries, plus the gateway's own.
            for name in ("kvpush_gateway_requests_total", "kvpush_queue_wait_seconds",
                         "kvpush_ttft_seconds", "kvpush_tpot_seconds",
                         "kvpush_reservations_in_use", "kvpush_gateway_errors_total"):
                assert name in text or name.removesuffix("_total") in text

    run(main())


def test_background_tasks_run_for_the_apps_lifespan(redis_url: str) -> None:
    """``create_app(background=...)``: how ``kvpush up`` runs its scheduler in the gateway."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def task() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def main() -> None:
        gs = GatewaySettings(redis_url=redis_url, gateway_id="gwbg")
        async with serve(create_app(gs, background=[task]), free_port()):
            await asyncio.wait_for(started.wait(), 30)
            assert not cancelled.is_set()
        assert cancelled.is_set()

    run(main())


def test_a_process_serving_the_gateway_alone_freezes_what_it_loaded(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpush gateway`` and ``kvpush up`` serve the app alone in their process: once the
    gateway is up, what it loaded is frozen out of the garbage collector's scans. An app
    embedded in another program (as in these tests) leaves that program's heap alone."""
    frozen: list[str] = []
    monkeypatch.setattr("kvpush.services.gateway.state.freeze_startup_heap",
                        lambda: frozen.append("frozen"))

    async def main() -> None:
        for freeze, expected in ((False, []), (True, ["frozen"])):
            gs = GatewaySettings(redis_url=redis_url, gateway_id=f"gwfreeze{int(freeze)}")
            async with serve(create_app(gs, freeze_heap=freeze), free_port()):
                assert frozen == expected

    run(main())


def test_health_reports_a_background_task_that_stopped(redis_url: str) -> None:
    """The in-process scheduler of ``kvpush up`` dying makes /health say so (503)."""
    crash = asyncio.Event()

    async def task() -> None:
        await crash.wait()
        raise RuntimeError("scheduler bug")

    async def main() -> None:
        gs = GatewaySettings(redis_url=redis_url, gateway_id="gwbg2")
        port = free_port()
        async with serve(create_app(gs, background=[task]), port), httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health")).status_code == 200
            crash.set()
            await asyncio.sleep(0.1)
            r = await client.get("/health")
            assert r.status_code == 503 and "background task stopped" in r.json()["detail"]

    run(main())


def test_gateway_does_not_import_the_scheduler() -> None:
    code = ("import sys, kvpush.services.gateway; "
            "assert 'kvpush.services.scheduler' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_orphan_assignment_is_released(redis_url: str, redis_client: redis.Redis,
                                       tokenizer_dir: Path) -> None:
    """An answer for a request nobody waits for (timed out, duplicate) frees its slot."""
    async def main() -> None:
        publish(redis_client, engine_status("d1"))
        async with stack(redis_url, redis_client, tokenizer_dir):
            r = Reservations(redis_client).reserve("d1", "cmpl-lost", 3, 600_000).reservation
            a = Assignment(request_id="cmpl-lost", decode_engine="d1", decode_url="x",
                           reservation_id="cmpl-lost", fencing_token=r.fencing_token)
            redis_client.xadd(K.assignments("gwtest"), {b"m": encode(a)})
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_many_concurrent_streams(redis_url: str, redis_client: redis.Redis,
                                 tokenizer_dir: Path) -> None:
    """64 streams at once are all served. Shedding is off: 64 requests arriving together
    are a backlog the shedder may rightly refuse on a loaded machine (its estimate is
    tests/test_gateway_shedding.py's), and this test is about serving them."""
    p, d = pd()
    d.tokens = 8

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_shed_ttft_s": 0}) as s:
            async def one(i: int) -> str:
                out = []
                async with s.client.stream("POST", "/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 8, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            out.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(out)

            t0 = time.monotonic()
            got = await asyncio.gather(*(one(i) for i in range(64)))
            assert all(g == "t0 t1 t2 t3 t4 t5 t6 t7 " for g in got), got[:3]
            assert time.monotonic() >= t0
            assert len(p.calls) == 64 and len(d.calls) == 64
            ids = {c.headers["x-request-id"] for c in d.calls}
            assert ids == {c.headers["x-request-id"] for c in p.calls} and len(ids) == 64
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_requests_spread_over_the_request_shards(redis_url: str, redis_client: redis.Redis,
                                                 tokenizer_dir: Path) -> None:
    """With KVPUSH_REQUEST_SHARDS=4 the gateway puts each request on its id's shard and the
    scheduler serves all of them."""
    p, d = pd()
    shards = {"request_shards": 4}

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, sched=shards,
                         gw=shards) as s:
            rs = await asyncio.gather(*(s.client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 2}) for _ in range(16)))
            assert [r.status_code for r in rs] == [200] * 16
            want = [0] * 4
            for c in d.calls:
                want[request_shard(c.headers["x-request-id"], 4)] += 1
            got = [int(redis_client.xinfo_stream(K.requests(i))["entries-added"])
                   for i in range(4)]
            assert got == want and sum(got) == 16 and sum(n > 0 for n in got) > 1
            assert [redis_client.xpending(K.requests(i), "schedulers")["pending"]
                    for i in range(4)] == [0] * 4
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


async def assert_placed_again(s: Stack, redis_client: redis.Redis, failed: FakeEngine,
                              other: FakeEngine) -> None:
    """Each call that reached ``failed`` was placed again on ``other`` (attempt ``-r1``),
    every reservation on both, the failed attempts' included, is released, and the gateway
    counted the re-routes."""
    retried = [c for c in other.calls if c.headers["x-request-id"].endswith("-r1")]
    assert len(retried) == len(failed.calls)
    for e in (failed.name, other.name):
        await wait_for(lambda e=e: not Reservations(redis_client).count(e), f"{e} released")
    m = (await s.client.get("/metrics")).text
    assert 'kvpush_gateway_errors_total{kind="rerouted",tenant="default"}' in m


def test_an_engine_that_fails_before_the_first_token_is_routed_around(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    """d1 answers 500: each request it gets is placed again on d2 within its deadline, the
    client sees only the answer, and d1 is marked suspect so schedulers stop choosing it."""
    p, d = pd()
    d.mode = "fail"
    d2 = FakeEngine("d2", "decode")

    async def main() -> None:
        # d2 is registered before the scheduler starts, so its first view holds both.
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            for stream in (False, True, False, True):
                r = await s.client.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 4, "stream": stream})
                assert r.status_code == 200, r.text
                if stream:
                    assert r.text.count("data: {") == 4 and "[DONE]" in r.text
                else:
                    assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
            # After the first failure the gateway steers placement off d1 at once.
            assert len(d.calls) == 1 and len(d2.calls) == 4
            assert int(redis_client.hget(K.engine("d1"), "suspect_strikes") or 0) >= 1
            await assert_placed_again(s, redis_client, d, d2)

    run(main())

