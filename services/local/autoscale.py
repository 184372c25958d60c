"""``kvpush up --autoscale``: the fleet planner's counts applied to the local stack's engines.

The planner (in the stack's scheduler, services/scheduler/planner_task.py) decides; this only
applies its :class:`~kvpush.common.wire.FleetPlan`, between one engine per role and
``--max-prefill`` / ``--max-decode``. An engine is added at the role's next port and boots
while the others serve (the supervisor brings it in once it answers). One is removed by
draining it first: it is marked draining, gets nothing new, and is stopped only when no
reservation, push or stream is left on it, so a scale-down fails no request. The newest
engine goes first; the stack's first engine of a role is never removed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import FleetPlan, WireError, decode, now_ms
from kvpush.services.engine.foreground import drain_engine
from kvpush.services.engine.launcher import EngineProcess
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.supervisor import EngineState, EngineSupervisor

if TYPE_CHECKING:  # stack.py runs the autoscaler
    from kvpush.services.local.stack import LocalStack

logger = logging.getLogger(__name__)

_DRAIN_TIMEOUT_S = 600.0  # longer than any request may last (the gateway's deadline)


@dataclass
class _Drain:
    engine: EngineProcess
    thread: threading.Thread
    drained: list[bool] = field(default_factory=list)


class LocalAutoscaler:
    """Call :meth:`tick` from the stack's main thread (engines fork from it)."""

    def __init__(self, stack: LocalStack, supervisor: EngineSupervisor,
                 max_engines: dict[str, int], plan_max_age_s: float = 30.0) -> None:
        self.stack = stack
        self.supervisor = supervisor
        self.max = {role: max(1, n) for role, n in max_engines.items()}
        self.plan_max_age_ms = int(plan_max_age_s * 1000)
        self.keys = RedisKeys(stack.settings.key_prefix)
        self.redis = redis.Redis.from_url(stack.redis_url, socket_timeout=2.0)
        self._drains: dict[str, _Drain] = {}
        self.events: list[str] = []  # what it did, in order (``kvpush up`` prints them)

    def _engines(self, role: str) -> list[EngineProcess]:
        return self.stack.prefills if role == "prefill" else self.stack.decodes

    def read_plan(self) -> FleetPlan | None:
        """The planner's latest plan, or None when there is none (or it is stale, or it
        does not decode: logged)."""
        try:
            raw = self.redis.get(self.keys.fleet_plan())
        except redis.RedisError as exc:
            logger.warning("autoscale: the plan is unreadable: %s", exc)
            return None
        if raw is None:
            return None
        try:
            plan = decode(raw, FleetPlan)
        except WireError as exc:
            logger.warning("autoscale: plan ignored: %s", exc)
            return None
        return plan if now_ms() - plan.updated_ms <= self.plan_max_age_ms else None

    def tick(self) -> None:
        """Finish drains that ended, then move each role one engine toward the plan."""
        self._finish_drains()
        plan = self.read_plan()
        if plan is None:
            return
        for role, rp in (("prefill", plan.prefill), ("decode", plan.decode)):
            engines = self._engines(role)
            if not engines:
                continue  # a colocated stack has no prefill to size
            serving = [e for e in engines if e.engine_id not in self._drains]
            want = min(self.max[role], max(1, rp.desired))
            booting = any(self._state(e) is not EngineState.RUNNING for e in serving)
            if want > len(serving) and not booting:
                self._add(role, rp.reason)
            elif want < len(serving) and not any(
                    d.engine in engines for d in self._drains.values()):
                self._remove(serving[-1], rp.reason)

    def _state(self, e: EngineProcess) -> EngineState | None:
        st = self.supervisor.states().get(e.engine_id)
        return st[0] if st else None

    def _add(self, role: str, reason: str) -> None:
        s = self.stack.settings
        base = s.stack_prefill_port if role == "prefill" else s.stack_decode_port
        used = {e.spec.port for e in self._engines(role)}
        port = next(base + 2 * i for i in range(1024) if base + 2 * i not in used)
        cpus = self.stack.prefill_cpus if role == "prefill" else self.stack.decode_cpus
        engine = EngineProcess(self.stack._spec(role, port, cpus), resolve=local_model)
        try:
            engine.start()
        except Exception:
            logger.exception("autoscale: a %s engine did not start", role)
            return
        self._engines(role).append(engine)
        self.supervisor.add(engine, booting=True)
        self._note(f"added {engine.engine_id} ({reason})")

    def _remove(self, engine: EngineProcess, reason: str) -> None:
        if engine is self._engines(engine.spec.role)[0]:
            return
        result: list[bool] = []
        thread = threading.Thread(
            target=lambda: result.append(drain_engine(engine, _DRAIN_TIMEOUT_S)),
            name=f"kvpush-drain-{engine.engine_id}", daemon=True)
        self._drains[engine.engine_id] = _Drain(engine, thread, result)
        thread.start()
        self._note(f"draining {engine.engine_id} ({reason})")

    def _finish_drains(self) -> None:
        for eid, d in list(self._drains.items()):
            if d.thread.is_alive():
                continue
            del self._drains[eid]
            self.supervisor.remove(d.engine)
            d.engine.stop()
            engines = self._engines(d.engine.spec.role)
            if d.engine in engines:
                engines.remove(d.engine)
            how = "drained" if d.drained and d.drained[0] else "not drained (timeout)"
            self._note(f"removed {eid} ({how})")

    def _note(self, what: str) -> None:
        logger.info("autoscale: %s", what)
        self.events.append(what)
        print(f"kvpush autoscale: {what}", flush=True)

    def close(self) -> None:
        """Wait for nothing: drains in progress end with the stack's own stop."""
        self.redis.close()
