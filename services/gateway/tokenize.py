"""``/tokenize`` and ``/detokenize``: forwarded to a live engine, so the answer is vLLM's own.

The gateway's tokenizer counts prompts, but vLLM's endpoints take options (chat messages
and templates, special tokens, token strings) whose every answer would have to match the
engine's; an engine that serves the model answers them exactly. The caller is
authenticated as for completions, the body is bounded and must be a JSON object, and an
engine that fails is left for another one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
from fastapi import Request
from fastapi.responses import Response

from kvpush.services.gateway.admission import authenticate_key, parse_body, read_request_body
from kvpush.services.gateway.any_engine import ENGINES_TRIED, TIMEOUT_S, engine_urls
from kvpush.services.gateway.edge import HTTPFailure
from kvpush.services.gateway.engines import ReplyTooLarge

if TYPE_CHECKING:
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

PATHS = ("/tokenize", "/detokenize")


async def forward(gw: Gateway, request: Request, path: str) -> Response:
    """Answer ``path`` with a live engine's reply; errors as OpenAI error objects."""
    try:
        await authenticate_key(gw, request.headers.get("authorization"))
        raw = await read_request_body(gw.s, request)
        body = parse_body(gw.s, raw)
        urls = await engine_urls(gw)
        for url in urls[:ENGINES_TRIED]:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    status, content = await gw.http.post(f"{url}{path}", body, {})
            except (aiohttp.ClientError, ReplyTooLarge, TimeoutError) as exc:
                logger.warning("%s on %s failed: %s", path, url, exc)
                continue
            if status >= 500:
                logger.warning("%s on %s answered HTTP %d", path, url, status)
                continue
            # vLLM's own answer, its 4xx included (a bad field, an unknown model).
            return Response(content, status, media_type="application/json")
        raise HTTPFailure(502, "bad_gateway", "no engine answered; retry later", 1.0,
                          metric=f"engine_{path.strip('/')}")
    except HTTPFailure as exc:
        gw.metrics.errors.labels(exc.metric, "-").inc()
        return exc.response()
