"""Fleet faults: the fault stack with two engines of each role, so that the engine a fault hits
always has a surviving peer, and the scenarios that need one.

The stack is :class:`~loadtest.faults.harness.FaultStack` with more engines (2 prefill +
2 decode, on loopback: the network-namespace topology has one side per role) and a longer
request deadline, so that a request placed again after the gateway gave up on a frozen
engine still has time to finish on a busy machine. With a peer alive, a fault may fail only
requests that already had their first token (a stream cut mid-answer); every request
without one must be placed again and answered. Each row counts failures before and after
the first token apart; any failure before it is a violation. ``kvpush reliability`` runs
these after the single-pair scenarios; ``tests/test_faults_fleet.py`` asserts them.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import live_reservations
from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.outcomes import (
    FAILED_CLEAN,
    LOST,
    UNCLEAR,
    FaultConfig,
    Load,
    Outcome,
    ScenarioResult,
    record_raise,
)
from kvpush.loadtest.faults.scenarios import _engine_running, _finish, _until
from kvpush.services.engine.drain import describe, mark_draining, wait_drained

FLEET_ROLES = {"prefill": "prefill", "prefill-b": "prefill",
               "decode": "decode", "decode-b": "decode"}


def fleet_config(base: FaultConfig | None = None) -> FaultConfig:
    """The fleet's deadlines: the single pair's, with room for one re-placement after the
    gateway gave up on an engine (``gateway_unresponsive_s``)."""
    return replace(base or FaultConfig(), netns=False, request_timeout_s=30.0)


class FleetStack(FaultStack):
    """Two prefill and two decode engines (ids ``kvft-prefill``, ``kvft-prefill-b``, ...)."""

    roles = FLEET_ROLES

    def __init__(self, workdir: Path, cfg: FaultConfig | None = None) -> None:
        super().__init__(workdir, fleet_config(cfg))

    def engine_id(self, name: str) -> str:
        return str(self.specs[name].engine_id)

    def names(self, role: str) -> list[str]:
        """Engine names of ``role``."""
        return [n for n, r in self.roles.items() if r == role]

    def busy_decode(self, bound_s: float) -> str:
        """The first decode engine seen running a request (under light load the scheduler
        favours one: ties go to the lowest id)."""
        return _wait_for(lambda: next((n for n in self.names("decode")
                                       if _engine_running(self, n)), None),
                         bound_s, "a decode engine running a request")

    def reservations_on(self, name: str) -> int:
        """Live reservations on engine ``name`` (requests placed on it, not yet ended)."""
        r = self.direct()
        try:
            eid = self.engine_id(name)
            return sum(1 for x in live_reservations(r) if x.engine_id == eid)
        except redis.RedisError:
            return 0
        finally:
            r.close()

    def targets(self, prefill: str) -> int:
        """Push targets decode published for prefill ``prefill`` (one per request placed)."""
        r = self.direct()
        try:
            return int(r.xlen(RedisKeys().targets(self.engine_id(prefill))))
        except redis.RedisError:
            return 0
        finally:
            r.close()


def _wait_for(pred: Callable[[], str | None], bound_s: float, what: str) -> str:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if got := pred():
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {bound_s:.0f}s")


@dataclass
class FleetResult(ScenarioResult):
    """A fleet fault's row: failures split by whether the client had its first token."""

    failed_before_token: int = 0
    """Failed (an error status, an unclear answer or lost) before any token reached the
    client: each of these should have been placed again on the surviving peer."""
    failed_after_token: int = 0
    """Streams cut after their first token (the engine serving them died): expected."""

    def add(self, outcomes: list[Outcome], late_after_s: float = float("inf")) -> None:
        super().add(outcomes, late_after_s)
        for o in outcomes:
            if o.kind in (FAILED_CLEAN, UNCLEAR, LOST):
                if o.tokens:
                    self.failed_after_token += 1
                else:
                    self.failed_before_token += 1

    def violations(self) -> list[str]:
        out = super().violations()
        if self.failed_before_token and not self.skipped:
            out.append(f"{self.failed_before_token} request(s) failed before their first "
                       "token although a peer engine was alive")
        return out


class Continuous(Load):
    """Open-loop load at ``rate`` until :meth:`stop` (for faults that take minutes)."""

    def __init__(self, url: str, cfg: FaultConfig, rate: float, **kw: Any) -> None:
        super().__init__(url, cfg, count=0, rate=rate, **kw)
        self._stop = threading.Event()

    def _drive(self) -> None:
        i = 0
        while not self._stop.wait(max(0.0, self.started_at + i / self.rate - time.monotonic())):
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            with self._lock:
                self.sent += 1
                self._threads.append(t)
            t.start()
            i += 1

    def stop(self) -> list[Outcome]:
        """Send nothing more; wait for what was sent."""
        self._stop.set()
        return self.join()


