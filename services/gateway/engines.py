"""Calls to the engines: the HTTP client, one JSON POST, one SSE stream, and what a failed
call means."""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

# The engines' own API servers close idle connections after 5 s (uvicorn's default): a
# pooled connection must be dropped before that, or a request may go out on one the engine
# is closing and fail the engine for nothing.
_KEEPALIVE_S = 4.0
_ENCODER = msgspec.json.Encoder()


class EngineClient:
    """The gateway's one HTTP client for engine calls (requests, streams, health probes).

    aiohttp rather than httpx: on this path it costs a quarter of httpx's CPU per call
    (a POST plus a relayed stream, measured side by side in one run), and the gateway's
    CPU is on every request's time to first token. The session is made on first use, inside
    the event loop that serves the requests.
    """

    def __init__(self, api_key: str | None = None, max_connections: int = 4096) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (made on first use)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections,
                                               keepalive_timeout=_KEEPALIVE_S),
                # No read timeout: a stream's pace is the model's; frozen engines are
                # found by the health probes (liveness.py) and the request deadline.
                timeout=aiohttp.ClientTimeout(total=None, connect=30.0, sock_connect=10.0),
                headers=self._headers)
        return self._session

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str]
                   ) -> tuple[int, bytes]:
        """POST ``body`` as JSON; the status and the whole reply."""
        async with self.session.post(url, data=_ENCODER.encode(body),
                                     headers={**headers, "Content-Type": _JSON}) as resp:
            if resp.status >= 400:
                return resp.status, await read_capped(resp, MAX_ERROR_BYTES)
            return resp.status, await read_capped(resp, MAX_REPLY_BYTES, strict=True)

    async def open(self, url: str, body: dict[str, Any], headers: dict[str, str]
                   ) -> aiohttp.ClientResponse:
        """POST ``body`` as JSON; the response once its headers are in, body unread (the
        caller reads or closes it)."""
        return await self.session.post(url, data=_ENCODER.encode(body),
                                       headers={**headers, "Content-Type": _JSON})

    async def healthy(self, url: str, timeout_s: float) -> bool:
        """Whether the engine at ``url`` answers ``GET /health`` within ``timeout_s``
        (a 404 still answers; a 5xx is an engine that says it is broken)."""
        try:
            async with self.session.get(f"{url}/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                await r.read()  # read to the end, so the connection goes back to the pool
                return r.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._session is not None:
            await self._session.close()
            self._session = None


_JSON = "application/json"
MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest whole reply taken from an engine (a non-streamed answer with every top logprob
of a long completion is tens of MiB): past it the engine is broken, not waited for."""
MAX_ERROR_BYTES = 64 * 1024
"""Bytes of an engine's error body kept: enough for its message, nothing a client sees."""
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Largest SSE event taken from an engine (vLLM's are a few hundred bytes; one with every
top logprob of a long chunk a few hundred KiB): past it the stream is broken, not held."""


class ReplyTooLarge(ValueError):
    """An engine's reply passed :data:`MAX_REPLY_BYTES`."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int, strict: bool = False
                      ) -> bytes:
    """At most ``limit`` bytes of ``resp``'s body, read as they come: a body that never
    ends must not grow the gateway's memory. Past the limit the rest is left unread (the
    connection is dropped, not pooled) and, when ``strict``, :class:`ReplyTooLarge` raised."""
    size = resp.content_length
    if size is not None and size <= limit:
        return await resp.read()
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await resp.content.read(limit + 1 - len(buf))
        if not chunk:
            return bytes(buf)
        buf += chunk
    resp.close()
    if strict:
        raise ReplyTooLarge(f"reply passed {limit} bytes")
    return bytes(buf[:limit])


class EngineFailed(RuntimeError):
    """A prefill or decode engine call failed (connection, 5xx, or a broken stream)."""

    def __init__(self, role: str, engine: str | None, detail: str, status: int | None = None,
                 body: bytes | None = None) -> None:
        super().__init__(f"{role} engine {engine} failed: {detail}")
        self.role = role
        self.engine = engine
        self.status = status
        self.body = body

    @property
    def client_error(self) -> bool:
        """The engine refused the request itself as malformed or too large: the client's
        fault. Other 4xx (auth, routes, rate limits) are the deployment's, not the client's."""
        return self.status in _CLIENT_FAULT

    def client_message(self, hide: tuple[str | None, ...] = ()) -> str:
        """What the engine told the client in its error body, cleaned for the client: no
        nested JSON, no URLs, none of the names in ``hide`` (engine ids); a generic line
        when the engine said nothing usable."""
        msg = _engine_error_message(self.body)
        if not msg or msg.lstrip().startswith(("{", "[")):
            return _GENERIC_REFUSAL
        msg = _URL.sub("<url>", msg)
        for name in (self.engine, *hide):
            if name:
                msg = msg.replace(name, "<engine>")
        return msg[:_MAX_MESSAGE]


