"""Answer the client: the unary JSON reply, or decode's SSE stream relayed with error events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from kvpush.services.gateway.continuation_exact import (
    NoFirstToken,
    after_lead,
    ended_at_prefill,
    merged,
    responses_after,
)
from kvpush.services.gateway.continuation_exact import lead as exact_lead
from kvpush.services.gateway.edge import HTTPFailure, RelayResponse, sse_error
from kvpush.services.gateway.engines import (
    RESPONSES_ENDS,
    EngineFailed,
    SSEEvents,
    check_first_event,
    completion_tokens_of,
    is_preamble,
    shows_text,
    sse_events,
)
from kvpush.services.gateway.flight import PREFILL_ANSWERED, UPSTREAM_FAILED, Flight
from kvpush.services.gateway.lead import FirstTokenDiffers, Lead, can_lead, held_to, lead_from
from kvpush.services.gateway.migration import continuation, generated, is_role_chunk
from kvpush.services.gateway.openai_api import RESPONSES

logger = logging.getLogger(__name__)


async def unary(f: Flight) -> Response:
    """Serve a non-streaming request on its placement; a failure before the reply raises
    :meth:`Flight.failure`'s HTTP error or :class:`Reroute`."""
    dec_body = f.dispatch()
    try:
        async with asyncio.timeout_at(f.deadline_at):
            f.start_prefill()
            work = asyncio.ensure_future(f.decode_json(dec_body))
            result = await f.race_prefill(work, or_prefill=f.goes_on)
            if f.goes_on:
                result = await _went_on(f, work, result)
            elif f.prefill_task is not None:
                with contextlib.suppress(EngineFailed):
                    await f.prefill_task  # decode answered, so the KV did arrive
    except (TimeoutError, EngineFailed) as exc:
        raise f.failure(exc) from exc
    finally:
        f.close_soon()
    f.kv_in()
    end = time.monotonic()
    f.ctx.reached_first_token()
    f.ctx.first_token_out(f.prefill_answered_at or end)  # as the planner times it
    s = f.stats
    s.completion_tokens = f.ctx.completion_tokens = completion_tokens_of(result)
    s.last_token_at = end
    s.first_token_at = f.prefill_answered_at or end
    if f.prefill_answered_at is not None:
        # Prefill sampled the first token; decode generated the rest after it, so the
        # gateway times a unary request's TTFT and time per output token too, and the
        # planner sees batch and agent load as it sees streams.
        s.events = s.completion_tokens
    if f.ctx.conversation is not None:
        result = await f.ctx.conversation.finish(result)
    return JSONResponse(result)


async def _went_on(f: Flight, work: asyncio.Future[Any], result: Any) -> Any:
    """A unary answer whose decode went on from prefill's first token: prefill's answer
    alone where its token ended it, else decode's with that token in front."""
    assert f.prefill_task is not None
    if result is PREFILL_ANSWERED:
        ended = ended_at_prefill(f.p, f.prefill_task.result())
        if ended is not None:
            work.cancel()  # decode would go on past the end
            return ended
        result = await f.race_prefill(work)
    try:
        answer = merged(f.p, await f.prefill_task, result)
    except NoFirstToken as exc:
        raise EngineFailed("prefill", f.a.prefill_engine, str(exc)) from exc
    f.gw.metrics.first_token.labels("continued").inc()
    return answer


