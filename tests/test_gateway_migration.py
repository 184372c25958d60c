"""Request migration: a stream whose decode dies after tokens reached the client goes on.

The gateway is the real app over real HTTP and a real Redis with the real scheduler; the
engines are the stand-ins of tests/test_gateway.py (the thing under test is the gateway's
relay, which must place the prompt plus what was generated on another decode and carry on).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from kvpush.common.reservations import live_reservations
from kvpush.common.runtime import run
from tests.sched_util import wait_for
from tests.test_gateway import (  # noqa: F401 (tokenizer_dir: a fixture)
    PROMPT,
    FakeEngine,
    serve_published,
    stack,
    tokenizer_dir,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"


class _Dies(FakeEngine):
    """Streams ``hang_after`` tokens, then drops the connection mid-response."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        for i in range(self.hang_after):
            part = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            yield f"data: {json.dumps({'id': 'x', 'choices': [{'index': 0, **part}]})}\n\n" \
                .encode()
        raise ConnectionResetError("decode engine died")


def _texts(sse: str, chat: bool) -> list[str]:
    out = []
    for ev in sse.split("\n\n"):
        if ev.startswith("data: {"):
            choices = json.loads(ev[6:]).get("choices")
            if not choices:
                continue
            choice = choices[0]
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                out.append(text)
    return out


@pytest.mark.parametrize("path", [C, CHAT])
def test_stream_moves_to_another_decode_when_its_decode_dies(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        path: str) -> None:
    p, d1, d2 = FakeEngine("p1", "prefill"), _Dies("d1", "decode"), FakeEngine("d2", "decode")
    d1.hang_after = 2
    chat = path == CHAT
    body = ({"messages": [{"role": "user", "content": PROMPT}]} if chat
            else {"prompt": PROMPT}) | {"max_tokens": 5, "stream": True}

    async def main() -> None:
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d1) as s:
            r = await s.client.post(path, json=body)
            assert r.status_code == 200, r.text
            # Two tokens from d1, the other three from d2 (which numbers from t0).
            assert _texts(r.text, chat) == ["t0 ", "t1 ", "t0 ", "t1 ", "t2 "], r.text
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            (call,) = d2.calls
            kv = call.body["kv_transfer_params"]
            assert kv["kvpush"] == "decode" and kv["prefill_engine"] == "p1"
            assert kv["request_id"].endswith("-m1")
            if chat:
                assert call.body["messages"][-1] == {"role": "assistant",
                                                     "content": "t0 t1 "}
                assert call.body["continue_final_message"] is True
                assert call.body["add_generation_prompt"] is False
                assert call.body["max_completion_tokens"] == 3
            else:
                tok = AutoTokenizer.from_pretrained(tokenizer_dir)
                assert call.body["prompt"] == tok(PROMPT).input_ids + tok(
                    "t0 t1 ", add_special_tokens=False).input_ids
                assert call.body["max_tokens"] == 3
            assert len(p.calls) == 2  # the continuation was prefilled again
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_errors_total{kind="migrated",tenant="default"} 1.0' in m
            await wait_for(lambda: live_reservations(redis_client) == [],
                           "reservations released")

    run(main())


def test_without_migration_the_stream_ends_with_an_error_event(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    p, d1 = FakeEngine("p1", "prefill"), _Dies("d1", "decode")
    d1.hang_after = 2

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d1,
                         gw={"gateway_migrations": 0}) as s:
            r = await s.client.post(C, json={"prompt": PROMPT, "max_tokens": 5,
                                             "stream": True})
            assert r.status_code == 200
            assert _texts(r.text, False) == ["t0 ", "t1 "]
            last = [ev for ev in r.text.split("\n\n") if ev.strip()][-1]
            assert last.startswith('data: {"error"'), r.text
            await wait_for(lambda: live_reservations(redis_client) == [],
                           "reservations released")

    run(main())
