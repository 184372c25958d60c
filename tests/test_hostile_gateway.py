"""Hostile client input at the gateway's edge: each gets a clear 4xx, and nothing leaks.

The table of inputs is shared with the real-engine run of ``tests/test_faults.py``.

The gateway is the real app over real HTTP and a real Redis with the real scheduler; the
engines are the stand-ins of tests/test_gateway.py (the thing under test is the gateway,
which must refuse all of this before an engine, a reservation or a quota is involved).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvpush.common.quotas import usage
from kvpush.common.reservations import live_reservations
from kvpush.common.runtime import run
from kvpush.common.tenancy import Quotas, create_tenant
from kvpush.loadtest.faults.hostile import CHAT, HOSTILE_BODIES, LIMITS, MSGS, C, error_problem
from tests.sched_util import wait_for
from tests.test_gateway import PROMPT, FakeEngine, pd, stack, tokenizer_dir  # noqa: F401

WORDS_1500 = " ".join(["hello world the"] * 500)


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert live_reservations(redis_client) == []


def _tenant(r: redis.Redis) -> dict[str, str]:
    # A concurrency quota makes every admission hold a lease, which must be gone again.
    _, key = create_tenant(r, "acme", tenant_id="acme",
                           quotas=Quotas(concurrent_requests=64, tokens_per_minute=10**6))
    return {"Authorization": f"Bearer {key}"}


def _assert_clean_error(r: Any, status: int, param: str | None, what: Any) -> None:
    problem = error_problem(r.status_code, _body(r), status, param, ("p1", "d1"))
    assert problem is None, (what, problem, r.text[:300])


def _body(r: Any) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def test_hostile_inputs_get_a_clear_4xx_and_leak_nothing(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    assert len(HOSTILE_BODIES) >= 30
    p, d = pd()
    auth = _tenant(redis_client)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=LIMITS) as s:
            for path, body, status, param in HOSTILE_BODIES:
                if isinstance(body, bytes):
                    r = await s.client.post(path, content=body, headers={
                        **auth, "content-type": "application/json"})
                else:
                    r = await s.client.post(path, json=body, headers=auth)
                _assert_clean_error(r, status, param, body if len(str(body)) < 200 else path)
            r = await s.client.post(C, json={"prompt": "hello"},
                                    headers={**auth, "x-big": "a" * 5000})
            assert r.status_code == 431 and r.json()["error"]["code"] == 431
            # Past twice the limit the HTTP parser itself refuses the header block.
            r = await s.client.post(C, json={"prompt": "hello"},
                                    headers={**auth, "x-big": "a" * 20000})
            assert 400 <= r.status_code < 500
            assert p.calls == [] and d.calls == []
            assert usage(redis_client, "acme")["concurrent_leases"] == 0
            assert usage(redis_client, "acme")["tokens_in_window"] == 0
            # Still serving: a good request after all that.
            r = await s.client.post(C, json={"prompt": PROMPT, "max_tokens": 3}, headers=auth)
            assert r.status_code == 200, r.text
            await wait_for(lambda: usage(redis_client, "acme")["concurrent_leases"] == 0,
                           "lease released")

    run(main())


def test_truncation_cannot_shrink_the_count(redis_url: str, redis_client: redis.Redis,
                                           tokenizer_dir: Path) -> None:  # noqa: F811
    """A 1,500-word prompt counts as 1,500 tokens whatever chat_template_kwargs say."""
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            seen: list[int] = []
            orig = s.gateway.schedule

            async def spy(ctx: Any, rid: str, pt: int, mt: int, dl: int, *rest: Any) -> Any:
                seen.append(pt)
                return await orig(ctx, rid, pt, mt, dl, *rest)

            s.gateway.schedule = spy  # type: ignore[method-assign]
            msgs = [{"role": "user", "content": WORDS_1500}]
            r = await s.client.post(CHAT, json={
                "messages": msgs, "max_tokens": 2,
                "chat_template_kwargs": {"truncation": True, "max_length": 1}})
            assert r.status_code == 400 and seen == []
            r = await s.client.post(CHAT, json={
                "messages": msgs, "max_tokens": 2,
                "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, r.text
            assert seen == [1 + 1500 + 1]  # "user", the words, "assistant"

    run(main())


@pytest.fixture(scope="session")
def tools_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory,
                        tokenizer_dir: Path) -> Path:  # noqa: F811
    """The test tokenizer with a template that renders tools and documents."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = (
        "{% for t in tools or [] %}tool {{ t['function']['name'] }} {% endfor %}"
        "{% for doc in documents or [] %}{{ doc['text'] }} {% endfor %}"
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}")
    out = tmp_path_factory.mktemp("tok-tools")
    tok.save_pretrained(out)
    return out


