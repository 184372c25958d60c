"""SLO-aware admission: a request whose wait for its first token would pass the objective is
shed at once, with a Retry-After computed from the backlog, instead of queueing behind it.

The wait is estimated by Little's law over what this gateway sees: the prompt tokens of the
requests it admitted that have not reached their first token yet (the backlog ahead of a new
request), divided by the rate at which the fleet brings prompt tokens to their first token.
That rate is measured per second of *busy* time (while anything is in the backlog), so an
idle minute does not make the fleet look slow. It is held as a capacity that decays slowly
over busy time (``half_life_s``): a stall, such as an engine that froze with requests on
it, does not make the gateway shed everything at once. Under pressure (the estimate near
the objective) with the fleet busy throughout the window, the window's rate is taken as
it is, lower or not: that is the fleet's capacity now, contention included.
With several gateways each sees its share of the backlog and of the rate, and the ratio
stays the same. A request alone is never shed for its own size: nothing is ahead of it, a
retry would meet the same estimate, and serving it is how a rate measured low during a
fault is measured again. The estimate is a mean, and a queue's tail is a few times its
mean: requests are admitted while it stays under ``headroom`` times the objective, so that
the admitted requests' slow tail, not only their typical wait, keeps the objective; with
learning on (the gateway's default), ``headroom`` is where the admitted requests' p99 time
to a first token keeps the objective (:class:`HeadroomLearner`), rather than a fixed
fraction. The gateway's own delay is
added: its event loop's lag (how late a timer fires), which a request waits before its
first byte is read and again on its first token's way out, and which grows first when the
gateway itself is the bottleneck.

With a TPOT objective (``tpot_objective_s``) the gateway also watches the gaps between the
tokens it relays: while their mean over the last half second passes it, decode is too busy
for another stream and new requests are shed (each admitted stream would slow every
other one). Decode's batch stops growing instead of every stream slowing down.

Tenants' weights decide who is shed first: a tenant holding more than its weighted share of
the backlog is shed once the estimate passes ``over_share`` of the objective, the others
only past the objective itself, so a flooding tenant fills at most its share and a light
tenant keeps being admitted within the objective. The shares are among the tenants seen in
the last ``window_s``: a tenant alone may use the whole objective, and one back after a
longer pause may meet a full backlog once (its Retry-After is short).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_GAP_INTERVAL_S = 0.5
"""Token gaps are averaged over intervals this long (and forgotten after one without any)."""


class Overloaded(Exception):
    """The request would wait past the objective: shed it with ``retry_after_s``."""

    def __init__(self, estimate_s: float, limit_s: float, retry_after_s: float,
                 what: str = "wait for a first token") -> None:
        super().__init__(f"overloaded: the estimated {what} is {estimate_s:.3g} s, over "
                         f"the {limit_s:.3g} s this gateway admits")
        self.estimate_s = estimate_s
        self.limit_s = limit_s
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Ticket:
    """One admitted request in the backlog until its first token (or its end)."""

    tenant: str
    tokens: int
    admitted_at: float = 0.0
    open: bool = True
    # When the request reached the gateway (its wait counts from there); admitted_at if unset.
    arrived_at: float | None = None
    # Its first token has not reached the client yet (what the headroom learner waits for).
    awaited: bool = True

    @property
    def arrived(self) -> float:
        """When it reached the gateway: its wait for a first token counts from here."""
        return self.admitted_at if self.arrived_at is None else self.arrived_at


class HeadroomLearner:
    """The share of the objective the estimated wait may reach, learned from what the
    admitted requests then waited.

    The estimate is a mean and a queue's tail waits a few times it, but how many times
    depends on the workload and the fleet: a fixed share either lets the admitted tail pass
    the objective or refuses requests the engines had room for. So the p99 time to first
    token, counted from each request's arrival at the gateway, is watched, and each change
    of the headroom is judged only on requests admitted under it: judging it on a window
    that still holds the tail that caused the last change shrinks the headroom again and
    again for one burst, and then grows it back past the objective.

    The requests admitted under it that are still waiting count too, each with the time it
    has waited so far: the first to report are the fast ones, and a p99 of those alone
    grew the headroom past the objective before its tail had reported. A p99 past
    ``target`` of the objective shrinks the headroom in proportion at once; it grows by
    ``step`` only while requests are shed, the p99 is well under the target, and the
    requests admitted since the last change had ``settle_s`` to reach their first token,
    up to ``ceiling``. A gateway's ceiling is its configured headroom: a headroom grown
    past it under one load met the next, doubled, burst with the whole objective's worth
    admitted, and the tail passed it (``kvpush bench overload``: TTFT p99 2.8 s at 4x after
    a 2x point had grown it to 0.95).
    """

    def __init__(self, objective_s: float, headroom: float, *, target: float = 0.7,
                 window_s: float = 5.0, period_s: float = 0.5, min_samples: int = 20,
                 floor: float = 0.1, step: float = 0.05, ceiling: float = 1.0,
                 settle_s: float | None = None) -> None:
        self.objective_s = objective_s
        self.headroom = headroom
        self.ceiling = ceiling
        self.target = target
        self.window_s = window_s
        self.period_s = period_s
        self.min_samples = min_samples
        self.floor = floor
        self.step = step
        self.settle_s = objective_s if settle_s is None else settle_s
        # (reported at, wait) of the requests admitted since the last change.
        self._waits: deque[tuple[float, float]] = deque(maxlen=4096)
        self._next_at = -math.inf
        self.changed_at = -math.inf
        self.p99_s = 0.0

    def observe(self, now: float, wait_s: float, pressed: bool,
                admitted_at: float | None = None,
                waiting: Callable[[float], list[float]] | None = None) -> None:
        """One admitted request reached its first token ``wait_s`` after it arrived (it was
        admitted at ``admitted_at``, by default its arrival); ``pressed``: requests were
        shed (or nearly) within the window; ``waiting(since)``: how long each request
        admitted since then and still waiting has waited so far."""
        waits = self._waits
        admitted = now - wait_s if admitted_at is None else admitted_at
        if admitted >= self.changed_at:
            waits.append((now, wait_s))
        while waits and waits[0][0] < now - self.window_s:
            waits.popleft()
        if now < self._next_at or len(waits) < self.min_samples:
            return
        self._next_at = now + self.period_s
        ordered = sorted([w for _, w in waits]
                         + (waiting(self.changed_at) if waiting is not None else []))
        self.p99_s = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        goal = self.target * self.objective_s
        if self.p99_s > goal:
            self._change(now, max(self.floor, self.headroom * goal / self.p99_s))
        elif pressed and self.p99_s < 0.75 * goal and now - self.changed_at >= self.settle_s \
                and self.headroom < self.ceiling:
            self._change(now, min(self.ceiling, self.headroom + self.step))

    def _change(self, now: float, headroom: float) -> None:
        self.headroom = headroom
        self.changed_at = now
        self._waits.clear()


class LoadShedder:
    """The backlog, the measured service rate and the shedding decision of one gateway.

    Single-threaded (the gateway's event loop); ``clock`` is injectable for tests."""

    def __init__(self, objective_s: float, over_share: float = 0.5, window_s: float = 10.0,
                 half_life_s: float = 30.0, min_served: int = 8,
                 tpot_objective_s: float = 0.0, headroom: float = 1.0, learn: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if objective_s <= 0:
            raise ValueError("objective_s must be positive (leave the shedder out to turn "
                             "shedding off)")
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        self.objective_s = objective_s
        # With ``learn``, the headroom follows the admitted requests' p99 wait.
        self.learner = (HeadroomLearner(objective_s, headroom, ceiling=headroom)
                        if learn else None)
        # Requests admitted and awaiting their first token, in admission order (learning).
        self._open: deque[Ticket] = deque()
        self._awaited = 0
        self._headroom = headroom
        self.over_share = over_share
        self.window_s = window_s
        self.half_life_s = half_life_s
        self.min_served = min_served
        self._clock = clock
        self.backlog_tokens = 0
        self.backlog_requests = 0
        self._tenants: dict[str, int] = {}  # tenant -> its tokens in the backlog
        self._seen: dict[str, tuple[float, float]] = {}  # tenant -> (weight, last seen)
        self._busy_total = 0.0
        self._busy_since: float | None = None
        self._served_tokens = 0
        self._served = 0
        # (clock, busy seconds so far, tokens served so far) at each first token
        self._samples: deque[tuple[float, float, int]] = deque()
        self.capacity = 0.0  # prompt tokens to first token per busy second; 0: unknown
        self.loop_lag_s = 0.0  # smoothed lag of the event loop (observe_lag)
        self.tpot_objective_s = tpot_objective_s
        self.itl_s = 0.0  # mean gap between relayed tokens over the last interval
        self._gaps = [0.0, 0]  # sum and count of the gaps of the interval so far
        self._gaps_since = clock()
        self._last_gap_at = -math.inf
        self._pressed_at = -math.inf  # last time the estimate passed the lower limit
        self._capacity_at = 0.0  # busy seconds when capacity was measured
        self.shed = 0

    @property
    def headroom(self) -> float:
        """Share of the objective the estimated wait may reach before requests are shed."""
        return self.learner.headroom if self.learner is not None else self._headroom

    # -- the decision ----------------------------------------------------------------
    def estimate_s(self, tokens: int = 0) -> float:
        """Estimated wait for the first token of a request of ``tokens`` prompt tokens
        admitted now: the event loop's lag, plus the backlog ahead over the rate once
        enough requests were served to know it."""
        cap = self._current_capacity()
        ahead = (self.backlog_tokens + tokens) / cap if cap > 0 else 0.0
        return self.loop_lag_s + ahead

    def observe_lag(self, lag_s: float) -> None:
        """One measurement of the event loop's lag (smoothed over a few)."""
        self.loop_lag_s += 0.3 * (max(0.0, lag_s) - self.loop_lag_s)

    def check(self, tenant: str, weight: float, tokens: int) -> None:
        """Raise :class:`Overloaded` when the request must be shed."""
        self._saw(tenant, weight)
        self._check_tpot(tenant, weight, tokens)
        est = self.estimate_s(tokens)
        if not self.backlog_requests:
            est = self.loop_lag_s  # alone: nothing to wait behind
        limit = self.objective_s * self.headroom
        if est <= limit * self.over_share:
            return
        self._pressed_at = self._clock()
        if self._over_share(tenant, weight, tokens):
            limit *= self.over_share
        if est > limit:
            self.shed += 1
            # The backlog ahead drains at the measured rate: by then a retry fits again.
            raise Overloaded(est, limit, max(1.0, est - limit))

    def _check_tpot(self, tenant: str, weight: float, tokens: int) -> None:
        obj = self.tpot_objective_s
        if obj <= 0 or self.itl_s <= obj * self.over_share:
            return
        if self._clock() - self._last_gap_at > _GAP_INTERVAL_S:
            self.itl_s = 0.0  # no stream is being relayed: nothing to slow down
            return
        limit = obj * self.over_share if self._over_share(tenant, weight, tokens) else obj
        if self.itl_s > limit:
            self.shed += 1
            raise Overloaded(self.itl_s, limit, 1.0, what="time per output token")

    def observe_gap(self, gap_s: float) -> None:
        """One gap between two tokens of a relayed stream (the relay's hot path: cheap)."""
        now = self._clock()
        self._last_gap_at = now
        g = self._gaps
        g[0] += gap_s
        g[1] += 1
        if now - self._gaps_since >= _GAP_INTERVAL_S:
            self.itl_s = g[0] / g[1]
            g[0], g[1] = 0.0, 0
            self._gaps_since = now

    def _saw(self, tenant: str, weight: float) -> None:
        now = self._clock()
        self._seen[tenant] = (weight, now)
        if len(self._seen) > 1024:
            # Bounded however many tenants come and go.
            for t in [t for t, (_, at) in self._seen.items() if at < now - self.window_s]:
                del self._seen[t]

    def _over_share(self, tenant: str, weight: float, tokens: int) -> bool:
        since = self._clock() - self.window_s
        weights = weight + sum(w for t, (w, at) in self._seen.items()
                               if t != tenant and at >= since)
        held = self._tenants.get(tenant, 0) + tokens
        total = self.backlog_tokens + tokens
        return total > 0 and held / total > max(weight, 1e-6) / max(weights, 1e-6)

    # -- the backlog -----------------------------------------------------------------
    def admit(self, tenant: str, weight: float, tokens: int,
              arrived_at: float | None = None) -> Ticket:
        """Count an admitted request in the backlog until :meth:`served` or :meth:`forget`
        (``arrived_at``: when it reached the gateway, on this shedder's clock)."""
        now = self._clock()
        if self.backlog_requests == 0:
            self._busy_since = now
        self.backlog_requests += 1
        self.backlog_tokens += tokens
        self._tenants[tenant] = self._tenants.get(tenant, 0) + tokens
        self._saw(tenant, weight)
        ticket = Ticket(tenant, tokens, now, arrived_at=arrived_at)
        self._awaited += 1
        if self.learner is not None:
            self._open.append(ticket)
        return ticket

    def _waiting(self, since: float) -> list[float]:
        """How long each request admitted since ``since`` and still awaiting its first
        token has waited so far, from its arrival (in admission order, so the scan stops
        early)."""
        tickets = self._open
        while tickets and not tickets[0].awaited:
            tickets.popleft()
        if len(tickets) > 4 * self._awaited + 64:
            # One request held for long keeps the answered ones behind it here: drop them.
            self._open = tickets = deque(t for t in tickets if t.awaited)
        now = self._clock()
        ages = []
        for t in reversed(tickets):
            if t.admitted_at < since:
                break
            if t.awaited:
                ages.append(now - t.arrived)
        return ages

    def served(self, ticket: Ticket) -> None:
        """The request reached its first token: its tokens count toward the rate."""
        if not ticket.open:
            return
        self._leave(ticket)
        now = self._clock()
        self._served += 1
        self._served_tokens += ticket.tokens
        busy = self._busy_now(now)
        self._samples.append((now, busy, self._served_tokens))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.window_s:
            self._samples.popleft()
        t0, busy0, tokens0 = self._samples[0]
        if self._served >= self.min_served and busy - busy0 > 0:
            rate = (self._served_tokens - tokens0) / (busy - busy0)
            # Under pressure and busy throughout the window, the window's rate is what the
            # fleet does now (contention included): trust it even when it is lower.
            saturated = (now - self._pressed_at <= self.window_s
                         and busy - busy0 >= 0.9 * (now - t0))
            if rate >= self._current_capacity() or saturated:
                self.capacity, self._capacity_at = rate, busy

    def first_token(self, ticket: Ticket, at: float | None = None) -> None:
        """The request's first token reached its client (``at``, by default now): with
        learning on, its time from arrival is what the headroom is learned from. Counted
        once; apart from :meth:`served`, since prefill's answer is not always the client's
        first token (a token that decodes to no text shows it nothing yet)."""
        if not ticket.awaited:
            return
        self._settle(ticket)
        if self.learner is None:
            return
        now = self._clock()
        at = now if at is None else at
        # From its arrival: what it waited before admission (its body read, its prompt
        # counted) is part of the time to first token the objective is about.
        self.learner.observe(now, at - ticket.arrived,
                             now - self._pressed_at <= self.learner.window_s,
                             ticket.admitted_at, self._waiting)

    def forget(self, ticket: Ticket) -> None:
        """The request ended: out of the backlog if it was still in it (failed, cancelled,
        shed later), and no longer awaited (a stream that never showed text included)."""
        if ticket.open:
            self._leave(ticket)
        if ticket.awaited:
            self._settle(ticket)

    def _settle(self, ticket: Ticket) -> None:
        ticket.awaited = False
        self._awaited -= 1

    def _leave(self, ticket: Ticket) -> None:
        ticket.open = False
        self.backlog_requests -= 1
        self.backlog_tokens -= ticket.tokens
        left = self._tenants.get(ticket.tenant, 0) - ticket.tokens
        if left > 0:
            self._tenants[ticket.tenant] = left
        else:
            self._tenants.pop(ticket.tenant, None)
        if self.backlog_requests == 0 and self._busy_since is not None:
            self._busy_total += self._clock() - self._busy_since
            self._busy_since = None

    # -- the rate --------------------------------------------------------------------
    def _busy_now(self, now: float) -> float:
        if self._busy_since is None:
            return self._busy_total
        return self._busy_total + now - self._busy_since

    def _current_capacity(self) -> float:
        if self.capacity <= 0:
            return 0.0
        # Aged in busy seconds: an idle gateway keeps what it measured.
        age = self._busy_now(self._clock()) - self._capacity_at
        return self.capacity * math.pow(0.5, age / self.half_life_s)

