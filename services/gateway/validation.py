"""Strict schema for client request bodies: every field checked before anything is reserved."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

logger = logging.getLogger(__name__)

_I32 = 2**31 - 1
_I64_MIN, _U64_MAX = -(2**63), 2**64 - 1
# Oversized bodies are drained up to this multiple of the limit so an honest client that is
# still uploading reads its 413 instead of a reset connection; beyond it the connection goes.
_DRAIN_FACTOR = 4

CHAT_TEMPLATE_KWARGS: dict[str, type] = {
    "add_generation_prompt": bool,
    "continue_final_message": bool,
    "enable_thinking": bool,
    "thinking": bool,
    "reasoning_effort": str,
}
"""``chat_template_kwargs`` a client may set, with their types. Everything else (``chat_template``,
``tokenize``, ``truncation``, ``max_length``, ``padding``, any tokenizer option) would change how
the prompt is tokenized or rendered, so the gateway's count would no longer match the engine's."""


class BadRequest(ValueError):
    """The client's request is malformed or asks for something the gateway cannot serve."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BodyTooLarge(BadRequest):
    """The request body is over ``gateway_max_body_bytes``."""

    status = 413


class BodyTimeout(BadRequest):
    """The client did not send its whole body within ``gateway_body_timeout_s``."""

    status = 408


class ClientGone(Exception):
    """The client closed the connection while its body was being read."""


def param_name(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role`` (the OpenAI ``param``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# -- raw body ---------------------------------------------------------------------------


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, at most ``limit`` bytes, sent within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or len(declared) > 18):
        raise BadRequest("invalid Content-Length header", "Content-Length")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            if declared is not None and int(declared) > limit:
                await _drain(request, limit * _DRAIN_FACTOR)
                raise BodyTooLarge(f"request body is larger than {limit} bytes")
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    await _drain(request, limit * _DRAIN_FACTOR - size)
                    raise BodyTooLarge(f"request body is larger than {limit} bytes")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise BodyTimeout(f"request body not received within {timeout_s:g} s") from exc
    except ClientDisconnect as exc:
        raise ClientGone() from exc
    return b"".join(chunks)


async def _drain(request: Request, budget: int) -> None:
    async for chunk in request.stream():
        budget -= len(chunk)
        if budget <= 0:
            return


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object: finite numbers, 64-bit integers, at most ``max_depth`` deep."""
    try:
        body = json.loads(raw)
    except RecursionError as exc:
        raise BadRequest(f"JSON nesting is deeper than {max_depth} levels") from exc
    except ValueError as exc:
        where = ""
        if isinstance(exc, json.JSONDecodeError):
            where = f" (line {exc.lineno}, column {exc.colno})"
        raise BadRequest(f"request body is not valid JSON{where}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    check_json_values(body, max_depth)
    return body


def check_json_values(body: dict[str, Any], max_depth: int) -> None:
    """Refuse NaN, Infinity (Python's json reads both, and ``1e999``), integers beyond 64 bits
    and nesting deeper than ``max_depth``, naming the field."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            raise BadRequest(f"'{path[0]}' nests deeper than {max_depth} levels",
                             str(path[0]))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(v, dict | list):
                stack.append((v, (*path, k)))
            elif isinstance(v, float):
                if not math.isfinite(v):
                    p = param_name((*path, k))
                    raise BadRequest(f"'{p}' must be a finite number", p)
            elif isinstance(v, int) and not isinstance(v, bool) \
                    and not _I64_MIN <= v <= _U64_MAX:
                p = param_name((*path, k))
                raise BadRequest(f"'{p}' is out of range", p)


# -- schema -----------------------------------------------------------------------------


def _as_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


def _content(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) for p in v):
        return v
    raise ValueError("must be a string or a list of content parts")


def _tool_choice(v: Any) -> Any:
    if v is None or isinstance(v, str | dict):
        return v
    raise ValueError("must be a string or an object")


Stop = Annotated[list[Annotated[str, Field(max_length=1024)]], BeforeValidator(_as_list),
                 Field(max_length=16)]
Int32 = Annotated[int, Field(ge=-_I32 - 1, le=_I32)]
Tokens = Annotated[int, Field(ge=1, le=_I32)]
Name = Annotated[str, Field(max_length=256)]


