"""A stream's first token from prefill's answer, held against decode's.

The gateway is the real app over real HTTP with a real Redis and the real scheduler; the
engines are the stand-ins of tests/test_gateway.py (the thing under test is the relay:
which token goes out first, that decode's copy of it is not sent twice, and that a decode
choosing another first token is not followed). The real engines' chunk shapes are checked
in tests/test_e2e_gateway.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvpush.common.runtime import run
from kvpush.services.gateway.lead import can_lead, lead_from
from kvpush.services.gateway.openai_api import CHAT as CHAT_PATH
from kvpush.services.gateway.openai_api import COMPLETIONS, ParsedRequest
from tests.sched_util import wait_for
from tests.test_gateway import (  # noqa: F401 (tokenizer_dir: a fixture)
    PROMPT,
    FakeEngine,
    serve_published,
    stack,
    tokenizer_dir,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"max_tokens": 5, "stream": True, "temperature": 0}


class _Differs(FakeEngine):
    """A decode whose first streamed token is not prefill's (its later calls stream as
    usual, so the continuation placed on it can be seen)."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        if len(self.calls) > 1:
            async for ev in super()._sse(n, chat):
                yield ev
            return
        for tok in ("x0 ", "x1 "):
            part = {"delta": {"content": tok}} if chat else {"text": tok}
            ev = {"id": "d1-x", "created": 0, "model": "tiny",
                  "choices": [{"index": 0, **part}]}
            yield f"data: {json.dumps(ev)}\n\n".encode()
        yield b"data: [DONE]\n\n"


class _RoleFirst(FakeEngine):
    """A chat decode that opens with vLLM's role chunk."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        role = {"id": "d1-x", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]}
        yield f"data: {json.dumps(role)}\n\n".encode()
        async for ev in super()._sse(n, chat):
            yield ev


def _texts(events: list[dict[str, Any]], chat: bool) -> list[str]:
    out = []
    for e in events:
        choice = e["choices"][0]
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text:
            out.append(text)
    return out


async def _events(s: Any, path: str, body: dict[str, Any],
                  on_first: Any = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with s.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]" or out, "the stream ended before a token"
            if line == "data: [DONE]":
                return out
            out.append(json.loads(line[6:]))
            if on_first is not None and len(out) == 1:
                await on_first()
    raise AssertionError("no [DONE]")


@pytest.mark.parametrize("path", [C, CHAT])
def test_first_token_goes_out_from_prefill_before_decode_streams_it(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        path: str) -> None:
    chat = path == CHAT
    p, d = FakeEngine("p1", "prefill"), (_RoleFirst if chat else FakeEngine)("d1", "decode")
    d.mode, d.hang_after = "pause_after", 0  # decode streams nothing until resumed
    body = ({"messages": [{"role": "user", "content": PROMPT}]} if chat
            else {"prompt": PROMPT}) | GREEDY

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            async def first_arrived() -> None:
                # The client holds prefill's token while decode has sent none.
                assert d.calls and not d.resume.is_set()
                d.resume.set()

            events = await _events(s, path, body, first_arrived)
            assert d.resume.is_set()
            # Decode's own first token (and its role chunk) is not sent a second time.
            assert _texts(events, chat) == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
            if chat:
                assert events[0]["choices"][0]["delta"] == {"role": "assistant",
                                                            "content": ""}
                assert sum("role" in e["choices"][0]["delta"] for e in events) == 1
            assert events[0]["id"] == "p1-x" and events[0]["model"] == "tiny"
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_first_token_from_prefill_total{outcome="led"} 1.0' in m

    run(main())


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_decode_that_chooses_another_first_token_is_not_followed(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        path: str) -> None:
    chat = path == CHAT
    p, d = FakeEngine("p1", "prefill"), _Differs("d1", "decode")
    body = ({"messages": [{"role": "user", "content": PROMPT}]} if chat
            else {"prompt": PROMPT}) | GREEDY

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            events = await _events(s, path, body)
            # Prefill's token, then the continuation after it (which numbers from t0):
            # nothing of the decode that went another way.
            assert _texts(events, chat) == ["t0 ", "t0 ", "t1 ", "t2 ", "t3 "]
            led, cont = d.calls
            kv = cont.body["kv_transfer_params"]
            # Not an engine failure: the same (and only) decode takes the continuation.
            assert kv["request_id"].endswith("-m1") and kv["kvpush"] == "decode"
            if chat:
                assert cont.body["messages"][-1] == {"role": "assistant", "content": "t0 "}
                assert cont.body["max_completion_tokens"] == 4
            else:
                # The prompt went as token ids: the same ones, then prefill's token's.
                n = len(led.body["prompt"])
                assert cont.body["prompt"][:n] == led.body["prompt"]
                assert len(cont.body["prompt"]) > n and cont.body["max_tokens"] == 4
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_first_token_from_prefill_total{outcome="differed"} 1.0' \
                in m
            assert 'kvpush_gateway_errors_total{kind="first_token_differs",' \
                   'tenant="default"} 1.0' in m

    run(main())


class _MergesFirst(FakeEngine):
    """A decode whose first chunk carries its first two tokens, as vLLM's API server sends
    the outputs it had not streamed yet in one chunk."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        i = 0
        async for ev in super()._sse(n, chat):
            i += 1
            if i == 2:
                continue  # already in the first chunk
            if i == 1:
                chunk = json.loads(ev[6:])
                if chat:
                    chunk["choices"][0]["delta"]["content"] = "t0 t1 "
                else:
                    chunk["choices"][0]["text"] = "t0 t1 "
                ev = f"data: {json.dumps(chunk)}\n\n".encode()
            yield ev


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_decode_first_chunk_with_more_tokens_than_the_lead_streams_the_rest(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
        path: str) -> None:
    """Decode's first chunk starts with prefill's token and carries the next one too: the
    next one goes out, the lead's is not sent twice, and nothing is placed again."""
    chat = path == CHAT
    p, d = FakeEngine("p1", "prefill"), _MergesFirst("d1", "decode")
    body = ({"messages": [{"role": "user", "content": PROMPT}]} if chat
            else {"prompt": PROMPT}) | GREEDY

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            events = await _events(s, path, body)
            assert _texts(events, chat) == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
            assert len(d.calls) == 1  # no continuation placed elsewhere
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_first_token_from_prefill_total{outcome="led"} 1.0' in m

    run(main())


