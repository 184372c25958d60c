"""Which push targets a prefill rank read from Redis itself it may take.

The scheduler side reads the same stream, but its copy reaches the worker only with the
next step's metadata: a target landing during a long forward pass would then be written all
at once after it, where the rank's own copy lets the remaining layers go out layer-wise.
Only a target the scheduler side would accept is taken: for a request this rank has a step
of, from the decode its assignment named, not cancelled. Anything else is left to the
scheduler side's copy (where the rank ignores a target it already took).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from kvpush.common.push_key import target_allowed
from kvpush.common.wire import PushTarget
from kvpush.connector.metadata import SendTarget
from kvpush.connector.push_job import PushJob
from kvpush.connector.state import PushState

# Targets read before this rank saw the request's first step wait this long at most, this
# many of them (the scheduler side's copy covers anything dropped here).
_EARLY_TTL_NS = 5_000_000_000
_MAX_EARLY = 256


def _from_owner(job: PushJob | None, t: PushTarget) -> bool:
    """``t`` may steer ``job`` (no job yet: checked once one exists)."""
    step = job.step if job is not None else None
    return step is None or target_allowed(step.decode_engine, step.push_key,
                                          t.decode_engine, t.push_key)


class RankTargets:
    """The targets a rank's reader thread delivered (``inbox``), and those read early."""

    def __init__(self, inbox: collections.deque[PushTarget] | None) -> None:
        self.inbox = inbox
        # rid -> (target, expiry monotonic ns): read before this rank saw the request's
        # first step.
        self._early: dict[str, tuple[PushTarget, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.inbox) or bool(self._early)

    def take(self, jobs: Iterable[PushJob]) -> list[tuple[PushJob, SendTarget]]:
        """The targets to accept now, each with its job (waiting for a target)."""
        now = time.monotonic_ns()
        fresh: list[PushTarget] = []
        while self.inbox:
            fresh.append(self.inbox.popleft())
        by_rid = {job.rid: job for job in jobs if job.step is not None}
        cancelled = {t.request_id for t in fresh
                     if t.cancel and _from_owner(by_rid.get(t.request_id), t)}
        for rid in [r for r, (_t, exp) in self._early.items() if exp < now or r in cancelled]:
            del self._early[rid]
        out: list[tuple[PushJob, SendTarget]] = []
        for t in [*fresh, *(t for t, _exp in list(self._early.values()))]:
            if t.cancel or t.request_id in cancelled:
                continue
            job = by_rid.get(t.request_id)
            if job is None:
                if len(self._early) < _MAX_EARLY:
                    self._early.setdefault(t.request_id, (t, now + _EARLY_TTL_NS))
                continue
            self._early.pop(t.request_id, None)
            step = job.step
            assert step is not None
            if job.state is not PushState.WAIT_TARGET or not _from_owner(job, t):
                continue
            out.append((job, SendTarget(
                t.request_id, t.decode_engine, t.decode_generation,
                [list(g) for g in t.block_ids], list(t.skip_blocks), t.num_tokens,
                t.deadline_ms or step.deadline_ms,
                traceparent=step.traceparent or t.traceparent, first_token=t.first_token,
            )))
        return out
