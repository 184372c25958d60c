"""The load shedder's estimate and decision on a manual clock (the real-engine behaviour is
in tests/e2e_tiny/test_e2e_shedding.py)."""

from __future__ import annotations

import itertools
import math

import pytest

from kvpush.services.gateway.shedding import HeadroomLearner, LoadShedder, Overloaded


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _measured(clock: Clock, objective_s: float = 1.0, **kw: float) -> LoadShedder:
    """A shedder that served 8 requests of 100 tokens, one at a time, 0.1 s each: it
    measured 1000 prompt tokens per busy second."""
    sh = LoadShedder(objective_s, clock=clock, **kw)
    for _ in range(8):
        t = sh.admit("a", 1.0, 100)
        clock.t += 0.1
        sh.served(t)
        sh.first_token(t)
        clock.t += 5.0  # idle between them: not counted against the rate
    return sh


def test_nothing_is_shed_before_the_rate_is_known() -> None:
    clock = Clock()
    sh = LoadShedder(0.5, clock=clock)
    tickets = [sh.admit("a", 1.0, 1000) for _ in range(50)]
    assert sh.estimate_s() == 0.0
    sh.check("a", 1.0, 1000)  # no rate measured yet: admitted
    for t in tickets[:7]:
        clock.t += 0.1
        sh.served(t)
    assert sh.estimate_s() == 0.0  # fewer than min_served
    assert sh.backlog_requests == 43 and sh.backlog_tokens == 43_000


def test_idle_time_does_not_lower_the_rate() -> None:
    clock = Clock()
    sh = _measured(clock)
    assert sh.capacity == pytest.approx(1000.0)
    clock.t += 3600  # an idle hour
    assert sh.estimate_s(500) == pytest.approx(0.5)


def test_a_request_is_shed_when_the_backlog_ahead_passes_the_objective() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=1.0)
    held = [sh.admit("a", 1.0, 100) for _ in range(9)]  # 900 tokens ahead
    sh.check("a", 1.0, 100)  # 1.0 s: within the objective
    held.append(sh.admit("a", 1.0, 100))
    with pytest.raises(Overloaded) as exc:
        sh.check("a", 1.0, 500)  # 1000 ahead + its own 500 at 1000/s
    assert exc.value.estimate_s == pytest.approx(1.5)
    assert exc.value.retry_after_s == pytest.approx(1.0)  # at least 1 s
    assert sh.shed == 1
    # As the backlog is served, the same request fits again.
    for t in held[:6]:
        clock.t += 0.1
        sh.served(t)
    sh.check("a", 1.0, 500)
    assert sh.backlog_requests == 4


def test_retry_after_is_the_time_the_backlog_takes_to_drain_below_the_objective() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=1.0)
    for _ in range(50):
        sh.admit("a", 1.0, 100)  # 5 s of work ahead
    with pytest.raises(Overloaded) as exc:
        sh.check("a", 1.0, 0)
    assert exc.value.retry_after_s == pytest.approx(4.0)


def test_a_tenant_over_its_weighted_share_is_shed_first() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=1.0, over_share=0.5)  # tenant "a" was seen
    clock.t += 20  # ... longer ago than the window
    for _ in range(6):
        sh.admit("flood", 1.0, 100)
    # Alone, a tenant may use the whole objective: nobody else is there.
    sh.check("flood", 1.0, 100)
    sh.admit("flood", 1.0, 100)  # 700 tokens ahead (0.7 s), all of one tenant
    # Once another tenant shows up, the flooding one holds more than its half: it is shed
    # past half the objective, the light one only past all of it.
    sh.check("light", 1.0, 100)
    with pytest.raises(Overloaded) as exc:
        sh.check("flood", 1.0, 0)
    assert exc.value.limit_s == pytest.approx(0.5)
    sh.admit("light", 1.0, 100)
    sh.check("light", 1.0, 100)
    # Past the objective itself everyone is shed.
    for _ in range(2):
        sh.admit("light", 1.0, 100)
    with pytest.raises(Overloaded) as exc:
        sh.check("light", 1.0, 100)
    assert exc.value.limit_s == pytest.approx(1.0)


def test_a_heavier_weight_buys_a_larger_share() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=1.0, over_share=0.5)
    clock.t += 20  # "a" left the window
    for _ in range(6):
        sh.admit("big", 3.0, 100)
    sh.admit("small", 1.0, 100)
    # 0.8 s with "big" holding 7/8 of the backlog: over a weight-3 share (3/4) ...
    with pytest.raises(Overloaded):
        sh.check("big", 3.0, 100)
    # ... and within a weight-9 one (9/10).
    sh.check("big", 9.0, 100)


