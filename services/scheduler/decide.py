"""The decision: parse a batch, place each request, reserve in one pipeline, or reject.

Reserving is fenced and idempotent per engine (the reservation id is the request id); the
marker ``kvpush:once:{RID}`` = ``"<entry ref>|<decode engine>"`` (``Pending.ref``: the entry
id, prefixed ``<shard>/`` beyond shard 0) sends a redelivered entry back to the engine that
may already hold its reservation and unmasks duplicate request ids. Answering appends
``"|<fencing token>"``: a redelivered entry whose reservation is gone by then (released when
its request ended, or lost with a Redis master) is answered with that first placement again,
never with a second one.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import NoScriptError

from kvpush.common.engine_view import DECODE_ROLES, EngineView
from kvpush.common.history_cost import HistoryCost
from kvpush.common.prefix_hashes import CHUNK_TOKENS
from kvpush.common.reservations import (
    Reservation,
    ReserveResult,
    ReserveStatus,
    parse_reserve,
)
from kvpush.common.wire import Assignment, encode, now_ms
from kvpush.services.scheduler.affinity import AffinityPart
from kvpush.services.scheduler.fair_queue import Pending
from kvpush.services.scheduler.intake import BadEntry, parse_entry, text
from kvpush.services.scheduler.placement import blocks_needed
from kvpush.services.scheduler.state import Entry, Outbox, Plan, as_str
from kvpush.services.scheduler.streams import StreamsPart

logger = logging.getLogger(__name__)

_TOO_LARGE = "prompt_tokens + max_tokens exceed every decode engine's KV cache"
_PIN_GONE = "the decode engine that holds the prompt's KV takes no requests"


class DecidePart(AffinityPart, StreamsPart):
    """Places requests on the local engine view, reserves them in Redis, fills the outbox."""

    async def handle_entries(
        self,
        entries: list[Entry],
        deliveries: dict[tuple[int, str], int] | None = None,
    ) -> None:
        """Decode, place, reserve and answer a batch of entries (of any shards)."""
        t0 = time.monotonic()
        out = Outbox()
        fresh: list[Pending] = []
        for shard, raw_id, fields in entries:
            eid = as_str(raw_id)
            self.stats.read += 1
            n = (deliveries or {}).get((shard, eid), 1)
            if n > self.s.scheduler_max_deliveries:
                out.dead.append((shard, eid, fields, f"delivered {n} times (max "
                                                     f"{self.s.scheduler_max_deliveries})"))
                continue
            p = self._parse(shard, eid, fields, t0, out)
            if p is None:
                continue
            p.redelivered = deliveries is not None
            fresh.append(p)
        if any(p.redelivered for p in fresh):
            await self._load_markers(fresh)
        await self.load_affinity(fresh)
        plans: list[Plan] = []
        for p in fresh:
            if now_ms() >= p.request.deadline_ms:
                self._reject(p, out, "deadline", "deadline passed before scheduling")
            elif self.decoders and not self._fits_somewhere(p):
                self._reject(p, out, "too_large", _TOO_LARGE)
            elif not self._has_other_decode(p):
                self._reject(p, out, "no_engine", "no other decode engine is alive")
            elif p.request.colocate_on is not None and self.index.decoder(
                    p.request.colocate_on) is None:
                # Its gateway places it afresh: waiting for this engine cannot help.
                self._reject(p, out, "no_engine", _PIN_GONE)
            elif len(self.queue) or not self._plan_into(p, plans):
                if self.queue.full():
                    self._reject(p, out, "overloaded", "scheduler queue is full")
                else:
                    self.queue.push(p)
        if len(self.queue):
            # Whatever still fits goes now, in fair order: a light tenant's new request
            # overtakes a flooding tenant's backlog without waiting for the next retry.
            self._plan_queue(plans)
        await self._execute(plans, out)
        await self.answer(out)
        await self.record_affinity(out.assignments)

    def _parse(self, shard: int, eid: str, fields: dict[bytes, bytes], t0: float,
               out: Outbox) -> Pending | None:
        now = now_ms()
        try:
            req, tp = parse_entry(fields, self.keys, now)
        except BadEntry as exc:
            out.dead.append((shard, eid, fields, str(exc)))
            return None
        left_s = (req.deadline_ms - now) / 1000
        wait = min(self.s.scheduler_queue_timeout_s, max(0.0, left_s))
        return Pending(eid, req, tp, t0, t0 + wait, read_ns=time.time_ns(), shard=shard)

    async def _load_markers(self, items: list[Pending]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for p in items:
            pipe.get(self.keys.request_once(p.request.request_id))
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
        for p, v in zip(items, raw, strict=True):
            if v is not None and not isinstance(v, Exception):
                entry, _, rest = text(v).partition("|")
                engine = rest.partition("|")[0]
                if entry == p.ref:
                    p.preferred_engine = engine or None

    def _plan_into(self, p: Pending, plans: list[Plan], skip: frozenset[str] = frozenset()
                   ) -> bool:
        """Pick engines for ``p`` by the local view and book them there; False if none fits."""
        req = p.request
        if req.exclude_engines:
            skip = skip | frozenset(req.exclude_engines)
        if req.colocate_on is not None:
            return self._plan_colocated(p, plans, skip)
        pref = self.engines.get(p.preferred_engine or "")
        if pref is not None and pref.role in DECODE_ROLES and pref.engine_id not in skip:
            # A redelivered entry goes back where its first attempt may hold a reservation:
            # the local view counts that reservation as taken, the script returns it.
            dec = pref
            blocks = blocks_needed(req.prompt_tokens, req.max_tokens, pref.block_size)
        else:
            best = None
            if req.avoid_engines:
                best = self.index.best_decode(req.prompt_tokens, req.max_tokens,
                                              skip | frozenset(req.avoid_engines))
            best = best or self.index.best_decode(req.prompt_tokens, req.max_tokens, skip)
            best = self.affine_decode(p, best, skip | frozenset(req.avoid_engines))
            if best is None:
                return False
            dec, blocks = best
        pre = history = None
        pre_held = 0
        cost: HistoryCost | None = None
        cached = min(req.prompt_tokens, self.held_by(p, dec.engine_id) * CHUNK_TOKENS)
        alone = cached > 0 and req.prompt_tokens - cached < self.s.scheduler_decode_alone_tokens
        if alone:
            # Conditional disaggregation: decode computes the short uncached tail itself,
            # sooner than a prefill pass plus a push of what it holds already.
            self.stats.decode_alone += 1
        elif req.prompt_tokens >= self.s.scheduler_min_disagg_tokens:
            never = {dec.engine_id, *req.exclude_engines}
            pre = started = self._prefill_started(p, never)
            if pre is None:
                pre = (self.index.pick_prefill(never | set(req.avoid_engines))
                       or self.index.pick_prefill(never))
                pre = self.affine_prefill(p, pre, never | set(req.avoid_engines))
            if pre is not None:
                pre_held = min(req.prompt_tokens, self.held_by(p, pre.engine_id) * CHUNK_TOKENS)
                if started is None:  # a prefill already computing it takes no history
                    found = self.history_source(p, pre, pre_held,
                                                skip | set(req.avoid_engines))
                    if found is not None:
                        source, tokens, cost = found
                        history = (source, tokens) if cost.choice.pushes else None
                self.add_pending_prompt(pre, req.prompt_tokens)
        self.add_reserved(dec, blocks)
        pl = Plan(p, dec, blocks, pre, cached, prefill_held_tokens=pre_held,
                  history_cost=cost)
        if history is not None:
            pl.history, pl.history_tokens = history
            self.stats.history_pushes += 1
        plans.append(pl)
        return True

    def _prefill_started(self, p: Pending, never: set[str]) -> EngineView | None:
        """The prefill engine ``p``'s gateway already sent the prompt to, while it takes
        requests (alive, not draining or suspect, not the decode chosen); else None."""
        on = p.request.prefill_on
        pre = self.index.prefiller(on) if on else None
        if pre is None or pre.engine_id in never:
            return None
        self.stats.prefill_kept += 1
        return pre

    def _plan_colocated(self, p: Pending, plans: list[Plan], skip: frozenset[str]) -> bool:
        """Book ``p`` on the decode engine it names, with no prefill; False until it fits
        there (a request no other engine could serve as cheaply waits its turn for it)."""
        req = p.request
        dec = self.index.decoder(req.colocate_on or "")
        if dec is None or dec.engine_id in skip:
            return False
        blocks = blocks_needed(req.prompt_tokens, req.max_tokens, dec.block_size)
        if blocks > dec.available_blocks:
            return False
        self.add_reserved(dec, blocks)
        plans.append(Plan(p, dec, blocks, None))
        return True

    async def _execute(self, plans: list[Plan], out: Outbox) -> None:
        """Reserve every plan in one pipeline; retry the ones that lost a race elsewhere."""
        tried: dict[str, set[str]] = {}
        while plans:
            pipe = self.redis.pipeline(transaction=False)
            for pl in plans:
                rid = pl.pending.request.request_id
                pipe.set(self.keys.request_once(rid), f"{pl.pending.ref}|"
                         f"{pl.decode.engine_id}", nx=True, get=True, px=self.once_ms)
                self.resv.queue_reserve(pipe, pl.decode.engine_id, rid, pl.blocks, self.lease_ms)
            raw = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            if any(isinstance(x, NoScriptError) for x in raw):
                await self.resv.load()  # reserve and SET NX GET are both safe to repeat
                continue
            retry: list[Plan] = []
            fixups = []
            for i, pl in enumerate(plans):
                marker, res = raw[2 * i], raw[2 * i + 1]
                if isinstance(res, Exception) or isinstance(marker, Exception):
                    logger.error("reserve for %s on %s failed: %s",
                                 pl.pending.request.request_id, pl.decode.engine_id,
                                 res if isinstance(res, Exception) else marker)
                    self._undo_local(pl)
                    if isinstance(marker, Exception):
                        self._requeue_or_reject(pl.pending, out)
                        continue
                    # The engine's reservation keys are broken (garbage written there):
                    # try the others rather than come back to it on every retry.
                    skip = tried.setdefault(pl.pending.ref, set())
                    skip.add(pl.decode.engine_id)
                    if not self._plan_into(pl.pending, retry, frozenset(skip)):
                        self._requeue_or_reject(pl.pending, out)
                    continue
                result = parse_reserve(pl.decode.engine_id, pl.pending.request.request_id, res)
                self.set_reserved(pl.decode, result.reserved_blocks)
                owner = engine = token = None
                if marker is not None:
                    owner, _, rest = text(marker).partition("|")
                    engine, _, token = rest.partition("|")
                if owner is not None and owner != pl.pending.ref:
                    await self._duplicate(pl, result, owner, out)
                    continue
                if result.ok:
                    if (result.status is ReserveStatus.RESERVED and token
                            and engine == pl.decode.engine_id and token.isdigit()):
                        result = await self._first_answer(pl, result, int(token))
                    elif owner is not None:
                        fixups.append(pl)  # redelivery: make the marker name this engine
                    self._assign(pl, result, out)
                    continue
                self._undo_prefill(pl)
                if result.status in (ReserveStatus.ENGINE_GONE, ReserveStatus.NOT_DECODE):
                    rest = dict(self.engines)
                    rest.pop(pl.decode.engine_id, None)
                    self._set_engines(rest)
                elif result.status is ReserveStatus.DRAINING:
                    pl.decode.draining = True  # marked since our last refresh
                    self._set_engines(self.engines)
                skip = tried.setdefault(pl.pending.ref, set())
                skip.add(pl.decode.engine_id)
                pl.pending.preferred_engine = None
                if not self._plan_into(pl.pending, retry, frozenset(skip)):
                    self._requeue_or_reject(pl.pending, out)
            if fixups:
                pipe = self.redis.pipeline(transaction=False)
                for pl in fixups:
                    pipe.set(self.keys.request_once(pl.pending.request.request_id),
                             f"{pl.pending.ref}|{pl.decode.engine_id}", px=self.once_ms)
                await pipe.execute()
                self.stats.round_trips += 1
            plans = retry

    async def _first_answer(self, pl: Plan, result: ReserveResult, token: int
                            ) -> ReserveResult:
        """``pl`` was answered once with ``token``, whose reservation is gone: give back the
        one just made and answer with the first again (its gateway holds it, or takes it if
        that answer was lost; a second placement would only be released as an orphan)."""
        r = result.reservation
        assert r is not None
        self.stats.answered_again += 1
        logger.info("%s was answered with token %d on %s, whose reservation is gone: "
                    "answering that again", r.reservation_id, token, r.engine_id)
        await self.resv.release(r.engine_id, r.reservation_id, r.fencing_token)
        self.stats.round_trips += 1
        self.add_reserved(pl.decode, -pl.blocks)
        first = Reservation(r.engine_id, r.reservation_id, token, r.blocks, r.expiry_ms)
        return ReserveResult(ReserveStatus.EXISTING, first, result.reserved_blocks - r.blocks,
                             result.total_blocks, result.generation)

    async def _duplicate(self, pl: Plan, result: ReserveResult, owner: str,
                         out: Outbox) -> None:
        """``pl``'s request id belongs to another entry: undo what we took, dead-letter it."""
        self.stats.duplicates += 1
        self._undo_prefill(pl)
        if result.status is ReserveStatus.RESERVED and result.reservation is not None:
            # The original holds nothing on this engine, so this reservation is ours alone.
            await self.resv.release(pl.decode.engine_id, result.reservation.reservation_id,
                                    result.reservation.fencing_token)
            self.stats.round_trips += 1
            self.add_reserved(pl.decode, -pl.blocks)
        out.dead.append((pl.pending.shard, pl.pending.entry_id, self._fields(pl.pending),
                         f"duplicate request id {pl.pending.request.request_id} "
                         f"(first seen in entry {owner})"))

    def _undo_prefill(self, pl: Plan) -> None:
        if pl.prefill is not None:
            self.add_pending_prompt(pl.prefill, -pl.pending.request.prompt_tokens)

    def _undo_local(self, pl: Plan) -> None:
        self._undo_prefill(pl)
        self.add_reserved(pl.decode, -pl.blocks)

    def _has_other_decode(self, p: Pending) -> bool:
        """False when the request excludes every live decode engine (a re-route after a
        failure): waiting cannot help it, its gateway answers at once."""
        ex = p.request.exclude_engines
        return not ex or any(e.engine_id not in ex for e in self.decoders)

    def _requeue_or_reject(self, p: Pending, out: Outbox) -> None:
        pin = p.request.colocate_on
        if pin is not None and self.index.decoder(pin) is None:
            self._reject(p, out, "no_engine", _PIN_GONE)
        elif self.queue.full():
            self._reject(p, out, "overloaded", "scheduler queue is full")
        else:
            self.queue.push(p)

    def _fields(self, p: Pending) -> dict[bytes, bytes]:
        return {b"m": encode(p.request), b"tp": p.traceparent}

    def _assign(self, pl: Plan, result: ReserveResult, out: Outbox) -> None:
        r = result.reservation
        assert r is not None
        pre = pl.prefill
        a = Assignment(
            request_id=pl.pending.request.request_id,
            prefill_engine=pre.engine_id if pre else None,
            prefill_url=pre.url if pre else None,
            decode_engine=pl.decode.engine_id,
            decode_url=pl.decode.url,
            reservation_id=r.reservation_id,
            fencing_token=r.fencing_token,
            blocks=r.blocks,
            lease_expiry_ms=r.expiry_ms,
            disaggregated=pre is not None,
            cached_tokens=pl.cached_tokens,
            decode_continues=pl.decode.continues,
            history_engine=pl.history.engine_id if pl.history else None,
            history_url=pl.history.url if pl.history else None,
            history_tokens=pl.history_tokens,
            prefill_held_tokens=pl.prefill_held_tokens,
        )
        if (cost := pl.history_cost) is not None:
            a.history_choice = cost.choice.value
            a.history_recompute_ms = cost.recompute_ms
            a.history_wait_ms = cost.wait_ms
        out.assignments.append((pl.pending, a))
        out.acks.append((pl.pending.shard, pl.pending.entry_id))
        self.stats.assigned += 1

    def _reject(self, p: Pending, out: Outbox, kind: str, error: str) -> None:
        retry = None if kind in ("too_large", "deadline") else self.s.scheduler_retry_after_s
        a = Assignment(request_id=p.request.request_id, ok=False, error=error,
                       error_kind=kind, retry_after_s=retry)
        out.assignments.append((p, a))
        out.acks.append((p.shard, p.entry_id))
        self.stats.rejected += 1
        logger.info("rejected %s (%s): %s", p.request.request_id, kind, error)

    async def drain(self) -> None:
        """Serve waiting requests in order while they fit; reject the ones that waited out."""
        if not len(self.queue):
            return
        out = Outbox()
        if self.decoders:
            # Engines that showed up since these requests arrived may all be too small.
            for p in self.queue.remove_where(lambda p: not self._fits_somewhere(p)):
                self._reject(p, out, "too_large", _TOO_LARGE)
        for p in self.queue.expire(time.monotonic()):
            if now_ms() >= p.request.deadline_ms:
                self._reject(p, out, "deadline", "deadline passed while waiting for a slot")
            elif not self.decoders:
                self._reject(p, out, "no_engine", "no decode engine is alive")
            else:
                self._reject(p, out, "overloaded",
                             "no decode slot freed up within the queue timeout")
        plans: list[Plan] = []
        self._plan_queue(plans)
        await self._execute(plans, out)
        await self.answer(out)
        await self.record_affinity(out.assignments)

    def _plan_queue(self, plans: list[Plan]) -> None:
        while (p := self.queue.peek()) is not None and self._plan_into(p, plans):
            self.queue.pop(p)
