"""Stream I/O: consumer group, reads, reclaims, answers with their acks, trimming (every shard)."""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from kvpush.common.redis_client import is_cluster, stream_read
from kvpush.common.wire import encode
from kvpush.services.scheduler.intake import dead_letter_fields, entry_id_key, trim_behind_groups
from kvpush.services.scheduler.shard_readers import ShardReaders
from kvpush.services.scheduler.state import Entry, Outbox, SchedulerState, as_str
from kvpush.services.scheduler.tracing import trace_answer

logger = logging.getLogger(__name__)

# An assignment stream nobody wrote to for this long goes away (see _queue_answer).
_ASSIGN_TTL_MS = 24 * 3600 * 1000


class StreamsPart(SchedulerState):
    """Talks to the request streams (``XREADGROUP``, ``XAUTOCLAIM``, ``XACK``) and writes
    the answers: assignments on each gateway's stream, dead letters on theirs.

    With ``request_shards > 1`` every call covers every shard: one multi-stream
    ``XREADGROUP`` on a single Redis, one reader task per shard on a Cluster (see
    ``shard_readers.py``); the rest is pipelined per shard (a Cluster pipeline splits by node).
    """

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) on every shard if needed."""
        for key in self._streams:
            try:
                await self.redis.xgroup_create(key, self._group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def trim(self) -> None:
        """Trim each request stream up to what every consumer group has read."""
        for key in self._streams:
            await trim_behind_groups(self.redis, key)

    async def read(self, block_ms: int) -> list[Entry]:
        """New entries for this consumer, from every shard (blocks up to ``block_ms``).

        Answers the run loop deferred are written first, in the same round trip: Redis runs
        the writes before the read blocks, so they are not delayed, and a busy loop costs
        two round trips per batch instead of three. (Not with shard readers: their reads
        are in flight already, the answers go in a pipeline of their own.)
        """
        if len(self._streams) > 1 and is_cluster(self.redis):
            await self._flush()
            if self._readers is None:
                self._readers = ShardReaders(
                    self.redis, self._group, self.consumer, self._streams, self._read_count,
                    self.stats, block_ms=min(1000, int(self.s.redis_socket_timeout_s * 500)),
                ).start()
            return await self._readers.next(block_ms)
        args, kw = stream_read(self.redis, dict.fromkeys(self._streams, ">"),
                               group=self._group, consumer=self.consumer,
                               count=self._read_count, block=block_ms)
        flush, self._unsent = self._unsent, None
        if flush:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_answer(pipe, flush)
            pipe.execute_command(*args, **kw)
            # The answers are written when the pipeline arrives, not when the read that
            # rides behind them stops blocking.
            sent = (time.monotonic(), time.time_ns())
            res = await pipe.execute(raise_on_error=False)
            self.stats.round_trips += 1
            for r in res[:-1]:
                if isinstance(r, Exception):
                    raise r  # like answer(): the entries stay pending, reclaimed later
            self._answered(flush, sent)
            reply = res[-1]
            if isinstance(reply, Exception):
                raise reply
        else:
            reply = await self.redis.execute_command(*args, **kw)
            self.stats.round_trips += 1
        out: list[Entry] = []
        for key, entries in reply or []:
            shard = self._shard_of[key if isinstance(key, bytes) else str(key).encode()]
            out.extend((shard, eid, f) for eid, f in entries)
        return out

    async def stop_readers(self) -> None:
        """Stop the shard readers, if any (the run loop ends)."""
        readers, self._readers = self._readers, None
        if readers is not None:
            await readers.stop()

    async def reclaim(self) -> None:
        """Keep our waiting entries ours; take over entries a dead scheduler left pending."""
        waiting: dict[int, list[str]] = {}
        for p in self.queue:
            waiting.setdefault(p.shard, []).append(p.entry_id)
        pipe = self.redis.pipeline(transaction=False)
        for shard, ids in waiting.items():
            pipe.xclaim(self._streams[shard], self._group, self.consumer, 0, ids, justid=True)
        for key in self._streams:
            pipe.xautoclaim(key, self._group, self.consumer, self.s.scheduler_claim_idle_ms,
                            start_id="0-0", count=self._read_count)
        replies = (await pipe.execute())[len(waiting):]
        self.stats.round_trips += 1
        mine = {(p.shard, p.entry_id) for p in self.queue}
        claimed: list[Entry] = []
        for shard, reply in enumerate(replies):
            claimed += [(shard, eid, f) for eid, f in reply[1]
                        if f is not None and (shard, as_str(eid)) not in mine]
        if not claimed:
            return
        by_shard: dict[int, list[str]] = {}
        for shard, eid, _ in claimed:
            by_shard.setdefault(shard, []).append(as_str(eid))
        pipe = self.redis.pipeline(transaction=False)
        for shard, ids in by_shard.items():
            ids.sort(key=entry_id_key)
            pipe.xpending_range(self._streams[shard], self._group, min=ids[0], max=ids[-1],
                                count=len(ids) + len(self.queue), consumername=self.consumer)
        infos = await pipe.execute()
        self.stats.round_trips += 1
        deliveries = {(shard, as_str(x["message_id"])): int(x["times_delivered"])
                      for shard, info in zip(by_shard, infos, strict=True) for x in info}
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
            if a.ok and a.decode_engine is not None:
                # The marker learns the token this request was answered with (decide.py).
                pipe.set(self.keys.request_once(a.request_id),
                         f"{p.ref}|{a.decode_engine}|{a.fencing_token}", xx=True,
                         keepttl=True)
        for g in gateways:
            # A gateway id nobody reads (gone for good, or made up by whoever wrote the
            # entry) must not leave a stream behind forever; a live gateway's XREAD cursor
            # works on a stream created again after it expired.
            pipe.pexpire(self.keys.assignments(g), _ASSIGN_TTL_MS)
        acks: dict[int, list[str]] = {}
        for shard, eid in out.acks:
            acks.setdefault(shard, []).append(eid)
        for shard, eid, fields, reason in out.dead:
            logger.warning("dead-lettering entry %s of %s: %s", eid, self._streams[shard],
                           reason)
            entry = {b"entry": eid, b"stream": self._streams[shard], b"reason": reason,
                     b"consumer": self.consumer}
            entry.update(dead_letter_fields(fields))
            pipe.xadd(self.keys.dead_letters(), entry, maxlen=self.s.scheduler_dead_maxlen,
                      approximate=True)
            acks.setdefault(shard, []).append(eid)
        for shard, ids in acks.items():
            pipe.xack(self._streams[shard], self._group, *ids)

    def _answered(self, out: Outbox, sent: tuple[float, int] | None = None) -> None:
        """Count and trace ``out`` as answered at ``sent`` (monotonic, wall ns): when its
        pipeline went out, default now."""
        self.stats.dead += len(out.dead)
        done, end_ns = sent or (time.monotonic(), time.time_ns())
        self.stats.decision_s.extend(done - p.arrived for p, _ in out.assignments)
        if self.tracing:
            for p, a in out.assignments:
                trace_answer(self.tracer, p, a, end_ns, done, stream=self._streams[p.shard],
                             group=self._group, scheduler=self.consumer)
