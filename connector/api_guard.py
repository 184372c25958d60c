"""ASGI middleware for the engine's API server: refuses malformed kvpush ``kv_transfer_params``.

vLLM loads it with ``--middleware kvpush.connector.api_guard.KVParamsGuard`` (the launcher
adds it for the kvpush connector). A request sent straight to an engine whose params name
kvpush but do not parse gets a 400 naming the problem here, before vLLM's scheduler sees it;
the connector also refuses to act on such params, so the guard is the clear error and not
the only defence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpush.common.wire import WireError, parse_kv_transfer_params

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths whose bodies may carry kv_transfer_params.
_GUARDED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate")


def kv_params_error(body: bytes) -> str | None:
    """Why ``body``'s kvpush ``kv_transfer_params`` are refused; None when they are fine
    (or absent, or not kvpush's: another connector's params pass through)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None  # vLLM answers a body that is not JSON itself
    if not isinstance(doc, dict):
        return None
    raw = doc.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return "kv_transfer_params must be a JSON object"
    if "kvpush" not in raw:
        return None
    try:
        parse_kv_transfer_params(raw)
    except WireError as exc:
        return str(exc)
    return None


class KVParamsGuard:
    """Reads a guarded request's body, refuses bad kvpush params, replays the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in _GUARDED):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        error = kv_params_error(bytes(body))
        if error is not None:
            logger.warning("refused a request with bad kv_transfer_params: %s", error)
            payload = json.dumps({"error": {"message": error, "type": "invalid_request_error",
                                            "param": "kv_transfer_params", "code": 400}})
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload.encode()})
            return

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)
