"""Requests that ask for several choices: batched completion prompts and ``n > 1``, each
choice placed as a request of its own and answered as one, as a single vLLM engine does.

Every prompt is parsed, counted and fitted to the context before any choice is admitted or
placed, so a bad one fails the whole request with a 400 naming it while nothing is held.
Each choice then gets its own quota admission, placement, reservation and span (below the
request's SERVER span). The first sample of a prompt is placed like any request: prefilled
once, its KV pushed once. The prompt's other samples wait until that KV is on its decode
engine and go there alone (``colocate_on``), where vLLM's prefix cache holds the prompt:
nothing is prefilled or pushed again. Each sample ``j`` carries ``seed + j`` as vLLM's own
parallel sampling does, so a seeded request gives the same choices again.

The answers come back merged: unary choices in order, or the streams interleaved as their
events arrive; either way with the request's one id, each choice at index
``prompt * n + sample``, and the usage summed (each prompt's tokens counted once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind

from kvpush.common.tenancy import Tenant
from kvpush.services.gateway.admission import (
    admit_quota,
    enter_backlog,
    parse_request,
    prepare,
    shed_if_late,
)
from kvpush.services.gateway.context import RequestCtx, fail_span
from kvpush.services.gateway.edge import HTTPFailure, RelayResponse, sse_error
from kvpush.services.gateway.openai_api import ParsedRequest

if TYPE_CHECKING:
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

Place = Callable[["Gateway", RequestCtx, ParsedRequest, str], Awaitable[Response]]
"""Places one request and answers it (``handler._place``)."""

_DONE = b"data: [DONE]"


@dataclass
class _Choice:
    """One choice: its prompt, its sample of that prompt, its request."""

    prompt: int
    sample: int
    ctx: RequestCtx
    parsed: ParsedRequest | None = None


def wants_choices(body: Any) -> bool:
    """Whether a request body asks for more than one choice by ``n`` (a batch of prompts is
    found by :func:`openai_api.split_batch`)."""
    n = body.get("n") if isinstance(body, dict) else None
    return isinstance(n, int) and not isinstance(n, bool) and n > 1


async def serve_choices(gw: Gateway, ctx: RequestCtx, tenant: Tenant,
                        bodies: list[dict[str, Any]], path: str, request_id: str,
                        place: Place) -> Response:
    """Serve the prompts ``bodies`` (one request body each, ``n`` samples of each) as one
    response."""
    batched = len(bodies) > 1
    prompts = [await _prepared(gw, ctx, tenant, b, path, i if batched else None)
               for i, b in enumerate(bodies)]
    n = prompts[0][0].n
    if len(prompts) * n > gw.s.gateway_max_choices:
        raise HTTPFailure(400, "invalid_request_error",
                          f"{len(prompts)} prompt(s) times n={n} is more than the "
                          f"{gw.s.gateway_max_choices} choices served in one request",
                          metric="bad_request", param="n")
    ctx.span.set_attributes({"kvpush.choices": len(prompts) * n,
                             "gen_ai.request.choice.count": n})
    ctx.prompt_tokens = sum(c.prompt_tokens for _, c in prompts)
    choices = [_choice(gw, ctx, tenant, i, j, parsed, counted)
               for i, (parsed, counted) in enumerate(prompts) for j in range(n)]
    shed_if_late(gw, ctx, tenant, ctx.prompt_tokens)
    for c in choices:  # all in the backlog before any await, as admission.admit does
        enter_backlog(gw, c.ctx, tenant, c.ctx.prompt_tokens if c.ctx.prompt_billed else 0)
    try:
        for c in choices:
            assert c.parsed is not None
            prompt = c.ctx.prompt_tokens if c.ctx.prompt_billed else 0
            c.ctx.admission = await admit_quota(gw, tenant, prompt, c.parsed.max_tokens)
        resps = await _placed_all(gw, choices, request_id, place)
    except BaseException as exc:
        status = exc.status if isinstance(exc, HTTPFailure) else 499
        for c in choices:
            if not c.ctx.streaming:
                await c.ctx.finish(status)
        raise
    first = prompts[0][0]
    if not first.stream:
        return await _merged_json(choices, resps, request_id, ctx)
    opts = first.body.get("stream_options")
    usage = isinstance(opts, dict) and opts.get("include_usage") is True
    ctx.streaming = True  # the merged stream's end finishes the request
    merged = _MergedStream(ctx, choices, resps, request_id, usage)
    return RelayResponse(merged.events(), gw.s.gateway_write_timeout_s, merged.write_timed_out,
                         media_type="text/event-stream", background=merged.close)


def _choice(gw: Gateway, ctx: RequestCtx, tenant: Tenant, prompt: int, sample: int,
            parsed: ParsedRequest, counted: RequestCtx) -> _Choice:
    span = gw.tracer.start_span("kvpush.choice", context=ctx.otel_context,
                                kind=SpanKind.INTERNAL,
                                attributes={"kvpush.choice.prompt": prompt,
                                            "kvpush.choice.sample": sample,
                                            "kvpush.tenant": tenant.id})
    c = RequestCtx(gw, ctx.endpoint, ctx.path, ctx.arrived, span, ctx.incoming_tp)
    c.tenant = tenant.id
    c.prompt_tokens = counted.prompt_tokens
    c.prefix_hashes = counted.prefix_hashes
    c.prompt_ids = counted.prompt_ids
    body = dict(parsed.body, n=1)
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        body["seed"] = seed + sample  # vLLM's parallel sampling seeds its children so
    if sample == 0:
        c.kv_ready = asyncio.Event()
    else:
        c.prompt_billed = False  # the prompt is counted (and paid) once, as vLLM counts it
    return _Choice(prompt, sample, c, replace(parsed, body=body, n=1))


async def _prepared(gw: Gateway, ctx: RequestCtx, tenant: Tenant, body: dict[str, Any],
                    path: str, index: int | None) -> tuple[ParsedRequest, RequestCtx]:
    """One prompt parsed, counted and fitted, with nothing held (the counts in a context
    of its own); a 400 names the prompt's place in a batch."""
    counted = RequestCtx(gw, ctx.endpoint, ctx.path, ctx.arrived, ctx.span, ctx.incoming_tp)
    try:
        return await prepare(gw, counted, tenant, parse_request(gw.s, body, path)), counted
    except HTTPFailure as exc:
        if exc.status != 400 or index is None:
            raise
        # Named by its place in the batch: the client must know which prompt to fix.
        param = f"prompt[{index}]" if exc.param in (None, "prompt") else exc.param
        raise HTTPFailure(exc.status, exc.kind, f"prompt[{index}]: {exc}",
                          exc.retry_after_s, exc.metric, exc.headers, param) from exc


