"""The gateway's HTTP edge: error responses, header limit, stream write timeout, uvicorn bounds."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpush.common.settings import GatewaySettings
from kvpush.services.gateway.openai_api import error_body
from kvpush.services.gateway.validation import BadRequest

logger = logging.getLogger(__name__)


class HTTPFailure(Exception):
    """A request ends with an HTTP error for the client."""

    def __init__(self, status: int, kind: str, message: str,
                 retry_after_s: float | None = None, metric: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.retry_after_s = retry_after_s
        self.metric = metric or kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        """The OpenAI-style error response."""
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            # Rounded up: retrying at the advertised time must be able to succeed.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(error_body(str(self), self.kind, self.status, self.param),
                            self.status, headers=headers)

    @classmethod
    def bad_request(cls, exc: BadRequest) -> HTTPFailure:
        """The client's error, naming the field at fault."""
        return cls(exc.status, "invalid_request_error", str(exc), metric="bad_request",
                   param=exc.param)


def redis_unavailable(exc: RedisError) -> HTTPFailure:
    """A 503 the client may retry; the Redis error itself goes to the log only."""
    logger.warning("Redis call failed: %s", exc)
    return HTTPFailure(503, "service_unavailable", "service temporarily unavailable", 1.0,
                       metric="redis")


def sse_error(message: str, kind: str, code: int) -> bytes:
    """An OpenAI error as one SSE event (the status line of a stream is already out)."""
    return b"data: " + json.dumps(error_body(message, kind, code)).encode() + b"\n\n"


def _headers_too_large(limit: int) -> bytes:
    """The OpenAI-shaped body of a 431 for a header block over ``limit`` bytes."""
    return json.dumps(error_body(f"request headers are larger than {limit} bytes",
                                 "invalid_request_error", 431)).encode()


class HeaderLimit:
    """ASGI middleware: a request whose header block is over ``max_bytes`` gets HTTP 431.

    Both parsers' protocols below already refuse blocks over twice the limit while reading
    them; this check gives the ones in between the same answer.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                body = _headers_too_large(self.max_bytes)
                await send({"type": "http.response.start", "status": 431, "headers": [
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class RelayResponse(StreamingResponse):
    """A streaming response that gives up on a client that stops reading.

    uvicorn's ``send`` waits while the socket's buffers are full; past ``write_timeout_s``
    the stream is closed (its ``finally`` releases the reservation and the quota lease) and
    the response is left incomplete, so uvicorn drops the connection.
    """

    def __init__(self, content: Any, write_timeout_s: float,
                 on_write_timeout: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.on_write_timeout = on_write_timeout

    async def stream_response(self, send: Send) -> None:
        """Stream with every ``send`` bounded by the write timeout.

        One watchdog timer per stream instead of a timeout per ``send``: a send almost
        never waits, and arming and cancelling a timer for each token was a fifth of the
        relay's CPU. The watchdog fires every ``write_timeout_s`` and cancels the stream
        only while a send has been pending that long."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        limit = self.write_timeout_s
        pending_since: float | None = None
        timed_out = False
        watchdog: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal watchdog, timed_out
            wait = limit
            if pending_since is not None:
                waited = loop.time() - pending_since
                if waited >= limit:
                    timed_out = True
                    task.cancel()
                    return
                wait = limit - waited
            watchdog = loop.call_later(wait, check)

        async def bounded(message: Message) -> None:
            nonlocal pending_since
            pending_since = loop.time()
            await send(message)
            pending_since = None

        watchdog = loop.call_later(limit, check)
        try:
            await super().stream_response(bounded)
        except asyncio.CancelledError:
            if not timed_out or task.uncancel() > 0:
                raise  # cancelled from outside too (the client left, the server stops)
            self.on_write_timeout()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            watchdog.cancel()


class _HeaderDeadline:
    """Mixin for uvicorn's HTTP protocols: a request's header block must arrive within
    ``header_timeout_s`` of its first byte (or of the connection opening).

    uvicorn bounds idle keep-alive connections but not a client that sends its headers a
    byte at a time (slow-loris): each such connection would be held forever and count
    against ``limit_concurrency``. The body has its own deadline in the app.
    """

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s,
                                                      self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.info("closing a connection that sent no complete header block in %ss",
                        self.header_timeout_s)
            self.transport.close()


class _BoundedH11(_HeaderDeadline, H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 leaves the client in IDLE until a whole request line + headers is parsed.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        # Between requests the keep-alive timeout bounds the idle connection.
        self._disarm_header_deadline()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)


class _BoundedHttpTools(_HeaderDeadline, HttpToolsProtocol):
    max_header_block: int = 64 * 1024
    """Most bytes read into an unfinished header block before the connection gets 431."""
    _header_bytes = 0
    _in_header_block = True
    _block_ended = False  # a header block or a message ended within the current read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        self._block_ended = False
        super().data_received(data)
        # httptools holds an unfinished header (one endless value too) until it ends and
        # only then calls back: bound what it may hold, as h11's incomplete-event limit does.
        # Only reads that fell wholly inside one header block count: a read in which a
        # message ended may also hold the next block's start, at most one read of slack.
        if self._in_header_block and not self._block_ended \
                and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_block:
                logger.info("closing a connection whose header block passed %d bytes",
                            self.max_header_block)
                body = _headers_too_large(self.max_header_block)
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        self._in_header_block = False
        self._block_ended = True
        self._header_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_header_block = True  # what comes next on the connection is a header block
        self._block_ended = True
        self._header_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)


def server_config(app: Any, settings: GatewaySettings, port: int | None = None,
                  host: str | None = None) -> uvicorn.Config:
    """uvicorn config with the gateway's connection, keep-alive, header-size and
    header-time bounds."""
    base = _BoundedH11 if settings.gateway_http == "h11" else _BoundedHttpTools
    protocol = type(base.__name__, (base,),
                    {"header_timeout_s": settings.gateway_header_timeout_s,
                     "max_header_block": 2 * settings.gateway_max_header_bytes})
    return uvicorn.Config(
        app, host=host or settings.gateway_host, port=port or settings.gateway_port,
        http=protocol, lifespan="on", access_log=False, log_level="warning",
        timeout_keep_alive=settings.gateway_keepalive_s,
        limit_concurrency=settings.gateway_max_connections,
        h11_max_incomplete_event_size=2 * settings.gateway_max_header_bytes,
    )