@dataclass(frozen=True)
class FleetScenario:
    name: str
    fault: str
    run: Callable[[FleetStack, FleetResult], None]


def _burst(st: FleetStack) -> Load:
    """Six requests at once, right after a decode froze: the scheduler spreads them over
    both decodes (its view of the frozen one lasts until that engine's status expires), so
    some certainly land on the frozen one, streamed and unary."""
    return st.load(count=6, rate=50, n_lines=20, max_tokens=48, tag="burst")


def decode_sigkill(st: FleetStack, res: FleetResult) -> None:
    """Streams under way on the victim are cut (after their first token); the requests
    placed on it while it was frozen have none yet and must be placed again."""
    load = st.load(count=12, rate=2, n_lines=20, max_tokens=48)
    victim = st.busy_decode(30)
    st.signal_engine(victim, signal.SIGSTOP)
    held = st.reservations_on(victim)
    burst = _burst(st)
    waited = _until(lambda: st.reservations_on(victim) > held, 10)
    placed = st.reservations_on(victim)
    st.signal_engine(victim, signal.SIGKILL)
    heal = st.recover_from(time.monotonic())
    outs = load.join() + burst.join()
    took = st.restart_engine(victim)
    res.notes.append(f"{st.engine_id(victim)} frozen holding {held} request(s) until "
                     f"{placed - held} more were placed on it"
                     + ("" if waited else " (none in 10 s)")
                     + f", then SIGKILLed, the other decode alive; restarted after the load "
                     f"({took:.0f}s)")
    _finish(st, res, outs, heal, "the kill, peer serving")


def prefill_sigkill(st: FleetStack, res: FleetResult) -> None:
    before = {n: st.targets(n) for n in st.names("prefill")}
    load = st.load(count=10, rate=2, n_lines=40)
    # The prefill the scheduler sends work to now, frozen so that requests are certainly
    # placed on it and wait there when it dies.
    victim = _wait_for(lambda: next((n for n, k in before.items() if st.targets(n) > k),
                                    None), 30, "a prefill taking work")
    mark = st.targets(victim)
    st.signal_engine(victim, signal.SIGSTOP)
    hit = _until(lambda: st.targets(victim) > mark, 10)
    placed = st.targets(victim) - mark
    st.signal_engine(victim, signal.SIGKILL)
    heal = st.recover_from(time.monotonic())
    outs = load.join()
    took = st.restart_engine(victim)
    res.notes.append(f"{st.engine_id(victim)} frozen until {placed} request(s) were placed "
                     "on it"
                     + ("" if hit else " (none in 10 s)")
                     + f", then SIGKILLed, the other prefill alive; restarted ({took:.0f}s)")
    _finish(st, res, outs, heal, "the kill, peer serving")