async def stream(f: Flight) -> Response:
    """Serve a streaming request on its placement: the response starts with the first
    token (from prefill's answer where :mod:`lead` allows); a failure before it raises like
    :func:`unary`, one after it ends the stream with an SSE error event."""
    dec_body = f.dispatch()
    lead: Lead | None = None
    try:
        async with asyncio.timeout_at(f.deadline_at):
            f.start_prefill()
            resp = await f.race_prefill(asyncio.ensure_future(f.open_decode(dec_body)))
            events: AsyncIterator[bytes] = sse_events(resp, f.a.decode_engine)
            if f.goes_on and f.p.path == RESPONSES:
                assert f.prefill_task is not None
                events = responses_after(f.p, events, f.prefill_task, f.a.prefill_engine)
            nxt = asyncio.ensure_future(anext(events, b""))
            leads = f.prefill_task is not None and (f.goes_on or (
                f.gw.s.gateway_first_token_from_prefill and can_lead(f.p)))
            # Hold the status line back until the first token: a transfer that fails
            # before it still gets a proper 502 instead of a broken 200 stream.
            first = await f.race_prefill(nxt, or_prefill=leads)
            if f.goes_on:
                assert f.prefill_task is not None
                # Decode streams from the token after prefill's: prefill's opens the
                # stream, however late its answer comes.
                lead = exact_lead(f.p, await f.prefill_task)
                if lead is None and first is PREFILL_ANSWERED:
                    first = await f.race_prefill(nxt)
            elif first is PREFILL_ANSWERED:
                assert f.prefill_task is not None
                lead = lead_from(f.p, f.prefill_task.result())
                if lead is None:
                    first = await f.race_prefill(nxt)
            held: list[bytes] = []
            if lead is None:
                check_first_event(first, f.a.decode_engine)
                # A Responses stream opens with events that carry no output yet.
                while is_preamble(first):
                    held.append(first)
                    nxt = asyncio.ensure_future(anext(events, b""))
                    first = await f.race_prefill(nxt)
                    check_first_event(first, f.a.decode_engine)
    except (TimeoutError, EngineFailed) as exc:
        raise f.failure(exc) from exc
    f.stats.first_token_at = f.stats.last_token_at = time.monotonic()
    f.ctx.reached_first_token()
    if lead is None:
        firsts = [*held, first]
        _first_event(f, nxt)
        if f.goes_on and f.p.path == RESPONSES:
            # Prefill's token is in decode's first text (continuation_responses.py).
            f.gw.metrics.first_token.labels("continued").inc()
    else:
        f.gw.metrics.first_token.labels("continued" if f.goes_on else "led").inc()
        # Splits a traced request's time to first token into prefill and the relay.
        f.ctx.span.add_event("kvpush.first_token_from_prefill")
        # Awaited by the relay, or ended by closing the decode stream; either way noted.
        nxt.add_done_callback(lambda fut: _first_event(f, fut))
        firsts = lead.events
        # Decode stays probed until its first event, as before the first token: one
        # that froze after its headers fails it, and the relay moves the request on.
        if any(_ends_answer(ev) for ev in firsts):
            nxt.cancel()  # prefill's token ended the answer: decode would go on past it
            events = _nothing()
        else:
            first_of_decode = asyncio.ensure_future(
                nxt if first is not PREFILL_ANSWERED and first is not None
                else f.race_prefill(nxt))
            first_of_decode.add_done_callback(_retrieved)
            events = after_lead(first_of_decode, events, f.a.decode_engine) if f.goes_on \
                else held_to(lead, first_of_decode, events, f.p.path, f.a.decode_engine)
    for ev in firsts:
        f.stats.observe(ev)
    # From here the stream's end (Flight.close) ends the SERVER span and the admission.
    f.ctx.streaming = True
    return RelayResponse(_relay(f, firsts, events, lead is not None),
                         f.gw.s.gateway_write_timeout_s,
                         lambda: _write_timed_out(f), media_type="text/event-stream",
                         background=_Cleanup(f))


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


def _retrieved(fut: asyncio.Future[Any]) -> None:
    # A relay that never started leaves its failure to no one: asyncio would log it.
    if not fut.cancelled():
        fut.exception()


def _first_event(f: Flight, fut: asyncio.Future[Any]) -> None:
    # Splits a traced request's time into decode's part and the relay's (see
    # loadtest/bench_phases.py); retrieving the exception keeps asyncio from logging it.
    if fut.cancelled() or fut.exception() is not None:
        return
    f.kv_in()  # decode scheduled the request: the prompt's blocks are in its prefix cache
    if f.decode_span is not None:
        f.decode_span.add_event("kvpush.first_event")


def _write_timed_out(f: Flight) -> None:
    logger.info("client of %s stopped reading; cutting its stream", f.request_id)
    f.gw.metrics.errors.labels("client_write_timeout", f.ctx.tenant).inc()
    f.status = 499
    f.ctx.span.set_attribute("error.type", "client_write_timeout")


