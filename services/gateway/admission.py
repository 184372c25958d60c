"""Before anything is enqueued: read the body, authenticate, parse, count tokens, admit quota."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request
from redis.exceptions import RedisError

from kvpush.common.prefix_hashes import prefix_hashes
from kvpush.common.quotas import Admission, QuotaExceeded, RequestTooLarge
from kvpush.common.redis_client import ride_out
from kvpush.common.settings import GatewaySettings
from kvpush.common.tenancy import (
    TenancyError,
    Tenant,
    apply_cache_salt,
    authenticate,
    cache_salt,
)
from kvpush.services.gateway.any_engine import responses_prompt_ids
from kvpush.services.gateway.context import DEFAULT_TENANT, RequestCtx
from kvpush.services.gateway.edge import HTTPFailure, redis_unavailable
from kvpush.services.gateway.openai_api import (
    COMPLETIONS,
    RESPONSES,
    BadRequest,
    ParsedRequest,
    TokenCounter,
    fit_context,
    parse_chat,
    parse_completion,
    parse_responses,
)
from kvpush.services.gateway.shedding import Overloaded
from kvpush.services.gateway.validation import ClientGone, parse_json, read_body

if TYPE_CHECKING:
    from kvpush.services.gateway.state import Gateway

# Chat and responses requests without max_tokens get this bound (the reservation must be
# finite).
CHAT_DEFAULT_MAX_TOKENS = 256


async def read_request_body(settings: GatewaySettings, request: Request) -> bytes:
    """The request body within the size and time bounds; a 4xx :class:`HTTPFailure` else."""
    try:
        return await read_body(request, settings.gateway_max_body_bytes,
                               settings.gateway_body_timeout_s)
    except BadRequest as exc:
        raise HTTPFailure.bad_request(exc) from exc
    except ClientGone as exc:
        raise HTTPFailure(499, "client_disconnect", "client closed the connection",
                          metric="client_disconnect") from exc


async def authenticate_key(gw: Gateway, authorization: str | None) -> Tenant:
    """The tenant of the request's API key (``default`` while auth is off); 401 else."""
    if not gw.s.gateway_auth:
        return DEFAULT_TENANT
    try:
        return await ride_out(lambda: authenticate(gw.redis, authorization, keys=gw.keys,
                                                   cache=gw.auth_cache),
                              gw.s.gateway_redis_outage_s, "authenticating")
    except TenancyError as exc:
        raise HTTPFailure(401, "authentication_error", f"invalid API key: {exc}",
                          metric="unauthorized",
                          headers={"WWW-Authenticate": "Bearer"}) from exc
    except RedisError as exc:
        raise redis_unavailable(exc) from exc


