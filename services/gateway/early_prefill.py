"""Early prefill: the prompt goes to a prefill engine at admission, while the scheduler is
still choosing decode, so prefill's forward pass races the scheduler's decision instead of
waiting for it.

The request names that engine to the scheduler (``ScheduleRequest.prefill_on``), which keeps
it for a disaggregated placement while it takes requests. The prefill request carries no
decode engine: its connector takes the push target by request id whenever decode publishes
it, so no decode block is written before decode holds the reservation the scheduler made.
When the placement goes elsewhere (another prefill, decode alone, a refusal) the gateway
cancels its call and tells the engine's connector, which frees what it held.

Only while the schedulers keep no queue: when one of this gateway's requests has waited for
its assignment longer than a placement takes (``gateway_early_prefill_queue_s``), the
schedulers' fair order decides who is computed first, prefill included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span
from redis.exceptions import RedisError

from kvpush.common.engine_view import EngineView, view_from_hash
from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncRedis
from kvpush.common.runtime import honour_cancellation, sleep_unless_cancelled
from kvpush.common.wire import PushTarget, encode, now_ms
from kvpush.services.gateway.flight import prefill_call
from kvpush.services.gateway.history import continues_conversation

if TYPE_CHECKING:
    from kvpush.services.gateway.context import RequestCtx
    from kvpush.services.gateway.openai_api import ParsedRequest
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

# Engines whose last heartbeat is older are not even read (as the schedulers do); a dead
# engine's status hash expires well before.
_STALE_MS = 60_000
# How long an engine's target stream may grow, as the decode connectors bound it too
# (connector/config.py's targets_maxlen).
_TARGETS_MAXLEN = 10_000


class PrefillEngines:
    """The dedicated prefill engines this gateway may send a prompt to before its
    assignment: alive, not draining, not suspect, as last read from Redis.

    ``pick`` adds the prompt tokens this gateway sent since the last read to each engine's
    published queue, so a burst between two reads spreads instead of piling on one engine.
    """

    def __init__(self, client: AsyncRedis, keys: RedisKeys, refresh_s: float) -> None:
        self.client = client
        self.keys = keys
        self.refresh_s = refresh_s
        self.engines: dict[str, EngineView] = {}
        self._sent: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read once, then keep reading in the background."""
        await self._refresh_logged()
        self._task = asyncio.create_task(self._run(), name="kvpush-prefill-engines")

    async def stop(self) -> None:
        """Stop reading."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await sleep_unless_cancelled(self.refresh_s)
            await self._refresh_logged()

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:
            # A lost Redis costs early prefill, never the gateway: requests then wait for
            # their assignment as before.
            honour_cancellation()
            self.engines = {}
            logger.warning("reading the prefill engines failed: %s", exc)

    async def refresh(self) -> None:
        """Re-read the engines' statuses; a malformed one is left out (logged once)."""
        now = now_ms()
        ranked = await self.client.zrange(self.keys.engines(), 0, -1, withscores=True)
        ids = [raw.decode(errors="replace") for raw, score in ranked if score >= now - _STALE_MS]
        engines: dict[str, EngineView] = {}
        if ids:
            pipe = self.client.pipeline(transaction=False)
            for e in ids:
                pipe.hgetall(self.keys.engine(e))
            raw = await pipe.execute(raise_on_error=False)
            for e, fields in zip(ids, raw, strict=True):
                if isinstance(fields, RedisError | Exception) or not isinstance(fields, dict):
                    continue
                view = view_from_hash(e, fields)
                if (view is not None and view.role == "prefill" and not view.draining
                        and view.suspect_until <= now):
                    engines[e] = view
        self.engines = engines
        self._sent = {}

    def pick(self, prompt_tokens: int, avoid: Collection[str] = ()) -> EngineView | None:
        """The engine with the fewest queued prompt tokens (ties at random), or None."""
        best: list[EngineView] = []
        best_load = 0
        for e in self.engines.values():
            if e.engine_id in avoid:
                continue
            load = e.queued_prompt_tokens + self._sent.get(e.engine_id, 0)
            if not best or load < best_load:
                best, best_load = [e], load
            elif load == best_load:
                best.append(e)
        if not best:
            return None
        chosen = random.choice(best)
        self._sent[chosen.engine_id] = self._sent.get(chosen.engine_id, 0) + prompt_tokens
        return chosen


class EarlyPrefill:
    """One prompt sent to ``engine`` before its assignment: the call, its span, and how to
    take it back."""

    def __init__(self, gw: Gateway, request_id: str, engine: EngineView, span: Span,
                 task: asyncio.Task[dict[str, Any]], deadline_ms: int) -> None:
        self.gw = gw
        self.request_id = request_id
        self.engine = engine.engine_id
        self.url = engine.url
        self.span = span
        self.task = task
        self.deadline_ms = deadline_ms

    def abandon(self, why: str) -> None:
        """The placement went elsewhere: stop the call (vLLM aborts a request whose
        connection closes) and cancel the push, which frees blocks an answered prefill
        still holds for a target that will never come."""
        self.gw.metrics.early_prefill.labels(why).inc()
        if not self.task.done():
            self.task.cancel()
        self.gw.spawn(self._cancel_push())

    async def _cancel_push(self) -> None:
        with contextlib.suppress(BaseException):
            await self.task
        # The request's push key: the connector takes no target or cancel without it.
        msg = PushTarget(request_id=self.request_id,
                         decode_engine=f"gateway:{self.gw.gateway_id}", decode_generation=0,
                         block_ids=[], num_tokens=0, deadline_ms=self.deadline_ms, cancel=True,
                         push_key=self.gw.push_keys.for_request(self.request_id))
        try:
            await self.gw.redis.xadd(self.gw.keys.targets(self.engine), {"m": encode(msg)},
                                     maxlen=_TARGETS_MAXLEN, approximate=True)
        except RedisError as exc:
            # The engine's connector frees the blocks at the request's deadline instead.
            logger.warning("cancelling the early prefill of %s on %s failed: %s",
                           self.request_id, self.engine, exc)


def start_early_prefill(gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest, request_id: str,
                        deadline_ms: int) -> EarlyPrefill | None:
    """Send the prompt to a prefill engine now, when the request qualifies; else None."""
    s = gw.s
    min_tokens = s.gateway_early_prefill_min_tokens
    if min_tokens is None:
        min_tokens = s.scheduler_min_disagg_tokens
    if (not s.gateway_early_prefill or ctx.colocate_on is not None
            or ctx.prompt_tokens < min_tokens
            or gw.waiter.longest_wait_s() > s.gateway_early_prefill_queue_s):
        return None
    if 0 < s.scheduler_history_push_tokens < ctx.prompt_tokens \
            and continues_conversation(parsed):
        # The engine that generated the last answer may hold enough of this prompt to push
        # it to the prefill the scheduler picks: only the placement knows, and that saves
        # more than starting now.
        return None
    engine = gw.prefill_engines.pick(ctx.prompt_tokens, gw.avoided_engines())
    if engine is None:
        return None
    span, task = prefill_call(gw, ctx, parsed, request_id, deadline_ms, engine.engine_id,
                              engine.url, decode_engine=None)
    ctx.span.set_attribute("kvpush.early_prefill_engine", engine.engine_id)
    return EarlyPrefill(gw, request_id, engine, span, task, deadline_ms)