def test_tools_and_documents_count_toward_prompt_tokens(
        redis_url: str, redis_client: redis.Redis, tools_tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tools_tokenizer_dir, p, d) as s:
            seen: list[int] = []
            orig = s.gateway.schedule

            async def spy(ctx: Any, rid: str, pt: int, mt: int, dl: int, *rest: Any) -> Any:
                seen.append(pt)
                return await orig(ctx, rid, pt, mt, dl, *rest)

            s.gateway.schedule = spy  # type: ignore[method-assign]
            tools = [{"type": "function", "function": {"name": "hello", "parameters": {}}}]
            docs = [{"title": "t", "text": "the a of and to"}]
            for extra in ({}, {"tools": tools}, {"tools": tools, "documents": docs}):
                r = await s.client.post(CHAT, json={"messages": MSGS, "max_tokens": 2,
                                                    **extra})
                assert r.status_code == 200, r.text
            assert seen == [4, 4 + 2, 4 + 2 + 5]

    run(main())


class _Talker(FakeEngine):
    """Refuses every request with a fixed status and error body."""

    def __init__(self, name: str, role: str, status: int, body: bytes) -> None:
        super().__init__(name, role)
        self.refusal = (status, body)

    async def _answer(self, path: str, body: dict[str, Any]) -> Any:
        from fastapi.responses import Response

        status, content = self.refusal
        return Response(content, status, media_type="application/json")


@pytest.mark.parametrize(("status", "body", "client_status", "message"), [
    (400, b'{"error": {"message": "engine d1 at http://10.0.0.7:8200/v1 says no"}}', 400,
     "engine <engine> at <url> says no"),
    (400, b'{"object": "error", "message": "{\\"nested\\": \\"json\\"}"}', 400,
     "the model refused the request"),
    (422, b'{"detail": [{"loc": ["body"], "msg": "bad"}]}', 400,
     "the model refused the request"),
    (401, b'{"error": {"message": "bad engine API key"}}', 502, None),
    (500, b'Traceback (most recent call last): ...', 502, None),
])
def test_engine_errors_reach_the_client_clean(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        status: int, body: bytes, client_status: int, message: str | None) -> None:
    p, d = FakeEngine("p1", "prefill"), _Talker("d1", "decode", status, body)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            for stream in (False, True):
                r = await s.client.post(C, json={"prompt": PROMPT, "stream": stream})
                assert r.status_code == client_status, r.text
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                if message is not None:
                    assert err["message"] == message
                for internal in ("d1", "p1", "10.0.0.7", "127.0.0.1", "Traceback", "{"):
                    assert internal not in err["message"], err

    run(main())


def test_metrics_and_docs_are_off_the_api_port_by_default(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir,
                         gw={"gateway_expose_metrics": False}) as s:
            for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
                assert (await s.client.get(path)).status_code == 404, path
            assert (await s.client.get("/health")).status_code == 200

    run(main())


