"""Exponential backoff with a cap: the one helper for every retry loop in kvpush."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays ``first``, ``2*first``, ... up to ``cap`` seconds, with optional jitter.

    ``reset`` after a success long enough to call the next failure a new outage.
    """

    first: float = 0.1
    cap: float = 2.0
    jitter: float = 0.0  # share of each delay drawn at random, so peers do not retry in step
    _next: float = field(default=0.0, init=False)

    def next(self) -> float:
        """The delay before the next attempt (grows on every call)."""
        delay = self._next or self.first
        self._next = min(delay * 2, self.cap)
        if self.jitter:
            delay *= 1 - self.jitter * random.random()
        return delay

    def reset(self) -> None:
        """Start again from ``first``."""
        self._next = 0.0