# Engine statuses that mean "this request is wrong", which the client must hear about.
_CLIENT_FAULT = frozenset({400, 413, 422})
_GENERIC_REFUSAL = "the model refused the request"
_MAX_MESSAGE = 500
_URL = re.compile(r"\b(?:https?|redis|rediss|tcp|ucx)://\S+")


def _engine_error_message(body: bytes | None) -> str | None:
    # vLLM answers {"error": {"message": ...}} (older releases {"message": ..., "object":
    # "error"}); anything else is not a message meant for a client.
    try:
        data = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    msg = err.get("message") if isinstance(err, dict) else data.get("message")
    return msg if isinstance(msg, str) else None


@dataclass
class SSEStats:
    """Timing and size of a relayed stream, for TTFT, TPOT and the tenant's token usage."""

    first_token_at: float | None = None
    last_token_at: float | None = None
    events: int = 0
    completion_tokens: int = 0
    """From the engine's ``usage`` (when the client asked for it); else 0 and the number of
    token events stands in (one token per event from vLLM)."""

    def observe(self, event: bytes) -> bool:
        """Count ``event``; returns whether it carried output."""
        if event.startswith(b"event: "):
            return self._observe_responses(event)
        if b'"completion_tokens"' in event and event.startswith(b"data:"):
            # Only the usage chunk has this key; parse just that one.
            try:
                usage = json.loads(event[5:]).get("usage") or {}
                self.completion_tokens = int(usage.get("completion_tokens") or 0)
            except (ValueError, TypeError, AttributeError):
                pass
        if is_token_event(event) and b'"choices":[]' not in event \
                and b'"choices": []' not in event:
            self.events += 1
            return True
        return False

    def _observe_responses(self, event: bytes) -> bool:
        # A Responses stream: "event: <type>" then its data line; the final response
        # carries the usage.
        if event.startswith(RESPONSES_ENDS):
            data = event[event.find(b"\ndata:") + 6:]
            try:
                response = json.loads(data).get("response") or {}
                self.completion_tokens = completion_tokens_of(response)
            except (ValueError, TypeError, AttributeError):
                pass
        if is_token_event(event):
            self.events += 1
            return True
        return False


def completion_tokens_of(result: dict[str, Any]) -> int:
    """Generated tokens of a non-streaming OpenAI answer (0 when it carries no usage);
    a Responses answer calls them ``output_tokens``."""
    usage = result.get("usage") if isinstance(result, dict) else None
    if not isinstance(usage, dict):
        return 0
    try:
        return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
    except (TypeError, ValueError):
        return 0


