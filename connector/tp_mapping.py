"""Rank arithmetic of a push between different tensor-parallel sizes (pure, unit-tested).

Prefill runs TP ``P`` and decode TP ``M``; one divides the other. Each rank holds a
contiguous range of the model's KV heads, or one head replicated on ``tp / heads`` ranks
when TP exceeds the head count (GQA). A prefill rank writes the heads it shares with a
decode rank into that rank's matching head slice; every (decode rank, head) gets exactly
one writer, the lowest prefill rank holding the head, so nothing is written twice. An MLA
latent is the same on every rank: each decode rank gets the whole page from one prefill
rank (``d % P``). A CPU attention page is ``[heads][K, V][tokens][head_dim]``, so a head
range of one block is one contiguous byte range.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedTP(ValueError):
    """A pairing of TP sizes and head counts the push cannot map."""


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``first .. first + count - 1`` of one rank's page (local head indexes)."""

    first: int
    count: int


@dataclass(frozen=True)
class RankWrite:
    """One prefill rank's part of a push into one decode rank."""

    decode_rank: int
    local: HeadSlice  # in the prefill rank's page
    remote: HeadSlice  # in the decode rank's page


def check_pairing(prefill_tp: int, decode_tp: int, total_heads: int) -> None:
    """Raise :class:`UnsupportedTP` unless the sizes divide each other and the heads."""
    if prefill_tp < 1 or decode_tp < 1 or total_heads < 1:
        raise UnsupportedTP(f"TP {prefill_tp} -> {decode_tp} with {total_heads} KV heads")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise UnsupportedTP(f"prefill TP {prefill_tp} and decode TP {decode_tp} do not "
                            "divide each other")
    for tp in (prefill_tp, decode_tp):
        if (tp <= total_heads and total_heads % tp) or (tp > total_heads and tp % total_heads):
            raise UnsupportedTP(f"TP {tp} does not divide (or is not a multiple of) "
                                f"{total_heads} KV heads")


def rank_heads(rank: int, tp: int, total_heads: int) -> range:
    """The model's KV heads that ``rank`` of a TP ``tp`` engine holds."""
    if tp <= total_heads:
        per = total_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // total_heads)
    return range(head, head + 1)


def _writer_of_head(head: int, prefill_tp: int, total_heads: int) -> int:
    """The one prefill rank that writes ``head`` (the lowest that holds it)."""
    if prefill_tp <= total_heads:
        return head // (total_heads // prefill_tp)
    return head * (prefill_tp // total_heads)


def writes_of(prefill_rank: int, prefill_tp: int, decode_tp: int, total_heads: int,
              mla: bool = False) -> list[RankWrite]:
    """What ``prefill_rank`` writes, one entry per decode rank it writes into."""
    check_pairing(prefill_tp, decode_tp, 1 if mla else total_heads)
    if mla:
        whole = HeadSlice(0, 1)
        return [RankWrite(d, whole, whole) for d in range(decode_tp)
                if d % prefill_tp == prefill_rank]
    mine = rank_heads(prefill_rank, prefill_tp, total_heads)
    out = []
    for d in range(decode_tp):
        theirs = rank_heads(d, decode_tp, total_heads)
        shared = [h for h in mine if h in theirs
                  and _writer_of_head(h, prefill_tp, total_heads) == prefill_rank]
        if shared:
            out.append(RankWrite(d, HeadSlice(shared[0] - mine.start, len(shared)),
                                 HeadSlice(shared[0] - theirs.start, len(shared))))
    return out


def writers_of(decode_rank: int, prefill_tp: int, decode_tp: int, total_heads: int,
               mla: bool = False) -> list[int]:
    """The prefill ranks whose PushDone ``decode_rank`` waits for."""
    return [p for p in range(prefill_tp)
            if any(w.decode_rank == decode_rank
                   for w in writes_of(p, prefill_tp, decode_tp, total_heads, mla))]
