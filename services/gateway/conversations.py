"""Conversations over ``/v1/responses``: a ``previous_response_id`` expanded into the whole
input the engines render, answers stored for their tenant, and the stored-response routes.

The engines stay stateless: each gets the conversation in full as ``input`` (every earlier
turn's input items, each earlier answer's output items, then the new input), which is
exactly what a client that keeps its own history sends, so P/D placement, token counting,
quotas and the tenant's cache salt all see the whole prompt. ``instructions`` do not carry
over, as in OpenAI's API.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind
from prometheus_client import Counter
from redis.exceptions import RedisError

from kvpush.common.redis_client import ride_out
from kvpush.common.telemetry import context_from_headers
from kvpush.common.wire import StoredResponse, now_ms
from kvpush.services.gateway.admission import authenticate_key
from kvpush.services.gateway.context import NO_TENANT, RequestCtx
from kvpush.services.gateway.edge import HTTPFailure, redis_unavailable
from kvpush.services.gateway.openai_api import RESPONSES, ParsedRequest
from kvpush.services.gateway.response_store import (
    ResponseStore,
    StoreResult,
    history_bytes,
    valid_response_id,
)
from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

# Events whose data carries the response object, and those that end it kept.
_WITH_RESPONSE = (b"event: response.created", b"event: response.in_progress",
                  b"event: response.completed", b"event: response.incomplete",
                  b"event: response.failed")
_KEPT_ENDS = (b"event: response.completed", b"event: response.incomplete")
_KEPT_STATUSES = ("completed", "incomplete")


def not_found(response_id: str, param: str = "response_id") -> HTTPFailure:
    """The one answer for an id the tenant has no response by: never stored, expired,
    deleted, or another tenant's (so ids cannot be probed)."""
    return HTTPFailure(404, "invalid_request_error",
                       f"Response with id '{response_id[:128]}' not found.",
                       metric="response_not_found", param=param)


def input_items(value: Any) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)


class Conversation:
    """One ``/v1/responses`` request's part in its conversation: the response it goes on
    from, and whether its own answer is kept."""

    def __init__(self, store: ResponseStore, tenant: str, previous_id: str | None,
                 history: list[Any], keep: bool, outcomes: Counter | None = None) -> None:
        self.store, self.tenant = store, tenant
        self.outcomes = outcomes  # stored responses by StoreResult
        self.previous_id = previous_id
        self.history = history  # input items up to and including this request's
        self.keep = keep
        self.result: StoreResult | None = None

    def _patch(self, response: dict[str, Any]) -> None:
        response["previous_response_id"] = self.previous_id
        response["store"] = self.keep if self.result is None \
            else self.result is StoreResult.STORED

    async def finish(self, response: Any) -> Any:
        """Keep a unary answer (or a stream's last response object) and say in it whether
        it was kept: the client's next turn may name it as soon as it has read it."""
        if not isinstance(response, dict):
            return response
        if self.keep and self.result is None:
            self.result = await self._keep(response)
        self._patch(response)
        return response

    async def _keep(self, response: dict[str, Any]) -> StoreResult:
        rid = response.get("id")
        if response.get("status") not in _KEPT_STATUSES or not isinstance(rid, str) \
                or not valid_response_id(rid):
            return StoreResult.FAILED
        stored = StoredResponse(id=rid, created_ms=now_ms(), history=self.history,
                                response=dict(response, store=True,
                                              previous_response_id=self.previous_id))
        try:
            result = await self.store.put(self.tenant, stored)
        except RedisError as exc:
            logger.warning("storing response %s of tenant %s failed: %s", rid, self.tenant,
                           exc)
            result = StoreResult.FAILED
        if result is StoreResult.TOO_LARGE:
            logger.info("response %s of tenant %s is over the stored-response bound; "
                        "served unstored", rid, self.tenant)
        if self.outcomes is not None:
            self.outcomes.labels(result.value).inc()
        return result

    async def event(self, event: bytes) -> bytes:
        """A relayed SSE event with the response object in it patched (and kept, at the
        stream's end); any other event as it came."""
        if not event.startswith(_WITH_RESPONSE):
            return event
        head, sep, data = event.partition(b"\ndata: ")
        try:
            doc = json.loads(data)
            response = doc["response"]
        except (ValueError, KeyError, TypeError):
            return event
        if not isinstance(response, dict):
            return event  # not a response object: the client gets it as the engine sent it
        if event.startswith(_KEPT_ENDS):
            await self.finish(response)
        else:
            self._patch(response)
        return head + sep + json.dumps(doc, ensure_ascii=False,
                                       separators=(",", ":")).encode() + b"\n\n"