def test_a_stall_decays_the_capacity_slowly_and_a_request_that_failed_leaves_the_backlog(
) -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=1.0, half_life_s=30.0)
    stuck = sh.admit("a", 1.0, 200)
    clock.t += 30  # nothing served for 30 busy seconds: half the capacity left
    assert sh.estimate_s() == pytest.approx(200 / 500)
    sh.forget(stuck)
    sh.forget(stuck)  # idempotent
    sh.served(stuck)  # an ended request is not counted as served
    assert sh.backlog_requests == 0 and sh.backlog_tokens == 0
    clock.t += 600  # idle: no further decay
    assert sh.estimate_s(100) == pytest.approx(100 / 500)


def test_a_request_alone_is_never_shed_for_its_own_size() -> None:
    """Nothing ahead: a retry would meet the same estimate, so a long prompt is admitted,
    and a rate measured low during a fault cannot shed every later request for good."""
    clock = Clock()
    sh = _measured(clock, objective_s=1.0)
    sh.check("a", 1.0, 5000)  # 5 s of its own work, nothing ahead
    held = sh.admit("a", 1.0, 100)
    with pytest.raises(Overloaded):
        sh.check("a", 1.0, 5000)  # now something is ahead of it
    sh.served(held)
    sh.check("a", 1.0, 5000)


def test_sustained_overload_measures_the_capacity_it_is_served_at() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=2.0)
    # Batched service: 10 requests of 100 tokens reach their first token every 0.5 s.
    backlog = [sh.admit("a", 1.0, 100) for _ in range(40)]
    for _ in range(30):  # 15 s: longer than the 10 s window
        clock.t += 0.5
        for _ in range(10):
            sh.served(backlog.pop(0))
        backlog += [sh.admit("a", 1.0, 100) for _ in range(10)]
    assert sh.capacity == pytest.approx(2000.0, rel=0.01)
    assert sh.estimate_s() == pytest.approx(4000 / 2000, rel=0.01)


def test_a_lagging_event_loop_counts_toward_the_wait() -> None:
    """The gateway itself the bottleneck: its loop's lag is waited before admission and
    again on the first token's way out."""
    clock = Clock()
    sh = _measured(clock, objective_s=1.0)
    sh.check("a", 1.0, 100)
    for _ in range(20):
        sh.observe_lag(1.2)
    assert sh.loop_lag_s == pytest.approx(1.2, rel=0.01)
    with pytest.raises(Overloaded):
        sh.check("a", 1.0, 0)  # nothing in the backlog, and still late
    for _ in range(20):
        sh.observe_lag(-0.01)  # an early timer is no lag
    assert sh.loop_lag_s == pytest.approx(0.0, abs=0.01)
    sh.check("a", 1.0, 100)


def test_under_pressure_a_saturated_window_sets_a_lower_capacity() -> None:
    """Contention lowers the fleet's rate: once the estimate nears the objective and the
    fleet stays busy, the lower rate it measures is taken (not the remembered best)."""
    clock = Clock()
    sh = _measured(clock, objective_s=1.0)  # 1000 tokens per busy second
    backlog = [sh.admit("a", 1.0, 100) for _ in range(6)]
    with pytest.raises(Overloaded):
        sh.check("a", 1.0, 500)  # 1.1 s: pressure
    for _ in range(40):  # 20 s, busy throughout, at 400 tokens/s
        clock.t += 0.5
        for _ in range(2):
            sh.served(backlog.pop(0))
        backlog += [sh.admit("a", 1.0, 100) for _ in range(2)]
        with pytest.raises(Overloaded):
            sh.check("a", 1.0, 500)
    assert sh.capacity == pytest.approx(400.0, rel=0.01)


def _relayed(sh: LoadShedder, clock: Clock, gap_s: float, n: int = 20) -> None:
    """``n`` token gaps of ``gap_s`` across the relayed streams, over more than one
    averaging interval."""
    for _ in range(n):
        clock.t += 0.05
        sh.observe_gap(gap_s)


def test_slow_tokens_shed_new_requests_until_decode_keeps_pace() -> None:
    clock = Clock()
    sh = LoadShedder(2.0, tpot_objective_s=0.05, clock=clock)
    _relayed(sh, clock, 0.03)
    assert sh.itl_s == pytest.approx(0.03)
    sh.check("a", 1.0, 100)
    _relayed(sh, clock, 0.08)  # decode's batch grew: every stream slows down
    with pytest.raises(Overloaded) as exc:
        sh.check("a", 1.0, 100)
    assert "time per output token" in str(exc.value) and exc.value.retry_after_s == 1.0
    _relayed(sh, clock, 0.04)
    sh.check("a", 1.0, 100)
    _relayed(sh, clock, 0.08)
    clock.t += 2.0  # every stream ended: nothing left to slow down
    sh.check("a", 1.0, 100)
    assert sh.itl_s == 0.0


