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
    responses_after,
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


def test_completions_go_on_without_logprobs_only() -> None:
    assert goes_on(parse_completion(COMPLETION))
    assert not goes_on(parse_completion({**COMPLETION, "logprobs": 2}))


RESPONSE = {"model": "m", "input": "hi", "temperature": 0, "max_output_tokens": 8}


@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"text": {"format": {"type": "text"}}},
                                   {"instructions": "Be brief."}, {"store": False}])
def test_greedy_plain_responses_go_on(extra: dict[str, Any]) -> None:
    assert goes_on(parse_responses({**RESPONSE, **extra}, 16))


@pytest.mark.parametrize("extra", [
    {"temperature": 0.7}, {"max_output_tokens": 1}, {"reasoning": {"effort": "low"}},
    {"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
    {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
    {"tool_choice": "auto"},
])
def test_responses_whose_answer_reaches_across_the_first_token_do_not(
        extra: dict[str, Any]) -> None:
    assert not goes_on(parse_responses({**RESPONSE, **extra}, 16))


def test_decode_is_asked_for_one_token_fewer() -> None:
    p = _chat(min_tokens=3, max_completion_tokens=8)
    body = decode_body({**p.body, "max_tokens": 8, "max_completion_tokens": 8}, p)
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (7, 7, 2)
    assert decode_body({"max_tokens": 5, "min_tokens": 0}, p) == {"max_tokens": 4,
                                                                  "min_tokens": 0}
    r = parse_responses(RESPONSE, 16)
    assert decode_body({**RESPONSE, "max_output_tokens": 8}, r)["max_output_tokens"] == 7


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
    assert ended_at_prefill(p, pre) is pre
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
    assert ended_at_prefill(p, pre) is None
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


def _response(texts: list[str], tokens: int, status: str, max_tokens: int) -> dict[str, Any]:
    """A Responses answer as vLLM makes it: one message, its text in one part, or no
    part when there is no text."""
    content = [{"type": "output_text", "text": t, "annotations": [], "logprobs": None}
               for t in texts if t]
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
            "status": status, "max_output_tokens": max_tokens,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                        "status": "completed", "content": content}],
            "usage": {"input_tokens": 9, "output_tokens": tokens,
                      "total_tokens": 9 + tokens}}


def _responses_stream(deltas: list[str], tokens: int, status: str) -> list[bytes]:
    """Decode's Responses stream as vLLM sends it (a message item only if there is text)."""
    text = "".join(deltas)
    final = _response([text], tokens, status, 7)
    opening = {**final, "status": "in_progress", "output": [], "usage": None}
    kinds: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": opening}),
                                               ("response.in_progress", {"response": opening})]
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    if deltas:
        part = final["output"][0]["content"][0]
        kinds += [("response.output_item.added", {"output_index": 0, "item": {
                      **final["output"][0], "status": "in_progress", "content": []}}),
                  ("response.content_part.added", {**at, "part": {**part, "text": ""}})]
        kinds += [("response.output_text.delta", {**at, "delta": d, "logprobs": []})
                  for d in deltas]
        kinds += [("response.output_text.done", {**at, "text": text, "logprobs": []}),
                  ("response.content_part.done", {**at, "part": part}),
                  ("response.output_item.done", {"output_index": 0,
                                                 "item": final["output"][0]})]
    else:
        final["output"] = []
    end = "response.completed" if status == "completed" else "response.incomplete"
    kinds.append((end, {"response": final}))
    return [f"event: {k}\ndata: ".encode()
            + json.dumps({"type": k, "sequence_number": n, **d}).encode() + b"\n\n"
            for n, (k, d) in enumerate(kinds)]


