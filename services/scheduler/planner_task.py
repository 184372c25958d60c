"""The fleet planner beside a scheduler: one scheduler of the group leads it (a lease in
Redis), reads the fleet, runs :class:`~kvpush.services.scheduler.planner.Planner` and
publishes the counts, as a :class:`~kvpush.common.wire.FleetPlan` in Redis (what
``kvpush up --autoscale`` applies) and as Prometheus gauges (what KEDA scales the k8s
Deployments on).

Its inputs: the scheduler's own engine view (per-role readiness, KV blocks reserved or used,
requests waiting, prompt tokens queued), the request streams' backlog (entries not delivered
yet plus delivered ones not answered: requests waiting for a slot), and the latencies every
gateway reports into ``kvpush:slo`` (:mod:`services.gateway.slo_report`).
"""

from __future__ import annotations

import contextlib
import logging
import time

from prometheus_client import CollectorRegistry, Gauge
from redis.exceptions import RedisError

from kvpush.common.engine_view import EngineView
from kvpush.common.redis_client import AsyncRedis
from kvpush.common.runtime import sleep_unless_cancelled
from kvpush.common.settings import SchedulerSettings
from kvpush.common.wire import (
    FleetPlan,
    GatewaySlo,
    RolePlan,
    WireError,
    decode,
    encode,
    now_ms,
)
from kvpush.services.scheduler.planner import (
    ROLES,
    Objectives,
    Planner,
    RoleDecision,
    RoleLoad,
    Signals,
)
from kvpush.services.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)

_MAX_GATEWAYS = 1024  # reports read per round; a flood of fields is not read whole
_FORGET_MS = 600_000  # a report this old is deleted (its gateway is gone)


def objectives(s: SchedulerSettings) -> Objectives:
    """The planner's objectives from ``KVPUSH_PLANNER_*``."""
    return Objectives(
        ttft_s=s.planner_ttft_s, itl_s=s.planner_itl_s, kv_high=s.planner_kv_high,
        kv_low=s.planner_kv_low, up_stable_s=s.planner_up_stable_s,
        down_stable_s=s.planner_down_stable_s, min_prefill=s.planner_min_prefill,
        max_prefill=s.planner_max_prefill, min_decode=s.planner_min_decode,
        max_decode=s.planner_max_decode)


def role_load(engines: list[EngineView], role: str) -> RoleLoad:
    """One role's load from the scheduler's view (a ``both`` engine counts as decode)."""
    mine = [e for e in engines if (e.role == role or (role == "decode" and e.role == "both"))
            and not e.draining]
    return RoleLoad(
        ready=len(mine),
        total_blocks=sum(e.total_blocks for e in mine),
        used_blocks=sum(max(e.reserved_blocks, e.total_blocks - e.free_blocks) for e in mine),
        waiting=sum(e.waiting for e in mine),
        queued_prompt_tokens=sum(e.queued_prompt_tokens for e in mine))


def merge_slo(reports: list[GatewaySlo]) -> tuple[int, float, float, int]:
    """(requests, p90 TTFT, mean time per output token, shed) over the gateways' reports:
    the worst gateway's p90 (a fleet meets its objective only where every gateway does),
    the time per token weighted by requests."""
    requests = sum(r.requests for r in reports)
    ttft = max((r.ttft_p90_s for r in reports if r.requests), default=0.0)
    weighted = sum(r.itl_mean_s * r.requests for r in reports if r.requests)
    return (requests, ttft, weighted / requests if requests else 0.0,
            sum(r.shed for r in reports))


