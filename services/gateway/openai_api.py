"""OpenAI request parsing for the gateway: validation, token counting, engine bodies, errors."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.services.gateway.validation import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    ResponsesRequest,
    check_chat_template_kwargs,
    validate,
)

__all__ = ["BadRequest", "ParsedRequest", "TokenCounter", "TokenizerUnavailable",
           "engine_bodies", "error_body", "fit_context", "parse_chat", "parse_completion",
           "parse_responses", "split_batch"]

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"

# The field that carries the prompt, by endpoint (named in errors about its length).
_PROMPT_FIELD = {COMPLETIONS: "prompt", CHAT: "messages", RESPONSES: "input"}
# Completions default to 16 tokens in the OpenAI API; chat has no fixed default.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_I32 = 2**31 - 1
_GREEDY = 1e-5  # a temperature below this is greedy sampling (vLLM's _SAMPLING_EPS)
# A tokenizer states no real context length when it reports more than this.
_NO_MODEL_MAX_LENGTH = 10**7


class TokenizerUnavailable(RuntimeError):
    """No tokenizer could be loaded to count prompt tokens."""


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request and what the scheduler needs to know about it."""

    path: str  # COMPLETIONS, CHAT or RESPONSES
    body: dict[str, Any]
    stream: bool
    max_tokens: int
    model: str | None
    max_tokens_given: bool = True  # False: max_tokens is the default, and may be lowered
    n: int = 1  # choices asked for (services/gateway/fanout.py serves more than one)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _common(req: Any, body: dict[str, Any], path: str, default_max_tokens: int,
            max_tokens_cap: int) -> ParsedRequest:
    if req.n > 1 and req.temperature is not None and req.temperature < _GREEDY:
        # vLLM's own rule: n greedy samples would all be the same one.
        raise BadRequest(f"n must be 1 when using greedy sampling, got {req.n}", "n")
    name, mt = "max_tokens", req.max_tokens
    if path == CHAT and req.max_completion_tokens is not None:
        name, mt = "max_completion_tokens", req.max_completion_tokens
    if mt is not None and mt > max_tokens_cap:
        raise BadRequest(f"'{name}' must be at most {max_tokens_cap}", name)
    if req.min_tokens is not None and req.min_tokens > (mt or default_max_tokens):
        raise BadRequest(f"'min_tokens' must not exceed '{name}'", "min_tokens")
    return ParsedRequest(path, body, req.stream, mt or min(default_max_tokens, max_tokens_cap),
                         req.model, mt is not None, req.n)


def parse_completion(body: dict[str, Any], default_max_tokens: int | None = None,
                     max_tokens_cap: int = _I32) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (one prompt: a string or a list of token ids)."""
    req = validate(CompletionRequest, body)
    p = _common(req, body, COMPLETIONS, default_max_tokens or _COMPLETIONS_DEFAULT_MAX_TOKENS,
                max_tokens_cap)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _I32 for t in prompt
    ):
        pass
    else:
        raise BadRequest("'prompt' must be one non-empty string or list of token ids", "prompt")
    return dataclasses.replace(p, body=dict(body, prompt=prompt))


def split_batch(body: Any, max_prompts: int) -> list[dict[str, Any]] | None:
    """The per-prompt bodies of a batched completions request (``prompt`` a list of two or
    more strings or token-id lists, as vLLM takes it); None for a single prompt, which
    :func:`parse_completion` checks. Each body is the request with one prompt."""
    if not isinstance(body, dict):
        return None
    prompts = body.get("prompt")
    if not isinstance(prompts, list) or len(prompts) < 2:
        return None
    if all(isinstance(x, str) for x in prompts) or all(isinstance(x, list) for x in prompts):
        if len(prompts) > max_prompts:
            raise BadRequest(f"'prompt' batches {len(prompts)} prompts; at most "
                             f"{max_prompts} choices are served in one request", "prompt")
        return [dict(body, prompt=x) for x in prompts]
    if any(isinstance(x, str | list) for x in prompts):
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of "
                         "either strings or token-id lists (not both)", "prompt")
    return None  # a list of token ids, or something parse_completion refuses


def parse_responses(body: dict[str, Any], default_max_tokens: int,
                    max_tokens_cap: int = _I32) -> ParsedRequest:
    """Validate a ``/v1/responses`` body. A ``previous_response_id`` is expanded by
    services/gateway/conversations.py afterwards; ``background`` is refused (a response
    computed unseen and polled for is not served)."""
    req = validate(ResponsesRequest, body)
    assert isinstance(req, ResponsesRequest)
    if req.background:
        raise BadRequest("background responses are not served: stream instead",
                         "background")
    mt = req.max_output_tokens
    if mt is not None and mt > max_tokens_cap:
        raise BadRequest(f"'max_output_tokens' must be at most {max_tokens_cap}",
                         "max_output_tokens")
    return ParsedRequest(RESPONSES, body, req.stream, mt or min(default_max_tokens,
                                                                 max_tokens_cap),
                         req.model, mt is not None)


def parse_chat(body: dict[str, Any], default_max_tokens: int,
               max_tokens_cap: int = _I32) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body."""
    req = validate(ChatRequest, body)
    assert isinstance(req, ChatRequest)
    if req.continue_final_message and req.add_generation_prompt:
        raise BadRequest("'continue_final_message' needs 'add_generation_prompt': false",
                         "continue_final_message")
    return _common(req, body, CHAT, default_max_tokens, max_tokens_cap)