class _DiesFirst(FakeEngine):
    """A decode that drops its stream, once resumed, before sending a token."""

    async def _sse(self, n: int, chat: bool) -> AsyncIterator[bytes]:
        await self.resume.wait()
        raise ConnectionResetError("decode engine died")
        yield b""  # an async generator


def test_a_decode_that_dies_before_its_first_token_goes_on_from_prefills(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
) -> None:
    p, d1, d2 = FakeEngine("p1", "prefill"), _DiesFirst("d1", "decode"), \
        FakeEngine("d2", "decode")

    async def main() -> None:
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d1) as s:
            async def first_arrived() -> None:
                d1.resume.set()

            events = await _events(s, C, {"prompt": PROMPT} | GREEDY, first_arrived)
            # Prefill's token, then the rest from d2 (numbering from t0) after it.
            assert _texts(events, False) == ["t0 ", "t0 ", "t1 ", "t2 ", "t3 "]
            (cont,) = d2.calls
            (led,) = d1.calls
            n = len(led.body["prompt"])
            assert cont.body["prompt"][:n] == led.body["prompt"]
            assert len(cont.body["prompt"]) > n and cont.body["max_tokens"] == 4

    run(main())


def _parsed(path: str = COMPLETIONS, **body: Any) -> ParsedRequest:
    return ParsedRequest(path, {"stream": True, "temperature": 0, **body}, True, 8, "tiny")


def test_which_requests_prefill_may_lead() -> None:
    assert can_lead(_parsed())
    assert can_lead(_parsed(temperature=0.7, seed=3))  # seeded: both engines draw alike
    assert not can_lead(_parsed(temperature=0.7))
    assert not can_lead(_parsed(temperature=None))  # the engine's default may sample
    assert not can_lead(_parsed(temperature=False, seed=True))
    assert not can_lead(ParsedRequest(COMPLETIONS, {"stream": True, "temperature": 0},
                                      True, 1, "tiny"))  # one token: decode ends it
    assert can_lead(_parsed(stop=["x"]))  # the lead holds back what decode holds back
    for extra in ({"logprobs": 2}, {"echo": True}, {"min_tokens": 3},
                  {"return_token_ids": True}, {"tools": [{"type": "function"}]},
                  {"stream_options": {"continuous_usage_stats": True}}):
        assert not can_lead(_parsed(**extra)), extra
    assert can_lead(_parsed(stop=[], stream_options={"include_usage": True}))


