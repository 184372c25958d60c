"""What an engine's status hash says, read and bounded: the view the scheduler places by and
the gateway picks an early prefill from (published by services/engine/status.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvpush.common.wire import EngineStatus, WireError, decode

logger = logging.getLogger(__name__)

DECODE_ROLES = frozenset({"decode", "both"})
PREFILL_ROLES = frozenset({"prefill", "both"})

# engine id -> (last status message bytes, its queued_prompt_tokens)
_QUEUED_CACHE: dict[str, tuple[bytes, int]] = {}


@dataclass(slots=True)
class EngineView:
    """What a scheduler (or a gateway) believes about one engine between two refreshes."""

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
    draining: bool = False
    """Marked draining for its current generation: it finishes what it holds, gets nothing
    new (see :mod:`services.engine.drain`)."""
    kv_events: bool = False
    """Its KV events are relayed: ``kvpush:kv:{E}`` says which prefix chunks it holds."""
    continues: bool = False
    """As decode, it goes on from prefill's first token (``EngineStatus.continues``)."""
    prefill_tok_s: int = 0
    """Its measured prompt throughput per request (``EngineStatus.prefill_tok_s``; 0: not
    yet)."""
    history_wait_ms: int = 0
    """Its measured mean wait for a pushed history (``EngineStatus.history_wait_ms``)."""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def available_blocks(self) -> int:
        """Blocks a new reservation could get, by the same rule as the reserve script."""
        return max(0, min(self.total_blocks - self.reserved_blocks, self.free_blocks))

    @property
    def prefill_load(self) -> int:
        """Prompt tokens queued on it (as a prefill engine), including ours not yet reported."""
        return self.queued_prompt_tokens + self.pending_prompt_tokens


class BadEngineStatus(ValueError):
    """An engine status hash that cannot be trusted: the engine is left out of placement."""


# Bounds on what a real engine publishes; anything outside is garbage, not an engine.
_MAX_BLOCKS = 1 << 31
_MAX_BLOCK_SIZE = 1 << 16
_MAX_COUNT = 1 << 31
_MAX_TOKENS = 1 << 40
_MAX_MS = 1 << 53
_MAX_URL = 2048
# (engine id, reason) pairs already logged, so a bad engine costs one warning, not one per
# refresh; bounded like _QUEUED_CACHE.
_WARNED: set[tuple[str, str]] = set()


def _int(fields: Mapping[bytes, bytes], name: bytes, default: int, lo: int, hi: int) -> int:
    raw = fields.get(name)
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise BadEngineStatus(f"{name.decode()} is not an integer") from None
    if not lo <= n <= hi:
        raise BadEngineStatus(f"{name.decode()}={n} is outside [{lo}, {hi}]")
    return n


def _url(raw: bytes | None) -> str:
    if raw is None or len(raw) > _MAX_URL:
        raise BadEngineStatus("url is missing or too long")
    try:
        url = raw.decode()
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise BadEngineStatus("url is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadEngineStatus(f"url {url[:80]!r} is not an http(s) URL")
    return url


def _text(fields: Mapping[bytes, bytes], name: bytes) -> str:
    return fields.get(name, b"")[:256].decode(errors="replace")


def parse_engine_hash(engine_id: str, fields: Mapping[bytes, bytes]) -> EngineView:
    """An :class:`EngineView` from a ``kvpush:engine:{E}`` hash; raises
    :class:`BadEngineStatus` when any field is malformed or out of bounds."""
    if not fields:
        raise BadEngineStatus("no status")
    role = fields.get(b"role")
    if role is None or role.decode(errors="replace") not in DECODE_ROLES | PREFILL_ROLES:
        raise BadEngineStatus(f"role {role[:32] if role else role!r} is not prefill, decode "
                              "or both")
    total = _int(fields, b"total_blocks", 0, 0, _MAX_BLOCKS)
    free = _int(fields, b"free_blocks", total, 0, _MAX_BLOCKS)
    if free > total:
        raise BadEngineStatus(f"free_blocks={free} exceeds total_blocks={total}")
    generation = fields.get(b"generation", b"0")
    return EngineView(
        engine_id=engine_id,
        role=role.decode(),
        url=_url(fields.get(b"url")),
        model=_text(fields, b"model"),
        block_size=_int(fields, b"block_size", 16, 1, _MAX_BLOCK_SIZE),
        total_blocks=total,
        free_blocks=free,
        running=_int(fields, b"running", 0, 0, _MAX_COUNT),
        waiting=_int(fields, b"waiting", 0, 0, _MAX_COUNT),
        queued_prompt_tokens=_queued(engine_id, fields.get(b"m")),
        generation=_int(fields, b"generation", 0, 0, _MAX_MS),
        suspect_until=_int(fields, b"suspect_until", 0, 0, _MAX_MS),
        draining=fields.get(b"draining") == generation,
        kv_events=fields.get(b"kv_events") == b"1",
        continues=fields.get(b"continues") == b"1",
        prefill_tok_s=_int(fields, b"prefill_tok_s", 0, 0, _MAX_TOKENS),
        history_wait_ms=_int(fields, b"history_wait_ms", 0, 0, _MAX_MS),
    )


def _queued(engine_id: str, m: bytes | None) -> int:
    """``queued_prompt_tokens`` of the status message (0 when absent or bad)."""
    if m is None:
        return 0
    hit = _QUEUED_CACHE.get(engine_id)
    if hit is not None and hit[0] == m:
        return hit[1]  # unchanged since the last refresh: skip decoding
    queued = 0
    try:
        queued = decode(m, EngineStatus).queued_prompt_tokens
    except WireError as exc:
        _warn_once(engine_id, "bad status message", str(exc))
    if not 0 <= queued <= _MAX_TOKENS:
        _warn_once(engine_id, "bad queued_prompt_tokens", str(queued))
        queued = 0
    if len(_QUEUED_CACHE) > 100_000:
        _QUEUED_CACHE.clear()
    _QUEUED_CACHE[engine_id] = (m, queued)
    return queued


def _warn_once(engine_id: str, what: str, detail: str) -> None:
    key = (engine_id, what)
    if key in _WARNED:
        logger.debug("engine %s: %s: %s", engine_id, what, detail)
        return
    if len(_WARNED) > 10_000:
        _WARNED.clear()
    _WARNED.add(key)
    logger.warning("engine %s: %s (%s)", engine_id, what, detail)


def view_from_hash(engine_id: str, fields: Mapping[bytes, bytes]) -> EngineView | None:
    """An :class:`EngineView` from a ``kvpush:engine:{E}`` hash; None when it is unusable
    (absent, or malformed: logged once per engine and reason, and left out of placement)."""
    if not fields:
        return None
    try:
        return parse_engine_hash(engine_id, fields)
    except BadEngineStatus as exc:
        _warn_once(engine_id, str(exc), "left out of placement")
        return None
