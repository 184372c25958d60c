"""Prefix affinity in the decision: where each request's prompt prefix went before, whether
those engines may take it again given their load, and remembering where it goes now."""

from __future__ import annotations

from collections.abc import Collection

from kvpush.common.wire import Assignment
from kvpush.services.scheduler.engines import EngineViewPart
from kvpush.services.scheduler.fair_queue import Pending
from kvpush.services.scheduler.placement import EngineView
from kvpush.services.scheduler.prefix_affinity import (
    DECODE_SLACK,
    PREFILL_SLACK_TOKENS,
    parse_lookup,
    queue_lookups,
    queue_record,
)


def _free_share(e: EngineView) -> float:
    return min(e.total_blocks - e.reserved_blocks, e.free_blocks) / max(1, e.total_blocks)


class AffinityPart(EngineViewPart):
    """Prefix affinity for :class:`~kvpush.services.scheduler.decide.DecidePart`."""

    async def load_affinity(self, items: list[Pending]) -> None:
        """Look up, in one round trip, where the prefixes of ``items`` went."""
        wanted = [p for p in items if p.request.prefix_hashes and p.affinity is None]
        if not wanted or not self.s.scheduler_prefix_affinity:
            return
        if len(self.decoders) <= 1 and len(self.prefillers) <= 1:
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

    def affine_decode(self, p: Pending, best: tuple[EngineView, int] | None,
                      skip: Collection[str]) -> tuple[EngineView, int] | None:
        """The decode holding ``p``'s prefix instead of ``best`` when it fits and is not
        much busier; ``best`` otherwise."""
        a = p.affinity
        if best is None or a is None or a.decode is None or a.decode in skip \
                or a.decode == best[0].engine_id:
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
                or a.prefill == best.engine_id:
            return best
        e = self.index.prefiller(a.prefill)
        if e is None or e.prefill_load > best.prefill_load + PREFILL_SLACK_TOKENS:
            return best
        return e

    async def record_affinity(self, assigned: list[tuple[Pending, Assignment]]) -> None:
        """Remember where the prefixes of the requests just placed went (one round trip)."""
        placed = [(p, a) for p, a in assigned
                  if p.request.prefix_hashes and a.ok and a.decode_engine]
        if not placed or not self.s.scheduler_prefix_affinity:
            return
        pipe = self.redis.pipeline(transaction=False)
        for p, a in placed:
            queue_record(pipe, self.keys, p.request.prefix_hashes, str(a.decode_engine),
                         a.prefill_engine)
        await pipe.execute(raise_on_error=False)
        self.stats.round_trips += 1
