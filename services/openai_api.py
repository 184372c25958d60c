"""OpenAI request parsing for the gateway: validation, token counting, engine bodies, errors."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# Completions default to 16 tokens in the OpenAI API; chat has no fixed default.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """The client's request is malformed or asks for something the gateway cannot serve."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TokenizerUnavailable(RuntimeError):
    """No tokenizer could be loaded to count prompt tokens."""


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request and what the scheduler needs to know about it."""

    path: str  # COMPLETIONS or CHAT
    body: dict[str, Any]
    stream: bool
    max_tokens: int
    model: str | None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest(f"'{name}' must be a positive integer", name)
    return v


def _common(body: Any, path: str, default_max_tokens: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", "n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of is not supported", "best_of")
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the gateway", "kv_transfer_params")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    mt = _positive_int(body, "max_tokens")
    if path == CHAT:
        mt = _positive_int(body, "max_completion_tokens") or mt
    return ParsedRequest(path, body, stream, mt or default_max_tokens, model)


def parse_completion(body: Any, default_max_tokens: int | None = None) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (one prompt: a string or a list of token ids)."""
    p = _common(body, COMPLETIONS, default_max_tokens or _COMPLETIONS_DEFAULT_MAX_TOKENS)
    prompt = p.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        pass
    else:
        raise BadRequest("'prompt' must be one non-empty string or list of token ids", "prompt")
    body2 = dict(p.body, prompt=prompt)
    return ParsedRequest(p.path, body2, p.stream, p.max_tokens, p.model)


def parse_chat(body: Any, default_max_tokens: int) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body."""
    p = _common(body, CHAT, default_max_tokens)
    msgs = p.body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a string 'role'", "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, str | list):
            raise BadRequest("message 'content' must be a string or a list of parts",
                             "messages")
    return p


def engine_bodies(
    p: ParsedRequest, prefill_params: dict[str, Any] | None, decode_params: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bodies for prefill (one token, no stream) and decode (the client's, bounded tokens).

    Decode's ``max_tokens`` is pinned to what the reservation was sized for, so the engine
    can never grow past the reserved blocks.
    """
    dec = dict(p.body)
    dec["max_tokens"] = p.max_tokens
    if p.path == CHAT:
        dec["max_completion_tokens"] = p.max_tokens
    if decode_params is not None:
        dec["kv_transfer_params"] = decode_params
    pre = dict(p.body)
    pre.update(max_tokens=1, stream=False)
    pre.pop("stream_options", None)
    if p.path == CHAT:
        pre["max_completion_tokens"] = 1
    pre.pop("min_tokens", None)
    if prefill_params is not None:
        pre["kv_transfer_params"] = prefill_params
    return pre, dec


class TokenCounter:
    """Counts prompt tokens the way vLLM will tokenize them, with the model's own tokenizer."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._tok: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._tok is None:
                from transformers import AutoTokenizer

                try:
                    self._tok = AutoTokenizer.from_pretrained(self.path)
                except (OSError, ValueError) as exc:
                    raise TokenizerUnavailable(
                        f"cannot load a tokenizer from {self.path}: {exc}"
                    ) from exc
                logger.info("tokenizer loaded from %s", self.path)
            return self._tok

    def load(self) -> None:
        """Load now (it is otherwise loaded on first use)."""
        self._load()

    def count(self, p: ParsedRequest) -> int:
        """Prompt tokens of ``p`` (blocking; run it off the event loop for long prompts)."""
        tok = self._load()
        if p.path == COMPLETIONS:
            prompt = p.body["prompt"]
            if isinstance(prompt, list):
                return len(prompt)
            return len(tok(prompt).input_ids)
        kwargs = {}
        if isinstance(p.body.get("chat_template_kwargs"), dict):
            kwargs = dict(p.body["chat_template_kwargs"])
        try:
            out = tok.apply_chat_template(
                p.body["messages"], add_generation_prompt=p.body.get(
                    "add_generation_prompt", True), tokenize=True, **kwargs
            )
        except Exception as exc:  # the template raises arbitrary errors on odd messages
            raise BadRequest(f"messages do not fit the model's chat template: {exc}",
                             "messages") from exc
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return len(ids)
