"""Whether a prompt's held history is pushed to prefill or recomputed there: the cost model,
pure and unit-tested (the scheduler feeds it what the engines measure and publish).

Pushing saves prefill the compute of the tokens another engine holds and it lacks; it costs
the wait for the push (the holder's next step, then the WRITEs). Both are measured on the
prefill engine and published with its heartbeat: its prompt throughput (vLLM's per-request
prefill time and computed tokens) and the mean wait of the histories pushed into it (the
connector's ``kvpush_kv_history_wait_seconds``). The push wins when the compute it saves
takes longer than that wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class HistoryChoice(StrEnum):
    """What became of a prompt whose prefix another engine holds (``Assignment.history_choice``,
    the ``choice`` label of ``kvpush_gateway_history_decisions``)."""

    PUSH = "push"  # the measured wait is shorter than the compute it saves
    UNMEASURED = "unmeasured"  # no measurement yet: pushed, which measures it
    EXPLORE = "explore"  # the model said recompute; pushed anyway, to measure again
    SHORT = "short"  # fewer tokens than scheduler_history_push_tokens: recomputed
    SLOWER = "slower"  # the measured wait is longer than the compute it saves: recomputed

    @property
    def pushes(self) -> bool:
        """Whether the history is pushed."""
        return self in (HistoryChoice.PUSH, HistoryChoice.UNMEASURED, HistoryChoice.EXPLORE)


@dataclass(frozen=True, slots=True)
class HistoryCost:
    """One decision and its inputs."""

    choice: HistoryChoice
    tokens: int  # held tokens prefill would not have to compute
    recompute_ms: float  # computing them on prefill, by its measured throughput (0: unknown)
    wait_ms: float  # the measured mean wait of a history push into prefill (0: unknown)


def choose(tokens: int, *, least_tokens: int, prefill_tok_s: float, wait_ms: float,
           explore: bool = False) -> HistoryCost:
    """The choice for a push that would save prefill ``tokens`` tokens of compute.

    ``least_tokens`` is the floor below which a push is never worth its round trips;
    ``prefill_tok_s`` and ``wait_ms`` are the prefill's measurements (0 or less: not yet
    measured). ``explore`` turns one recompute the model chose into a push, so a wait
    measured while the holder was busy cannot keep every later history recomputed.
    """
    recompute_ms = tokens / prefill_tok_s * 1000 if prefill_tok_s > 0 else 0.0
    wait_ms = max(0.0, wait_ms)
    if tokens < least_tokens or tokens <= 0:
        choice = HistoryChoice.SHORT
    elif recompute_ms <= 0 or wait_ms <= 0:
        choice = HistoryChoice.UNMEASURED
    elif recompute_ms > wait_ms:
        choice = HistoryChoice.PUSH
    else:
        choice = HistoryChoice.EXPLORE if explore else HistoryChoice.SLOWER
    return HistoryCost(choice, max(0, tokens), round(recompute_ms, 3), round(wait_ms, 3))
