"""One request's push from one prefill rank: its state, its blocks, its WRITE batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvpush.common.wire import KVChecksums
from kvpush.connector import integrity
from kvpush.connector.metadata import BlockIds, FenceTo, PrefillStep, SendTarget
from kvpush.connector.page_layout import PageGeometry
from kvpush.connector.state import PushState
from kvpush.connector.stats import Outcome, PushRecord, WriteSpan, unix_ns
from kvpush.connector.tp_mapping import HeadSlice
from kvpush.connector.transport import Peer, Xfer, XferState


def blocks_ready(computed: int, prompt_len: int, block_size: int) -> int:
    """Leading blocks whose KV is final once ``computed`` prompt tokens are computed."""
    if computed >= prompt_len:
        return -(-prompt_len // block_size)
    return computed // block_size


@dataclass
class WriteBatch:
    """WRITEs of one step (layer-wise) or one catch-up, kept only while tracing."""

    blocks: int
    xfers: list[tuple[Xfer, int, int]] = field(default_factory=list)  # (xfer, lo, hi)

    def span(self) -> WriteSpan:
        """The batch as a ``kvpush.kv.write`` span."""
        xs = [x for x, _lo, _hi in self.xfers]
        done = [x.done_ns for x in xs if x.done_ns]
        return WriteSpan(
            start_unix_ns=unix_ns(min(x.posted_ns for x in xs)),
            end_unix_ns=unix_ns(max(done)) if done else 0,
            bytes=sum(x.nbytes for x in xs), descriptors=sum(x.descriptors for x in xs),
            blocks=self.blocks, layer_start=min(lo for _x, lo, _hi in self.xfers),
            layer_end=max(hi for _x, _lo, hi in self.xfers),
            ok=all(x.state is XferState.DONE for x in xs),
        )


@dataclass
class PushJob:
    """One request being pushed from this rank."""

    req_id: str
    rid: str
    state: PushState = PushState.WAIT_TARGET
    block_ids: BlockIds = field(default_factory=list)  # prefill's blocks, per group
    prompt_len: int = 0
    step: PrefillStep | None = None  # the latest step that computed part of the prompt
    ready: int = 0  # leading blocks whose KV is final
    written: int = 0  # leading blocks posted for every layer
    target: SendTarget | None = None
    # decode ranks written, each with the local heads it gets (one unless TPs differ)
    peers: list[tuple[Peer, HeadSlice]] = field(default_factory=list)
    peer_bytes: dict[str, int] = field(default_factory=dict)  # by peer agent name
    xfers: list[Xfer] = field(default_factory=list)
    held: bool = False  # request finished; vLLM keeps its blocks until we report
    first_token: int = -1  # the token prefill sampled after the prompt (once held)
    released: bool = False  # no push will happen: free the blocks
    forgotten: bool = False  # vLLM ended the request without holding its blocks
    notified: bool = False  # PushDone sent (or nobody to send it to)
    fenced: bool = True  # no WRITE left in flight when the push ended (fence.py)
    fence_to: FenceTo | None = None  # the decode to tell if no target ever reached this rank
    error: str | None = None
    outcome: str = Outcome.OK
    record: PushRecord | None = None
    step_regions: set[int] = field(default_factory=set)  # layers posted this step
    compute_done_ns: int = 0  # forward pass over the prompt's last chunk ended
    batches: list[WriteBatch] = field(default_factory=list)  # only while tracing

    def checksums(self, layers: list[torch.Tensor], groups: list[int],
                  geometry: PageGeometry | None, heads: HeadSlice, verify_rate: float
                  ) -> KVChecksums | None:
        """Checksums of what this push wrote to the decode rank that gets ``heads`` (the
        rank's KV ``layers`` of KV cache ``groups``), when the request is sampled for it."""
        target, total = self.target, self.total_blocks
        if (target is None or geometry is None
                or not integrity.sampled(self.rid, verify_rate)
                or len(self.block_ids) <= max(groups, default=0)
                or any(len(g) < total for g in self.block_ids)):
            return None
        t0 = time.perf_counter()
        sums = integrity.checksums(layers, groups, [g[:total] for g in self.block_ids],
                                   target.skip_blocks, self.prompt_len, geometry,
                                   (heads.first, heads.count))
        if self.record is not None:
            self.record.verified = True
            self.record.verify_ms = (time.perf_counter() - t0) * 1e3
        return sums

    @property
    def writable(self) -> bool:
        """True while new WRITEs may be posted."""
        return self.state is PushState.PUSHING and bool(self.peers)

    @property
    def total_blocks(self) -> int:
        """Blocks the whole prompt occupies (in every group)."""
        return len(self.target.block_ids[0]) if self.target and self.target.block_ids else 0

    @property
    def first_block(self) -> int:
        """The first block any group pushes."""
        return min(self.target.skip_blocks, default=0) if self.target else 0
