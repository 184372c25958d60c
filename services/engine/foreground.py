"""``kvpush engine`` in the foreground, and draining an engine before it stops."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from kvpush.common.settings import EngineSettings
from kvpush.services.engine.launcher import EngineProcess, EngineSpec, ModelResolver, resolve_model
from kvpush.services.proc import drain_events_on_signals

logger = logging.getLogger(__name__)


def drain_engine(engine: EngineProcess, timeout_s: float,
                 now: threading.Event | None = None) -> bool:
    """Mark ``engine`` draining and wait until it holds nothing (or ``timeout_s``, ``now``
    set, the process gone). True when it drained; without a heartbeat there is nothing to
    mark and it returns False at once."""
    import redis

    from kvpush.services.engine.drain import (
        UnknownEngine,
        describe,
        mark_draining,
        wait_drained,
    )

    pub = engine.publisher
    if pub is None or timeout_s <= 0 or (now is not None and now.is_set()):
        return False
    try:
        mark_draining(pub.client, pub.keys, engine.engine_id)
        print(f"kvpush engine {engine.engine_id} draining (up to {timeout_s:g} s; "
              "signal again to stop now)", flush=True)
        res = wait_drained(pub.client, pub.keys, engine.engine_id, timeout_s=timeout_s,
                           settle_s=min(2.0, 2 * engine.spec.heartbeat_s), abort=now,
                           alive=engine.running)
    except (UnknownEngine, redis.RedisError) as exc:
        logger.warning("engine %s: cannot drain (%s); stopping now", engine.engine_id, exc)
        return False
    logger.info("%s", describe(engine.engine_id, res))
    return res.drained


def run_engine(spec: EngineSpec, resolve: ModelResolver = resolve_model) -> int:
    """Foreground ``kvpush engine``: start, serve until SIGINT/SIGTERM, drain, stop cleanly.

    The first signal drains (see :func:`drain_engine`), a second one stops at once.
    """
    stop, now = drain_events_on_signals("the engine")
    if spec.zygote_dir is None and EngineSettings().engine_zygote_dir is None:
        # A zygote of its own would only keep vLLM's imports in memory for a restart
        # this command never does; shared ones serve the host's other launchers too.
        spec = replace(spec, zygote=False)
    engine = EngineProcess(spec, resolve)
    try:
        engine.start().wait_ready()
        print(f"kvpush engine {engine.engine_id} serving {engine.url}", flush=True)
        while not stop.wait(1.0):
            if not engine.running():
                logger.error("engine %s exited unexpectedly", engine.engine_id)
                return 1
        drain_engine(engine, spec.drain_timeout_s, now)
        return 0
    finally:
        engine.stop()
