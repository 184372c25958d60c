"""Calls that any live engine of the model answers alike: which engines there are, and the
token ids vLLM renders a ``/v1/responses`` request into (its count sizes the reservation)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import TYPE_CHECKING, Any

import aiohttp
from redis.exceptions import RedisError

from kvpush.services.gateway.edge import HTTPFailure, redis_unavailable
from kvpush.services.gateway.engines import EngineFailed, ReplyTooLarge

if TYPE_CHECKING:
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

RENDER = "/v1/responses/render"
# Tried in turn when one fails (refused connection, reset, 5xx).
ENGINES_TRIED = 2
TIMEOUT_S = 30.0


async def engine_urls(gw: Gateway) -> list[str]:
    """URLs of live engines in random order, those this gateway saw fail lately last."""
    try:
        ids = [e.decode() for e in await gw.redis.zrange(gw.keys.engines(), 0, -1)]
        pipe = gw.redis.pipeline(transaction=False)
        for e in ids:
            pipe.hget(gw.keys.engine(e), "url")
        urls = await pipe.execute() if ids else []
    except RedisError as exc:
        raise redis_unavailable(exc) from exc
    if not ids:
        raise HTTPFailure(503, "service_unavailable", "no engine is up yet", 1.0,
                          metric="no_engine")
    avoided = set(gw.avoided_engines())
    pairs = [(e in avoided, random.random(), u.decode()) for e, u in zip(ids, urls, strict=True)
             if u]
    return [u for _, _, u in sorted(pairs)]


async def responses_prompt_ids(gw: Gateway, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as an engine renders ``body`` (a ``/v1/responses`` request):
    the engines run the same renderer on the same input, so the count is theirs. The
    engine's refusal of the input is the client's 400."""
    request = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    for url in (await engine_urls(gw))[:ENGINES_TRIED]:
        try:
            async with asyncio.timeout(TIMEOUT_S):
                status, content = await gw.http.post(f"{url}{RENDER}", request, {})
        except (aiohttp.ClientError, ReplyTooLarge, TimeoutError) as exc:
            logger.warning("rendering a responses request on %s failed: %s", url, exc)
            continue
        if status in (400, 404, 413, 422):
            failed = EngineFailed("render", None, f"HTTP {status}", status, content)
            raise HTTPFailure(400 if status != 413 else 413, "invalid_request_error",
                              failed.client_message(), metric="bad_request", param="input")
        if status >= 400:
            logger.warning("rendering a responses request on %s answered HTTP %d", url,
                           status)
            continue
        try:
            ids = json.loads(content)["token_ids"]
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("render on %s answered no token ids: %s", url, exc)
            continue
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return ids
        logger.warning("render on %s answered malformed token ids", url)
    raise HTTPFailure(502, "bad_gateway", "no engine could count the input; retry later",
                      1.0, metric="engine_render")
