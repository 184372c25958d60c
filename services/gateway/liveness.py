"""Engine probes for requests waiting on an engine: one that stopped answering fails them.

A frozen engine (stopped, wedged, cut off) keeps its connections open and answers nothing,
so a request waiting on it for its first token would wait out its whole deadline, although
another engine could serve it. While requests wait on an engine, the gateway GETs its
``/health`` every ``poll_s``; once it has answered no probe for ``unresponsive_s`` (a
timeout, a refused connection or a 5xx each count as no answer), its waiters fail and
:mod:`services.gateway.handler` places them again elsewhere. Probes go to the engine
itself, not to Redis, so a Redis outage never makes an engine look dead. A stream that
already sent tokens is not watched: it cannot be placed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from kvpush.services.gateway.engines import EngineClient

logger = logging.getLogger(__name__)


@dataclass
class _Watched:
    url: str
    last_ok: float
    """Loop time of its last answered probe (or of the first request that waited on it)."""
    waiters: set[asyncio.Future[str]] = field(default_factory=set)


class EngineProbes:
    """Probes the engines requests are waiting on; see the module docstring."""

    def __init__(self, http: EngineClient, unresponsive_s: float) -> None:
        self.http = http
        self.unresponsive_s = unresponsive_s
        self.poll_s = min(1.0, unresponsive_s / 3)
        self._engines: dict[str, _Watched] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, engine: str | None, url: str | None) -> asyncio.Future[str] | None:
        """A future that completes with a reason once ``engine`` (at ``url``) stops
        answering; None when probes are off. Pass it to :meth:`unwatch` when done."""
        if not self.unresponsive_s or not engine or not url:
            return None
        loop = asyncio.get_running_loop()
        w = self._engines.get(engine)
        if w is None or w.url != url:
            w = self._engines[engine] = _Watched(url, loop.time(),
                                                 w.waiters if w is not None else set())
        fut: asyncio.Future[str] = loop.create_future()
        w.waiters.add(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return fut

    def unwatch(self, engine: str | None, fut: asyncio.Future[str] | None) -> None:
        """Stop watching for the caller of :meth:`watch`."""
        if fut is None or engine is None:
            return
        fut.cancel()
        w = self._engines.get(engine)
        if w is not None:
            w.waiters.discard(fut)
            if not w.waiters:
                del self._engines[engine]

    async def close(self) -> None:
        """Stop probing (the gateway is stopping)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._engines:
            started = loop.time()
            engines = list(self._engines.items())
            answered = await asyncio.gather(*(self.http.healthy(w.url, self.poll_s)
                                              for _, w in engines))
            now = loop.time()
            for (engine, w), ok in zip(engines, answered, strict=True):
                if ok:
                    w.last_ok = now
                elif now - w.last_ok >= self.unresponsive_s:
                    self._give_up(engine, w, now - w.last_ok)
            await asyncio.sleep(max(0.0, self.poll_s - (loop.time() - started)))

    def _give_up(self, engine: str, w: _Watched, silent_s: float) -> None:
        reason = f"answered no health probe for {silent_s:.1f} s"
        logger.warning("engine %s %s; %d request(s) waiting on it go elsewhere", engine,
                       reason, len(w.waiters))
        for fut in w.waiters:
            if not fut.done():
                fut.set_result(reason)
        w.last_ok = asyncio.get_running_loop().time()  # next waiters get a fresh window
