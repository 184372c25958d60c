"""Prefix affinity in the decision: which engines hold each request's prompt prefix (from
their KV events) or, for engines that relay none, where it went before; whether those
engines may take it given their load; and remembering where it goes now (the fallback)."""

from __future__ import annotations

from collections.abc import Collection

from kvpush.common.engine_view import EngineView
from kvpush.common.history_cost import HistoryChoice, HistoryCost, choose
from kvpush.common.prefix_hashes import CHUNK_TOKENS
from kvpush.common.wire import Assignment, now_ms
from kvpush.services.scheduler.engines import EngineViewPart
from kvpush.services.scheduler.fair_queue import Pending
from kvpush.services.scheduler.prefix_affinity import (
    DECODE_SLACK,
    PREFILL_SLACK_TOKENS,
    held_affinity,
    leading_held,
    parse_lookup,
    queue_lookups,
    queue_record,
)


def _draining_holder(e: EngineView | None, now: int) -> bool:
    """A draining engine that is not suspect: it takes no request, but may still push a
    history it holds, so its conversations move with their KV to the engines that take
    their next turns rather than being recomputed once the drain ends it."""
    return e is not None and e.draining and e.suspect_until <= now


def _free_share(e: EngineView) -> float:
    return min(e.total_blocks - e.reserved_blocks, e.free_blocks) / max(1, e.total_blocks)