def _ends_answer(event: bytes) -> bool:
    return event.startswith((b"data: [DONE]", b"data: {\"error\"", *RESPONSES_ENDS))


async def _relay(f: Flight, firsts: list[bytes], events: AsyncIterator[bytes],
                 led: bool = False) -> AsyncIterator[bytes]:
    errors = f.gw.metrics.errors
    tenant = f.ctx.tenant
    # What the client got is kept while the request may still move to another decode, or
    # go on from prefill's first token (``led``) should decode's differ.
    # A Responses stream has no continuation to move to (its events are not one token
    # each, and its output is items, not text).
    movable = f.ctx.migrations < f.gw.s.gateway_migrations and f.p.path != RESPONSES
    keep = movable or led
    relayed: list[bytes] = list(firsts) if keep else []
    moved_by: EngineFailed | None = None
    conv = f.ctx.conversation
    try:
        ended = any(_ends_answer(ev) for ev in firsts)
        # Until the client has seen text, each token is checked for it (a cheap scan).
        texted = any(shows_text(ev) for ev in firsts)
        if conv is not None:
            firsts = [await conv.event(ev) for ev in firsts]
        if texted:
            f.ctx.first_token_out()
        yield b"".join(firsts)
        async with asyncio.timeout_at(f.deadline_at):
            # Token gaps feed the shedder only while it watches TPOT (a per-token cost).
            gaps = f.gw.shedder if f.gw.shedder is not None \
                and f.gw.shedder.tpot_objective_s > 0 else None
            # Events decode sent together go out together: one write instead of one each.
            ready = events.ready if isinstance(events, SSEEvents) else None
            async for ev in events:
                batch = [ev, *ready()] if ready is not None else [ev]
                for ev in batch:
                    if f.stats.observe(ev):
                        now = time.monotonic()
                        if gaps is not None and f.stats.last_token_at is not None:
                            gaps.observe_gap(now - f.stats.last_token_at)
                        f.stats.last_token_at = now
                        if not texted and shows_text(ev):
                            texted = True
                            f.ctx.first_token_out(now)
                    ended = ended or _ends_answer(ev)
                    if keep:
                        relayed.append(ev)
                if conv is not None:
                    # Its last event is kept before the client reads it, so a next turn
                    # may name the response at once.
                    batch = [await conv.event(ev) for ev in batch]
                yield batch[0] if len(batch) == 1 else b"".join(batch)
        if not ended:
            # The engine closed a complete HTTP response without [DONE]: the answer may be
            # cut short, and the client must be told rather than left guessing.
            raise EngineFailed("decode", f.a.decode_engine, "stream ended without [DONE]")
        if f.prefill_task is not None:
            with contextlib.suppress(EngineFailed):
                await f.prefill_task  # decode finished, so the KV did arrive
    except TimeoutError as exc:
        errors.labels("deadline", tenant).inc()
        f.status = 504
        f.fail_decode(exc)
        yield sse_error("request deadline passed", "timeout", 504)
    except FirstTokenDiffers as exc:
        f.gw.metrics.first_token.labels("differed").inc()
        logger.info("%s: %s; going on from prefill's", f.request_id, exc)
        moved_by = exc
    except EngineFailed as exc:
        errors.labels(f"engine_{exc.role}", tenant).inc()
        f.fail_decode(exc)
        logger.warning("%s", exc)
        if movable and exc.engine:
            moved_by = exc
        else:
            f.status = 502
            yield sse_error(UPSTREAM_FAILED, "bad_gateway", 502)
    except asyncio.CancelledError:
        errors.labels("client_disconnect", tenant).inc()
        f.status = 499
        f.ctx.span.set_attribute("error.type", "client_disconnect")
        raise
    except Exception as exc:
        # The status line is already out: whatever broke, the client must see an error
        # event rather than a stream that just stops.
        logger.exception("stream of %s broke", f.request_id)
        errors.labels("internal", tenant).inc()
        f.status = 500
        f.fail_decode(exc)
        yield sse_error("internal error", "internal_error", 500)
    finally:
        if moved_by is not None:
            f.handed_over = True  # the request and its admission go on in the next flight
        f.close_soon()
    if moved_by is not None:
        async for ev in _migrate(f, relayed, moved_by):
            yield ev