def test_without_a_tpot_objective_token_gaps_shed_nothing() -> None:
    clock = Clock()
    sh = LoadShedder(2.0, clock=clock)
    _relayed(sh, clock, 5.0)
    sh.check("a", 1.0, 100)


def test_the_objective_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoadShedder(0.0)


def test_headroom_admits_only_up_to_its_share_of_the_objective() -> None:
    """The estimate is a mean wait: with headroom 0.5 a 2 s objective admits up to 1 s."""
    clock = Clock()
    sh = _measured(clock, objective_s=2.0, headroom=0.5)
    held = [sh.admit("a", 1.0, 100) for _ in range(8)]  # 800 tokens ahead
    sh.check("a", 1.0, 200)  # 1.0 s: at the limit, admitted
    held.append(sh.admit("a", 1.0, 200))
    with pytest.raises(Overloaded) as exc:
        sh.check("a", 1.0, 100)  # 1.1 s, within the objective but past its half
    assert exc.value.limit_s == pytest.approx(1.0)
    assert exc.value.estimate_s == pytest.approx(1.1)
    assert "1 s this gateway admits" in str(exc.value)
    assert len(held) == 9
    with pytest.raises(ValueError):
        LoadShedder(1.0, headroom=0.0)


def test_the_learned_headroom_shrinks_when_the_admitted_tail_passes_the_objective() -> None:
    learner = HeadroomLearner(2.0, 0.5, min_samples=20)
    for i in range(19):
        learner.observe(float(i) / 10, 3.6, pressed=True)
    assert learner.headroom == 0.5  # too few samples to judge
    learner.observe(2.0, 3.6, pressed=True)
    # p99 3.6 s against 70 % of 2 s: the headroom shrinks in proportion.
    assert learner.p99_s == pytest.approx(3.6)
    shrunk = 0.5 * 1.4 / 3.6
    assert learner.headroom == pytest.approx(shrunk)
    # The tail admitted before the change says nothing about the new headroom: however
    # long it waited, it does not shrink the headroom again.
    for i in range(200):
        learner.observe(2.5 + i / 100, 100.0, pressed=True)
    assert learner.headroom == pytest.approx(shrunk)
    # Requests admitted after the change that still wait too long do.
    for i in range(19):
        learner.observe(10.0 + i / 100, 2.0, pressed=True)
    assert learner.headroom == pytest.approx(shrunk)
    learner.observe(10.5, 2.0, pressed=True)
    assert learner.headroom == pytest.approx(shrunk * 1.4 / 2.0)
    for k in range(40):
        for i in range(20):
            learner.observe(200.0 + k * 10 + i / 100, 3.0, pressed=True)
    assert learner.headroom == pytest.approx(learner.floor)


def test_the_learned_headroom_grows_only_while_requests_are_shed_and_the_tail_is_short(
        ) -> None:
    learner = HeadroomLearner(2.0, 0.5, min_samples=20)
    t = 0.0
    for _ in range(40):
        t += 0.1
        learner.observe(t, 0.2, pressed=False)
    assert learner.headroom == 0.5  # nothing shed: the limit does not bind, nothing to gain
    changes: list[float] = []
    for _ in range(600):
        t += 0.1
        before = learner.headroom
        learner.observe(t, 0.2, pressed=True)
        if learner.headroom != before:
            changes.append(t)
    assert learner.headroom == pytest.approx(1.0)  # a step at a time, capped at 1
    assert len(changes) == 10
    # Each step waits for the requests admitted under the last one to settle.
    assert min(b - a for a, b in itertools.pairwise(changes)) >= learner.settle_s - 1e-9
    for _ in range(200):
        t += 0.1
        learner.observe(t, 1.3, pressed=True)  # within 70 % of the objective: kept
    assert learner.headroom == pytest.approx(1.0)


def test_a_learning_shedder_admits_less_once_its_admitted_requests_waited_too_long() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=2.0, headroom=1.0, learn=True)
    assert sh.headroom == 1.0
    # Thirty admitted requests that each waited 4 s for their first token.
    for _ in range(30):
        t = sh.admit("a", 1.0, 10)
        clock.t += 0.2
        sh._pressed_at = clock.t
        t.admitted_at = clock.t - 4.0
        sh.served(t)
        sh.first_token(t)
    assert sh.headroom < 0.5
    held = [sh.admit("a", 1.0, 100) for _ in range(8)]  # about 0.8 s ahead
    with pytest.raises(Overloaded):
        sh.check("a", 1.0, 100)  # within the fixed headroom of 1, not the learned one
    assert len(held) == 8