def parse_body(settings: GatewaySettings, raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 when it is not one or nests too deep."""
    try:
        return parse_json(raw, settings.gateway_max_json_depth)
    except BadRequest as exc:
        raise HTTPFailure.bad_request(exc) from exc


def parse_request(settings: GatewaySettings, body: dict[str, Any], path: str
                  ) -> ParsedRequest:
    """The OpenAI request in ``body`` for the endpoint ``path``; 400 when it is invalid."""
    try:
        if path == COMPLETIONS:
            return parse_completion(body, max_tokens_cap=settings.gateway_max_tokens)
        if path == RESPONSES:
            return parse_responses(body, CHAT_DEFAULT_MAX_TOKENS, settings.gateway_max_tokens)
        return parse_chat(body, CHAT_DEFAULT_MAX_TOKENS, settings.gateway_max_tokens)
    except BadRequest as exc:
        raise HTTPFailure.bad_request(exc) from exc


async def admit_quota(gw: Gateway, tenant: Tenant, prompt_tokens: int,
                      max_tokens: int) -> Admission | None:
    """Admit the request under its tenant's quotas (nothing to admit while auth is off)."""
    if not gw.s.gateway_auth:
        return None  # one anonymous tenant: nothing to share fairly
    try:
        # A reply lost in an outage can admit twice: the lost lease expires on its own and
        # the token count is charged once too often, which beats failing the request.
        return await ride_out(lambda: gw.limiter.admit(tenant, prompt_tokens, max_tokens),
                              gw.s.gateway_redis_outage_s, "admitting")
    except RequestTooLarge as exc:
        raise HTTPFailure(400, "invalid_request_error", str(exc),
                          metric=f"quota_{exc.limit_name}") from exc
    except QuotaExceeded as exc:
        raise HTTPFailure(429, "rate_limit_exceeded", str(exc), exc.retry_after_s or 1.0,
                          metric=f"quota_{exc.limit_name}") from exc
    except RedisError as exc:
        raise redis_unavailable(exc) from exc


_INLINE_IDS = 8192
"""Longest token-id prompt checked on the event loop (longer ones go to a thread)."""
_INLINE_CHARS = 512
"""Longest text prompt tokenized on the event loop (~150 us; longer ones go to a thread,
whose hop costs more than tokenizing a short prompt)."""


def set_tenant(ctx: RequestCtx, tenant: Tenant) -> None:
    """Name the request's tenant in ``ctx`` and on its span."""
    ctx.tenant = tenant.id
    ctx.span.set_attribute("kvpush.tenant", tenant.id)


async def admit(gw: Gateway, ctx: RequestCtx, tenant: Tenant, parsed: ParsedRequest
                ) -> ParsedRequest:
    """Everything an authenticated, parsed request must pass before it is enqueued; fills
    in ``ctx`` (prompt tokens, quota admission) and returns the request as the engines will
    get it."""
    shed_if_late(gw, ctx, tenant, 0)  # before the tokenizer: shedding must cost nothing
    parsed = await prepare(gw, ctx, tenant, parsed)
    # Checked and counted with no await between: a burst cannot all pass the check before
    # any of it is in the backlog. (A quota refusal below takes it out again: finish.)
    shed_if_late(gw, ctx, tenant, ctx.prompt_tokens)
    enter_backlog(gw, ctx, tenant, ctx.prompt_tokens)
    ctx.admission = await admit_quota(gw, tenant, ctx.prompt_tokens, parsed.max_tokens)
    return parsed


def shed_if_late(gw: Gateway, ctx: RequestCtx, tenant: Tenant, prompt_tokens: int) -> None:
    """Shed the request now (``gateway_shed_status`` with a Retry-After) when its estimated
    wait for a first token passes the objective (services/gateway/shedding.py)."""
    sh = gw.shedder
    if sh is None:
        return
    try:
        sh.check(tenant.id, tenant.weight, prompt_tokens)
    except Overloaded as exc:
        gw.slo.shed()
        gw.metrics.est_wait.set(exc.estimate_s)
        ctx.span.set_attribute("kvpush.shed.estimated_wait_s", round(exc.estimate_s, 3))
        status = gw.s.gateway_shed_status
        raise HTTPFailure(status, "rate_limit_exceeded" if status == 429 else
                          "service_unavailable", str(exc), exc.retry_after_s,
                          metric="shed") from exc


def enter_backlog(gw: Gateway, ctx: RequestCtx, tenant: Tenant, prompt_tokens: int) -> None:
    """Count an admitted request in the shedder's backlog until its first token."""
    sh = gw.shedder
    if sh is None:
        return
    ctx.backlog = sh.admit(tenant.id, tenant.weight, prompt_tokens, ctx.arrived)
    gw.metrics.backlog.set(sh.backlog_tokens)
    gw.metrics.est_wait.set(sh.estimate_s())


async def prepare(gw: Gateway, ctx: RequestCtx, tenant: Tenant, parsed: ParsedRequest
                  ) -> ParsedRequest:
    """A parsed request made ready for the engines, with no side effect anywhere: the model
    checked, the prompt counted (and hashed for placement) into ``ctx``, max_tokens fitted
    to the context, the tenant's cache salt set."""
    model = await gw.resolve_model()
    if parsed.model is not None and parsed.model != model:
        raise HTTPFailure(404, "model_not_found", f"model {parsed.model!r} is not served "
                          f"here (serving {model!r})", param="model")
    counter = await gw.token_counter()
    try:
        salt = _engine_salt(gw, tenant, parsed) if gw.s.gateway_prefix_affinity else None
        prompt = parsed.body.get("prompt") if parsed.path == COMPLETIONS else None
        if parsed.path == RESPONSES:
            # Its input items render through the engine's own code: an engine counts it.
            ids = await responses_prompt_ids(gw, parsed.body)
            ctx.prefix_hashes = prefix_hashes(ids, salt) if salt is not None else []
        elif (isinstance(prompt, list) and len(prompt) <= _INLINE_IDS) or (
                isinstance(prompt, str) and len(prompt) <= _INLINE_CHARS):
            # Token ids need no tokenizer: checking and hashing 512 takes ~20 us, less
            # than the hop to a thread and back; so does tokenizing a short text.
            ids, ctx.prefix_hashes = _prompt_ids(counter, parsed, salt)
        else:
            # Off the event loop: a long text, or a chat template over many messages or
            # tools, takes long enough to stall every other request.
            ids, ctx.prefix_hashes = await asyncio.to_thread(_prompt_ids, counter, parsed,
                                                             salt)
        if gw.s.gateway_forward_token_ids and isinstance(prompt, str):
            # Tokenized once, here: both engines get the ids and skip their own pass.
            parsed.body["prompt"] = ids
        prompt_tokens = len(ids)
        ctx.prompt_ids = ids
        parsed = fit_context(parsed, prompt_tokens,
                             gw.s.gateway_max_model_len or counter.model_max_length)
    except BadRequest as exc:
        raise HTTPFailure.bad_request(exc) from exc
    ctx.prompt_tokens = prompt_tokens
    ctx.span.set_attributes({"gen_ai.request.model": model,
                             "gen_ai.request.max_tokens": parsed.max_tokens,
                             "gen_ai.usage.input_tokens": prompt_tokens})
    if gw.s.gateway_auth:
        # Both legs get the tenant's salt: prefix-cache blocks are shared within the
        # tenant only (and a client cannot pick another tenant's salt).
        apply_cache_salt(parsed.body, tenant)
    return parsed


def _engine_salt(gw: Gateway, tenant: Tenant, parsed: ParsedRequest) -> str:
    """The ``cache_salt`` the engines will see for this request, which their prefix caches
    (and so their KV events) are salted with: the tenant's under auth, else the client's."""
    if gw.s.gateway_auth:
        return cache_salt(tenant)
    salt = parsed.body.get("cache_salt")
    return salt if isinstance(salt, str) else ""


def _prompt_ids(counter: TokenCounter, parsed: ParsedRequest, salt: str | None
                ) -> tuple[list[int], list[int]]:
    """The prompt's token ids and, with a ``salt``, its prefix hashes (blocking)."""
    ids = counter.prompt_ids(parsed)
    return ids, prefix_hashes(ids, salt) if salt is not None else []