def decode_sigstop(st: FleetStack, res: FleetResult) -> None:
    """Streams under way on the victim stall past their deadline (cut after their first
    token); requests placed on it while frozen must leave it (the gateway's probes)."""
    load = st.load(count=12, rate=2, n_lines=20, max_tokens=48)
    victim = st.busy_decode(30)
    st.signal_engine(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    heal = st.recover_from(t0)
    held = st.reservations_on(victim)
    burst = _burst(st)
    _until(lambda: st.reservations_on(victim) > held, 10)
    placed = st.reservations_on(victim) - held
    frozen = st.cfg.request_timeout_s + 3
    time.sleep(max(0.0, t0 + frozen - time.monotonic()))
    st.signal_engine(victim, signal.SIGCONT)
    res.notes.append(f"{st.engine_id(victim)} frozen {frozen:.0f}s (request deadline "
                     f"{st.cfg.request_timeout_s:.0f}s) holding {held} request(s), {placed} "
                     "more placed on it while frozen; the other decode alive")
    _finish(st, res, load.join() + burst.join(), heal, "the freeze, peer serving")


def rolling_drain(st: FleetStack, res: FleetResult) -> None:
    """Every engine in turn, one of each role at a time, as two Deployments rolling side by
    side with ``maxUnavailable: 1``: drain (services/engine/drain.py, as ``kvpush drain
    --wait``), stop, start again with a new generation; steady load throughout, and the
    other engine of each role serving."""
    load = Continuous(st.url, st.cfg, rate=1.0, tag=f"roll{uuid.uuid4().hex[:4]}").start()
    r = st.direct()
    try:
        for batch in zip(st.names("prefill"), st.names("decode"), strict=True):
            for name in batch:
                # Only a registered engine can be drained; one that a fault just froze
                # registers again within a status TTL of waking up.
                eid = st.engine_id(name)
                _wait_for(lambda eid=eid: eid if r.exists(st.keys.engine(eid)) else None,
                          st.cfg.recovery_bound_s, f"{eid}'s status")
                mark_draining(r, st.keys, eid)
            for name in batch:
                eid = st.engine_id(name)
                res.notes.append(describe(eid, wait_drained(r, st.keys, eid, timeout_s=60)))
            took = st.restart_engines(list(batch))
            res.notes.append(f"{', '.join(st.engine_id(n) for n in batch)} restarted together "
                             f"({took:.0f}s until both were ready)")
    finally:
        r.close()
        outs = load.stop()
    _finish(st, res, outs, time.monotonic(), "the last restart")


def scale_down(st: FleetStack, res: FleetResult) -> None:
    """The planner's scale-down as ``kvpush up --autoscale`` and the k8s engines apply it,
    under steady load: the decode serving requests is drained (marked, it gets nothing new,
    and the wait ends only when no reservation, push or stream is left on it), then stopped;
    the load goes on on the other decode. The fleet then grows back, as a scale-up would
    add an engine. The planner's decision itself is tests/test_autoscale.py's."""
    load = Continuous(st.url, st.cfg, rate=1.0, tag=f"down{uuid.uuid4().hex[:4]}").start()
    r = st.direct()
    try:
        victim = st.busy_decode(30)
        eid = st.engine_id(victim)
        mark_draining(r, st.keys, eid)
        res.notes.append(describe(eid, wait_drained(r, st.keys, eid, timeout_s=60)))
        st.engines[victim].stop()
        time.sleep(10)  # the load on one decode
        took = st.restart_engine(victim)
        res.notes.append(f"{eid} stopped after its drain, 10 s of load on the other decode, "
                         f"then added back ({took:.0f}s until ready)")
    finally:
        r.close()
        outs = load.stop()
    _finish(st, res, outs, time.monotonic(), "the scale-up after")


FLEET_SCENARIOS: list[FleetScenario] = [
    FleetScenario("fleet_decode_sigkill",
                  "2P2D: a decode SIGKILLed while streaming, with requests placed on it, the "
                  "other decode alive",
                  decode_sigkill),
    FleetScenario("fleet_prefill_sigkill",
                  "2P2D: a prefill SIGKILLed with requests on it, the other prefill alive",
                  prefill_sigkill),
    FleetScenario("fleet_decode_sigstop",
                  "2P2D: a decode SIGSTOPped past the deadline, the other decode alive",
                  decode_sigstop),
    FleetScenario("fleet_rolling_drain",
                  "2P2D: rolling drain-and-restart of every engine under load, one of each "
                  "role at a time",
                  rolling_drain),
    FleetScenario("fleet_scale_down",
                  "2P2D: scale-down under load: a decode drained, then removed, the other "
                  "decode serving; added back after",
                  scale_down),
]

FLEET_BY_NAME = {s.name: s for s in FLEET_SCENARIOS}


def run_fleet_scenario(st: FleetStack, sc: FleetScenario) -> FleetResult:
    """Run one fleet scenario; an exception inside it becomes a note and a failed row."""
    res = FleetResult(sc.name, sc.fault)
    t0 = time.monotonic()
    try:
        sc.run(st, res)
    except Exception as exc:  # the row records it; the suite goes on
        record_raise(res, exc)
    res.duration_s = time.monotonic() - t0
    return res


def render_fleet(results: list[FleetResult], cfg: FaultConfig) -> list[str]:
    """The fleet table of RELIABILITY.md."""
    lines = [
        "## With a surviving peer (2 prefill + 2 decode engines)", "",
        "The same stack with two engines of each role, on loopback, request deadline "
        f"{cfg.request_timeout_s:.0f} s (room for one re-placement after the "
        "gateway gave up on an engine that answers no health probe for 5 s). **failed "
        "before 1st token** must be 0: such a request is placed again on the surviving "
        "peer; **failed after** counts streams cut mid-answer by the fault itself.", "",
        "| fault | sent | ok | failed before 1st token | failed after | cancelled | lost "
        "| late | slowest | leaked | drain | recovery | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        leaked = "; ".join(f"{k}: {v}" for k, v in r.leaks.items()) or "none"
        rec = "never" if r.recovery_s is None else f"{r.recovery_s:.1f} s"
        drain = "never" if r.drain_s is None else f"{r.drain_s:.1f} s"
        lines.append(
            f"| {r.fault} | {r.sent} | {r.ok} | {r.failed_before_token} | "
            f"{r.failed_after_token} | {r.cancelled} | {r.lost} | {r.late} | "
            f"{r.max_latency_s:.1f} s | {leaked[:160]} | {drain} | {rec} "
            f"({r.recovery_from}) | {'pass' if not r.violations() else '**FAIL**'} |")
    return [*lines, ""]
