"""Placement: which decode engine and which prefill engine serve a request (pure functions)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from kvpush.common.wire import EngineStatus, WireError, decode

logger = logging.getLogger(__name__)

DECODE_ROLES = frozenset({"decode", "both"})
PREFILL_ROLES = frozenset({"prefill", "both"})

# engine id -> (last status message bytes, its queued_prompt_tokens)
_QUEUED_CACHE: dict[str, tuple[bytes, int]] = {}


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


@dataclass(slots=True)
class EngineView:
    """What a scheduler believes about one engine between two refreshes."""

    engine_id: str
    role: str
    url: str
    model: str = ""
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    generation: int = 0
    reserved_blocks: int = 0
    """Blocks reserved on it, as of the last refresh or this scheduler's last reserve reply."""
    pending_prompt_tokens: int = 0
    """Prompt tokens this scheduler sent it since the last refresh (not in its status yet)."""
    suspect_until: int = 0
    """Unix ms until which a failed dispatch keeps it out of placement (circuit breaker)."""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def available_blocks(self) -> int:
        """Blocks a new reservation could get, by the same rule as the reserve script."""
        return max(0, min(self.total_blocks - self.reserved_blocks, self.free_blocks))

    @property
    def prefill_load(self) -> int:
        """Prompt tokens queued on it (as a prefill engine), including ours not yet reported."""
        return self.queued_prompt_tokens + self.pending_prompt_tokens


def _int(fields: Mapping[bytes, bytes], name: bytes, default: int = 0) -> int:
    raw = fields.get(name)
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


def view_from_hash(engine_id: str, fields: Mapping[bytes, bytes]) -> EngineView | None:
    """An :class:`EngineView` from a ``kvpush:engine:{E}`` hash; None when it is unusable."""
    if not fields or b"role" not in fields:
        return None
    queued = 0
    m = fields.get(b"m")
    if m is not None:
        hit = _QUEUED_CACHE.get(engine_id)
        if hit is not None and hit[0] == m:
            queued = hit[1]  # unchanged since the last refresh: skip decoding
        else:
            try:
                queued = decode(m, EngineStatus).queued_prompt_tokens
            except WireError as exc:
                logger.warning("engine %s publishes a bad status message: %s", engine_id, exc)
            if len(_QUEUED_CACHE) > 100_000:
                _QUEUED_CACHE.clear()
            _QUEUED_CACHE[engine_id] = (m, queued)
    return EngineView(
        engine_id=engine_id,
        role=fields[b"role"].decode(),
        url=fields.get(b"url", b"").decode(),
        model=fields.get(b"model", b"").decode(),
        block_size=max(1, _int(fields, b"block_size", 16)),
        total_blocks=_int(fields, b"total_blocks"),
        free_blocks=_int(fields, b"free_blocks", _int(fields, b"total_blocks")),
        running=_int(fields, b"running"),
        waiting=_int(fields, b"waiting"),
        queued_prompt_tokens=queued,
        generation=_int(fields, b"generation"),
        suspect_until=_int(fields, b"suspect_until"),
    )


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
