"""Wire messages: every payload kvpush puts in Redis or in a NIXL notification.

Each message is a msgspec ``Struct`` encoded as msgpack and carries ``v`` (the schema
version). Decoding checks types and version and raises :class:`WireError` on anything
malformed, so a corrupt stream entry is a clear error rather than a crash deep inside a
service. Times on the wire are wall-clock unix milliseconds: monotonic clocks do not
compare across hosts.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

# 2: per-group block ids and skips in PushTarget (hybrid KV cache groups), page kind,
# region groups and KV heads in KVLayout, per-layer first blocks in KVChecksums, the
# sender's TP size in PushDone. 3: the page geometry in KVLayout (vLLM's KVCacheLayout,
# the backend's K/V content split and the byte strides of heads, parts and tokens).
SCHEMA_VERSION = 3


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
    # Its KV events are relayed to kvpush:kv:{E}: placement may read what it holds there.
    kv_events: bool = False
    # As decode, it goes on from prefill's first token (``KVTransferParams.continues``): its
    # connector fails a push that brings no first token rather than recomputing the prompt.
    continues: bool = False
    # Measured on its requests, for the history cost model (common/history_cost.py); 0:
    # not yet. Prompt tokens it computes per second of a request's prefill, and the mean
    # wait of a history pushed into it (its blocks allocated to the push's PushDone).
    prefill_tok_s: int = 0
    history_wait_ms: int = 0


class KVLayout(Message, kw_only=True):
    """Where one worker rank keeps its paged KV cache, enough for a peer to address blocks.

    One region per layer: ``base_addrs[i]`` is the origin of block 0 of region ``i`` and
    block ``b``'s page starts at ``base_addrs[i] + b * block_stride``; where its bytes lie
    inside (heads, K/V, tokens) is the page geometry below. In a hybrid
    model the layers of different KV cache groups share one tensor, so regions may alias;
    a block id belongs to one group at a time.
    """

    layer_names: list[str]
    base_addrs: list[int]
    region_len: int
    block_len: int
    num_blocks: int
    block_size: int
    dtype: str
    kv_splits: int  # regions per layer: 1, K and V live in one layer's pages
    tp_rank: int
    tp_size: int
    memory: str  # "DRAM" | "VRAM"
    device_id: int = 0
    block_stride: int = 0  # bytes between blocks of a region; 0: equal to block_len
    # What one block's page holds: "heads" is [heads][K, V][tokens][head_dim] (vLLM's CPU
    # attention), "latent" is [tokens][latent] (MLA: one latent per token, no heads).
    page: str = "heads"
    # KV cache group of each region, in region order (hybrid models); empty: all group 0.
    layer_groups: list[int] = []
    # KV heads in one page of this rank, and in the whole model (TP splits or replicates
    # them); an MLA latent counts as one head on every rank.
    kv_heads: int = 1
    total_kv_heads: int = 1
    # vLLM's resolved KVCacheLayout and how the backend reads a head's content ("split":
    # CPU attention's [K of every token][V of every token]; "fused": [K | V] per token;
    # "latent": MLA), with the byte strides of one page's axes (connector/page_layout.py).
    cache_layout: str = "LBHNC"
    content: str = "split"
    parts: int = 2
    part_bytes: int = 0
    head_stride: int = 0
    part_stride: int = 0
    token_stride: int = 0


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
    # Engines a previous attempt of this request failed on (re-route before first token).
    exclude_engines: list[str] = []
    # Engines the gateway saw fail moments ago: placed elsewhere when anything else fits
    # (the schedulers see the breaker's mark in Redis only at their next refresh).
    avoid_engines: list[str] = []
    # Hashes of the prompt's leading token chunks (common/prefix_hashes.py).
    prefix_hashes: list[int] = []
    # Place on this decode engine alone, with no prefill: it holds the prompt's KV already
    # (a further sample of an n > 1 request). A scheduler that predates the field places
    # the request as any other, which is correct, only not as cheap.
    colocate_on: str | None = None
    # The prefill engine this request is already computing on: its gateway sent the prompt
    # there at admission, before any decode was chosen (services/gateway/early_prefill.py).
    # A disaggregated placement keeps it while it is usable, so that pass is not wasted; a
    # scheduler that predates the field picks a prefill anew and the gateway cancels its own.
    prefill_on: str | None = None


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
    # Prompt tokens the decode engine holds already, by its KV events.
    cached_tokens: int = 0
    # The decode engine can go on from prefill's first token (``EngineStatus.continues``).
    decode_continues: bool = False
    # History push: this engine holds the prompt's first ``history_tokens`` and pushes them
    # to the prefill engine, which computes only the rest.
    history_engine: str | None = None
    history_url: str | None = None
    history_tokens: int = 0
    # Prompt tokens the prefill engine holds itself, by its KV events.
    prefill_held_tokens: int = 0
    # Where another engine held more of the prompt than prefill: the cost model's choice
    # (common/history_cost.py HistoryChoice: push, unmeasured, explore, short, slower) and
    # its inputs, computing those tokens on prefill and the wait for their push (ms).
    history_choice: Annotated[str, msgspec.Meta(max_length=16)] = ""
    history_recompute_ms: float = 0.0
    history_wait_ms: float = 0.0


class PushTarget(Message, kw_only=True):
    """Decode's reserved blocks for one request, published for the prefill connector.

    Per KV cache group (one group unless the model is hybrid): ``block_ids[g]`` has one
    decode block per prompt block, and its first ``skip_blocks[g]`` are not pushed:
    decode holds them already (a prefix-cache hit) or, in a sliding-window group, no
    token decode computes attends to them (vLLM may list its null block there)."""

    request_id: str
    decode_engine: str
    decode_generation: int
    block_ids: list[list[int]]
    num_tokens: int
    skip_blocks: list[int] = []
    deadline_ms: int = 0
    traceparent: str | None = None
    cancel: bool = False  # decode no longer wants this push (request ended or failed)
    push_key: str | None = None  # the request's key from its gateway (common/push_key.py)
    # Decode goes on from prefill's first token: PushDone must carry it.
    first_token: bool = False


class KVChecksums(Message, kw_only=True):
    """CRC-32 of every pushed block of every layer, as prefill computed it from its own KV.

    ``crcs[layer][i]`` covers block ``first_blocks[layer] + i`` of the request (the
    prompt's token slots only, so a partial last block is compared over the tokens it
    holds; the first block is the layer's group's skip).
    """

    first_blocks: list[int]
    num_tokens: int
    crcs: list[list[int]]


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
    # Present when the push was sampled for verification (``KVPUSH_VERIFY_KV``): decode
    # recomputes them over the blocks it received before it schedules the request.
    checksums: KVChecksums | None = None
    # Prefill's TP size: a decode rank waits for a PushDone from every prefill rank that
    # writes into it (connector/tp_mapping.py).
    tp_size: int = 1
    # The token prefill sampled after the prompt, when the target asked for it; -1: none.
    first_token: int = -1
    # No WRITE this rank posted for the request is still in flight, and it will post none
    # again: decode may give a failed receive's blocks back to vLLM. A push that had to
    # leave WRITEs in flight says False, and says True in a later PushDone once they ended.
    fenced: bool = False


# Engine ids end up in Redis key names: the same alphabet as ``common.keys``.
EngineId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]


class KVTransferParams(Message, kw_only=True, forbid_unknown_fields=True):
    """The ``kv_transfer_params`` the gateway sends each engine with a pushed request.

    ``kvpush`` is the role. Every field is bounded so a hand-made request sent straight to
    an engine is refused at its edge instead of failing inside vLLM's scheduler.
    """

    kvpush: Literal["prefill", "decode"]
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    deadline_ms: Annotated[int, msgspec.Meta(ge=0, le=2**53)] = 0
    traceparent: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    # Both legs: the key decode's push target must carry (common/push_key.py).
    push_key: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    # prefill only
    decode_engine: EngineId | None = None
    # decode only
    prefill_engine: EngineId | None = None
    reservation_id: EngineId | None = None
    # Tokens come from Lua doubles: none is ever 2^53 or more (see common/reservations.py).
    fencing_token: Annotated[int, msgspec.Meta(ge=0, le=2**53)] = 0
    # Decode goes on from prefill's first token: the prompt's last token is not recomputed;
    # the token prefill sampled is appended to the prompt when the KV is in, so decode's
    # first step is the step a colocated engine runs for it (docs/contracts.md).
    continues: bool = False
    # prefill only: the prompt's first ``history_tokens`` arrive by push from
    # ``history_engine``, which holds them (a conversation's earlier turns): this engine
    # reserves blocks for them, computes only the rest, and pushes to decode as usual. The
    # holder runs them as a prefill leg of its own, ``history_request_id``, whose target
    # must carry ``history_push_key``. A history that never arrives is recomputed here.
    history_engine: EngineId | None = None
    history_request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    history_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    history_push_key: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    # ``history_digest(prompt[:history_tokens])`` as the gateway tokenized the prompt: a
    # history is received only into a prompt that starts with the very tokens pushed.
    history_digest: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    # prefill only: push only the prompt's first ``push_tokens`` (a holder's leg: the last
    # token is there so that the whole history is a prefix-cache hit)
    push_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0

    def to_dict(self) -> dict[str, Any]:
        """The params as the JSON object an engine request carries. Fields at their default
        are left out (a prefill leg has no fencing token): parsing gives them back as is."""
        return {f.name: value for f in msgspec.structs.fields(self)
                if f.name != "v" and (value := getattr(self, f.name)) is not None
                and value != f.default}


def history_digest(token_ids: Sequence[int]) -> str:
    """The digest a history's token ids are named by in ``KVTransferParams``."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def parse_kv_transfer_params(raw: Any) -> KVTransferParams:
    """Validate ``kv_transfer_params`` of a kvpush request; raises :class:`WireError`."""
    if not isinstance(raw, dict):
        raise WireError("kv_transfer_params must be a JSON object")
    data = {k: v for k, v in raw.items() if k != "v"}
    try:
        params = msgspec.convert(data, KVTransferParams)
    except (msgspec.ValidationError, TypeError) as exc:
        raise WireError(f"invalid kv_transfer_params: {exc}") from exc
    if params.kvpush == "decode" and not params.prefill_engine:
        raise WireError("invalid kv_transfer_params: a decode request needs prefill_engine")
    history = (params.history_engine, params.history_request_id, params.history_tokens,
               params.history_digest)
    if any(history) and not all(history):
        raise WireError("invalid kv_transfer_params: history_engine, history_request_id, "
                        "history_tokens and history_digest come together")
    if params.history_engine and params.kvpush != "prefill":
        raise WireError("invalid kv_transfer_params: only a prefill leg receives a history")
    return params