async def _migrate(f: Flight, relayed: list[bytes], cause: EngineFailed
                   ) -> AsyncIterator[bytes]:
    """Go on with a stream whose decode failed after tokens reached the client: place the
    prompt plus what was generated on another decode and relay the rest, as NVIDIA Dynamo
    migrates requests. Without a place for it, the stream ends with an error event.

    A decode whose first token differs from prefill's (:class:`FirstTokenDiffers`) did
    nothing wrong: the request goes on from prefill's token on any decode, that one too."""
    gw, ctx = f.gw, f.ctx
    ctx.migrations += 1
    failed = not isinstance(cause, FirstTokenDiffers)
    if cause.engine and failed:
        gw.mark_suspect(cause.engine, str(cause))
    nf: Flight | None = None
    try:
        text, count = generated(relayed, f.p.path)
        ids = None
        if isinstance(f.p.body.get("prompt"), list):
            counter = await gw.token_counter()
            ids = await asyncio.to_thread(counter.encode_text, text)
        cont = continuation(f.p, text, count, ids)
        if cont is None:
            # Every token was out; only the end was lost.
            gw.spawn(ctx.finish(200))
            yield b"data: [DONE]\n\n"
            return
        rid = f"{f.request_id}-m{ctx.migrations}"
        try:
            a = await gw.schedule(ctx, rid, ctx.prompt_tokens + count, cont.max_tokens,
                                  f.deadline_ms,
                                  [f.a.decode_engine] if f.a.decode_engine and failed else [])
        except HTTPFailure as exc:
            logger.warning("%s cannot move on after %s: %s", f.request_id, cause, exc)
            gw.spawn(ctx.finish(502))
            yield sse_error(UPSTREAM_FAILED, "bad_gateway", 502)
            return
        nf = Flight(gw, ctx, cont, rid, f.deadline_ms, a)
        nf.stats = f.stats  # one stream to the client: TTFT, TPOT and tokens over all of it
        gw.active[rid] = a
        logger.info("moving %s (%d tokens out) from %s to %s", f.request_id, count,
                    f.a.decode_engine, a.decode_engine)
        gw.metrics.errors.labels("migrated" if failed else "first_token_differs",
                                 ctx.tenant).inc()
        ctx.span.add_event("kvpush.migrate", {
            "kvpush.failed_engine": f.a.decode_engine or "",
            "kvpush.decode_engine": a.decode_engine or "", "kvpush.tokens_out": count})
        dec_body = nf.dispatch()
        try:
            async with asyncio.timeout_at(nf.deadline_at):
                nf.start_prefill()
                resp = await nf.race_prefill(asyncio.ensure_future(nf.open_decode(dec_body)))
                events = sse_events(resp, a.decode_engine)
                first = await nf.race_prefill(asyncio.ensure_future(anext(events, b"")))
                check_first_event(first, a.decode_engine)
                if is_role_chunk(first):
                    first = await nf.race_prefill(asyncio.ensure_future(anext(events, b"")))
                    check_first_event(first, a.decode_engine)
        except (TimeoutError, EngineFailed) as exc:
            nf.fail_decode(exc)
            logger.warning("moving %s to %s failed: %s", f.request_id, a.decode_engine, exc)
            nf.status = 504 if isinstance(exc, TimeoutError) else 502
            nf.close_soon()
            yield sse_error(UPSTREAM_FAILED, "bad_gateway", 502) if nf.status == 502 else \
                sse_error("request deadline passed", "timeout", 504)
            return
    except BaseException:
        # The client left (or something broke) before the next flight took over: whatever
        # was taken for it is given back now, not when its leases run out.
        if nf is not None:
            nf.status = 499
            nf.close_soon()
        else:
            gw.spawn(ctx.finish(499))
        raise
    if nf.stats.observe(first):
        nf.stats.last_token_at = time.monotonic()
    async for ev in _relay(nf, [first], events):
        yield ev


class _Cleanup:
    """Starlette background task that closes a flight even if its stream never started."""

    def __init__(self, flight: Flight) -> None:
        self.flight = flight

    async def __call__(self) -> None:
        self.flight.close_soon()
