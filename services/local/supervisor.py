"""Keeps the local stack's engines up: an engine that exits is withdrawn and restarted."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import httpx

from kvpush.common.backoff import Backoff
from kvpush.services.engine.launcher import EngineProcess

logger = logging.getLogger(__name__)

# An engine that stayed up this long counts as healthy again: its next exit starts the
# backoff from the beginning.
_STABLE_S = 60.0


class EngineState(enum.Enum):
    """Where one supervised engine stands."""

    RUNNING = "running"
    WAITING = "waiting"  # exited; restarts when its backoff delay is over
    BOOTING = "booting"  # restarted; not answering /health yet


@dataclass
class _Watch:
    engine: EngineProcess
    state: EngineState = EngineState.RUNNING
    restart_at: float = 0.0
    since: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff: Backoff = field(default_factory=lambda: Backoff(first=1.0, cap=30.0))


class EngineSupervisor:
    """Call :meth:`tick` from the stack's long-lived main thread (engines are forked from
    the calling thread, and their parent-death signal is tied to it); it never blocks
    on an engine's boot."""

    def __init__(self, engines: list[EngineProcess]) -> None:
        self._watches = [_Watch(e) for e in engines]
        self._http = httpx.Client(timeout=0.5)

    def tick(self) -> None:
        """Notice exits, restart engines whose delay is over, finish restarted boots."""
        now = time.monotonic()
        for w in self._watches:
            e = w.engine
            if w.state is EngineState.RUNNING:
                if e.running():
                    if now - w.since > _STABLE_S:
                        w.backoff.reset()
                    continue
                self._exited(w, now)
            elif w.state is EngineState.WAITING and now >= w.restart_at:
                logger.warning("restarting engine %s (restart %d)", e.engine_id, w.restarts + 1)
                w.restarts += 1
                w.state, w.since = EngineState.BOOTING, now
                try:
                    e.start()
                except Exception:
                    logger.exception("engine %s did not start", e.engine_id)
                    self._exited(w, now)
            elif w.state is EngineState.BOOTING:
                if not e.running():
                    self._exited(w, now)
                elif self._answers(e):
                    e.mark_ready()
                    w.state, w.since = EngineState.RUNNING, now
                    if w.restarts:
                        logger.warning("engine %s is back at %s", e.engine_id, e.url)
                    else:
                        logger.info("engine %s is up at %s", e.engine_id, e.url)

    def add(self, engine: EngineProcess, booting: bool = False) -> None:
        """Watch ``engine`` too; ``booting``: just started, brought in once it answers."""
        state = EngineState.BOOTING if booting else EngineState.RUNNING
        self._watches.append(_Watch(engine, state=state))

    def remove(self, engine: EngineProcess) -> None:
        """Stop watching ``engine`` (it is being stopped on purpose)."""
        self._watches = [w for w in self._watches if w.engine is not engine]

    def _exited(self, w: _Watch, now: float) -> None:
        e = w.engine
        code = e.proc.poll() if e.proc is not None else None
        delay = w.backoff.next()
        logger.error("engine %s exited (code %s); withdrawn, restarting in %.0f s",
                     e.engine_id, code, delay)
        # Withdraws its status from Redis at once, so no scheduler routes to it meanwhile.
        e.stop()
        w.state, w.restart_at = EngineState.WAITING, now + delay

    def _answers(self, e: EngineProcess) -> bool:
        try:
            return self._http.get(f"{e.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def states(self) -> dict[str, tuple[EngineState, int]]:
        """(state, restarts so far) of every engine, by engine id."""
        return {w.engine.engine_id: (w.state, w.restarts) for w in self._watches}

    def close(self) -> None:
        """Release the health-check client."""
        self._http.close()
