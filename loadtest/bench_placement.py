"""Placement at scale: the real scheduler's cost and Redis round trips per decision, 2-64 engines.

For each fleet size N it registers N decode and N prefill engine statuses (no real engines) in
a real Redis, runs the real :class:`~kvpush.services.scheduler.Scheduler` loop in this
process on a client that counts round trips (one per write to the socket: a pipeline is one)
and commands, and pushes requests through it closed-loop: enqueue one, wait for its
assignment, enqueue the next. It reports, per N:

* **decide**: the scheduler's time for one decision (``handle_entries``: parse, place,
  reserve pipeline, outbox), p50/p99; **place**: the placement alone (engine choice on the
  local view, no Redis); **e2e**: enqueue to assignment read back, as a gateway sees it.
* **RT/decision**: round trips on the decision path (the read that delivered the request
  plus the reserve pipeline; the answer rides with the next read), and all-in (background
  work of the window included); **cmds/decision** the commands the scheduler sent for it.
* **background**: engine-view refreshes in the window, their time and round trips each.

Timings are whatever this machine gives; the counts are what the flatness test checks
(``tests/test_bench_placement.py``). Take real numbers on a quiet machine:

    kvpush bench placement --engines 2,4,8,16,32,64 --decisions 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.settings import SchedulerSettings
from kvpush.common.wire import Assignment, ScheduleRequest, decode, encode, now_ms
from kvpush.loadtest.bench_scheduler import publish_engines
from kvpush.services.scheduler import Plan, Scheduler
from kvpush.services.scheduler.fair_queue import Pending

logger = logging.getLogger(__name__)

ENGINE_COUNTS = (2, 4, 8, 16, 32, 64)
GATEWAY = "bench-placement"
K = RedisKeys()
T = TypeVar("T")


@dataclass
class Meter:
    """Round trips and commands one client sent (shared by its pool's connections)."""

    trips: int = 0
    commands: int = 0


def counting_client(url: str, meter: Meter) -> aioredis.Redis:
    """An asyncio client whose every socket write counts as one round trip in ``meter``
    (a pipeline is one write) and every packed command as one command. A new connection's
    handshake (HELLO, CLIENT SETINFO) is not counted: it is no part of any decision."""

    class CountingConnection(aioredis.Connection):
        handshake = False

        async def on_connect_check_health(self, check_health: bool = True) -> None:
            self.handshake = True
            try:
                await super().on_connect_check_health(check_health)
            finally:
                self.handshake = False

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not self.handshake:
                meter.trips += 1
            await super().send_packed_command(command, check_health)

        def pack_command(self, *args: Any) -> list[bytes]:
            if not self.handshake:
                meter.commands += 1
            return super().pack_command(*args)

    pool = aioredis.ConnectionPool.from_url(url, connection_class=CountingConnection)
    return aioredis.Redis(connection_pool=pool)


@dataclass
class Window:
    """What the scheduler did while it was being measured."""

    decide_s: list[float] = field(default_factory=list)
    place_s: list[float] = field(default_factory=list)
    decision_trips: int = 0
    decision_commands: int = 0
    decisions: int = 0
    background: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    """Part name -> (seconds, round trips, commands) per call."""
    empty_reads: int = 0


class MeteredScheduler(Scheduler):
    """The real scheduler, unchanged, with each part timed and its round trips attributed:
    reads that brought entries and ``handle_entries`` to decisions, the rest to background."""

    def __init__(self, settings: SchedulerSettings, client: aioredis.Redis,
                 meter: Meter) -> None:
        super().__init__(settings, client)
        self.meter = meter
        self.window = Window()
        self._inside = False  # a part's nested calls (reclaim -> handle_entries) count once

    async def _metered(self, part: str, call: Callable[[], Awaitable[T]]) -> T:
        if self._inside:
            return await call()
        self._inside = True
        t0, rt0, c0 = time.perf_counter(), self.meter.trips, self.meter.commands
        try:
            return await call()
        finally:
            self._inside = False
            self.window.background.setdefault(part, []).append(
                (time.perf_counter() - t0, self.meter.trips - rt0, self.meter.commands - c0))

    async def read(self, block_ms: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        rt0, c0 = self.meter.trips, self.meter.commands
        got = await super().read(block_ms)
        if got:
            self.window.decision_trips += self.meter.trips - rt0
            self.window.decision_commands += self.meter.commands - c0
        else:
            self.window.empty_reads += 1
        return got

    async def handle_entries(self, entries: list[tuple[bytes, dict[bytes, bytes]]],
                             deliveries: dict[str, int] | None = None) -> None:
        if self._inside:
            await super().handle_entries(entries, deliveries)
            return
        t0, rt0, c0 = time.perf_counter(), self.meter.trips, self.meter.commands
        await super().handle_entries(entries, deliveries)
        w = self.window
        w.decide_s.append((time.perf_counter() - t0) / max(1, len(entries)))
        w.decisions += len(entries)
        w.decision_trips += self.meter.trips - rt0
        w.decision_commands += self.meter.commands - c0

    def _plan_into(self, p: Pending, plans: list[Plan],
                   skip: frozenset[str] = frozenset()) -> bool:
        t0 = time.perf_counter()
        ok = super()._plan_into(p, plans, skip)
        self.window.place_s.append(time.perf_counter() - t0)
        return ok

    async def refresh(self) -> None:
        await self._metered("refresh", super().refresh)

    async def refresh_reserved(self) -> None:
        await self._metered("refresh_reserved", super().refresh_reserved)

    async def reclaim(self) -> None:
        await self._metered("reclaim", super().reclaim)

    async def sweep(self) -> None:
        await self._metered("sweep", super().sweep)

    async def trim(self) -> None:
        await self._metered("trim", super().trim)


@dataclass
class PlacementRow:
    """One fleet size's figures (times in microseconds unless named otherwise)."""

    engines: int
    decisions: int
    decide_p50_us: float
    decide_p99_us: float
    place_p50_us: float
    place_p99_us: float
    e2e_p50_us: float
    e2e_p99_us: float
    rt_per_decision: float
    rt_per_decision_all_in: float
    cmds_per_decision: float
    refreshes: int
    refresh_p50_ms: float
    refresh_max_ms: float
    refresh_rt: float
    """Round trips of one refresh (the same for every refresh of a run)."""
    refresh_cmds: float
    seconds: float
    background: dict[str, Any] = field(default_factory=dict)


def _pct(xs: list[float], q: float, scale: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[int(q * (len(s) - 1))] * scale


async def measure(redis_url: str, engines: int, decisions: int,
                  settings: dict[str, Any] | None = None) -> PlacementRow:
    """Register ``engines`` decode + ``engines`` prefill statuses in the (flushed) Redis at
    ``redis_url``, push ``decisions`` requests through a metered scheduler, closed-loop.

    ``settings`` override scheduler settings (a test sets long background periods so that
    only decisions happen in the window). Ends with one explicit refresh, so every row has
    at least one refresh measured."""
    sync = redis.Redis.from_url(redis_url)
    sync.flushall()
    publish_engines(sync, engines, engines)
    sync.close()
    s = SchedulerSettings(**{"redis_url": redis_url, "scheduler_id": "bench-placement",
                             **(settings or {})})
    meter = Meter()
    client = counting_client(redis_url, meter)
    driver = aioredis.Redis.from_url(redis_url)
    sched = MeteredScheduler(s, client, meter)
    task = asyncio.create_task(sched.run())
    try:
        ready = asyncio.create_task(sched.ready.wait())
        await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        if not ready.done():
            ready.cancel()
            raise RuntimeError("scheduler did not become ready in 30 s")
        e2e: list[float] = []
        cursor = b"0-0"
        t_start, rt_start = time.perf_counter(), meter.trips
        # Warm-up (first decisions pay for connections and script loads), then a clean window.
        for i in range(decisions + 20):
            if i == 20:
                sched.window = Window()
                t_start, rt_start = time.perf_counter(), meter.trips
            req = ScheduleRequest(request_id=f"cmpl-{uuid.uuid4().hex}", gateway_id=GATEWAY,
                                  prompt_tokens=512, max_tokens=64,
                                  deadline_ms=now_ms() + 60_000)
            t0 = time.perf_counter()
            await driver.xadd(K.requests(), {b"m": encode(req), b"tp": b"00-x-y-00"})
            a = None
            while a is None:
                reply = await driver.xread({K.assignments(GATEWAY): cursor}, count=1,
                                           block=10_000)
                if not reply:
                    raise RuntimeError(f"no assignment in 10 s (decision {i}, {engines} "
                                       "engines)")
                cursor, f = reply[0][1][0]
                a = decode(f[b"m"], Assignment)
            if not a.ok:
                raise RuntimeError(f"rejected: {a.error}")
            if i >= 20:
                e2e.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - t_start
        all_trips = meter.trips - rt_start
        w = sched.window
        # One refresh outside the loop, in case the window saw none.
        if not w.background.get("refresh"):
            await sched.refresh()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await driver.aclose()
    refresh = w.background.get("refresh", [])
    bg = {part: {"calls": len(v), "p50_ms": round(_pct([x[0] for x in v], 0.5, 1e3), 3),
                 "max_ms": round(max(x[0] for x in v) * 1e3, 3),
                 "rt_each": statistics.mean(x[1] for x in v),
                 "cmds_each": statistics.mean(x[2] for x in v)}
          for part, v in w.background.items() if v}
    n = max(1, w.decisions)
    return PlacementRow(
        engines=engines, decisions=w.decisions,
        decide_p50_us=_pct(w.decide_s, 0.5, 1e6), decide_p99_us=_pct(w.decide_s, 0.99, 1e6),
        place_p50_us=_pct(w.place_s, 0.5, 1e6), place_p99_us=_pct(w.place_s, 0.99, 1e6),
        e2e_p50_us=_pct(e2e, 0.5, 1e6), e2e_p99_us=_pct(e2e, 0.99, 1e6),
        rt_per_decision=w.decision_trips / n, rt_per_decision_all_in=all_trips / n,
        cmds_per_decision=w.decision_commands / n,
        refreshes=len(refresh),
        refresh_p50_ms=_pct([x[0] for x in refresh], 0.5, 1e3),
        refresh_max_ms=max((x[0] for x in refresh), default=0.0) * 1e3,
        refresh_rt=statistics.mean(x[1] for x in refresh) if refresh else 0.0,
        refresh_cmds=statistics.mean(x[2] for x in refresh) if refresh else 0.0,
        seconds=seconds, background=bg)


def render(rows: list[PlacementRow]) -> str:
    """The table ``kvpush bench placement`` prints."""
    hdr = (f"{'engines':>8} {'decisions':>9} {'decide p50':>10} {'p99 us':>8} "
           f"{'place p50':>9} {'p99 us':>7} {'e2e p50':>8} {'p99 us':>8} {'RT/dec':>7} "
           f"{'all-in':>7} {'cmds/dec':>8} {'refreshes':>9} {'refresh ms':>10} {'RT':>4} "
           f"{'cmds':>5}")
    out = ["engines: N decode + N prefill statuses; closed loop, one request at a time; "
           "times in us unless named", "", hdr, "-" * len(hdr)]
    for r in rows:
        out.append(
            f"{r.engines:8d} {r.decisions:9d} {r.decide_p50_us:10.0f} {r.decide_p99_us:8.0f} "
            f"{r.place_p50_us:9.1f} {r.place_p99_us:7.1f} {r.e2e_p50_us:8.0f} "
            f"{r.e2e_p99_us:8.0f} {r.rt_per_decision:7.2f} {r.rt_per_decision_all_in:7.2f} "
            f"{r.cmds_per_decision:8.2f} {r.refreshes:9d} {r.refresh_p50_ms:10.2f} "
            f"{r.refresh_rt:4.0f} {r.refresh_cmds:5.0f}")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench placement`` (shared with ``python -m``)."""
    g = p.add_argument_group("placement benchmark")
    g.add_argument("--engines", default=",".join(map(str, ENGINE_COUNTS)),
                   help="fleet sizes: engines per role (default 2,4,8,16,32,64)")
    g.add_argument("--decisions", type=int, default=2000, help="decisions per fleet size")
    g.add_argument("--redis-url", default=None,
                   help="a Redis to flush and use (default: an embedded one)")
    g.add_argument("--json", default=None, help="also write the rows here")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench placement``."""
    from kvpush.common.runtime import run
    from kvpush.services.local.local_redis import LocalRedis

    counts = [int(x) for x in str(args.engines).split(",") if x.strip()]
    local = None
    url = args.redis_url
    if url is None:
        local = LocalRedis(Path(tempfile.mkdtemp(prefix="kvpush-placement-"))).start()
        url = local.url
    rows = []
    try:
        for n in counts:
            rows.append(run(measure(url, n, args.decisions)))
            logger.info("placement %d engines: %s", n, rows[-1])
    finally:
        if local is not None:
            local.stop()
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(run_from_args(ap.parse_args()))


if __name__ == "__main__":
    main()
