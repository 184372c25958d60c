"""The fleet planner's decision: desired prefill and decode replica counts from what the fleet
measures against its objectives. Pure (a clock is passed in); the Redis side that feeds it
and publishes its counts is services/scheduler/planner_task.py.

Prefill is sized for the wait to the first token, decode for the time per output token and
for the KV blocks requests reserve on it:

- **prefill up** while the gateways' p90 TTFT passes ``ttft_s`` (or they shed) and prefill
  is where requests wait: prompt tokens queue on the prefill engines;
- **decode up** while the mean time per output token passes ``itl_s``, decode's KV usage
  passes ``kv_high``, or requests wait in the request streams for a decode slot;
- **down**, one role at a time, while nothing of the above holds for it, its latency is
  under half its objective and its load would fit on one engine fewer (decode: under
  ``kv_low`` of the smaller fleet's blocks, nothing waiting).

Pressure must hold ``up_stable_s`` and room ``down_stable_s`` before a count changes, one
engine per step, and a role grows again only once the fleet reached the last count (an
engine still booting is not asked for twice). Scale-down itself drains first: whoever
applies the count (``kvpush up --autoscale``, or k8s through the engines' preStop drain)
removes an engine only when nothing is in flight on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


class Pressure(enum.Enum):
    """What the signals say about one role right now."""

    UP = "up"
    HOLD = "hold"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """One role's engines as the scheduler sees them."""

    ready: int  # serving, not draining
    total_blocks: int = 0
    used_blocks: int = 0  # reserved or in use, whichever is more, summed
    waiting: int = 0  # requests the engines report waiting
    queued_prompt_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Signals:
    """One reading of the fleet."""

    prefill: RoleLoad
    decode: RoleLoad
    stream_backlog: int = 0  # requests in the request streams not placed yet
    requests: int = 0  # first tokens in the gateways' window
    ttft_p90_s: float = 0.0
    itl_s: float = 0.0
    shed: int = 0


@dataclass(frozen=True, slots=True)
class Objectives:
    """What the planner sizes toward (``KVPUSH_PLANNER_*``)."""

    ttft_s: float = 2.0
    itl_s: float = 0.2
    kv_high: float = 0.85
    kv_low: float = 0.4
    up_stable_s: float = 10.0
    down_stable_s: float = 120.0
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8

    def bounds(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.min_prefill, max(self.min_prefill, self.max_prefill)
        return self.min_decode, max(self.min_decode, self.max_decode)


@dataclass(frozen=True, slots=True)
class RoleDecision:
    ready: int
    desired: int
    pressure: Pressure
    reason: str


@dataclass(slots=True)
class _Memory:
    desired: int | None = None
    pressure: Pressure = Pressure.HOLD
    since: float = 0.0


def prefill_pressure(sig: Signals, obj: Objectives) -> tuple[Pressure, str]:
    """Whether prefill needs another engine, could do with one fewer, or neither."""
    pre = sig.prefill
    queued = pre.queued_prompt_tokens > 0 or pre.waiting > 0
    slow = sig.requests > 0 and sig.ttft_p90_s > obj.ttft_s
    if (slow or sig.shed) and queued:
        what = f"p90 TTFT {sig.ttft_p90_s:.2f} s" if slow else f"{sig.shed} shed"
        return Pressure.UP, (f"{what} over the {obj.ttft_s:g} s objective with "
                             f"{pre.queued_prompt_tokens} prompt tokens queued on prefill")
    if pre.ready > 1 and not queued and not sig.shed and sig.ttft_p90_s <= obj.ttft_s / 2:
        return Pressure.DOWN, (f"nothing queued on prefill, p90 TTFT {sig.ttft_p90_s:.2f} s "
                               "under half the objective")
    return Pressure.HOLD, "within its objective"


def decode_pressure(sig: Signals, obj: Objectives) -> tuple[Pressure, str]:
    """Whether decode needs another engine, could do with one fewer, or neither."""
    dec = sig.decode
    if sig.requests > 0 and sig.itl_s > obj.itl_s:
        return Pressure.UP, f"time per output token {sig.itl_s * 1000:.0f} ms over " \
                            f"the {obj.itl_s * 1000:.0f} ms objective"
    if dec.total_blocks and dec.kv_usage >= obj.kv_high:
        return Pressure.UP, f"decode KV usage {dec.kv_usage:.0%} over {obj.kv_high:.0%}"
    if sig.stream_backlog > 0 and not (sig.prefill.queued_prompt_tokens
                                       or sig.prefill.waiting):
        return Pressure.UP, f"{sig.stream_backlog} request(s) waiting for a decode slot"
    if dec.ready > 1 and not dec.waiting and not sig.stream_backlog \
            and sig.itl_s <= obj.itl_s / 2 and dec.total_blocks:
        smaller = dec.total_blocks * (dec.ready - 1) / dec.ready
        if dec.used_blocks <= obj.kv_low * smaller:
            return Pressure.DOWN, (f"decode KV usage {dec.used_blocks / smaller:.0%} of one "
                                   f"engine fewer, under {obj.kv_low:.0%}")
    return Pressure.HOLD, "within its objective"


@dataclass
class Planner:
    """Desired counts over time: pressure and room must hold before a count moves."""

    objectives: Objectives = field(default_factory=Objectives)
    _memory: dict[str, _Memory] = field(default_factory=lambda: {r: _Memory() for r in ROLES})

    def decide(self, sig: Signals, now: float) -> dict[str, RoleDecision]:
        """The desired count of each role for ``sig`` read at ``now`` (seconds, any clock
        that only moves forward)."""
        obj = self.objectives
        out: dict[str, RoleDecision] = {}
        for role, (pressure, reason) in (("prefill", prefill_pressure(sig, obj)),
                                         ("decode", decode_pressure(sig, obj))):
            load = sig.prefill if role == "prefill" else sig.decode
            out[role] = self._step(role, load.ready, pressure, reason, now)
        return out

    def _step(self, role: str, ready: int, pressure: Pressure, reason: str, now: float
              ) -> RoleDecision:
        obj = self.objectives
        lo, hi = obj.bounds(role)
        mem = self._memory[role]
        if mem.desired is None:
            mem.desired = min(hi, max(lo, ready))
        if pressure is not mem.pressure:
            mem.pressure, mem.since = pressure, now
        settled = ready >= mem.desired  # the last count was reached: no engine booting
        if not settled and pressure is Pressure.UP:
            mem.since = now  # pressure counts once the new engine serves too
        held = now - mem.since
        if pressure is Pressure.UP and settled and mem.desired < hi \
                and held >= obj.up_stable_s:
            mem.desired += 1
            mem.since = now  # the next step needs its own stable pressure
            reason = f"up: {reason}"
        elif pressure is not Pressure.UP and mem.desired > max(lo, ready) \
                and held >= obj.down_stable_s:
            # A count the fleet never reached (no room for the engine, a boot that keeps
            # failing) and no longer needs is not asked for forever.
            mem.desired = max(lo, ready)
            mem.since = now
            reason = f"down: never reached, and {reason}"
        elif pressure is Pressure.DOWN and mem.desired > lo and held >= obj.down_stable_s:
            mem.desired = max(lo, min(mem.desired, ready) - 1)
            mem.since = now
            reason = f"down: {reason}"
        elif not lo <= mem.desired <= hi:
            mem.desired = min(hi, max(lo, mem.desired))
        return RoleDecision(ready, mem.desired, pressure, reason)
