"""Stream I/O: the consumer group, reads, reclaims, answers with their acks, trimming."""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from kvpush.common.wire import encode
from kvpush.services.scheduler.state import Outbox, SchedulerState, as_str
from kvpush.services.scheduler.tracing import trace_answer
from kvpush.services.scheduler_input import dead_letter_fields, entry_id_key, trim_behind_groups

logger = logging.getLogger(__name__)

# An assignment stream nobody wrote to for this long goes away (see _queue_answer).
_ASSIGN_TTL_MS = 24 * 3600 * 1000


class StreamsPart(SchedulerState):
    """Talks to the request stream (``XREADGROUP``, ``XAUTOCLAIM``, ``XACK``) and writes
    the answers: assignments on each gateway's stream, dead letters on theirs."""

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if needed."""
        try:
            await self.redis.xgroup_create(self._stream, self._group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def trim(self) -> None:
        """Trim the request stream up to what every consumer group has read."""
        await trim_behind_groups(self.redis, self._stream)

    async def read(self, block_ms: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """New entries for this consumer (blocks up to ``block_ms``).

        Answers the run loop deferred are written first, in the same round trip: Redis runs
        the writes before the read blocks, so they are not delayed, and a busy loop costs
        two round trips per batch instead of three.
        """
        flush, self._unsent = self._unsent, None
        if flush:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_answer(pipe, flush)
            pipe.xreadgroup(self._group, self.consumer, {self._stream: ">"},
                            count=self.s.scheduler_batch, block=block_ms)
            res = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            for r in res[:-1]:
                if isinstance(r, Exception):
                    raise r  # like answer(): the entries stay pending, reclaimed later
            self._answered(flush)
            reply = res[-1]
            if isinstance(reply, Exception):
                raise reply
        else:
            reply = await self.redis.xreadgroup(
                self._group, self.consumer, {self._stream: ">"},
                count=self.s.scheduler_batch, block=block_ms,
            )
            self.stats.round_trips += 1
        if not reply:
            return []
        return reply[0][1]

    async def reclaim(self) -> None:
        """Keep our waiting entries ours; take over entries a dead scheduler left pending."""
        waiting = [p.entry_id for p in self.queue]
        if waiting:
            await self.redis.xclaim(
                self._stream, self._group, self.consumer, 0, waiting, justid=True
            )
            self.stats.round_trips += 1
        reply = await self.redis.xautoclaim(
            self._stream, self._group, self.consumer, self.s.scheduler_claim_idle_ms,
            start_id="0-0", count=self.s.scheduler_batch,
        )
        self.stats.round_trips += 1
        mine = {p.entry_id for p in self.queue}
        claimed = [(eid, f) for eid, f in reply[1] if f is not None and as_str(eid) not in mine]
        if not claimed:
            return
        ids = sorted((as_str(eid) for eid, _ in claimed), key=entry_id_key)
        info = await self.redis.xpending_range(
            self._stream, self._group, min=ids[0], max=ids[-1], count=len(ids) + len(self.queue),
            consumername=self.consumer,
        )
        self.stats.round_trips += 1
        deliveries = {as_str(x["message_id"]): int(x["times_delivered"]) for x in info}
        self.stats.reclaimed += len(claimed)
        logger.info("reclaimed %d entries left pending by another scheduler", len(claimed))
        await self.handle_entries(claimed, deliveries=deliveries)

    async def answer(self, out: Outbox) -> None:
        """Write assignments and dead letters, then acknowledge, in one pipeline.

        Inside the run loop's batch handling the write is deferred to the next read."""
        if not out:
            return
        if self._defer:
            if self._unsent is None:
                self._unsent = out
            else:
                u = self._unsent
                u.assignments += out.assignments
                u.dead += out.dead
                u.acks += out.acks
            return
        pipe = self.redis.pipeline(transaction=False)
        self._queue_answer(pipe, out)
        await pipe.execute()
        self.stats.round_trips += 1
        self._answered(out)

    async def _flush(self) -> None:
        out, self._unsent = self._unsent, None
        if out:
            await self.answer(out)

    def _queue_answer(self, pipe: Any, out: Outbox) -> None:
        gateways = set()
        for p, a in out.assignments:
            pipe.xadd(self.keys.assignments(p.request.gateway_id), {b"m": encode(a)},
                      maxlen=self.s.scheduler_assign_maxlen, approximate=True)
            gateways.add(p.request.gateway_id)
        for g in gateways:
            # A gateway id nobody reads (gone for good, or made up by whoever wrote the
            # entry) must not leave a stream behind forever; a live gateway's XREAD cursor
            # works on a stream created again after it expired.
            pipe.pexpire(self.keys.assignments(g), _ASSIGN_TTL_MS)
        for eid, fields, reason in out.dead:
            logger.warning("dead-lettering entry %s: %s", eid, reason)
            entry = {b"entry": eid, b"reason": reason, b"consumer": self.consumer}
            entry.update(dead_letter_fields(fields))
            pipe.xadd(self.keys.dead_letters(), entry, maxlen=self.s.scheduler_dead_maxlen,
                      approximate=True)
        acks = out.acks + [eid for eid, _, _ in out.dead]
        if acks:
            pipe.xack(self._stream, self._group, *acks)

    def _answered(self, out: Outbox) -> None:
        self.stats.dead += len(out.dead)
        done = time.monotonic()
        self.stats.decision_s.extend(done - p.arrived for p, _ in out.assignments)
        if self.tracing:
            end_ns = time.time_ns()
            for p, a in out.assignments:
                trace_answer(self.tracer, p, a, end_ns, done, stream=self._stream,
                             group=self._group, scheduler=self.consumer)
