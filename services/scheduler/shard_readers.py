"""On a Redis Cluster with several request shards: one reader task per shard, one queue out.

On one Redis a single ``XREADGROUP`` blocks on every shard at once. A Cluster refuses a
command whose keys span slots, and each shard has a slot of its own; blocking on the shards
one after another would hold every other shard's requests for the block time. So each shard
gets a task that stays blocked in its own ``XREADGROUP`` (on a connection of its own) and
hands what it reads to the run loop through a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from kvpush.common.redis_client import AsyncRedis, stream_read
from kvpush.common.runtime import honour_cancellation

if TYPE_CHECKING:
    from kvpush.services.scheduler.state import Entry, SchedulerStats

logger = logging.getLogger(__name__)

# A reader's blocking read returns after this long at most and blocks again: short enough to
# stay below any sane socket timeout, long enough to cost nothing while a shard is idle.
_BLOCK_MS = 1000


class ShardReaders:
    """Reader tasks over ``streams`` (shard ``i`` is ``streams[i]``) for one consumer.

    Entries a reader took stay pending under the consumer until answered, like entries in the
    run loop's hands: if the scheduler stops before it handles them, ``XAUTOCLAIM`` gives
    them to another one. A reader that fails hands its error to :meth:`next` and stops.
    """

    def __init__(self, client: AsyncRedis, group: str, consumer: str, streams: list[str],
                 count: int, stats: SchedulerStats, block_ms: int = _BLOCK_MS) -> None:
        self.client = client
        self.group = group
        self.consumer = consumer
        self.streams = streams
        self.count = count
        self.stats = stats
        self.block_ms = block_ms
        # One batch per shard may wait: a busy shard cannot run ahead of the run loop.
        self._out: asyncio.Queue[list[Entry] | BaseException] = asyncio.Queue(len(streams))
        self._tasks: list[asyncio.Task[None]] = []
        self._error: BaseException | None = None

    def start(self) -> ShardReaders:
        """Start one task per shard."""
        self._tasks = [asyncio.create_task(self._read(i, key), name=f"kvpush-shard-{i}")
                       for i, key in enumerate(self.streams)]
        return self

    async def stop(self) -> None:
        """Cancel the readers (entries in flight stay pending, reclaimed later)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _read(self, shard: int, key: str) -> None:
        try:
            while True:
                honour_cancellation()
                args, kw = stream_read(self.client, {key: ">"}, group=self.group,
                                       consumer=self.consumer, count=self.count,
                                       block=self.block_ms)
                reply = await self.client.execute_command(*args, **kw)
                self.stats.round_trips += 1
                if reply:
                    await self._out.put([(shard, eid, f) for eid, f in reply[0][1]])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            honour_cancellation()
            logger.debug("reader of %s failed: %s", key, exc)
            await self._out.put(exc)

    async def next(self, block_ms: int) -> list[Entry]:
        """Whatever the readers have, waiting up to ``block_ms`` for the first batch; raises
        a reader's error (once the entries read before it are handed out)."""
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        try:
            first = await asyncio.wait_for(self._out.get(), block_ms / 1000)
        except TimeoutError:
            return []
        batches = [first]
        while not self._out.empty():
            batches.append(self._out.get_nowait())
        out: list[Entry] = []
        for b in batches:
            if isinstance(b, BaseException):
                self._error = self._error or b
            else:
                out.extend(b)
        if not out and self._error is not None:
            exc, self._error = self._error, None
            raise exc
        return out