def test_what_prefill_answer_can_lead() -> None:
    p = _parsed()

    def answer(text: Any, finish: str = "length") -> dict[str, Any]:
        return {"id": "cmpl-1", "created": 5, "model": "tiny",
                "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    lead = lead_from(p, answer(" hi"))
    assert lead is not None and lead.text == " hi"
    (ev,) = lead.events
    assert json.loads(ev[6:]) == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny",
        "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None,
                     "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]}
    assert lead_from(p, answer(" hi", "stop")) is None  # the request ends: decode says so
    # Stop strings: decode streams the first token short of the longest one less a char.
    held = lead_from(_parsed(stop=["abc", "d"]), answer(" hello"))
    assert held is not None and held.text == " hel"
    assert json.loads(held.events[0][6:])["choices"][0]["text"] == " hel"
    assert lead_from(_parsed(stop="abcdef"), answer(" hi")) is None  # nothing to show
    sent = lead_from(_parsed(stop=["abc"], include_stop_str_in_output=True), answer(" hi"))
    assert sent is not None and sent.text == " hi"
    # A token ending inside a character: "" from prefill, and "" is what decode streams.
    partial = lead_from(p, answer(""))
    assert partial is not None and partial.text == ""
    assert lead_from(p, answer("\ufffd")) is None  # decode holds a partial character back
    assert lead_from(p, answer(5)) is None
    assert lead_from(p, answer("x" * 10_000)) is None  # no one token says this much
    assert lead_from(p, {"choices": []}) is None
    assert lead_from(p, "not json") is None
    chat = _parsed(CHAT_PATH)
    lead = lead_from(chat, {"id": "c", "created": 1, "model": "tiny", "choices": [
        {"index": 0, "finish_reason": "length",
         "message": {"role": "assistant", "content": "yo"}}]})
    assert lead is not None
    assert [json.loads(e[6:])["choices"][0]["delta"] for e in lead.events] == [
        {"role": "assistant", "content": ""}, {"content": "yo"}]
    assert lead_from(chat, {"id": "c", "created": 1, "model": "tiny", "choices": [
        {"index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}}]}) is None


def test_without_a_seed_or_greedy_decode_streams_the_first_token(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
) -> None:
    p, d = FakeEngine("p1", "prefill"), _Differs("d1", "decode")

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            events = await _events(s, C, {"prompt": PROMPT, "max_tokens": 5,
                                          "stream": True, "temperature": 0.8})
            assert _texts(events, False) == ["x0 ", "x1 "]
            assert len(d.calls) == 1
            await wait_for(lambda: p.calls, "prefill called")

    run(main())


def test_a_decode_that_freezes_after_prefill_led_is_left_for_another(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path,  # noqa: F811
) -> None:
    """Decode sent its headers, then stopped answering (SIGSTOPped) before its first token:
    the health probes that guard a request until its first token still guard it after
    prefill's answer led, and the request goes on from prefill's token on another decode
    instead of waiting out its deadline."""
    from tests.test_gateway_liveness import PATIENT, FrozenEngine

    p, d2 = FakeEngine("p1", "prefill"), FakeEngine("d2", "decode")
    d1 = FrozenEngine("d1", "decode", mode="pause_after", hang_after=0)

    async def main() -> None:
        async with serve_published(redis_client, d2), \
                stack(redis_url, redis_client, tokenizer_dir, p, d1, gw=PATIENT) as s:
            events = await _events(s, C, {"prompt": PROMPT} | GREEDY)
            assert _texts(events, False) == ["t0 ", "t0 ", "t1 ", "t2 ", "t3 "]
            assert d1.health_calls  # it was probed, and given up on
            (cont,) = d2.calls
            assert cont.body["max_tokens"] == 4

    run(main())