async def _placed_all(gw: Gateway, choices: list[_Choice], request_id: str, place: Place
                      ) -> list[Response]:
    """Every choice placed and answered (a stream: up to its first token); the first
    failure, in choice order, fails them all and gives back what the others hold."""
    firsts = {c.prompt: c.ctx for c in choices if c.sample == 0}

    async def one(k: int, c: _Choice) -> Response:
        assert c.parsed is not None
        rid = f"{request_id}-c{k}"
        if c.sample == 0:
            return await place(gw, c.ctx, c.parsed, rid)
        first = firsts[c.prompt]
        assert first.kv_ready is not None
        await first.kv_ready.wait()
        c.ctx.colocate_on = first.placed_on
        try:
            return await place(gw, c.ctx, c.parsed, rid)
        except HTTPFailure as exc:
            if c.ctx.colocate_on is None or exc.metric != "no_engine":
                raise
        # That engine left: the sample goes wherever it fits, prefilled again if need be
        # (a new id: the refused one may be taken in the schedulers' dedup markers).
        c.ctx.colocate_on = None
        return await place(gw, c.ctx, c.parsed, f"{rid}-u")

    tasks = [asyncio.create_task(one(k, c)) for k, c in enumerate(choices)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await _give_back(tasks)
        raise
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
    if failed:
        await _give_back(tasks)
        exc = failed[0].exception()
        assert exc is not None
        raise exc
    return [t.result() for t in tasks]


async def _give_back(tasks: list[asyncio.Task[Response]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            resp = await t
            await _close(resp)


async def _close(resp: Response) -> None:
    """Close a stream that will not be relayed: its flight releases what it holds."""
    if resp.background is not None:
        await resp.background()


def _usage(choices: list[_Choice], usages: list[tuple[int, Any]]) -> Any:
    """The request's usage from its choices' (choice index, usage) pairs: completion tokens
    of every choice, prompt tokens of each prompt once."""
    counted = []
    for k, u in usages:
        if isinstance(u, dict) and choices[k].sample > 0:
            u = {f: v for f, v in u.items()
                 if f not in ("prompt_tokens", "prompt_tokens_details", "total_tokens")}
        counted.append(u)
    total = _summed(counted)
    if isinstance(total, dict) and isinstance(total.get("completion_tokens"), int) \
            and isinstance(total.get("prompt_tokens"), int):
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


async def _merged_json(choices: list[_Choice], resps: list[Response], request_id: str,
                       ctx: RequestCtx) -> Response:
    docs = [json.loads(bytes(r.body)) for r in resps]
    for c in choices:
        await c.ctx.finish(200)
    out = dict(docs[0])
    out["id"] = request_id
    out["choices"] = [dict(ch, index=k) for k, d in enumerate(docs) for ch in d["choices"]]
    out["usage"] = _usage(choices, [(k, d.get("usage")) for k, d in enumerate(docs)])
    ctx.completion_tokens = sum(c.ctx.completion_tokens for c in choices)
    return JSONResponse(out)


def _summed(usages: list[Any]) -> Any:
    """Usage objects added up field by field (nested ones too); None if none has any."""
    dicts = [u for u in usages if isinstance(u, dict)]
    if not dicts:
        return None
    out: dict[str, Any] = {}
    for u in dicts:
        for k, v in u.items():
            if isinstance(v, int) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, dict):
                out[k] = _summed([out.get(k), v])
            else:
                out.setdefault(k, v)
    return out


class _MergedStream:
    """The choices' streams as one: events as they come, rewritten to the request's id and
    each choice's index, their usage chunks summed into one before a single ``[DONE]``."""

    def __init__(self, ctx: RequestCtx, choices: list[_Choice], resps: list[Response],
                 request_id: str, include_usage: bool) -> None:
        self.ctx = ctx
        self.choices = choices
        self.resps = resps
        self.request_id = request_id
        self.include_usage = include_usage
        self.usage: list[tuple[int, Any]] = []  # (choice index, usage), until the end
        self.status = 200
        self._created = 0
        self._model = ""
        self._object = "text_completion"

    def write_timed_out(self) -> None:
        logger.info("client of %s stopped reading; cutting its stream", self.request_id)
        self.status = 499

    async def events(self) -> AsyncIterator[bytes]:
        # Bounded: a client that reads slowly holds the engines' streams back instead of
        # the gateway buffering them.
        queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue(64)
        pumps = [asyncio.create_task(self._pump(i, r, queue))
                 for i, r in enumerate(self.resps)]
        left = len(pumps)
        try:
            while left:
                i, chunk = await queue.get()
                if chunk is None:
                    left -= 1
                    continue
                out = self._rewritten(i, chunk)
                if out:
                    yield out
            if self.include_usage and self.usage:
                yield _event({"id": self.request_id, "object": self._object,
                              "created": self._created, "model": self._model,
                              "choices": [], "usage": _usage(self.choices, self.usage)})
            yield _DONE + b"\n\n"
        except BaseException as exc:
            self.status = 499 if self.status == 200 else self.status
            if not isinstance(exc, asyncio.CancelledError | GeneratorExit):
                fail_span(self.ctx.span, exc)
            raise
        finally:
            for t in pumps:
                t.cancel()
            for t in pumps:
                with contextlib.suppress(BaseException):
                    await t
            await self.close()

    async def close(self) -> None:
        """Give back what every choice holds and finish the request; idempotent (also run
        as the response's background task, for a stream that never started)."""
        for r in self.resps:
            await _close(r)
        self.ctx.completion_tokens = sum(c.ctx.completion_tokens for c in self.choices)
        await self.ctx.finish(self.status)

    @staticmethod
    async def _pump(i: int, resp: Response, queue: asyncio.Queue[tuple[int, bytes | None]]
                    ) -> None:
        it: AsyncIterator[Any] = resp.body_iterator  # type: ignore[attr-defined]
        try:
            async for chunk in it:
                await queue.put((i, bytes(chunk)))
        except asyncio.CancelledError:
            raise
        except Exception:
            # The relay turns engine failures into error events itself; this is a bug.
            logger.exception("stream of choice %d broke", i)
            await queue.put((i, sse_error("internal error", "internal_error", 500)))
        await queue.put((i, None))

    def _rewritten(self, index: int, chunk: bytes) -> bytes:
        out: list[bytes] = []
        for ev in chunk.split(b"\n\n"):
            if not ev.strip():
                continue
            if not ev.startswith(b"data:") or ev.startswith(_DONE):
                continue  # one [DONE] ends the merged stream
            try:
                doc = json.loads(ev[5:])
            except ValueError:
                out.append(ev + b"\n\n")
                continue
            if not isinstance(doc, dict) or "choices" not in doc:
                out.append(ev + b"\n\n")  # an error event: the client must see it
                continue
            self._created = doc.get("created", self._created)
            self._model = doc.get("model", self._model)
            self._object = doc.get("object", self._object)
            if not doc["choices"] and doc.get("usage") is not None:
                self.usage.append((index, doc["usage"]))
                continue
            doc["id"] = self.request_id
            for ch in doc["choices"]:
                if isinstance(ch, dict):
                    ch["index"] = index
            out.append(_event(doc))
        return b"".join(out)


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"