# -- fleet sizing (services/scheduler/planner.py) ------------------------------------------

_Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e6)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
_UnixMs = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class GatewaySlo(Message, kw_only=True):
    """What one gateway measured over its last window: the latencies the planner sizes the
    fleet toward. Published every few seconds into ``kvpush:slo``."""

    gateway_id: EngineId
    updated_ms: _UnixMs
    window_s: _Seconds
    requests: _Count  # reached their first token in the window
    ttft_p90_s: _Seconds = 0.0
    itl_mean_s: _Seconds = 0.0  # mean time per output token of streams that ended
    shed: _Count = 0  # shed in the window (their wait would have passed the objective)


class RolePlan(Message, kw_only=True):
    """The planner's count for one role."""

    ready: _Count  # serving, not draining
    desired: _Count
    reason: Annotated[str, msgspec.Meta(max_length=512)] = ""


class FleetPlan(Message, kw_only=True):
    """The planner's desired replica counts, written by the leading planner; what
    ``kvpush up --autoscale`` applies (k8s reads the same counts from Prometheus)."""

    planner_id: EngineId
    updated_ms: _UnixMs
    prefill: RolePlan
    decode: RolePlan


# -- engine zygotes (services/engine/zygote.py), over a local Unix socket ---------------------

_Arg = Annotated[str, msgspec.Meta(max_length=1 << 16)]