def _parse_stream(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for ev in raw:
        head, _, data = ev.partition(b"\ndata: ")
        body = json.loads(data)
        assert head.decode() == f"event: {body['type']}"
        out.append((body["type"], body))
    assert [b["sequence_number"] for _, b in out] == list(range(len(out)))
    return out


def _continued(deltas: list[str], tokens: int, status: str, head: str = "The"
               ) -> list[tuple[str, dict[str, Any]]]:
    p = parse_responses({**RESPONSE, "stream": True}, 16)
    prefill = _response([head], 1, "incomplete", 1)

    async def main() -> list[bytes]:
        async def decode() -> Any:
            for e in _responses_stream(deltas, tokens, status):
                yield e

        async def answered() -> Any:
            return prefill

        return [e async for e in responses_after(p, decode(), answered(), "p")]

    return _parse_stream(asyncio.run(main()))


def _streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(b["delta"] for k, b in events if k == "response.output_text.delta")


def test_a_responses_answer_is_prefill_token_then_decode_rest() -> None:
    p = parse_responses(RESPONSE, 16)
    pre = _response(["The"], 1, "incomplete", 1)
    assert ended_at_prefill(p, pre) is None
    out = merged(p, pre, _response([" capital is Paris."], 4, "completed", 7))
    assert out["output"][0]["content"][0]["text"] == "The capital is Paris."
    assert out["usage"] == {"input_tokens": 9, "output_tokens": 5, "total_tokens": 14}
    assert (out["status"], out["max_output_tokens"]) == ("completed", 8)
    # Decode generated no text (vLLM then gives the message no part): the token is all.
    out = merged(p, pre, _response([""], 1, "completed", 7))
    assert [c["text"] for c in out["output"][0]["content"]] == ["The"]
    for bad in ({"output": [{"type": "reasoning"}]}, {"output": "x"}, []):
        with pytest.raises(NoFirstToken):
            merged(p, bad, _response(["x"], 1, "completed", 7))
    with pytest.raises(NoFirstToken):
        merged(p, pre, {"choices": []})


def test_a_responses_stream_carries_prefill_token_in_its_text_and_usage() -> None:
    events = _continued([" capital", " is", " Paris."], 3, "incomplete")
    kinds = [k for k, _ in events]
    assert kinds.count("response.output_text.delta") == 3  # nothing inserted
    assert _streamed_text(events) == "The capital is Paris."
    done = dict(events)
    assert done["response.output_text.done"]["text"] == "The capital is Paris."
    assert done["response.content_part.done"]["part"]["text"] == "The capital is Paris."
    assert done["response.output_item.done"]["item"]["content"][0]["text"] == \
        "The capital is Paris."
    final = done["response.incomplete"]["response"]
    assert final["output"][0]["content"][0]["text"] == "The capital is Paris."
    assert final["usage"]["output_tokens"] == 4 and final["usage"]["total_tokens"] == 13
    assert done["response.created"]["response"]["max_output_tokens"] == 8
    assert final["max_output_tokens"] == 8


def test_a_responses_stream_whose_decode_says_nothing_gets_the_token_message() -> None:
    events = _continued([], 1, "completed")
    kinds = [k for k, _ in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert _streamed_text(events) == "The"
    final = dict(events)["response.completed"]["response"]
    assert [c["text"] for c in final["output"][0]["content"]] == ["The"]
    assert final["usage"]["output_tokens"] == 2


def test_prefill_token_that_ends_a_responses_answer_is_the_whole_stream() -> None:
    p = parse_responses({**RESPONSE, "stream": True}, 16)
    pre = _response(["Hi"], 1, "completed", 1)
    assert ended_at_prefill(p, pre) is pre and pre["max_output_tokens"] == 8
    got = lead(p, pre)
    assert got is not None and got.text == "Hi"
    events = _parse_stream(got.events)
    assert _streamed_text(events) == "Hi"
    assert events[-1][0] == "response.completed"
    assert events[0][1]["response"]["status"] == "in_progress"
    # An end-of-sequence token has no text: the stream still opens and ends as vLLM's.
    eos = lead(p, _response([""], 1, "completed", 1))
    assert eos is not None
    assert [k for k, _ in _parse_stream(eos.events)] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.output_item.done", "response.completed"]
    # Prefill's token did not end it: decode's stream opens, with the token in its text.
    assert lead(p, _response(["The"], 1, "incomplete", 1)) is None