class _Strict(BaseModel):
    # Unknown fields (vLLM's extensions) pass through for the engine to check; the known
    # ones must have exactly their type: no "1" for 1, no 1.0 for 1, no NaN.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Knobs(_Strict):
    """The sampling knobs every generating endpoint takes, each checked alike."""

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_I32)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=_I64_MIN, le=2**63 - 1)] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=_I32)]],
                              Field(max_length=256)] | None = None


class _Sampling(_Knobs):
    model: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Tokens = 1
    best_of: Int32 | None = None
    max_tokens: Tokens | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_I32)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=1024)] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_I32)] | None = None
    user: Name | None = None
    cache_salt: Name | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """``/v1/completions``; ``prompt`` is checked by the parser (one string or token list)."""

    prompt: Any = None
    echo: bool | None = None
    suffix: Annotated[str, Field(max_length=65536)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class Message(_Strict):
    """One chat message."""

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Annotated[Any, BeforeValidator(_content)] = None
    name: Name | None = None
    tool_call_id: Name | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None


class ChatRequest(_Sampling):
    """``/v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=10000)]
    max_completion_tokens: Tokens | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Annotated[Any, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    documents: Annotated[list[dict[str, str]], Field(max_length=128)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning_effort: Annotated[str, Field(max_length=32)] | None = None


def _responses_input(v: Any) -> Any:
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(isinstance(item, dict) for item in v):
        return v
    raise ValueError("must be a non-empty string or a non-empty list of input items")


class ResponsesRequest(_Knobs):
    """``/v1/responses`` (no ``background``); a ``previous_response_id`` names a response
    the gateway stored (services/gateway/conversations.py)."""

    model: Name | None = None
    input: Annotated[Any, BeforeValidator(_responses_input)]
    instructions: Annotated[str, Field(max_length=1 << 20)] | None = None
    stream: bool = False
    max_output_tokens: Tokens | None = None
    ignore_eos: bool | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Annotated[Any, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: Annotated[dict[str, Any], Field(max_length=64)] | None = None
    include: Annotated[list[Name], Field(max_length=32)] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: Name | None = None
    user: Name | None = None
    cache_salt: Name | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncation: Annotated[str, Field(max_length=32)] | None = None


# Fields a client may never set: the gateway owns them, or they change how the engine
# renders the prompt behind the gateway's token count.
_FORBIDDEN = {
    "kv_transfer_params": "kv_transfer_params is set by the gateway",
    "ec_transfer_params": "ec_transfer_params is set by the gateway",
    "request_id": "request ids are given by the gateway",
    "chat_template": "a custom chat_template is not accepted",
    "prompt_embeds": "prompt_embeds are not served: send text or token ids",
}


def _no_beam_search(body: dict[str, Any]) -> None:
    # vLLM runs a beam search as many requests inside one engine, which no P/D
    # placement can hold.
    if body.get("use_beam_search") not in (None, False):
        raise BadRequest("use_beam_search is not served through P/D", "use_beam_search")


def validate(model: type[_Strict], body: dict[str, Any]) -> Any:
    """``body`` checked against ``model``; the first problem becomes a :class:`BadRequest`."""
    for name, why in _FORBIDDEN.items():
        if name in body:
            raise BadRequest(why, name)
    _no_beam_search(body)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        p = param_name(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"'{p}': {msg}" if p else msg, p or None) from None
    if isinstance(req, ChatRequest | ResponsesRequest) and req.chat_template_kwargs:
        check_chat_template_kwargs(req.chat_template_kwargs)
    return req


def check_chat_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Only the allowlisted keys (:data:`CHAT_TEMPLATE_KWARGS`), each of its type."""
    for key, value in kwargs.items():
        kind = CHAT_TEMPLATE_KWARGS.get(key)
        p = f"chat_template_kwargs.{key}"
        if kind is None:
            raise BadRequest(f"'{p}' is not an accepted chat template option (accepted: "
                             f"{', '.join(sorted(CHAT_TEMPLATE_KWARGS))})", p)
        if not isinstance(value, kind) or (kind is str and len(value) > 64):
            raise BadRequest(f"'{p}' must be a {kind.__name__}", p)