class _Flood(FakeEngine):
    """Streams far more than socket buffers hold, in big events."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        ev = {"id": "x", "choices": [{"index": 0, "text": "t " * 32768}]}
        line = f"data: {json.dumps(ev)}\n\n".encode()
        try:
            for _ in range(400):
                yield line
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.aborted.set()
            raise


def test_client_that_stops_reading_is_cut_and_releases_everything(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    p, d = FakeEngine("p1", "prefill"), _Flood("d1", "decode")
    auth = _tenant(redis_client)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_auth": True, "gateway_write_timeout_s": 0.5}) as s:
            host, port = s.url.removeprefix("http://").split(":")
            sock = socket.socket()
            # A tiny receive window, so the gateway's writes back up quickly.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = json.dumps({"prompt": PROMPT, "max_tokens": 500, "stream": True}).encode()
            writer.write(f"POST {C} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         f"authorization: {auth['Authorization']}\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            # ... and read nothing more.
            await wait_for(lambda: usage(redis_client, "acme")["concurrent_leases"] == 0,
                           "quota lease released")
            await wait_for(lambda: live_reservations(redis_client) == [], "reservation released")
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_errors_total{kind="client_write_timeout",tenant="acme"} 1.0' \
                in m
            writer.close()

    run(main())


def test_kvpush_gateway_serves_metrics_on_its_own_port(redis_url: str,
                                                       tokenizer_dir: Path,  # noqa: F811
                                                       tmp_path: Path) -> None:
    """The deployed process: /metrics on the metrics listener only; SIGTERM stops both."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from kvpush.services.local.local_redis import free_port

    api, mport = free_port(), free_port()
    env = dict(os.environ, KVPUSH_REDIS_URL=redis_url, KVPUSH_GATEWAY_PORT=str(api),
               KVPUSH_GATEWAY_METRICS_PORT=str(mport), KVPUSH_GATEWAY_MODEL="tiny",
               KVPUSH_GATEWAY_TOKENIZER=str(tokenizer_dir), KVPUSH_GATEWAY_ID="gw-proc")
    log = (tmp_path / "gw.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.gateway"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # only keeps a broken build from hanging
        while True:
            assert proc.poll() is None, (tmp_path / "gw.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway did not come up"
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{api}/metrics").status_code == 404
        m = httpx.get(f"http://127.0.0.1:{mport}/metrics")
        assert m.status_code == 200 and "kvpush_gateway_requests_in_flight" in m.text
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down cleanly.
        assert proc.wait(60) in (0, -signal.SIGTERM), (tmp_path / "gw.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


class _Shaped(FakeEngine):
    """Streams a fixed list of SSE events, then closes the response cleanly."""

    def __init__(self, name: str, role: str, events: list[bytes]) -> None:
        super().__init__(name, role)
        self.events = events

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        for ev in self.events:
            yield ev


_TOKEN = b'data: {"id": "x", "choices": [{"index": 0, "text": "t "}]}\n\n'


@pytest.mark.parametrize(("events", "status", "ends_with_error"), [
    ([], 502, False),  # a 200 with no event at all
    ([b'data: {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}\n\n',
      b"data: [DONE]\n\n"], 400, False),
    ([b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n',
      b"data: [DONE]\n\n"], 502, False),
    ([b'data: {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}'
      b"\n\n", b"data: [DONE]\n\n"], 502, False),
    ([_TOKEN, _TOKEN], 200, True),  # cut after tokens: no [DONE]
], ids=["empty", "error-400-first", "error-500-first", "abort-first", "no-done"])
def test_every_stream_ends_with_done_or_an_error(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        events: list[bytes], status: int, ends_with_error: bool) -> None:
    """Whatever shape decode's stream has, the client gets a status before the first
    token, or a stream that ends in [DONE] or an SSE error event: never a silent cut.
    Decode's stream alone decides the status here: with prefill's answer leading (on by
    default, tests/test_gateway_lead.py), a prefill that answers first, as one sent at
    admission does, would start the stream before decode's shape is known."""
    p, d = FakeEngine("p1", "prefill"), _Shaped("d1", "decode", events)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_first_token_from_prefill": False}) as s:
            r = await s.client.post(C, json={"prompt": PROMPT, "stream": True})
            assert r.status_code == status, r.text
            if status != 200:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert "d1" not in err["message"] and "{" not in err["message"], err
                return
            last = [ev for ev in r.text.split("\n\n") if ev.strip()][-1]
            assert ends_with_error and last.startswith('data: {"error"'), r.text

    run(main())


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_a_header_that_never_ends_is_cut_off_while_it_is_read(parser: str) -> None:
    """Either parser refuses a header block once it passes twice the limit, without
    holding the rest: a client streaming one endless header value is answered and cut off
    after a few reads, not buffered until memory runs out."""
    import uvicorn

    from kvpush.common.settings import GatewaySettings
    from kvpush.services.gateway.edge import server_config
    from kvpush.services.local.ports import free_port

    limit = 4096
    settings = GatewaySettings(gateway_http=parser, gateway_max_header_bytes=limit,
                               gateway_port=free_port())

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> tuple[int, bytes]:
        server = uvicorn.Server(server_config(app, settings, host="127.0.0.1"))
        task = asyncio.create_task(server.serve())
        await wait_for(lambda: server.started or task.done(), "server start")
        sent, answer = 0, b""
        try:
            # Bodies are not header blocks: two requests with bodies far over the header
            # limit, in one write, each with the next one's headers after it, are served.
            reader, writer = await asyncio.open_connection("127.0.0.1", settings.gateway_port)
            body = b"x" * (40 * limit)
            one = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
            writer.write(one + one)
            for _ in range(2):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert await reader.readexactly(2) == b"ok"
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", settings.gateway_port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
            try:
                while sent < 16 * 1024 * 1024 and not answer:
                    writer.write(b"a" * 8192)
                    await writer.drain()
                    sent += 8192
                    with contextlib.suppress(TimeoutError):
                        answer = await asyncio.wait_for(reader.read(4096), 0.005)
            except (ConnectionResetError, BrokenPipeError):
                with contextlib.suppress(ConnectionError):
                    answer = await reader.read(4096)
            writer.close()
        finally:
            server.should_exit = True
            await task
        return sent, answer

    sent, answer = run(main())
    # Cut off within a few 8 KiB writes past twice the limit.
    assert sent <= 2 * limit + 64 * 1024, sent
    assert answer.startswith(b"HTTP/1.1 4"), answer[:100]
    if parser == "httptools":
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
