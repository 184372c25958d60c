"""Reads a prefill engine's push-target stream on a background thread, for the scheduler
side (the authority on each request's push) and for every worker rank (which starts
writing the moment a target lands, even in the middle of a forward pass)."""

from __future__ import annotations

import collections
import logging
import threading

import redis

from kvpush.common.wire import PushTarget, WireError, decode

logger = logging.getLogger(__name__)


class TargetReader:
    """Background XREAD BLOCK on one target stream into a deque; never blocks vLLM.

    Every reader keeps its own cursor (no consumer group): the scheduler side and each
    worker rank all see every entry. Entries that do not decode are skipped with a log
    line (``log_skips`` off for the workers, whose scheduler side already logs them).
    """

    def __init__(self, client: redis.Redis, stream: str,
                 inbox: collections.deque[PushTarget], *, log_skips: bool = True) -> None:
        self._r = client
        self._stream = stream
        self._inbox = inbox
        self._log_skips = log_skips
        self._stop = threading.Event()
        # Start at the stream's current end before returning, so no target published
        # after the engine is up can slip past (the thread would otherwise race it).
        self._first: str | None = None
        try:
            self._first = self._start_id()
        except (redis.RedisError, OSError) as exc:
            logger.warning("reading %s failed: %s", self._stream, exc)
        self._t = threading.Thread(target=self._run, name="kvpush-targets", daemon=True)
        self._t.start()

    def _start_id(self) -> str:
        last = self._r.xrevrange(self._stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def _run(self) -> None:
        last = self._first
        while not self._stop.is_set():
            try:
                if last is None:
                    last = self._start_id()
                resp = self._r.xread({self._stream: last}, block=1000, count=256)
            except (redis.RedisError, OSError) as exc:
                logger.warning("reading %s failed: %s", self._stream, exc)
                self._stop.wait(1.0)
                continue
            for _stream, entries in resp or ():
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        self._inbox.append(decode(fields[b"m"], PushTarget))
                    except (KeyError, WireError) as exc:
                        if self._log_skips:
                            logger.warning("skipping bad target entry %s: %s", last, exc)

    def close(self) -> None:
        """Stop the thread (it wakes within a second)."""
        self._stop.set()
        self._t.join(timeout=3)