def test_the_learner_counts_the_requests_still_waiting_with_their_wait_so_far() -> None:
    """The first to report are the fast ones: a p99 of those alone grew the headroom while
    its tail was still waiting (``kvpush bench overload``)."""
    blind, seeing = (HeadroomLearner(2.0, 0.5, min_samples=20) for _ in range(2))
    for i in range(19):
        for learner in (blind, seeing):
            learner.observe(0.1 * (i + 1), 0.2, pressed=True)
    assert blind.headroom == seeing.headroom == 0.5  # too few to judge
    blind.observe(2.0, 0.2, pressed=True)
    assert blind.headroom == pytest.approx(0.55)  # twenty fast ones: it grows
    # Twenty more admitted under it have waited 1.8 s so far, none reported yet.
    seeing.observe(2.0, 0.2, pressed=True, waiting=lambda since: [1.8] * 20)
    assert seeing.p99_s == pytest.approx(1.8)
    assert seeing.headroom == pytest.approx(0.5 * 1.4 / 1.8)  # shrunk instead


def test_a_learning_shedder_counts_each_wait_from_the_request_arrival() -> None:
    clock = Clock()
    sh = _measured(clock, objective_s=2.0, headroom=0.5, learn=True)
    # Each spent 1.7 s before admission (its body read, its prompt counted), then reached
    # its first token 0.1 s later: 1.8 s from arrival, past 70 % of the objective.
    for _ in range(30):
        clock.t += 0.1
        sh._pressed_at = clock.t
        t = sh.admit("a", 1.0, 10, arrived_at=clock.t - 1.7)
        sh.served(t)
        sh.first_token(t, at=clock.t + 0.1)
    assert sh.learner is not None and sh.learner.p99_s == pytest.approx(1.8)
    assert sh.headroom < 0.5


def test_a_learning_shedder_shrinks_while_its_admitted_tail_still_waits() -> None:
    """Prefill answered the first ten at once, but their clients saw no text yet (decode's
    first tokens are the ones with text): they count as waiting, not as answered."""
    clock = Clock()
    sh = _measured(clock, objective_s=2.0, headroom=0.5, learn=True)
    assert sh.learner is not None
    sh.learner.changed_at = clock.t  # the requests below are judged
    clock.t += 0.01
    waiting = [sh.admit("a", 1.0, 10) for _ in range(10)]
    for t in waiting:
        sh.served(t)  # out of the backlog: prefill answered
    for _ in range(30):  # others answered at once, while the ten wait on
        clock.t += 0.1
        sh._pressed_at = clock.t
        t = sh.admit("a", 1.0, 10)
        sh.served(t)
        sh.first_token(t)
    # Once twenty had reported (at once each), the ten had waited 2 s: the p99, though
    # every reported wait was 0.
    assert sh.learner.p99_s == pytest.approx(2.0)
    assert sh.headroom == pytest.approx(0.5 * 1.4 / 2.0)
    assert len(sh._waiting(-math.inf)) == 10
    for t in waiting[:5]:
        sh.first_token(t)
    for t in waiting[5:]:
        sh.forget(t)  # ended without showing text: no longer awaited
    assert sh.backlog_requests == 0 and sh._waiting(-math.inf) == []


def test_a_request_that_never_shows_text_stops_counting_as_waiting_when_it_ends() -> None:
    clock = Clock()
    sh = LoadShedder(2.0, clock=clock, learn=True)
    t = sh.admit("a", 1.0, 10)
    sh.served(t)
    clock.t += 1.0
    assert sh._waiting(-math.inf) == [pytest.approx(1.0)]
    sh.forget(t)
    sh.first_token(t)  # too late to count: it ended
    assert sh._waiting(-math.inf) == [] and sh.learner is not None
    assert sh.learner.p99_s == 0.0


def test_a_learning_shedder_grows_its_headroom_no_further_than_the_configured_one() -> None:
    """Grown past it under one load, the headroom met the next, doubled, burst with the
    objective's worth admitted (``kvpush bench overload``: TTFT p99 2.8 s at 4x)."""
    clock = Clock()
    sh = _measured(clock, objective_s=2.0, headroom=0.5, learn=True)
    assert sh.learner is not None
    sh.learner.headroom = 0.3  # shrunk by an earlier tail
    for _ in range(600):  # pressed, every wait short
        clock.t += 0.1
        sh._pressed_at = clock.t
        t = sh.admit("a", 1.0, 10)
        sh.served(t)
        sh.first_token(t)
    assert sh.headroom == pytest.approx(0.5)
