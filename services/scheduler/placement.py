"""Placement: which decode engine and which prefill engine serve a request (pure functions)."""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

from kvpush.common.engine_view import DECODE_ROLES, PREFILL_ROLES, EngineView


class UnknownPolicy(ValueError):
    """``scheduler_placement`` names no known policy."""


class Policy(enum.StrEnum):
    """Decode placement policies."""

    LEAST_LOADED = "least_loaded"
    """Most unreserved capacity (as a share of the engine), spreading load."""
    BEST_FIT = "best_fit"
    """Least unreserved capacity that still fits, packing engines and keeping big holes."""

    @classmethod
    def parse(cls, name: str) -> Policy:
        """The policy called ``name``; raises :class:`UnknownPolicy`."""
        try:
            return cls(name)
        except ValueError:
            raise UnknownPolicy(
                f"unknown placement policy {name!r}; use one of {[p.value for p in cls]}"
            ) from None


def blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request can occupy at most: prompt plus every token it may generate."""
    tokens = max(0, prompt_tokens) + max(0, max_tokens)
    return max(1, -(-tokens // max(1, block_size)))


def decode_candidates(
    engines: Iterable[EngineView], prompt_tokens: int, max_tokens: int, policy: Policy
) -> list[tuple[EngineView, int]]:
    """Decode engines that fit the request by the local view, best first, with their block need."""
    fits: list[tuple[EngineView, int]] = []
    for e in engines:
        if e.role not in DECODE_ROLES:
            continue
        need = blocks_needed(prompt_tokens, max_tokens, e.block_size)
        if need <= e.available_blocks:
            fits.append((e, need))
    if policy is Policy.BEST_FIT:
        fits.sort(key=lambda x: (x[0].available_blocks - x[1], x[0].engine_id))
    else:
        fits.sort(
            key=lambda x: (
                -x[0].available_blocks / max(1, x[0].total_blocks),
                x[0].running + x[0].waiting,
                x[0].engine_id,
            )
        )
    return fits


def best_decode(
    engines: Iterable[EngineView],
    prompt_tokens: int,
    max_tokens: int,
    policy: Policy,
    skip: frozenset[str] = frozenset(),
) -> tuple[EngineView, int] | None:
    """The first of :func:`decode_candidates` in one pass (the scheduler's hot path)."""
    tokens = max(0, prompt_tokens) + max(0, max_tokens)
    best: tuple[EngineView, int] | None = None
    best_key: tuple[float, int, str] | None = None
    fit = policy is Policy.BEST_FIT
    for e in engines:
        if e.role not in DECODE_ROLES or e.engine_id in skip:
            continue
        need = max(1, -(-tokens // e.block_size))
        avail = min(e.total_blocks - e.reserved_blocks, e.free_blocks)
        if need > avail:
            continue
        if fit:
            key: tuple[float, int, str] = (avail - need, 0, e.engine_id)
        else:
            key = (-avail / max(1, e.total_blocks), e.running + e.waiting, e.engine_id)
        if best_key is None or key < best_key:
            best, best_key = (e, need), key
    return best


def can_ever_fit(engines: Iterable[EngineView], prompt_tokens: int, max_tokens: int) -> bool:
    """Whether some live decode engine is big enough for the request when empty."""
    return any(
        e.role in DECODE_ROLES
        and blocks_needed(prompt_tokens, max_tokens, e.block_size) <= e.total_blocks
        for e in engines
    )


def pick_prefill(engines: Iterable[EngineView], exclude: Collection[str] = ()
                 ) -> EngineView | None:
    """The prefill engine with the fewest queued prompt tokens (ties: fewer requests, id)."""
    best: EngineView | None = None
    best_key: tuple[int, int, str] | None = None
    for e in engines:
        if e.role not in PREFILL_ROLES or e.engine_id in exclude:
            continue
        key = (e.prefill_load, e.running + e.waiting, e.engine_id)
        if best_key is None or key < best_key:
            best, best_key = e, key
    return best