async def open_conversation(gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest
                            ) -> ParsedRequest:
    """``parsed`` with its previous response's conversation in front of its input (404 for
    an id its tenant has no response by), the engines told not to store anything; sets
    ``ctx.conversation``, which keeps the answer where asked and says in it whether it did."""
    body = parsed.body
    previous_id = body.get("previous_response_id")
    store = gw.responses
    keep = store.enabled and body.get("store") is not False
    engine_body = {k: v for k, v in body.items() if k != "previous_response_id"}
    engine_body["store"] = False  # kept here, never in one engine's memory
    history = input_items(body["input"])
    if previous_id is not None:
        assert isinstance(previous_id, str)  # validated
        try:
            prev = await ride_out(lambda: store.get(ctx.tenant, previous_id),
                                  gw.s.gateway_redis_outage_s, "reading a stored response")
        except RedisError as exc:
            raise redis_unavailable(exc) from exc
        if prev is None:
            raise not_found(previous_id, "previous_response_id")
        output = prev.response.get("output")
        history = [*prev.history, *(output if isinstance(output, list) else []), *history]
        if history_bytes(history) > store.max_bytes:
            raise HTTPFailure(400, "invalid_request_error",
                              f"the conversation passes the {store.max_bytes} bytes a "
                              "stored response may hold: start a new one",
                              metric="bad_request", param="previous_response_id")
        engine_body["input"] = history
        ctx.span.set_attribute("kvpush.previous_response_id", previous_id)
    # Even an answer neither kept nor continuing one says so ("store" is OpenAI's field,
    # which vLLM's response object lacks).
    ctx.conversation = Conversation(store, ctx.tenant, previous_id, history, keep,
                                    gw.metrics.responses_stored)
    return dataclasses.replace(parsed, body=engine_body)


async def serve_stored(gw: Gateway, request: Request, response_id: str,
                       delete: bool = False) -> Response:
    """``GET`` or ``DELETE /v1/responses/{id}`` for the caller's tenant, in a SERVER span."""
    method = "DELETE" if delete else "GET"
    endpoint = f"responses_{method.lower()}"
    tenant = NO_TENANT
    status = 500
    span = gw.tracer.start_span(
        f"{method} {RESPONSES}/{{response_id}}",
        context=context_from_headers(request.headers), kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": request.url.path,
                    "http.route": f"{RESPONSES}/{{response_id}}"})
    try:
        t = await authenticate_key(gw, request.headers.get("authorization"))
        tenant = t.id
        span.set_attribute("kvpush.tenant", tenant)
        try:
            if delete:
                found = await gw.responses.delete(tenant, response_id)
                if not found:
                    raise not_found(response_id)
                status = 200
                return JSONResponse({"id": response_id, "object": "response",
                                     "deleted": True})
            stored = await ride_out(lambda: gw.responses.get(tenant, response_id),
                                    gw.s.gateway_redis_outage_s, "reading a stored response")
        except RedisError as exc:
            raise redis_unavailable(exc) from exc
        if stored is None:
            raise not_found(response_id)
        status = 200
        return JSONResponse(stored.response)
    except HTTPFailure as exc:
        status = exc.status
        span.set_attribute("error.type", exc.kind)
        gw.metrics.errors.labels(exc.metric, tenant).inc()
        return exc.response()
    finally:
        span.set_attribute("http.response.status_code", status)
        span.end()
        gw.metrics.requests.labels(endpoint, str(status), tenant).inc()