class ZygoteFork(Message, kw_only=True):
    """A launcher asks a warm engine zygote for an engine; the engine's stdout and stderr
    travel beside it as file descriptors."""

    argv: Annotated[list[_Arg], msgspec.Meta(max_length=1024)]  # the engine main's arguments
    env: Annotated[dict[_Arg, _Arg], msgspec.Meta(max_length=4096)]
    cwd: _Arg
    cpus: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]],
                    msgspec.Meta(max_length=1 << 16)] | None = None
    title: _Arg = ""  # the command line the engine shows in ps (its launcher's command)


class ZygoteReply(Message, kw_only=True):
    """The zygote's answers on a fork's connection: the engine's pid once forked, then its
    exit status (negative: the signal that ended it); or why it forked nothing."""

    pid: int | None = None
    returncode: int | None = None
    error: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


# -- stored responses (services/gateway/response_store.py) ---------------------------------


class StoredResponse(Message, kw_only=True):
    """A ``/v1/responses`` answer kept for its tenant: what ``GET /v1/responses/{id}``
    returns, and the conversation a request naming it as ``previous_response_id`` goes on
    from (every input item before it and its own, then its output items)."""

    id: Annotated[str, msgspec.Meta(max_length=128)]
    created_ms: _UnixMs
    history: list[Any]  # input items of every turn up to this one, in order
    response: dict[str, Any]  # the response object as the client received it


