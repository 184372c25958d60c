"""Decode going on from prefill's first token, the gateway's part: which requests, decode's
body, and answers put together from prefill's token and decode's rest (pure functions;
tests/test_eval_real_model.py proves the whole path on real engines)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvpush.services.gateway.continuation_exact import (
    NoFirstToken,
    after_lead,
    decode_body,
    ended_at_prefill,
    goes_on,
    lead,
    merged,
)
from kvpush.services.gateway.openai_api import parse_chat, parse_completion, parse_responses

GREEDY = {"model": "m", "temperature": 0, "max_tokens": 8}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {**GREEDY, "prompt": "Once"}


def _chat(**extra: Any) -> Any:
    return parse_chat({**CHAT, **extra}, 16)


@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"logprobs": True, "top_logprobs": 2},
                                   {"min_tokens": 3}, {"repetition_penalty": 1.2},
                                   {"stream": True, "stream_options": {"include_usage": True}},
                                   {"seed": 3}, {"ignore_eos": True}])
def test_greedy_plain_chat_goes_on(extra: dict[str, Any]) -> None:
    assert goes_on(_chat(**extra))


@pytest.mark.parametrize("extra", [
    {"temperature": 0.7}, {"temperature": None}, {"max_tokens": 1}, {"stop": ["\n"]},
    {"stop": "x"}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.1},
    {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"echo": True}, {"prompt_logprobs": 1}, {"return_token_ids": True},
    {"bad_words": ["no"]}, {"stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}},
])
def test_requests_whose_answer_reaches_across_the_first_token_do_not(
        extra: dict[str, Any]) -> None:
    body = {**CHAT, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    assert not goes_on(parse_chat(body, 16))


def test_completions_go_on_without_logprobs_only_and_responses_never() -> None:
    assert goes_on(parse_completion(COMPLETION))
    assert not goes_on(parse_completion({**COMPLETION, "logprobs": 2}))
    assert not goes_on(parse_responses({"model": "m", "input": "hi", "temperature": 0}, 16))


def test_decode_is_asked_for_one_token_fewer() -> None:
    p = _chat(min_tokens=3, max_completion_tokens=8)
    body = decode_body({**p.body, "max_tokens": 8, "max_completion_tokens": 8}, p)
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (7, 7, 2)
    assert decode_body({"max_tokens": 5, "min_tokens": 0}, p) == {"max_tokens": 4,
                                                                  "min_tokens": 0}


def _lp(token: str, lp: float) -> dict[str, Any]:
    return {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}


def _chat_answer(text: str, tokens: int, finish: str, logprobs: list[Any] | None
                 ) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                         "finish_reason": finish, "stop_reason": None}],
            "usage": {"prompt_tokens": 9, "completion_tokens": tokens,
                      "total_tokens": 9 + tokens}}


def test_a_unary_answer_is_prefill_token_then_decode_rest_with_logprobs_and_usage() -> None:
    p = _chat(logprobs=True)
    pre = _chat_answer("The", 1, "length", [_lp("The", -0.5)])
    dec = _chat_answer(" capital is Paris.", 4, "stop",
                       [_lp(" capital", -0.1), _lp(" is", -0.2), _lp(" Paris", -0.3),
                        _lp(".", -0.4)])
    out = merged(p, pre, dec)
    choice = out["choices"][0]
    assert choice["message"]["content"] == "The capital is Paris."
    assert [t["token"] for t in choice["logprobs"]["content"]] == \
        ["The", " capital", " is", " Paris", "."]
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    assert choice["finish_reason"] == "stop" and out["id"] == "chatcmpl-1"


def test_a_completion_answer_is_put_together_too() -> None:
    p = parse_completion(COMPLETION)
    pre = {"choices": [{"index": 0, "text": " upon", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    dec = {"choices": [{"index": 0, "text": " a time", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    out = merged(p, pre, dec)
    assert out["choices"][0]["text"] == " upon a time"
    assert out["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("pre, dec", [
    ({"choices": []}, _chat_answer("x", 1, "stop", None)),
    ("not json", _chat_answer("x", 1, "stop", None)),
    (_chat_answer("The", 1, "length", None), {"choices": [{"message": "x"}]}),
    (_chat_answer("The", 1, "length", None), []),
])
def test_malformed_answers_are_refused_not_put_together(pre: Any, dec: Any) -> None:
    with pytest.raises(NoFirstToken):
        merged(_chat(), pre, dec)


def _events(raw: list[bytes]) -> list[Any]:
    return [json.loads(e[6:]) if e.startswith(b"data: {") else e.decode().strip()
            for e in raw]


def test_prefill_token_that_ends_the_answer_is_the_whole_stream() -> None:
    p = _chat(stream=True, stream_options={"include_usage": True})
    pre = _chat_answer("Hi", 1, "stop", None)
    assert ended_at_prefill(pre)
    got = lead(p, pre)
    assert got is not None
    role, token, usage, done = _events(got.events)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert token["choices"][0]["delta"] == {"content": "Hi"}
    assert token["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    assert done == "data: [DONE]"


def test_a_stream_opens_with_prefill_token_and_its_logprobs() -> None:
    p = _chat(stream=True, logprobs=True)
    pre = _chat_answer("The", 1, "length", [_lp("The", -0.5)])
    assert not ended_at_prefill(pre)
    got = lead(p, pre)
    assert got is not None
    _role, token = _events(got.events)
    assert token["choices"][0]["delta"] == {"content": "The"}
    assert token["choices"][0]["logprobs"] == {"content": [_lp("The", -0.5)]}
    # A token that ends inside a character cannot open it.
    assert lead(p, _chat_answer("\ufffd", 1, "length", None)) is None


def test_decode_stream_after_the_lead_drops_its_role_chunk_and_counts_the_token() -> None:
    def ev(chunk: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    role = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None}]})
    tok = ev({"choices": [{"index": 0, "delta": {"content": " capital"},
                           "finish_reason": None}]})
    usage = ev({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                         "total_tokens": 13}})

    async def main() -> list[bytes]:
        async def rest() -> Any:
            for e in (tok, usage, b"data: [DONE]\n\n"):
                yield e

        first: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        first.set_result(role)
        return [e async for e in after_lead(first, rest(), "d")]

    out = asyncio.run(main())
    assert out[0] == tok and out[-1] == b"data: [DONE]\n\n"
    assert json.loads(out[1][6:])["usage"] == {"prompt_tokens": 9, "completion_tokens": 5,
                                               "total_tokens": 14}
