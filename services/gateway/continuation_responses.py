"""Decode going on from prefill's first token, on ``/v1/responses``: that token's text in
front of decode's answer, unary and streamed (continuation_exact.py says which requests go
on, and why that makes a greedy answer the colocated engine's token for token).

A Responses answer is a list of output items, not choices: the token's text goes in front of
the text of the first message item, wherever decode's answer carries it. In a stream that is
the first ``response.output_text.delta`` and the ``.done`` events and final response that
repeat the text; the answer counts one more output token. vLLM opens a message item only
when there is text, so a decode that generated no text gets one with the token's text alone,
its events numbered in sequence with the rest of the stream. Every response object decode
sends names the client's ``max_output_tokens``, not the one token fewer decode was asked for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

# Request fields of a Responses body whose meaning reaches across the first token, besides
# those chat and completions share (continuation_exact._ACROSS).
ACROSS = ("include", "top_logprobs", "reasoning", "max_tool_calls", "prompt")

_DELTA = "response.output_text.delta"
_TEXT_DONE = "response.output_text.done"
_PART_DONE = "response.content_part.done"
_ITEM_DONE = "response.output_item.done"
_WITH_RESPONSE = ("response.created", "response.in_progress")
_ENDS = ("response.completed", "response.incomplete")
# Decode's events that carry text or the response: the rest pass through unparsed (until
# an inserted event renumbers them).
_TOUCHED = tuple(f"event: {k}\n".encode()
                 for k in (_DELTA, _TEXT_DONE, _PART_DONE, _ITEM_DONE, *_WITH_RESPONSE, *_ENDS))


def plain_text_format(body: dict[str, Any]) -> bool:
    """Whether a Responses body asks for plain text (no structured output)."""
    text = body.get("text")
    if text in (None, {}):
        return True
    fmt = text.get("format") if isinstance(text, dict) else None
    return set(text) <= {"format", "verbosity"} and (
        fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"))


def _messages(response: Any) -> list[dict[str, Any]] | None:
    out = response.get("output") if isinstance(response, dict) else None
    if not isinstance(out, list) or not all(isinstance(i, dict) for i in out):
        return None
    return out


def first_text(answer: Any) -> str | None:
    """Prefill's one-token answer's text ("" for a token with none, such as the end of
    sequence); None when the answer is malformed or holds anything but a message."""
    out = _messages(answer)
    if out is None or any(i.get("type") != "message" for i in out):
        return None
    texts = [c.get("text") for i in out for c in i.get("content") or []
             if isinstance(c, dict) and c.get("type") == "output_text"]
    if len(texts) > 1 or not all(isinstance(t, str) for t in texts):
        return None
    return texts[0] if texts else ""


def ended(answer: Any) -> bool:
    """Prefill's token ended the answer (it completed within its one token)."""
    return isinstance(answer, dict) and answer.get("status") == "completed"


def _message() -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
            "role": "assistant", "status": "completed", "content": []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def _prefix_part(parts: list[Any], head: str) -> None:
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "output_text":
            part["text"] = head + (part.get("text") or "")
            return
    if head:
        parts.insert(0, _text_part(head))


