"""Wire messages: every payload kvpush puts in Redis or in a NIXL notification.

Each message is a msgspec ``Struct`` encoded as msgpack and carries ``v`` (the schema
version). Decoding checks types and version and raises :class:`WireError` on anything
malformed, so a corrupt stream entry is a clear error rather than a crash deep inside a
service. Times on the wire are wall-clock unix milliseconds: monotonic clocks do not
compare across hosts.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 1


class WireError(ValueError):
    """A payload could not be decoded into the expected message."""


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every wire message."""

    v: int = SCHEMA_VERSION


def now_ms() -> int:
    """Wall-clock unix time in milliseconds, the only clock allowed on the wire."""
    return time.time_ns() // 1_000_000


# -- engines -------------------------------------------------------------------------------


class EngineStatus(Message, kw_only=True):
    """What an engine publishes on every heartbeat."""

    engine_id: str
    role: str  # "prefill" | "decode" | "both"
    url: str
    model: str
    block_size: int
    total_blocks: int
    free_blocks: int
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    generation: int = 0
    tp_size: int = 1
    connector: str = "kvpush"
    updated_ms: int = 0


class KVLayout(Message, kw_only=True):
    """Where one worker rank keeps its paged KV cache, enough for a peer to address blocks.

    One region per (layer, K/V) pair: ``base_addrs[i]`` is the start of region ``i`` and
    block ``b`` of that region sits at ``base_addrs[i] + b * block_len``.
    """

    layer_names: list[str]
    base_addrs: list[int]
    region_len: int
    block_len: int
    num_blocks: int
    block_size: int
    dtype: str
    kv_splits: int  # regions per layer: 2 when K and V are separate, 1 when fused
    tp_rank: int
    tp_size: int
    memory: str  # "DRAM" | "VRAM"
    device_id: int = 0
    block_stride: int = 0  # bytes between blocks of a region; 0: equal to block_len


class AgentInfo(Message, kw_only=True):
    """A worker's NIXL agent: its metadata blob and the KV layout it registered."""

    engine_id: str
    rank: int
    agent_name: str
    agent_metadata: bytes
    backends: list[str]
    generation: int
    layout: KVLayout
    published_ms: int = 0


# -- request flow --------------------------------------------------------------------------


class ScheduleRequest(Message, kw_only=True):
    """A request the gateway enqueues for the schedulers (trace context travels beside it)."""

    request_id: str
    gateway_id: str
    tenant: str = "default"
    prompt_tokens: int
    max_tokens: int
    deadline_ms: int
    enqueued_ms: int = 0


class Assignment(Message, kw_only=True):
    """A scheduler's answer: where a request runs and the reservation that holds its slot."""

    request_id: str
    ok: bool = True
    error: str | None = None
    retry_after_s: float | None = None
    prefill_engine: str | None = None
    prefill_url: str | None = None
    decode_engine: str | None = None
    decode_url: str | None = None
    reservation_id: str | None = None
    fencing_token: int = 0
    blocks: int = 0
    lease_expiry_ms: int = 0
    disaggregated: bool = True
    # Why ok is False, for the gateway's status code: "overloaded" (queue full or waited too
    # long), "no_engine" (no live decode engine), "too_large" (fits no engine), "deadline".
    error_kind: str | None = None


class PushTarget(Message, kw_only=True):
    """Decode's reserved blocks for one request, published for the prefill connector."""

    request_id: str
    decode_engine: str
    decode_generation: int
    block_ids: list[int]
    num_tokens: int
    skip_blocks: int = 0  # leading blocks decode already holds (prefix-cache hit)
    deadline_ms: int = 0
    traceparent: str | None = None
    cancel: bool = False  # decode no longer wants this push (request ended or failed)


class PushDone(Message, kw_only=True):
    """NIXL notification prefill sends after the last WRITE of a request."""

    request_id: str
    ok: bool = True
    error: str | None = None
    num_tokens: int = 0
    bytes_written: int = 0
    # Wall-clock unix ms when prefill's forward pass over the prompt's last chunk ended
    # (its last layer's KV was in the cache); 0: unknown. Decode subtracts it from when
    # the KV is complete on its side: the transfer time the request could not hide.
    last_layer_done_ms: int = 0


# -- codec ---------------------------------------------------------------------------------

M = TypeVar("M", bound=Message)
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(msg: Message) -> bytes:
    """msgpack bytes of ``msg``."""
    return _ENCODER.encode(msg)


def decode(data: bytes | bytearray | memoryview, cls: type[M]) -> M:
    """Decode ``data`` as ``cls``; raises :class:`WireError` on bad bytes or version."""
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        msg = dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from exc
    if msg.v != SCHEMA_VERSION:
        raise WireError(
            f"{cls.__name__} schema version {msg.v} is not supported (want {SCHEMA_VERSION})"
        )
    return msg