def fit_context(p: ParsedRequest, prompt_tokens: int, context: int | None) -> ParsedRequest:
    """``p`` with a default max_tokens lowered to what the context has left; a request that
    cannot fit is the client's error, named by its field."""
    if context is None:
        return p
    if prompt_tokens >= context:
        raise BadRequest(f"the prompt is {prompt_tokens} tokens; the model's context is "
                         f"{context}", _PROMPT_FIELD[p.path])
    room = context - prompt_tokens
    if p.max_tokens <= room:
        return p
    if not p.max_tokens_given:
        return dataclasses.replace(p, max_tokens=room)
    name = "max_output_tokens" if p.path == RESPONSES else \
        "max_completion_tokens" if "max_completion_tokens" in p.body else "max_tokens"
    raise BadRequest(f"prompt ({prompt_tokens} tokens) plus '{name}' ({p.max_tokens}) "
                     f"exceed the model's context ({context})", name)


def engine_bodies(
    p: ParsedRequest, prefill_params: dict[str, Any] | None, decode_params: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bodies for prefill (one token, no stream) and decode (the client's, bounded tokens).

    Decode's ``max_tokens`` is pinned to what the reservation was sized for, so the engine
    can never grow past the reserved blocks.
    """
    dec = dict(p.body)
    pre = dict(p.body)
    if p.path == RESPONSES:
        dec["max_output_tokens"] = p.max_tokens
        pre.update(max_output_tokens=1, stream=False)
    else:
        dec["max_tokens"] = p.max_tokens
        pre.update(max_tokens=1, stream=False)
    if p.path == CHAT:
        dec["max_completion_tokens"] = p.max_tokens
        pre["max_completion_tokens"] = 1
    if decode_params is not None:
        dec["kv_transfer_params"] = decode_params
    pre.pop("stream_options", None)
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

    @property
    def model_max_length(self) -> int | None:
        """The context length the tokenizer states, if it states a real one."""
        n = getattr(self._load(), "model_max_length", None)
        return n if isinstance(n, int) and 0 < n < _NO_MODEL_MAX_LENGTH else None

    def count(self, p: ParsedRequest) -> int:
        """Prompt tokens of ``p``, tools and documents included (blocking: call it in a
        thread)."""
        return len(self.prompt_ids(p))

    def prompt_ids(self, p: ParsedRequest) -> list[int]:
        """The prompt's token ids as vLLM will make them, tools and documents included
        (blocking: call it in a thread)."""
        tok = self._load()
        if p.path == COMPLETIONS:
            prompt = p.body["prompt"]
            if isinstance(prompt, list):
                vocab = max(len(tok), getattr(tok, "vocab_size", 0) or 0)
                if max(prompt) >= vocab:
                    raise BadRequest(f"'prompt' has a token id outside the vocabulary "
                                     f"(0..{vocab - 1})", "prompt")
                return list(prompt)
            return self.encode_completion(p)
        return self._chat_ids(tok, p.body)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens (blocking: call it in a thread)."""
        return list(self._load()(text, add_special_tokens=False).input_ids)

    def encode_completion(self, p: ParsedRequest) -> list[int]:
        """Token ids of a completion's text prompt, as vLLM's completions endpoint would
        make them (blocking: call it in a thread)."""
        tok = self._load()
        special = p.body.get("add_special_tokens", True)
        return list(tok(p.body["prompt"], add_special_tokens=special is not False).input_ids)

    @staticmethod
    def _chat_ids(tok: Any, body: dict[str, Any]) -> list[int]:
        # The same template arguments vLLM renders with: the request's own flags, then the
        # allowlisted chat_template_kwargs over them.
        kwargs: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
        }
        extra = body.get("chat_template_kwargs") or {}
        check_chat_template_kwargs(extra)
        kwargs.update(extra)
        from jinja2 import TemplateError

        try:
            out = tok.apply_chat_template(
                body["messages"], tools=body.get("tools"), documents=body.get("documents"),
                tokenize=True, **kwargs)
        except TemplateError as exc:
            # Templates reject odd conversations with raise_exception("..."): their words.
            raise BadRequest(f"messages do not fit the model's chat template: "
                             f"{str(exc)[:300]}", "messages") from exc
        except Exception as exc:  # the template or tokenizer choked on an odd structure
            logger.info("chat template failed: %s: %s", type(exc).__name__, exc)
            raise BadRequest("messages do not fit the model's chat template",
                             "messages") from exc
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)