class AffinityPart(EngineViewPart):
    """Prefix affinity for :class:`~kvpush.services.scheduler.decide.DecidePart`."""

    def _relaying(self) -> list[str]:
        """Usable engines whose KV events say what they hold, and draining ones
        (:func:`_draining_holder`)."""
        ids = {e.engine_id for e in self.decoders if e.kv_events}
        ids.update(e.engine_id for e in self.prefillers if e.kv_events)
        now = now_ms()
        ids.update(e.engine_id for e in self.engines.values()
                   if e.kv_events and _draining_holder(e, now))
        return sorted(ids)

    def _holder(self, engine_id: str) -> EngineView | None:
        """A usable engine, or a draining one that may still push (:func:`_draining_holder`)."""
        e = self.index.decoder(engine_id) or self.index.prefiller(engine_id)
        if e is None and _draining_holder(d := self.engines.get(engine_id), now_ms()):
            e = d
        return e

    async def load_affinity(self, items: list[Pending]) -> None:
        """Look up, in one round trip, which engines hold the prefixes of ``items`` (or,
        without KV events, where they went)."""
        wanted = [p for p in items if p.request.prefix_hashes and p.affinity is None]
        if not wanted or not self.s.scheduler_prefix_affinity:
            return
        one_each = len(self.decoders) <= 1 and len(self.prefillers) <= 1
        relaying = self._relaying()
        if relaying:
            # With one engine per role what decode holds still decides whether it
            # computes the prompt alone.
            if not one_each or self.s.scheduler_decode_alone_tokens > 0 \
                    or self.s.scheduler_history_push_tokens > 0:
                await self._load_held(wanted, relaying)
            return
        if one_each:
            # One engine per role: where a prefix went cannot change the pick, so the
            # round trip would only delay it (where it goes is still recorded).
            return
        pipe = self.redis.pipeline(transaction=False)
        for p in wanted:
            queue_lookups(pipe, self.keys, p.request.prefix_hashes)
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
        for i, p in enumerate(wanted):
            p.affinity = parse_lookup(p.request.prefix_hashes, raw[2 * i], raw[2 * i + 1],
                                      self.keys)

    async def _load_held(self, wanted: list[Pending], relaying: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for p in wanted:
            for e in relaying:
                pipe.smismember(self.keys.kv_chunks(e), p.request.prefix_hashes)
        raw = await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
        decoders = [e.engine_id for e in self.decoders]
        prefillers = [e.engine_id for e in self.prefillers]
        n = len(relaying)
        for i, p in enumerate(wanted):
            held = {e: k for j, e in enumerate(relaying)
                    if (k := leading_held(raw[i * n + j]))}
            p.affinity = held_affinity(held, decoders, prefillers)

    def held_by(self, p: Pending, engine_id: str) -> int:
        """Leading prompt chunks ``engine_id`` holds of ``p`` by its KV events."""
        return p.affinity.held.get(engine_id, 0) if p.affinity is not None else 0

    def history_source(self, p: Pending, pre: EngineView, pre_held: int,
                       skip: Collection[str]) -> tuple[EngineView, int, HistoryCost] | None:
        """The engine that holds the longest prefix of ``p``'s prompt, the tokens of it
        (whole blocks of ``pre``, never the prompt's last token) it would push to ``pre``,
        and whether it does (:func:`~kvpush.common.history_cost.choose` on what ``pre``
        measured, beyond the ``pre_held`` tokens ``pre`` holds itself); None when no other
        engine holds more of it than ``pre`` (prefill computes what it lacks)."""
        least, a = self.s.scheduler_history_push_tokens, p.affinity
        if least <= 0 or a is None or not a.held:
            return None
        best: EngineView | None = None
        chunks = 0
        for engine_id, held in a.held.items():
            if held <= chunks or engine_id == pre.engine_id or engine_id in skip:
                continue
            e = self._holder(engine_id)
            if e is not None:
                best, chunks = e, held
        if best is None:
            return None
        bs = max(1, pre.block_size)
        tokens = min(chunks * CHUNK_TOKENS, p.request.prompt_tokens - 1) // bs * bs
        if tokens <= pre_held:
            return None
        model = self.s.scheduler_history_cost_model
        every = self.s.scheduler_history_explore_every
        cost = choose(tokens - pre_held, least_tokens=least,
                      prefill_tok_s=pre.prefill_tok_s if model else 0,
                      wait_ms=pre.history_wait_ms if model else 0,
                      explore=every > 0 and (self.stats.history_declined + 1) % every == 0)
        if cost.choice is HistoryChoice.SLOWER or cost.choice is HistoryChoice.EXPLORE:
            self.stats.history_declined += 1
        return best, tokens, cost

    def affine_decode(self, p: Pending, best: tuple[EngineView, int] | None,
                      skip: Collection[str]) -> tuple[EngineView, int] | None:
        """The decode holding ``p``'s prefix instead of ``best`` when it fits and is not
        much busier; ``best`` otherwise."""
        a = p.affinity
        if best is None or a is None or a.decode is None or a.decode in skip \
                or a.decode == best[0].engine_id \
                or (a.held and self.held_by(p, best[0].engine_id) >= a.held[a.decode]):
            return best
        e = self.index.decoder(a.decode)
        if e is None:
            return best
        tokens = p.request.prompt_tokens + p.request.max_tokens
        need = max(1, -(-tokens // e.block_size))
        if need > min(e.total_blocks - e.reserved_blocks, e.free_blocks):
            return best
        if _free_share(e) < _free_share(best[0]) - DECODE_SLACK:
            return best
        self.stats.affinity_hits += 1
        return e, need

    def affine_prefill(self, p: Pending, best: EngineView | None,
                       exclude: Collection[str]) -> EngineView | None:
        """The prefill holding ``p``'s prefix instead of ``best`` when it is not much busier."""
        a = p.affinity
        if best is None or a is None or a.prefill is None or a.prefill in exclude \
                or a.prefill == best.engine_id \
                or (a.held and self.held_by(p, best.engine_id) >= a.held[a.prefill]):
            return best
        e = self.index.prefiller(a.prefill)
        if e is None or e.prefill_load > best.prefill_load + PREFILL_SLACK_TOKENS:
            return best
        return e

    async def record_affinity(self, assigned: list[tuple[Pending, Assignment]]) -> None:
        """Remember where the prefixes of the requests just placed went (one round trip)."""
        placed = [(p, a) for p, a in assigned
                  if p.request.prefix_hashes and a.ok and a.decode_engine]
        if not placed or not self.s.scheduler_prefix_affinity or self._relaying():
            return  # the engines' KV events say where prefixes are
        pipe = self.redis.pipeline(transaction=False)
        for p, a in placed:
            queue_record(pipe, self.keys, p.request.prefix_hashes, str(a.decode_engine),
                         a.prefill_engine)
        await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
