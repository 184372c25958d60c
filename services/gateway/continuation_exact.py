"""Decode goes on from prefill's first token: which requests, decode's body, the answer.

Prefill samples the first token after computing the whole prompt, as a colocated engine's
first step does. Where decode can go on from it (``Assignment.decode_continues``), the
gateway asks it to (``KVTransferParams.continues``): decode receives the KV of every
prompt token and prefill's token, appends the token to the prompt and computes nothing
else of the prompt, so its first step is the step a colocated engine runs for that token
and a greedy answer is the colocated engine's token for token. Decode then generates the
rest, one token fewer, and the gateway puts prefill's token in front of it: the first
event of a stream, the head of a unary answer's text and logprobs, one more completion
token in the usage.

Only requests whose answer is the plain sequence of tokens go this way: greedy, one
choice, no stop strings or bad words (they may span the first token and the next, which
decode's detokenizer never sees together), no guided decoding, structured output, tools or
reasoning (decode's grammar and parsers would start after the first token), no presence or
frequency penalty (decode counts the first token as prompt), no echo, prompt logprobs or
token ids, and logprobs only in chat. The others go the way a colocated engine's output is
approached without it: decode recomputes the prompt's last token and samples the first
token itself. A Responses answer is put together by continuation_responses.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from kvpush.services.gateway import continuation_responses as responses
from kvpush.services.gateway.engines import EngineFailed, check_first_event
from kvpush.services.gateway.lead import Lead, lead_from
from kvpush.services.gateway.migration import is_role_chunk
from kvpush.services.gateway.openai_api import CHAT, COMPLETIONS, RESPONSES, ParsedRequest

# Fields whose meaning reaches across the first token, or that put more in the answer than
# its tokens: a request with any of them set recomputes the prompt's last token on decode.
_ACROSS = ("stop", "bad_words", "echo", "prompt_logprobs", "return_token_ids",
           "return_prompt_text", "return_token_offsets", "tools", "functions",
           "tool_choice", "function_call", "response_format", "structured_outputs",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_decoding_backend", "guided_whitespace_pattern", "presence_penalty",
           "frequency_penalty", "stream_interval", "best_of", "allowed_token_ids",
           "logits_processors", "vllm_xargs")


def goes_on(p: ParsedRequest) -> bool:
    """Whether ``p``'s decode may go on from prefill's first token (module docstring)."""
    b = p.body
    if p.path not in (CHAT, COMPLETIONS, RESPONSES) or p.n != 1 or p.max_tokens < 2:
        return False
    if p.path == RESPONSES and (not responses.plain_text_format(b) or any(
            b.get(k) not in (None, False, 0, [], "", {}) for k in responses.ACROSS)):
        return False
    temperature = b.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
            or temperature != 0:
        return False
    if any(b.get(k) not in (None, False, 0, [], "", {}) for k in _ACROSS):
        return False
    if p.path == COMPLETIONS and b.get("logprobs") not in (None, False):
        return False  # its text offsets count from the first token
    opts = b.get("stream_options")
    return not (isinstance(opts, dict) and opts.get("continuous_usage_stats"))


def decode_body(body: dict[str, Any], p: ParsedRequest) -> dict[str, Any]:
    """Decode's body for a request that goes on: one token fewer to generate (and to
    generate at least), since prefill's token is the answer's first."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(out.get(key), int):
            out[key] -= 1
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 0:
        out["min_tokens"] -= 1
    return out


def _choice(answer: Any) -> dict[str, Any] | None:
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    return choice if isinstance(choice, dict) else None


def ended_at_prefill(p: ParsedRequest, answer: Any) -> dict[str, Any] | None:
    """The client's answer when prefill's token ended it (an end-of-sequence or stop
    token): decode's part is not wanted. None when decode's part is."""
    if p.path == RESPONSES:
        return responses.as_client(answer, p.max_tokens) if responses.ended(answer) \
            else None
    choice = _choice(answer)
    return answer if choice is not None and choice.get("finish_reason") not in (
        None, "length") else None


