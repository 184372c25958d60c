"""What the scheduler side hands the workers each step (``KVConnectorMetadata``).

Block ids are per KV cache group (``BlockIds``: one list per group, in vLLM's group order;
a single list for a model with one group), like vLLM's own ``get_block_ids()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

BlockIds: TypeAlias = list[list[int]]


@dataclass
class SendTarget:
    """Where a prefill request's KV goes: decode's blocks for the whole prompt."""

    rid: str
    decode_engine: str
    decode_generation: int
    block_ids: BlockIds
    skip_blocks: list[int]  # per group: leading blocks not pushed
    num_tokens: int
    deadline_ms: int
    traceparent: str | None = None  # the request's trace (prefill's own params first)
    first_token: bool = False  # decode goes on from prefill's first token: PushDone has it


@dataclass
class PrefillStep:
    """One prefill request scheduled in this step."""

    rid: str
    block_ids: BlockIds  # every block of the request so far, in order
    computed_before: int  # tokens whose KV existed before this step (cache hits included)
    computed_after: int  # tokens whose KV exists once this step's forward pass ends
    prompt_len: int
    restarted: bool = False  # preempted and rescheduled: blocks were reallocated
    # What a worker needs to accept a target it read from Redis itself, mid-forward:
    decode_engine: str | None = None  # the decode the assignment named (None: any)
    push_key: str | None = None  # what its target must carry (common/push_key.py)
    deadline_ms: int = 0  # the request's push deadline, for a target that carries none
    traceparent: str | None = None  # prefill's own trace context


@dataclass
class FenceTo:
    """Where a prefill request that may end without a push says so: decode's receive
    fails at once instead of at its deadline, and gives its blocks back (fence.py)."""

    rid: str
    decode_engine: str
    decode_generation: int | None = None  # None: the engine's newest


@dataclass
class RecvSpec:
    """A decode request waiting for its push."""

    rid: str
    prefill_engine: str
    block_ids: BlockIds
    skip_blocks: list[int]  # per group: leading blocks not pushed
    deadline_ms: int
    traceparent: str | None = None
    allocated_ns: int = 0  # time.time_ns() when the scheduler allocated the blocks
    first_token: bool = False  # the push must bring prefill's first token
    history: bool = False  # a prefill leg's history, pushed by the engine holding it


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step. Keys are vLLM request ids."""

    # prefill (sender)
    steps: dict[str, PrefillStep] = field(default_factory=dict)
    targets: dict[str, SendTarget] = field(default_factory=dict)
    held: dict[str, BlockIds] = field(default_factory=dict)  # finished, blocks kept
    first_tokens: dict[str, int] = field(default_factory=dict)  # held: the token sampled
    cancel: set[str] = field(default_factory=set)  # stop writing, tell decode it failed
    release: set[str] = field(default_factory=set)  # held, no push will happen: free
    forget: set[str] = field(default_factory=set)  # ended without holding: drop state
    # preempted this step: vLLM freed their blocks, which this step may already reuse
    preempted: set[str] = field(default_factory=set)
    # the decode to tell once the push ended, where it never reached one (fence.py)
    fence: dict[str, FenceTo] = field(default_factory=dict)
    # decode (receiver)
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)  # ended while receiving
    # ended after a verified receive: check its blocks again, then let vLLM free them
    recheck: set[str] = field(default_factory=set)
    unkeep: set[str] = field(default_factory=set)  # preempted: its blocks are not its own

    def is_empty(self) -> bool:
        """True when the step carries nothing for the connector workers."""
        return not (self.steps or self.targets or self.held or self.cancel or self.release
                    or self.forget or self.preempted or self.fence or self.recvs
                    or self.abandoned or self.recheck or self.unkeep)


@dataclass
class KVPushWorkerMeta(KVConnectorWorkerMetadata):
    """Worker to scheduler, once per step, from decode ranks: prefill's first token of each
    request received that goes on from it, and the requests received verified. vLLM merges
    every rank's."""

    first_tokens: dict[str, int] = field(default_factory=dict)
    # received verified: its blocks are checked again when it ends (KVPUSH_VERIFY_KV)
    kept: set[str] = field(default_factory=set)
    # decode: given up and quarantined: tell prefill to stop, so that it fences its WRITEs
    closing: set[str] = field(default_factory=set)
    # prefill: by rank, requests whose WRITEs the fence still polls (when it changed)
    lingering: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPushWorkerMeta:
        """Every rank's tokens (the ranks of one request agree: one prefill sampled it)."""
        if isinstance(other, KVPushWorkerMeta):
            return KVPushWorkerMeta({**self.first_tokens, **other.first_tokens},
                                    self.kept | other.kept, self.closing | other.closing,
                                    {**self.lingering, **other.lingering})
        return self