# -- codec ---------------------------------------------------------------------------------

M = TypeVar("M", bound=Message)
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(msg: Message) -> bytes:
    """msgpack bytes of ``msg``."""
    return _ENCODER.encode(msg)


# No legitimate message comes near this; a larger payload is refused before decoding.
MAX_MESSAGE_BYTES = 1 << 20


def decode(data: bytes | bytearray | memoryview, cls: type[M],
           max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Decode ``data`` as ``cls``; raises :class:`WireError` on bad bytes or version, or
    on more than ``max_bytes`` of them."""
    if len(data) > max_bytes:
        raise WireError(f"{cls.__name__} of {len(data)} bytes exceeds {max_bytes}")
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


# -- vLLM's KV events (vLLM's format, read by services/engine/kv_events.py) -----------------
# Not kvpush messages (no schema version): mirrors of vllm.distributed.kv_events with only
# the fields placement reads, bounded so a hostile publisher cannot make decoding costly.

_Hash = int | bytes
_MAX_EVENT_BLOCKS = 1 << 14
_MAX_EVENT_TOKENS = 1 << 22


class VllmBlockStored(msgspec.Struct, tag="BlockStored", forbid_unknown_fields=False):
    """Blocks an engine's prefix cache now holds, each chained to the one before."""

    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=_MAX_EVENT_BLOCKS)]
    parent_block_hash: _Hash | None
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]],
                         msgspec.Meta(max_length=_MAX_EVENT_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    lora_id: int | None = None
    lora_name: str | None = None
    # Per block: the LoRA name, multimodal (identifier, offset) pairs, the cache salt and
    # prompt-embedding digests that went into the block's hash, untagged.
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=False):
    """Blocks an engine's prefix cache evicted."""

    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=_MAX_EVENT_BLOCKS)]
    group_idx: int | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared",
                           forbid_unknown_fields=False):
    """The engine's prefix cache was emptied."""


VllmKvEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmKvEventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    """One ZMQ message of vLLM's KV event publisher."""

    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=_MAX_EVENT_BLOCKS)]
    data_parallel_rank: int | None = None
