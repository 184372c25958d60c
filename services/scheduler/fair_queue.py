"""Waiting room: the requests a scheduler holds and the weighted fair queue across tenants."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpush.common.wire import ScheduleRequest
from kvpush.services.scheduler.prefix_affinity import Affinity


@dataclass(slots=True)
class Pending:
    """A request this scheduler holds: read from the stream, not yet answered."""

    entry_id: str
    request: ScheduleRequest
    traceparent: bytes
    arrived: float  # monotonic
    wait_until: float  # monotonic: queue timeout or the request's deadline, whichever first
    seq: int = 0
    redelivered: bool = False
    preferred_engine: str | None = None
    affinity: Affinity | None = None  # where its longest known prompt prefix went
    vstart: float = 0.0  # virtual start tag while it waits (WaitQueue)
    read_ns: int = 0  # wall clock when read, for the spans
    shard: int = 0  # the request stream it was read from (entry ids are per stream)

    @property
    def ref(self) -> str:
        """The entry's id qualified by its shard, unique across shards; shard 0's is the
        bare entry id, as written in ``kvpush:once:*`` before the stream was sharded."""
        return self.entry_id if self.shard == 0 else f"{self.shard}/{self.entry_id}"


class WaitQueue:
    """Requests held back for lack of a decode slot: one FIFO per tenant, weighted fair.

    Start-time fair queueing over the tenants' FIFOs. A request pushed by tenant ``t`` gets
    a virtual start tag ``S = max(V, F[t])`` and advances ``F[t] = S + cost / weight(t)``,
    where ``cost`` is what it takes of the decode engine (prompt + max tokens) and ``V`` is
    the start tag of the last request served. The next request served is the tenants' head
    with the smallest start tag (ties: arrival order). So while several tenants wait, each
    gets decode capacity in proportion to its weight however many requests it queues, a
    tenant that floods only lengthens its own FIFO, and a tenant back from idle starts at
    ``V`` (no credit saved up while away). Within a tenant, order stays FIFO.

    Requests that do not fit stop the drain (no overtaking by smaller ones), so a large
    request is never starved either.
    """

    def __init__(self, max_len: int,
                 weight_of: Callable[[str], float] = lambda _t: 1.0) -> None:
        self.max_len = max_len
        self.weight_of = weight_of
        self._by_tenant: dict[str, deque[Pending]] = {}
        self._finish: dict[str, float] = {}  # F[t]: virtual finish of t's last request
        self._heads: list[tuple[float, int, str]] = []  # (start tag, seq, tenant) heap
        self._vtime = 0.0  # V
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def full(self) -> bool:
        """No room for another request."""
        return self._len >= self.max_len

    def push(self, p: Pending) -> None:
        """Queue ``p`` behind its tenant's earlier requests, tagged for fair service."""
        tenant = p.request.tenant
        p.seq = next(self._seq)
        start = max(self._vtime, self._finish.get(tenant, 0.0))
        cost = max(1, p.request.prompt_tokens + p.request.max_tokens)
        self._finish[tenant] = start + cost / max(1e-6, self.weight_of(tenant))
        p.vstart = start
        q = self._by_tenant.get(tenant)
        if q is None:
            q = self._by_tenant[tenant] = deque()
        q.append(p)
        if len(q) == 1:
            heapq.heappush(self._heads, (start, p.seq, tenant))
        self._len += 1

    def peek(self) -> Pending | None:
        """The request to serve next: the head with the smallest virtual start tag."""
        if not self._heads:
            return None
        return self._by_tenant[self._heads[0][2]][0]

    def pop(self, p: Pending) -> None:
        """Remove ``p``, which :meth:`peek` returned."""
        _, _, tenant = heapq.heappop(self._heads)
        q = self._by_tenant[tenant]
        assert q[0] is p, "pop() takes what peek() returned"
        q.popleft()
        self._len -= 1
        self._vtime = max(self._vtime, p.vstart)
        if q:
            heapq.heappush(self._heads, (q[0].vstart, q[0].seq, tenant))
        else:
            del self._by_tenant[tenant]
            if len(self._finish) > 4 * len(self._by_tenant) + 1024:
                # Tags at or below V carry no information (max() with V wins): forget them
                # so a scheduler that saw many tenants does not grow.
                self._finish = {t: f for t, f in self._finish.items() if f > self._vtime}

    def remove_where(self, pred: Callable[[Pending], bool]) -> list[Pending]:
        """Remove and return every request matching ``pred`` (order kept for the rest)."""
        out: list[Pending] = []
        for tenant in list(self._by_tenant):
            q = self._by_tenant[tenant]
            keep = deque(p for p in q if not pred(p))
            if len(keep) == len(q):
                continue
            out.extend(p for p in q if pred(p))
            if keep:
                self._by_tenant[tenant] = keep
            else:
                del self._by_tenant[tenant]
        if out:
            self._len -= len(out)
            self._heads = [(q[0].vstart, q[0].seq, t) for t, q in self._by_tenant.items()]
            heapq.heapify(self._heads)
        return out

    def expire(self, now: float) -> list[Pending]:
        """Remove and return every request whose wait is over."""
        return self.remove_where(lambda p: p.wait_until <= now)

    def tenants(self) -> list[str]:
        """Tenants with requests waiting."""
        return list(self._by_tenant)

    def __iter__(self) -> Iterator[Pending]:
        for q in self._by_tenant.values():
            yield from q
