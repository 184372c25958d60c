"""Request migration: what a stream whose decode engine failed after its first tokens asks
of the next engine, so that the client's stream goes on (the prompt plus what it already got).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from kvpush.services.gateway.openai_api import CHAT, ParsedRequest


def generated(events: Iterable[bytes], path: str) -> tuple[str, int]:
    """The text the client received in ``events`` and how many events carried some (one
    token each, as vLLM streams)."""
    parts: list[str] = []
    for ev in events:
        try:
            choice = (json.loads(ev[5:]).get("choices") or [{}])[0]
        except (ValueError, AttributeError, IndexError, TypeError):
            continue
        if not isinstance(choice, dict):
            continue
        if path == CHAT:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts), len(parts)


def is_role_chunk(event: bytes) -> bool:
    """A chat stream's opening chunk that only names the assistant role (the client already
    had it from the first engine)."""
    try:
        choice = (json.loads(event[5:]).get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
    except (ValueError, AttributeError, IndexError, TypeError):
        return False
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") \
        and choice.get("finish_reason") is None


def continuation(p: ParsedRequest, text: str, count: int,
                 text_ids: list[int] | None) -> ParsedRequest | None:
    """The request that generates the rest of ``p`` after ``text`` (``count`` tokens, or
    ``text_ids`` when the prompt went as token ids); None when nothing is left to generate
    or the request cannot be continued."""
    left = p.max_tokens - count
    if left <= 0:
        return None
    body: dict[str, Any] = dict(p.body)
    body.pop("echo", None)  # the client has its echo already
    if "min_tokens" in body and isinstance(body["min_tokens"], int):
        body["min_tokens"] = max(0, body["min_tokens"] - count)
    if p.path == CHAT:
        body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
        body["max_completion_tokens"] = left
        body.pop("max_tokens", None)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and text_ids is not None:
            body["prompt"] = [*prompt, *text_ids]
        elif isinstance(prompt, str):
            body["prompt"] = prompt + text
        else:
            return None
        body["max_tokens"] = left
    return replace(p, body=body, max_tokens=left)