class PlannerMetrics:
    """The planner's gauges, in a registry of their own (served on
    ``scheduler_metrics_port``). Only the leader sets the desired counts, so a query of
    their maximum over every scheduler is the plan."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("kvpush_planner_desired_replicas",
                             "Engines of a role the fleet planner asks for", ["role"],
                             registry=r)
        self.ready = Gauge("kvpush_planner_ready_replicas",
                           "Engines of a role serving (not draining)", ["role"], registry=r)
        self.leader = Gauge("kvpush_planner_leader", "1 on the scheduler leading the planner",
                            registry=r)
        self.ttft = Gauge("kvpush_planner_ttft_p90_seconds",
                          "p90 time to first token the gateways report", registry=r)
        self.itl = Gauge("kvpush_planner_itl_seconds",
                         "Mean time per output token the gateways report", registry=r)
        self.backlog = Gauge("kvpush_planner_stream_backlog",
                             "Requests in the request streams not placed yet", registry=r)
        self.kv_usage = Gauge("kvpush_planner_kv_usage", "KV blocks reserved or used, over "
                              "all, per role", ["role"], registry=r)

    def show(self, sig: Signals, plan: dict[str, RoleDecision] | None) -> None:
        self.ttft.set(sig.ttft_p90_s)
        self.itl.set(sig.itl_s)
        self.backlog.set(sig.stream_backlog)
        for role in ROLES:
            load = sig.prefill if role == "prefill" else sig.decode
            self.ready.labels(role).set(load.ready)
            self.kv_usage.labels(role).set(load.kv_usage)
        self.leader.set(1 if plan else 0)
        if plan is None:
            self.desired.clear()  # a follower's counts would only be stale
        else:
            for role, d in plan.items():
                self.desired.labels(role).set(d.desired)


class PlannerTask:
    """Runs beside one scheduler (``run_scheduler``); leads when it holds the lease."""

    def __init__(self, sched: SchedulerState, planner: Planner | None = None) -> None:
        self.sched = sched
        self.s = sched.s
        self.keys = sched.keys
        self.redis: AsyncRedis = sched.redis
        self.planner = planner or Planner(objectives(self.s))
        self.metrics = PlannerMetrics()
        self.id = sched.consumer
        self.leading = False
        self.last: dict[str, RoleDecision] | None = None

    async def run(self) -> None:
        """Every ``planner_period_s`` until cancelled; a Redis error skips one round."""
        period = self.s.planner_period_s
        while True:
            try:
                await self.once()
            except (RedisError, OSError) as exc:
                logger.warning("planner round failed: %s", exc)
            await sleep_unless_cancelled(period)

    async def once(self) -> dict[str, RoleDecision] | None:
        """One round: hold or take the lease, read, decide, publish (only when leading)."""
        await self.sched.ready.wait()  # the engine view is read
        self.leading = await self._lead()
        sig = await self.signals()
        plan = self.planner.decide(sig, time.monotonic()) if self.leading else None
        self.metrics.show(sig, plan)
        if plan is None:
            return None
        if self.last is None or any(plan[r].desired != self.last[r].desired for r in ROLES):
            logger.info("planner: prefill %d -> %d (%s); decode %d -> %d (%s)",
                        plan["prefill"].ready, plan["prefill"].desired,
                        plan["prefill"].reason, plan["decode"].ready,
                        plan["decode"].desired, plan["decode"].reason)
        self.last = plan
        msg = FleetPlan(planner_id=self.id, updated_ms=now_ms(),
                        **{r: RolePlan(ready=d.ready, desired=d.desired, reason=d.reason[:512])
                           for r, d in plan.items()})
        await self.redis.set(self.keys.fleet_plan(), encode(msg),
                             px=int(self.s.planner_period_s * 10_000))
        return plan

    async def _lead(self) -> bool:
        key, ttl = self.keys.planner_lead(), int(self.s.planner_period_s * 3000)
        if await self.redis.set(key, self.id, nx=True, px=ttl):
            if not self.leading:
                logger.info("planner %s leads", self.id)
            return True
        holder = await self.redis.get(key)
        if holder == self.id.encode():
            # Between the GET and this PEXPIRE the lease cannot lapse: it has ttl left.
            await self.redis.pexpire(key, ttl)
            return True
        return False

    async def signals(self) -> Signals:
        """The fleet as the planner reads it now."""
        engines = list(self.sched.engines.values())
        requests, ttft, itl, shed = merge_slo(await self.slo_reports())
        return Signals(prefill=role_load(engines, "prefill"),
                       decode=role_load(engines, "decode"),
                       stream_backlog=await self.stream_backlog(),
                       requests=requests, ttft_p90_s=ttft, itl_s=itl, shed=shed)

    async def stream_backlog(self) -> int:
        """Entries of the request streams not delivered yet plus those delivered and not
        answered (waiting in a scheduler's queue for a slot), over every shard."""
        total = 0
        group = self.sched.consumer_group
        for stream in self.sched.request_streams:
            try:
                groups = await self.redis.xinfo_groups(stream)
            except RedisError as exc:
                if "no such key" in str(exc).lower():
                    continue
                raise
            for g in groups:
                name = g.get("name")
                if (name.decode() if isinstance(name, bytes) else name) != group:
                    continue
                total += int(g.get("pending") or 0) + int(g.get("lag") or 0)
        return total

    async def slo_reports(self) -> list[GatewaySlo]:
        """Fresh gateway reports; stale ones are skipped, long-gone ones deleted, and a
        report that does not decode is logged and skipped."""
        raw = await self.redis.hgetall(self.keys.slo_reports())
        now = now_ms()
        fresh: list[GatewaySlo] = []
        gone: list[bytes] = []
        for field, value in list(raw.items())[:_MAX_GATEWAYS]:
            try:
                rep = decode(value, GatewaySlo)
            except WireError as exc:
                logger.warning("gateway SLO report %r skipped: %s", field[:64], exc)
                gone.append(field)
                continue
            age = now - rep.updated_ms
            if age > _FORGET_MS:
                gone.append(field)
            elif age <= 1000 * max(3 * self.s.planner_period_s, rep.window_s):
                fresh.append(rep)
        if gone:
            with contextlib.suppress(RedisError):
                await self.redis.hdel(self.keys.slo_reports(), *gone)
        return fresh