def with_head(response: dict[str, Any], head: str, max_tokens: int) -> dict[str, Any]:
    """Decode's finished response with ``head`` in front of its first message's text,
    counted in its usage, naming the client's ``max_output_tokens``."""
    out = _messages(response)
    if out is not None:
        msg = next((i for i in out if i.get("type") == "message"), None)
        if msg is None and head:
            msg = _message()
            out.append(msg)
        if msg is not None:
            if not isinstance(msg.get("content"), list):
                msg["content"] = []
            _prefix_part(msg["content"], head)
    usage = response.get("usage")
    if isinstance(usage, dict):
        for key in ("output_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                usage[key] += 1
    return as_client(response, max_tokens)


def as_client(response: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """A response object naming the client's ``max_output_tokens`` (decode was asked for
    one fewer, prefill for one)."""
    if "max_output_tokens" in response:
        response["max_output_tokens"] = max_tokens
    return response


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return (f"event: {kind}\ndata: ".encode()
            + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
            + b"\n\n")


def _parsed(event: bytes) -> tuple[str, dict[str, Any]] | None:
    head, sep, data = event.partition(b"\ndata: ")
    if not sep or not head.startswith(b"event: "):
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return (head[7:].decode(errors="replace"), obj) if isinstance(obj, dict) else None


def _message_events(item: dict[str, Any], index: int, first_seq: int) -> list[bytes]:
    """A finished message item's events, from ``output_item.added`` to ``.done``,
    numbered from ``first_seq``."""
    where = {"item_id": item.get("id"), "output_index": index}
    out: list[tuple[str, dict[str, Any]]] = [("response.output_item.added", {
        "output_index": index, "item": {**item, "status": "in_progress", "content": []}})]
    for ci, part in enumerate(item.get("content") or []):
        text = part.get("text") or ""
        at = {**where, "content_index": ci}
        out += [("response.content_part.added", {**at, "part": {**part, "text": ""}}),
                (_DELTA, {**at, "delta": text, "logprobs": []}),
                (_TEXT_DONE, {**at, "text": text, "logprobs": []}),
                (_PART_DONE, {**at, "part": part})]
    out.append((_ITEM_DONE, {"output_index": index, "item": item}))
    return [_event(kind, {"type": kind, "sequence_number": first_seq + n, **data})
            for n, (kind, data) in enumerate(out)]


def stream_of(response: dict[str, Any], max_tokens: int) -> list[bytes]:
    """The whole stream of a response that prefill's one token finished: the events vLLM
    sends for it, in its order."""
    response = as_client(response, max_tokens)
    opening = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [_event(k, {"type": k, "sequence_number": n, "response": opening})
              for n, k in enumerate(_WITH_RESPONSE)]
    for index, item in enumerate(_messages(response) or []):
        events += _message_events(item, index, len(events))
    end = "response.completed" if ended(response) else "response.incomplete"
    events.append(_event(end, {"type": end, "sequence_number": len(events),
                               "response": response}))
    return events


async def continued(events: AsyncIterator[bytes], head_of: Callable[[], Awaitable[str]],
                    max_tokens: int) -> AsyncIterator[bytes]:
    """Decode's stream with prefill's token (``head_of()``, awaited at decode's first
    text) in front of its text (module docstring)."""
    head: str | None = None
    placed = False  # the head went out in a delta
    shift = 0  # events inserted so far: decode's later sequence numbers move up by this
    fixed: set[str] = set()  # the .done events that carry the head already (the first each)
    async for ev in events:
        if not shift and not ev.startswith(_TOUCHED):
            yield ev
            continue
        parsed = _parsed(ev)
        if parsed is None:
            yield ev
            continue
        kind, data = parsed
        if isinstance(data.get("sequence_number"), int):
            data["sequence_number"] += shift
        if kind in _WITH_RESPONSE and isinstance(data.get("response"), dict):
            as_client(data["response"], max_tokens)
        elif kind == _DELTA and not placed:
            head = head if head is not None else await head_of()
            data["delta"] = head + str(data.get("delta") or "")
            placed = True
        elif kind == _TEXT_DONE and not placed:
            # Text ended before any delta: the head goes out as the delta it lacked.
            head = head if head is not None else await head_of()
            delta = {"type": _DELTA, "sequence_number": data.get("sequence_number"),
                     "item_id": data.get("item_id"), "output_index": data.get("output_index"),
                     "content_index": data.get("content_index"), "delta": head,
                     "logprobs": []}
            yield _event(_DELTA, delta)
            shift += 1
            data["sequence_number"] = (data.get("sequence_number") or 0) + 1
            placed = True
            fixed.add(kind)
            data["text"] = head + str(data.get("text") or "")
        elif kind in _ENDS and isinstance(data.get("response"), dict):
            head = head if head is not None else await head_of()
            response = with_head(data["response"], head, max_tokens)
            msg = next((i for i in _messages(response) or [] if i.get("type") == "message"),
                       None)
            if not placed and head and msg is not None:
                # Decode generated no text: the token's message goes out before the end.
                start = data.get("sequence_number") or 0
                index = (response.get("output") or []).index(msg)
                inserted = _message_events(msg, index, start)
                for e in inserted:
                    yield e
                shift += len(inserted)
                data["sequence_number"] = start + len(inserted)
        elif head is None or kind in fixed:
            pass
        elif kind == _TEXT_DONE:
            fixed.add(kind)
            data["text"] = head + str(data.get("text") or "")
        elif kind == _PART_DONE and isinstance(data.get("part"), dict):
            fixed.add(kind)
            _prefix_part([data["part"]], head)
        elif kind == _ITEM_DONE and isinstance(data.get("item"), dict) \
                and data["item"].get("type") == "message":
            fixed.add(kind)
            item = data["item"]
            if not isinstance(item.get("content"), list):
                item["content"] = []
            _prefix_part(item["content"], head)
        yield _event(kind, data)