def _text_of(path: str, choice: dict[str, Any]) -> str | None:
    if path == CHAT:
        msg = choice.get("message")
        text = msg.get("content") if isinstance(msg, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else None


def _one_more_token(usage: Any) -> None:
    if isinstance(usage, dict):
        for key in ("completion_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                usage[key] += 1


class NoFirstToken(ValueError):
    """Prefill's answer has no first token to put in front of decode's (malformed)."""


def merged(p: ParsedRequest, prefill: Any, decode: Any) -> dict[str, Any]:
    """Decode's unary answer with prefill's first token in front of its text and
    logprobs and counted in its usage; raises :class:`NoFirstToken`."""
    if p.path == RESPONSES:
        return responses.with_head(_checked(decode), first_text(prefill), p.max_tokens)
    first, rest = _choice(prefill), _choice(decode)
    head = _text_of(p.path, first) if first is not None else None
    if head is None or rest is None or not isinstance(decode, dict):
        raise NoFirstToken("prefill's or decode's answer has no choice with text")
    if p.path == CHAT:
        msg = rest.get("message")
        if not isinstance(msg, dict):
            raise NoFirstToken("decode's answer has no message")
        msg["content"] = head + (msg.get("content") or "")
        lp_head, lp_rest = first.get("logprobs"), rest.get("logprobs")
        if isinstance(lp_head, dict) and isinstance(lp_rest, dict) \
                and isinstance(lp_head.get("content"), list) \
                and isinstance(lp_rest.get("content"), list):
            lp_rest["content"] = lp_head["content"] + lp_rest["content"]
    else:
        rest["text"] = head + (rest.get("text") or "")
    _one_more_token(decode.get("usage"))
    return decode


def first_text(prefill: Any) -> str:
    """The text of prefill's token in its Responses answer; raises :class:`NoFirstToken`."""
    head = responses.first_text(prefill)
    if head is None:
        raise NoFirstToken("prefill's answer holds no message of one token")
    return head


def _checked(decode: Any) -> dict[str, Any]:
    if not isinstance(decode, dict) or not isinstance(decode.get("output"), list):
        raise NoFirstToken("decode's answer has no output")
    return decode


def lead(p: ParsedRequest, prefill: Any) -> Lead | None:
    """The stream's opening events from prefill's answer: its first token, with its
    logprobs in chat, and the whole stream when that token ended the answer. None when
    the answer cannot open it: malformed, or a token that ends inside a character (decode
    then streams from the next token, which its detokenizer sees without the first). A
    Responses stream opens with decode's events (:func:`responses_after`) unless prefill's
    token ended it."""
    if p.path == RESPONSES:
        answer = ended_at_prefill(p, prefill)
        head = responses.first_text(answer)
        if answer is None or head is None:
            return None  # a malformed answer fails at decode's first text
        return Lead(responses.stream_of(answer, p.max_tokens), head)
    return lead_from(p, prefill, logprobs=True, whole=True)


def responses_after(p: ParsedRequest, events: AsyncIterator[bytes],
                    prefill: Awaitable[Any], engine: str | None) -> AsyncIterator[bytes]:
    """Decode's Responses stream with prefill's token in front of its text; a malformed
    answer from prefill (``engine``) raises :class:`EngineFailed` at decode's first text."""
    async def head() -> str:
        try:
            return first_text(await prefill)
        except NoFirstToken as exc:
            raise EngineFailed("prefill", engine, str(exc)) from exc
    return responses.continued(events, head, p.max_tokens)


async def after_lead(first: Awaitable[bytes], events: AsyncIterator[bytes],
                     engine: str | None) -> AsyncIterator[bytes]:
    """Decode's stream after prefill's token went out: its role chunk dropped (the lead
    had one), its usage counting prefill's token. ``first`` resolves to decode's first
    event; a stream with no answer raises :class:`EngineFailed`."""
    ev = await first
    check_first_event(ev, engine)
    while ev:
        if is_role_chunk(ev):
            pass
        elif b'"usage"' in ev:
            yield _with_usage(ev)
        else:
            yield ev
        ev = await anext(events, None)


def _with_usage(event: bytes) -> bytes:
    try:
        chunk = json.loads(event[5:])
    except ValueError:
        return event
    if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), dict):
        return event
    _one_more_token(chunk["usage"])
    return b"data: " + json.dumps(chunk, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"
