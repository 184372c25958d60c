"""One request end to end: SERVER span, admission, placement (re-placed on failure), answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from kvpush.common.telemetry import context_from_headers
from kvpush.common.wire import now_ms
from kvpush.services.gateway.admission import (
    admit,
    authenticate_key,
    parse_body,
    parse_request,
    read_request_body,
    set_tenant,
)
from kvpush.services.gateway.context import RequestCtx, fail_span
from kvpush.services.gateway.conversations import open_conversation
from kvpush.services.gateway.early_prefill import start_early_prefill
from kvpush.services.gateway.edge import HTTPFailure
from kvpush.services.gateway.fanout import serve_choices, wants_choices
from kvpush.services.gateway.flight import Flight, Reroute
from kvpush.services.gateway.openai_api import (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    BadRequest,
    ParsedRequest,
    split_batch,
)
from kvpush.services.gateway.relay import stream, unary
from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

# Each endpoint's label on the gateway's metrics and its GenAI operation name on the span.
_ENDPOINTS = {COMPLETIONS: "completions", CHAT: "chat", RESPONSES: "responses"}
_OPERATIONS = {COMPLETIONS: "text_completion", CHAT: "chat", RESPONSES: "chat"}


async def handle(gw: Gateway, request: Request, path: str) -> Response:
    """Serve one OpenAI request; every failure becomes a clear HTTP error."""
    arrived = time.monotonic()
    endpoint = _ENDPOINTS[path]
    incoming_tp = request.headers.get("traceparent")
    span = gw.tracer.start_span(
        f"POST {path}", context=context_from_headers(request.headers), kind=SpanKind.SERVER,
        attributes={"http.request.method": "POST", "url.path": path,
                    "http.route": path, "gen_ai.system": "vllm",
                    "gen_ai.operation.name": _OPERATIONS[path]})
    ctx = RequestCtx(gw, endpoint, path, arrived, span, incoming_tp)
    gw.metrics.in_flight.inc()
    status = 500
    try:
        # The body is read before the disconnect watcher starts: both read ``receive``.
        raw = await read_request_body(gw.s, request)
        with trace.use_span(span, end_on_exit=False):
            resp = await _with_disconnect(
                request, _serve(gw, ctx, request.headers.get("authorization"), raw, path))
        status = resp.status_code
        return resp
    except HTTPFailure as exc:
        status = exc.status
        gw.metrics.errors.labels(exc.metric, ctx.tenant).inc()
        if status >= 500:
            fail_span(span, exc)
        else:
            span.set_attribute("error.type", exc.kind)
        return exc.response()
    except BaseException as exc:
        fail_span(span, exc)
        raise
    finally:
        gw.metrics.requests.labels(endpoint, str(status), ctx.tenant).inc()
        gw.metrics.in_flight.dec()
        if not ctx.streaming:
            await ctx.finish(status)


async def _serve(gw: Gateway, ctx: RequestCtx, authorization: str | None, raw: bytes,
                 path: str) -> Response:
    # The key first: a caller without one learns nothing about its body.
    tenant = await authenticate_key(gw, authorization)
    set_tenant(ctx, tenant)
    body = parse_body(gw.s, raw)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ctx.span.set_attributes({"kvpush.request_id": request_id, "gen_ai.response.id": request_id})
    prompts = None
    if path == COMPLETIONS:
        try:
            prompts = split_batch(body, gw.s.gateway_max_choices)
        except BadRequest as exc:
            raise HTTPFailure.bad_request(exc) from exc
    if prompts is not None or (path != RESPONSES and wants_choices(body)):
        return await serve_choices(gw, ctx, tenant, prompts or [body], path, request_id,
                                   _place)
    parsed = parse_request(gw.s, body, path)
    if path == RESPONSES:
        parsed = await open_conversation(gw, ctx, parsed)
    parsed = await admit(gw, ctx, tenant, parsed)
    return await _place(gw, ctx, parsed, request_id)


async def _place(gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest,
                 request_id: str) -> Response:
    """Place the request and serve it; an engine that fails before the first token gets
    the request placed again on others, within its deadline and the retry budget."""
    deadline_ms = now_ms() + int(gw.s.gateway_request_timeout_s * 1000)
    exclude: list[str] = []
    failure: HTTPFailure | None = None
    retries = gw.s.gateway_dispatch_retries
    for attempt in range(retries + 1):
        # Each attempt is a request of its own to the engines and the scheduler: a new
        # assignment, reservation and fencing token; the failed attempt's are released.
        attempt_id = request_id if attempt == 0 else f"{request_id}-r{attempt}"
        # A placement again after a failure waits for its assignment: prefill may be
        # what failed.
        early = start_early_prefill(gw, ctx, parsed, attempt_id, deadline_ms) \
            if attempt == 0 else None
        try:
            a = await gw.schedule(ctx, attempt_id, ctx.prompt_tokens, parsed.max_tokens,
                                  deadline_ms, exclude, early.engine if early else None)
        except HTTPFailure:
            if early is not None:
                early.abandon("refused")
            if failure is None:
                raise
            raise failure from None  # no other engine: the client hears what failed
        except BaseException:
            if early is not None:
                early.abandon("left")
            raise
        flight = Flight(gw, ctx, parsed, attempt_id, deadline_ms, a, early)
        gw.active[attempt_id] = a
        try:
            if parsed.stream:
                return await stream(flight)
            return await unary(flight)
        except Reroute as r:
            flight.close_soon()
            exclude.append(r.engine)
            failure = r.failure
            if attempt == retries or now_ms() >= deadline_ms:
                raise r.failure from r
            logger.warning("%s; placing %s again (attempt %d)", r, request_id, attempt + 2)
            gw.metrics.errors.labels("rerouted", ctx.tenant).inc()
            ctx.span.add_event("kvpush.reroute", {"kvpush.failed_engine": r.engine})
        except BaseException:
            flight.close_soon()
            raise
    raise AssertionError("unreachable")


async def _with_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    # Until the response starts, nothing notices a client that left: watch for it, so
    # a queued or prefilling request is dropped (and its reservation released) at once.
    task = asyncio.create_task(work)
    watch = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise HTTPFailure(499, "client_disconnect", "client closed the connection")


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