async def post_json(http: EngineClient, role: str, engine: str | None, url: str,
                    body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """POST and return the JSON reply; raises :class:`EngineFailed`."""
    try:
        status, content = await http.post(url, body, headers)
    except aiohttp.ClientError as exc:
        raise EngineFailed(role, engine, f"{type(exc).__name__}: {exc}") from exc
    except ReplyTooLarge as exc:
        raise EngineFailed(role, engine, str(exc)) from exc
    if status >= 400:
        raise EngineFailed(role, engine, f"HTTP {status}: {content[:300]!r}", status, content)
    try:
        reply = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineFailed(role, engine, "reply is not JSON") from exc
    if not isinstance(reply, dict):
        raise EngineFailed(role, engine, "reply is not a JSON object")
    return reply


async def open_stream(http: EngineClient, engine: str | None, url: str,
                      body: dict[str, Any], headers: dict[str, str]) -> aiohttp.ClientResponse:
    """Send the decode request and return the response once its headers are in."""
    try:
        resp = await http.open(url, body, headers)
    except aiohttp.ClientError as exc:
        raise EngineFailed("decode", engine, f"{type(exc).__name__}: {exc}") from exc
    if resp.status >= 400:
        try:
            content = await read_capped(resp, MAX_ERROR_BYTES)
        except aiohttp.ClientError:
            content = b""
        finally:
            resp.close()
        raise EngineFailed("decode", engine, f"HTTP {resp.status}: {content[:300]!r}",
                           resp.status, content)
    return resp


class SSEEvents:
    """Complete SSE events (each ending in a blank line) from an engine's stream, one per
    ``anext``. :meth:`ready` hands over the events one read already brought in, without
    waiting, so the relay writes them to the client in one ``send`` rather than one each."""

    def __init__(self, resp: aiohttp.ClientResponse, engine: str | None) -> None:
        self._chunks = resp.content.iter_any()
        self._engine = engine
        self._buf = b""
        self._events: deque[bytes] = deque()
        self._done = False

    def __aiter__(self) -> SSEEvents:
        return self

    async def __anext__(self) -> bytes:
        while not self._events:
            if self._done:
                raise StopAsyncIteration
            await self._read()
        return self._events.popleft()

    def ready(self) -> list[bytes]:
        """The events read and not yet taken (often none)."""
        out = list(self._events)
        self._events.clear()
        return out

    async def _read(self) -> None:
        try:
            chunk = await anext(self._chunks, None)
        except aiohttp.ClientError as exc:
            self._done = True
            raise EngineFailed("decode", self._engine,
                               f"stream broke: {type(exc).__name__}") from exc
        if chunk is None:
            self._done = True
            if self._buf.strip():
                self._events.append(self._buf + b"\n\n")
            return
        buf = self._buf + chunk
        start = 0
        while (cut := buf.find(b"\n\n", start)) >= 0:
            self._events.append(buf[start:cut + 2])
            start = cut + 2
        self._buf = buf[start:]
        if len(self._buf) > MAX_EVENT_BYTES:
            self._done = True
            raise EngineFailed("decode", self._engine,
                               f"an event passed {MAX_EVENT_BYTES} bytes without ending")


def sse_events(resp: aiohttp.ClientResponse, engine: str | None) -> SSEEvents:
    """The complete SSE events of an engine's stream (:class:`SSEEvents`)."""
    return SSEEvents(resp, engine)


RESPONSES_ENDS = (b"event: response.completed", b"event: response.incomplete",
                  b"event: response.failed", b"event: error")
"""How a Responses stream ends (it sends no ``[DONE]``)."""
_RESPONSES_PREAMBLE = (b"event: response.created", b"event: response.in_progress",
                       b"event: response.output_item.added",
                       b"event: response.content_part.added")


def is_token_event(event: bytes) -> bool:
    """An SSE event that carries generated output (not the final ``[DONE]``; in a
    Responses stream, a delta)."""
    if event.startswith(b"event: "):
        line = event[:event.find(b"\n")]
        return line.endswith(b".delta")
    return event.startswith(b"data:") and not event.startswith(b"data: [DONE]")


# A token whose text is empty (part of a character, a special token) shows a client nothing.
_NO_TEXT = (b'"text":""', b'"content":""', b'"delta":""', b'"choices":[]',
            b'"text": ""', b'"content": ""', b'"delta": ""', b'"choices": []')


def shows_text(event: bytes) -> bool:
    """A token event that shows its client text: where the time to first token of a
    client that reads text ends (``kvpush bench`` counts to the first chunk with text;
    ``vllm bench serve`` to the first chunk, text or not, which is never later)."""
    return is_token_event(event) and not any(e in event for e in _NO_TEXT)


def is_preamble(event: bytes) -> bool:
    """A Responses stream's opening events, sent before any output: the status line waits
    past them for the first token, as it does for the other endpoints."""
    return event.startswith(_RESPONSES_PREAMBLE)


def check_first_event(first: bytes, engine: str | None) -> None:
    """Refuse a stream whose start is no answer, while the client can still get a proper
    status (or the request another engine): no event at all, or an error event."""
    if not first:
        raise EngineFailed("decode", engine, "stream ended before its first event")
    if first.startswith((b"event: error", b"event: response.failed")):
        raise EngineFailed("decode", engine, f"error event before the first token: "
                           f"{first[:300]!r}")
    if first.startswith(b"data: {\"error\"") or first.startswith(b"data:{\"error\""):
        try:
            err = json.loads(first[5:]).get("error") or {}
            code = int(err.get("code") or 500)
        except (ValueError, TypeError, AttributeError):
            code = 500
        raise EngineFailed("decode", engine, f"error event before the first token: "
                           f"{first[:300]!r}", code, first[5:].strip())
    if b'"finish_reason":"abort"' in first.replace(b" ", b"") or \
            b'"finish_reason":"error"' in first.replace(b" ", b""):
        # vLLM ended the request before producing anything: no answer, so place it again.
        raise EngineFailed("decode", engine, f"request ended by the engine before its first "
                           f"token: {first[:300]!r}")
