"""The first token from prefill: a stream's first token relayed from prefill's answer.

Prefill samples the first token anyway (its leg has ``max_tokens=1``), and its answer
reaches the gateway before decode has the KV, has run a step and streamed the same token.
For requests whose first token both engines choose alike (greedy or seeded sampling, no
per-token extras), the gateway sends prefill's token as the stream's first event, in
vLLM's own chunk shape, and then holds decode to it: decode's first token must be the same
text, and is not sent twice. If it differs, the client already has prefill's token, so
decode's stream is dropped and the prompt plus that token is placed again (see
``relay._migrate``), as a colocated engine would have gone on from it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from kvpush.services.gateway.engines import EngineFailed, check_first_event
from kvpush.services.gateway.migration import is_role_chunk
from kvpush.services.gateway.openai_api import CHAT, RESPONSES, ParsedRequest

# Request fields that put more in a stream chunk than the token's text (or hold text back,
# as stop strings do), so a chunk built from prefill's answer could not match decode's.
_EXTRAS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids",
           "min_tokens", "tools", "functions", "return_prompt_text",
           "stream_interval", "return_token_offsets")


# No single token's text is longer; a longer "first token" is no answer to relay.
_MAX_TOKEN_TEXT = 256


class FirstTokenDiffers(EngineFailed):
    """Decode's first token is not the one prefill answered and the client already has.

    Not an engine fault: the request goes on from prefill's token on any decode."""

    def __init__(self, engine: str | None, lead: str, got: str) -> None:
        super().__init__("decode", engine, f"first token {got!r} differs from prefill's "
                                           f"{lead!r}")


@dataclass(frozen=True)
class Lead:
    """Prefill's first token as stream events, and its text for checking decode's."""

    events: list[bytes]
    text: str


def can_lead(p: ParsedRequest) -> bool:
    """Whether prefill's first token is the one decode will stream: greedy or seeded
    sampling, more than one token wanted, and nothing in a chunk beyond the text."""
    b = p.body
    if not p.stream or p.max_tokens < 2 or p.path == RESPONSES:
        return False  # a Responses stream's events are not one chunk per token
    if any(b.get(k) not in (None, False, 0, [], "") for k in _EXTRAS):
        return False
    opts = b.get("stream_options")
    if isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        return False
    temperature, seed = b.get("temperature"), b.get("seed")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) \
        and temperature == 0
    return greedy or (isinstance(seed, int) and not isinstance(seed, bool))


def lead_from(p: ParsedRequest, answer: Any, logprobs: bool = False,
              whole: bool = False) -> Lead | None:
    """The stream's first events built from prefill's one-token answer; None when it
    cannot stand in for decode's (the request ended there, a replacement character, an
    answer of another shape). With ``logprobs`` the token's chunk carries the answer's
    (chat); with ``whole`` an answer that ended there is the whole stream, [DONE]
    included (a decode that goes on from it, ``continuation_exact.py``)."""
    try:
        choice = answer["choices"][0]
        finish = choice.get("finish_reason")
        if finish != "length" and not whole:
            return None  # a stop token or string ends the request: decode says so
        if finish not in ("length", "stop"):
            return None
        # A chunk's opening fields, in vLLM's order.
        head = {"id": str(answer["id"]),
                "object": "chat.completion.chunk" if p.path == CHAT else "text_completion",
                "created": int(answer["created"]), "model": str(answer["model"])}
        if p.path == CHAT:
            msg = choice["message"]
            if msg.get("tool_calls") or msg.get("reasoning") or msg.get("reasoning_content"):
                return None
            text, role = msg["content"], msg.get("role") or "assistant"
        else:
            text = choice["text"]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    # A token that ends inside a character has "" as its text, as decode streams it too
    # (one detokenizer for both); a replacement character would be held back there.
    if not isinstance(text, str) or "\ufffd" in text or len(text) > _MAX_TOKEN_TEXT:
        return None
    hold = stop_hold(p.body)
    if hold:
        # Decode's detokenizer holds back what could begin a stop string and streams the
        # first token's text short of it: so does the lead. (Prefill's answer, finished,
        # has it all.) Nothing left to show: decode may send no chunk at all, so no lead.
        text = text[:max(0, len(text) - hold)]
        if not text:
            return None
    # The fields vLLM's own stream chunks carry, in its order (nulls included).
    if p.path == CHAT:
        events = [
            {**head, "choices": [{"index": 0, "delta": {"role": role, "content": ""},
                                  "logprobs": None, "finish_reason": None}],
             "prompt_token_ids": None, "prompt_text": None},
            {**head, "choices": [{"index": 0, "delta": {"content": text},
                                  "logprobs": choice.get("logprobs") if logprobs else None,
                                  "finish_reason": None, "token_ids": None}]},
        ]
    else:
        events = [{**head, "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": None,
            "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]}]
    out = [_event(e) for e in events]
    if finish != "length":
        # The answer ended at this token: its end and usage, as vLLM closes a stream.
        events[-1]["choices"][0]["finish_reason"] = finish
        if p.path != CHAT:
            events[-1]["choices"][0]["stop_reason"] = choice.get("stop_reason")
        out[-1] = _event(events[-1])
        opts = p.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            out.append(_event({**head, "choices": [], "usage": answer.get("usage")}))
        out.append(b"data: [DONE]\n\n")
    return Lead(out, text)


def stop_hold(body: dict[str, Any]) -> int:
    """Characters vLLM holds back from a stream that has stop strings (as its incremental
    detokenizer does: the longest stop string less one, unless stop strings are sent)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if not stops or body.get("include_stop_str_in_output"):
        return 0
    return max((len(s) for s in stops if isinstance(s, str)), default=1) - 1


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"


async def held_to(lead: Lead, first: Awaitable[bytes], events: AsyncIterator[bytes],
                  path: str, engine: str | None) -> AsyncIterator[bytes]:
    """Decode's stream after ``lead`` went out: its role chunk and its first token are
    dropped once the token is found to be the lead's; a different token raises
    :class:`FirstTokenDiffers`, and a stream with no answer :class:`EngineFailed`.
    ``first`` resolves to decode's first event."""
    ev: bytes | None = await first
    check_first_event(ev, engine)
    if path == CHAT and is_role_chunk(ev):
        ev = await anext(events, None)
    if not ev:
        return  # the relay reports a stream that ended without [DONE]
    text, finish = _token_of(ev, path)
    if text is None:
        yield ev  # no token (an error event, say): the relay deals with it
    elif text == lead.text:
        if finish is not None:
            # The same token also ended the stream: the end is still news to the client.
            yield _with_text(ev, path, "")
    elif lead.text and text.startswith(lead.text):
        # vLLM merges the outputs its API server has not streamed yet into one chunk, so
        # decode's first may carry the tokens after the lead's too: those are news.
        yield _with_text(ev, path, text[len(lead.text):])
    else:
        raise FirstTokenDiffers(engine, lead.text, text)
    async for ev in events:
        yield ev


def _token_of(event: bytes, path: str) -> tuple[str | None, Any]:
    try:
        choice = json.loads(event[5:])["choices"][0]
        text = choice["delta"].get("content") if path == CHAT else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None, None
    return (text if isinstance(text, str) else None), choice.get("finish_reason")


def _with_text(event: bytes, path: str, text: str) -> bytes:
    chunk = json.loads(event[5:])
    choice = chunk["choices"][0]
    if path == CHAT:
        choice["delta"]["content"] = text
    else:
        choice["text"] = text
    return _event(chunk)
