"""Worker side of the push connector: registers the KV cache, WRITEs layers, receives PushDone."""

from __future__ import annotations

import logging
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
import torch

from kvpush.common.keys import RedisKeys
from kvpush.common.settings import CommonSettings
from kvpush.common.wire import (
    AgentInfo,
    KVChecksums,
    KVLayout,
    PushDone,
    WireError,
    decode,
    encode,
    now_ms,
)
from kvpush.connector import integrity
from kvpush.connector.config import ConnectorConfig, RedisAccessError, connector_redis
from kvpush.connector.metadata import KVPushMetadata, PrefillStep, RecvSpec, SendTarget
from kvpush.connector.nixl_transport import NixlTransport
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.state import PushState, RecvState
from kvpush.connector.stats import (
    KVPushStats,
    Outcome,
    PushRecord,
    TransferObserver,
    WriteSpan,
    unix_ns,
)
from kvpush.connector.transport import Peer, TransportError, Xfer, XferState

logger = logging.getLogger(__name__)

# A bare notification that never arrived would leave decode waiting for its deadline,
# so an unknown PushDone is kept this long in case its receive is registered late.
_EARLY_NOTIF_TTL_MS = 60_000
# Bound on those kept notifications: a flood of bogus ones must not grow memory.
_EARLY_NOTIF_MAX = 4096
# In-flight WRITEs get this long past the push deadline before they are abandoned (their
# handles released, which cancels them in UCX). Decode reuses the target blocks only
# ``late_write_grace_s`` (default 2 s) after the deadline, so abandoning must come first.
_XFER_GRACE_MS = 1_000
# Longest the forward pass waits for WRITEs still reading a preempted request's blocks;
# past it they are abandoned and the push fails (a frozen peer must not stall the engine).
_PREEMPT_WAIT_MS = 5_000


class UnsupportedLayout(RuntimeError):
    """The engine's KV cache cannot be pushed block by block as registered."""


class TargetRejected(ValueError):
    """A push target read from Redis does not fit the decode engine it names."""


def check_target(target: SendTarget, layout: KVLayout, block_size: int) -> None:
    """Refuse a target that could make prefill write outside the blocks decode reserved:
    every block id inside decode's registered cache, one block per ``block_size`` prompt
    tokens, and the skipped prefix no longer than the prompt."""
    want = -(-target.num_tokens // block_size) if target.num_tokens > 0 else 0
    if layout.block_size != block_size:
        raise TargetRejected(f"decode block size {layout.block_size} != {block_size}")
    if len(target.block_ids) != want:
        raise TargetRejected(f"{len(target.block_ids)} block ids for {target.num_tokens} "
                             f"tokens (want {want})")
    if not 0 <= target.skip_blocks <= want:
        raise TargetRejected(f"skip_blocks {target.skip_blocks} outside 0..{want}")
    if any(not 0 <= b < layout.num_blocks for b in target.block_ids):
        raise TargetRejected(f"block id outside decode's {layout.num_blocks} blocks")
    if len(set(target.block_ids)) != len(target.block_ids):
        raise TargetRejected("repeated block id")


def generation_of(cfg: ConnectorConfig, instance_id: str) -> int:
    """The engine generation every rank and the scheduler side agree on."""
    if cfg.generation:
        return cfg.generation
    # vLLM stamps one instance id per engine start and ships it to every worker.
    return zlib.crc32(instance_id.encode()) or 1


def _blocks_ready(computed: int, prompt_len: int, block_size: int) -> int:
    """Leading blocks whose KV is final once ``computed`` prompt tokens are computed."""
    if computed >= prompt_len:
        return -(-prompt_len // block_size)
    return computed // block_size


@dataclass
class _Batch:
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
    block_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    ready: int = 0  # leading blocks whose KV is final
    written: int = 0  # leading blocks posted for every layer
    target: SendTarget | None = None
    peer: Peer | None = None
    xfers: list[Xfer] = field(default_factory=list)
    held: bool = False  # request finished; vLLM keeps its blocks until we report
    released: bool = False  # no push will happen: free the blocks
    notified: bool = False  # PushDone sent (or nobody to send it to)
    error: str | None = None
    outcome: str = Outcome.OK
    record: PushRecord | None = None
    step_regions: set[int] = field(default_factory=set)  # layers posted this step
    compute_done_ns: int = 0  # forward pass over the prompt's last chunk ended
    batches: list[_Batch] = field(default_factory=list)  # only while tracing

    @property
    def writable(self) -> bool:
        """True while new WRITEs may be posted."""
        return self.state is PushState.PUSHING and self.peer is not None

    @property
    def total_blocks(self) -> int:
        """Blocks the whole prompt occupies."""
        return len(self.target.block_ids) if self.target else 0


@dataclass
class RecvJob:
    """One request on this rank waiting for its push."""

    req_id: str
    spec: RecvSpec
    state: RecvState = RecvState.RECEIVING
    since_ns: int = field(default_factory=time.monotonic_ns)


class WorkerSide:
    """Per-rank connector logic; vLLM calls it from the model runner's thread only."""

    def __init__(self, cfg: ConnectorConfig, *, tp_rank: int, tp_size: int, block_size: int,
                 num_blocks: int, generation: int, client: redis.Redis | None = None,
                 tracing: bool = False) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.generation = generation
        self.keys = RedisKeys(cfg.key_prefix)
        self._redis = client or connector_redis(cfg)
        self.registry = AgentRegistry(self._redis, self.keys, cfg.agent_ttl_s, cfg.heartbeat_s)
        self.observer = TransferObserver(cfg.stats_file, tracing=tracing)
        self.transport: NixlTransport | None = None
        self.layout: KVLayout | None = None
        self._region: dict[str, int] = {}
        self._layers: list[torch.Tensor] = []  # region order, for KV checksums
        self.verify_rate = (cfg.verify_kv if cfg.verify_kv is not None
                            else CommonSettings().verify_kv)
        self._jobs: dict[str, PushJob] = {}
        # (job, first block, end block, batch or None when not tracing) of this step
        self._layer_jobs: list[tuple[PushJob, int, int, _Batch | None]] = []
        self._step_ids: list[str] = []
        self._recvs: dict[str, RecvJob] = {}
        self._recv_by_rid: dict[str, str] = {}
        self._early: dict[str, tuple[PushDone, str, int]] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()

    # -- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every layer's paged KV cache with NIXL and publish the agent."""
        layout, ranges = self._describe(kv_caches)
        name = f"{self.cfg.engine_id}-r{self.tp_rank}-{self.generation}"
        self.transport = NixlTransport(name, self.cfg.backends)
        self.transport.register(layout, ranges)
        self.layout = layout
        self._region = {n: i for i, n in enumerate(layout.layer_names)}
        self._layers = [kv_caches[n] for n in layout.layer_names]
        try:
            self.registry.publish(AgentInfo(
                engine_id=self.cfg.engine_id, rank=self.tp_rank, agent_name=name,
                agent_metadata=self.transport.metadata(), backends=list(self.cfg.backends),
                generation=self.generation, layout=layout,
            ))
        except redis.RedisError as exc:
            # e.g. an ACL user without write access to the agent keys
            raise RedisAccessError(
                f"cannot publish agent metadata to Redis key "
                f"{self.keys.agent(self.cfg.engine_id, self.tp_rank)}: {exc}"
            ) from exc
        logger.info(
            "kvpush worker rank %s/%s registered %s layers x %s blocks of %s bytes "
            "(stride %s, %s) on %s, generation %s",
            self.tp_rank, self.tp_size, len(layout.layer_names), layout.num_blocks,
            layout.block_len, layout.block_stride, layout.dtype, self.cfg.backends,
            self.generation,
        )

    def _describe(self, kv_caches: dict[str, torch.Tensor]
                  ) -> tuple[KVLayout, list[tuple[int, int]]]:
        if not kv_caches:
            raise UnsupportedLayout("no KV cache layers to register")
        names = list(kv_caches)
        first = kv_caches[names[0]]
        storages: dict[int, int] = {}
        bases: list[int] = []
        for n in names:
            t = kv_caches[n]
            if not isinstance(t, torch.Tensor):
                raise UnsupportedLayout(
                    f"layer {n} has a {type(t).__name__} KV cache; only plain attention "
                    "layers are supported (no hybrid/mamba models)"
                )
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise UnsupportedLayout(
                    f"layer {n} has KV cache {tuple(t.shape)}/{t.dtype}; every layer must "
                    f"match {tuple(first.shape)}/{first.dtype}"
                )
            # Blocks must be the outer dimension with each page contiguous, so one block of
            # one layer is one descriptor (CPU layout [blocks, heads, block, 2*head]).
            if t.ndim < 2 or t.shape[0] != self.num_blocks or not t[0].is_contiguous():
                raise UnsupportedLayout(
                    f"layer {n}: KV cache {tuple(t.shape)} is not block-major with "
                    f"contiguous pages ({self.num_blocks} blocks expected); use a backend "
                    "with layout LBHNC (e.g. the CPU attention backend)"
                )
            stride = t.stride(0) * t.element_size()
            if stride < t[0].nbytes:
                raise UnsupportedLayout(f"layer {n}: pages overlap (stride {stride})")
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            bases.append(t.data_ptr())
        memory = "DRAM" if first.device.type == "cpu" else "VRAM"
        device_id = 0 if first.device.type == "cpu" else max(first.get_device(), 0)
        layout = KVLayout(
            layer_names=names, base_addrs=bases, region_len=first.nbytes,
            block_len=first[0].nbytes, num_blocks=self.num_blocks,
            block_size=self.block_size, dtype=str(first.dtype).removeprefix("torch."),
            kv_splits=1, tp_rank=self.tp_rank, tp_size=self.tp_size, memory=memory,
            device_id=device_id, block_stride=first.stride(0) * first.element_size(),
        )
        return layout, sorted(storages.items())

    # -- per step: metadata ----------------------------------------------------------------
    def on_metadata(self, meta: KVPushMetadata) -> None:
        """Take this step's instructions; runs before the forward pass."""
        self._layer_jobs = []
        self._step_ids = list(meta.steps)
        # Normally done already by handle_preemptions; a no-op then.
        self.handle_preemptions(meta.preempted)
        for req_id in meta.forget:
            self._jobs.pop(req_id, None)
        for req_id, step in meta.steps.items():
            self._on_step(req_id, step)
        for req_id, target in meta.targets.items():
            self._on_target(req_id, target)
        for req_id, block_ids in meta.held.items():
            job = self._jobs.get(req_id)
            if job is None:
                # Finished without a step seen here (prefix fully cached elsewhere).
                job = self._jobs[req_id] = PushJob(req_id, rid="")
            job.held = True
            if block_ids:
                job.block_ids = list(block_ids)
        for req_id in meta.cancel:
            job = self._jobs.get(req_id)
            if job is not None:
                self._stop(job, "cancelled", Outcome.CANCELLED)
        for req_id in meta.release:
            job = self._jobs.get(req_id)
            if job is not None:
                job.released = True
                self._stop(job, "released", Outcome.CANCELLED)
        for req_id, spec in meta.recvs.items():
            self._recvs[req_id] = RecvJob(req_id, spec)
            self._recv_by_rid[spec.rid] = req_id
            self.observer.started("recv", spec.rid, spec.prefill_engine)
            early = self._early.pop(spec.rid, None)
            if early is not None:
                self._on_push_done(early[0], early[1])
        for req_id in meta.abandoned:
            job = self._recvs.get(req_id)
            if job is not None:
                job.state = RecvState.ABANDONED
        # Layer-wise WRITEs of this step are decided now, before the forward pass, for the
        # requests this forward pass computes; others catch up in wait_for_save.
        if self.cfg.layerwise and meta.steps:
            now = now_ms()
            for req_id in meta.steps:
                job = self._jobs.get(req_id)
                if job is not None and job.writable and job.target is not None:
                    if self._past_deadline(job, now):
                        continue
                    start = max(job.written, job.target.skip_blocks)
                    end = min(job.ready, job.total_blocks)
                    if end > start:
                        job.step_regions = set()
                        batch = self._batch(job, end - start)
                        self._layer_jobs.append((job, start, end, batch))

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """vLLM preempted these requests and freed their blocks, which this very step may
        hand to other requests: drain the WRITEs still reading them (as vLLM's offloading
        connector flushes its stores), and post nothing more from them until the request
        is rescheduled. Blocks already written stay valid on decode: recomputing them
        yields the same KV."""
        for req_id in preempted:
            job = self._jobs.get(req_id)
            if job is None:
                continue
            job.ready = 0
            job.block_ids = []
            if job.xfers:
                self._drain(job)

    def _drain(self, job: PushJob) -> None:
        """Block until ``job``'s in-flight WRITEs complete; abandon them (and fail the push)
        at the push deadline plus grace, or after ``_PREEMPT_WAIT_MS`` at most."""
        assert self.transport is not None
        deadline_ms = job.target.deadline_ms + _XFER_GRACE_MS if job.target else 0
        wait_ms = min(_PREEMPT_WAIT_MS, max(deadline_ms - now_ms(), 0) if deadline_ms
                      else _PREEMPT_WAIT_MS)
        try:
            self.transport.wait(job.xfers, time.monotonic_ns() + wait_ms * 1_000_000)
        except TransportError as exc:
            for xfer in job.xfers:
                self.transport.abandon(xfer)
            self._fail(job, f"WRITEs from preempted blocks did not finish: {exc}")
        if job.record is not None:
            for xfer in job.xfers:
                if xfer.state is XferState.DONE:
                    job.record.last_done_ns = max(job.record.last_done_ns, xfer.done_ns)
        job.xfers = [x for x in job.xfers if x.state is XferState.IN_PROGRESS]

    def _on_step(self, req_id: str, step: PrefillStep) -> None:
        job = self._jobs.get(req_id)
        if job is None:
            job = self._jobs[req_id] = PushJob(req_id, step.rid)
        job.block_ids = list(step.block_ids)
        job.prompt_len = step.prompt_len
        job.ready = _blocks_ready(step.computed_after, step.prompt_len, self.block_size)

    def _on_target(self, req_id: str, target: SendTarget) -> None:
        job = self._jobs.get(req_id)
        if job is None:
            job = self._jobs[req_id] = PushJob(req_id, target.rid)
        if job.state is not PushState.WAIT_TARGET:
            return
        job.rid = target.rid
        job.target = target
        job.written = target.skip_blocks
        job.record = PushRecord("push", target.rid, self.cfg.engine_id, target.decode_engine,
                                self.tp_rank, start_ns=time.monotonic_ns(),
                                traceparent=target.traceparent)
        try:
            if job.prompt_len and target.num_tokens != job.prompt_len:
                raise TransportError(
                    f"decode expects {target.num_tokens} prompt tokens, prefill has "
                    f"{job.prompt_len} (different tokenization?)"
                )
            if not target.decode_generation:
                raise TargetRejected("target names no decode generation")
            info = self.registry.fetch(target.decode_engine, self.tp_rank,
                                       target.decode_generation)
            check_target(target, info.layout, self.block_size)
            assert self.transport is not None
            job.peer = self.transport.peer(info)
        except (TransportError, LookupError, TargetRejected, redis.RedisError) as exc:
            self._fail(job, f"cannot reach decode {target.decode_engine}: {exc}")
            return
        job.state = PushState.PUSHING
        self.observer.started("push", target.rid, target.decode_engine)

    # -- per step: writes ------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str) -> None:
        """Post this layer's WRITEs for every request being pushed (forward pass hot path)."""
        if self._jobs:
            # Without a progress thread, the layer hooks of the next forward pass are the
            # earliest chance to see an earlier push's WRITEs done and send its PushDone;
            # waiting for the end of that pass costs decode a whole (long) prefill step.
            self._progress()
        if not self._layer_jobs:
            return
        region = self._region.get(layer_name)
        if region is None:
            return
        assert self.transport is not None
        for job, start, end, batch in self._layer_jobs:
            if not job.writable:
                continue
            assert job.target is not None and job.peer is not None
            try:
                xfer = self.transport.write(job.peer, [region], job.block_ids[start:end],
                                            job.target.block_ids[start:end])
            except TransportError as exc:
                self._fail(job, f"WRITE post failed: {exc}")
                continue
            job.step_regions.add(region)
            self._track(job, xfer, layerwise_region=region)
            if batch is not None:
                batch.xfers.append((xfer, region, region + 1))

    def wait_for_save(self) -> None:
        """After the forward pass: finish the step's layer-wise writes, post catch-ups."""
        forward_end = time.monotonic_ns()
        for req_id in self._step_ids:
            job = self._jobs.get(req_id)
            # The step that computed the prompt's last token: its last layer's KV is in
            # the cache now (PushDone.last_layer_done_ms, for decode's exposed time).
            if (job is not None and not job.compute_done_ns and job.prompt_len
                    and job.ready * self.block_size >= job.prompt_len):
                job.compute_done_ns = forward_end
        for job, _start, end, _batch in self._layer_jobs:
            # Only a step whose every layer was posted counts; otherwise the catch-up
            # below writes the whole range again, all layers at once.
            if job.writable and len(job.step_regions) == len(self._region):
                job.written = max(job.written, end)
                if job.record is not None and end >= job.total_blocks:
                    job.record.forward_end_ns = forward_end
        self._layer_jobs = []
        for job in self._jobs.values():
            if job.writable:
                self._catch_up(job)
        self._progress()

    def _catch_up(self, job: PushJob) -> None:
        """Post every layer of the blocks computed before the target was known (or of
        this step's blocks when layer-wise writes are off)."""
        assert job.target is not None and job.peer is not None and self.transport is not None
        start = max(job.written, job.target.skip_blocks)
        end = min(job.ready, job.total_blocks)
        if end <= start or self._past_deadline(job, now_ms()):
            return
        regions = list(range(len(self._region)))
        try:
            xfer = self.transport.write(job.peer, regions, job.block_ids[start:end],
                                        job.target.block_ids[start:end])
        except TransportError as exc:
            self._fail(job, f"WRITE post failed: {exc}")
            return
        job.written = end
        self._track(job, xfer)
        batch = self._batch(job, end - start)
        if batch is not None:
            batch.xfers.append((xfer, 0, len(regions)))

    def _past_deadline(self, job: PushJob, now: int) -> bool:
        """Stop ``job`` if its deadline passed: decode reuses its blocks a grace period
        after the deadline, so no WRITE may be posted once it has passed."""
        deadline = job.target.deadline_ms if job.target else 0
        if deadline and now > deadline:
            self._stop(job, "push deadline passed", Outcome.DEADLINE)
            return True
        return False

    def _batch(self, job: PushJob, blocks: int) -> _Batch | None:
        """A new ``kvpush.kv.write`` batch for ``job``; None (nothing kept) when not tracing."""
        if not self.observer.tracing:
            return None
        batch = _Batch(blocks)
        job.batches.append(batch)
        return batch

    def _track(self, job: PushJob, xfer: Xfer, layerwise_region: int | None = None) -> None:
        job.xfers.append(xfer)
        rec = job.record
        if rec is None:
            return
        if not rec.first_post_ns:
            rec.first_post_ns = xfer.posted_ns
        rec.bytes += xfer.nbytes
        rec.descriptors += xfer.descriptors
        rec.xfers += 1
        if layerwise_region is not None:
            rec.layerwise_xfers += 1
            rec.layer_posts_ns.append((layerwise_region, xfer.posted_ns))
        if xfer.state is XferState.FAILED:
            self._fail(job, xfer.error or "WRITE failed")

    def _progress(self) -> None:
        """Poll in-flight WRITEs, enforce deadlines, seal finished pushes."""
        if not self._jobs:
            return
        assert self.transport is not None
        now = now_ms()
        for job in list(self._jobs.values()):
            for xfer in job.xfers:
                state = self.transport.poll(xfer)
                if state is XferState.FAILED:
                    self._fail(job, xfer.error or "WRITE failed")
                elif state is XferState.DONE and job.record is not None:
                    job.record.last_done_ns = max(job.record.last_done_ns, xfer.done_ns)
            job.xfers = [x for x in job.xfers if x.state is XferState.IN_PROGRESS]
            deadline = job.target.deadline_ms if job.target else 0
            if deadline and now > deadline and job.state is PushState.PUSHING:
                self._stop(job, "push deadline passed", Outcome.DEADLINE)
            if job.xfers and deadline and now > deadline + _XFER_GRACE_MS:
                # A frozen peer keeps a WRITE in progress forever; stop waiting for it.
                for xfer in job.xfers:
                    self.transport.abandon(xfer)
                job.xfers = []
                self._fail(job, "WRITEs still in progress past the deadline")
            if job.xfers:
                continue
            # Decode needs PushDone as soon as the whole prompt's KV is written, not when
            # prefill's request ends a step later; the blocks stay held until it ends.
            prompt_done = job.held or (
                job.prompt_len > 0 and job.ready * self.block_size >= job.prompt_len)
            if (job.state is PushState.PUSHING and prompt_done
                    and job.written >= job.total_blocks):
                job.state = PushState.DONE
            if job.state.ended and not job.notified:
                self._seal(job, ok=job.state is PushState.DONE)
            if job.held and job.notified:
                self._finished_sending.add(job.req_id)
                self._jobs.pop(job.req_id, None)

    def _seal(self, job: PushJob, ok: bool) -> None:
        """Send PushDone once every WRITE completed (a completed NIXL WRITE is flushed
        to the peer, so the notification cannot overtake the data)."""
        job.notified = True
        rec = job.record
        if rec is not None:
            rec.last_layer_done_ms = unix_ns(job.compute_done_ns) // 1_000_000
        if job.peer is not None and self.transport is not None:
            sums = self._checksums(job) if ok else None
            msg = PushDone(request_id=job.rid, ok=ok, error=job.error,
                           num_tokens=job.prompt_len, bytes_written=rec.bytes if rec else 0,
                           last_layer_done_ms=rec.last_layer_done_ms if rec else 0,
                           checksums=sums)
            try:
                self.transport.notify(job.peer, encode(msg))
                # No progress thread: push the notification out before the engine idles.
                self.transport.notifications()
            except TransportError as exc:
                logger.warning("PushDone for %s to %s not sent: %s", job.rid,
                               job.peer.agent_name, exc)
                self.registry.forget(job.peer.engine_id, job.peer.rank)
        if rec is None:
            return  # no target was ever accepted: nothing was pushed
        rec.ok = ok
        rec.error = job.error
        rec.outcome = Outcome.OK if ok else (
            job.outcome if job.outcome != Outcome.OK else Outcome.ERROR)
        rec.notify_ns = time.monotonic_ns()
        rec.backend = ",".join(self.transport.backends) if self.transport else ""
        rec.start_unix_ns = unix_ns(rec.first_post_ns or rec.start_ns)
        rec.end_unix_ns = unix_ns(rec.notify_ns)
        if job.target is not None:
            rec.blocks = max(0, job.written - job.target.skip_blocks)
            rec.layers = len(self._region)
        self.observer.finished(rec, [b.span() for b in job.batches if b.xfers])
        job.batches = []

    def _checksums(self, job: PushJob) -> KVChecksums | None:
        """Checksums of what this push wrote, when the request is sampled for it."""
        target = job.target
        if (target is None or not integrity.sampled(job.rid, self.verify_rate)
                or len(job.block_ids) < job.total_blocks):
            return None
        t0 = time.perf_counter()
        sums = integrity.checksums(self._layers, job.block_ids[:job.total_blocks],
                                   target.skip_blocks, job.prompt_len, self.block_size)
        if job.record is not None:
            job.record.verified = True
            job.record.verify_ms = (time.perf_counter() - t0) * 1e3
        return sums

    def _stop(self, job: PushJob, why: str, outcome: str) -> None:
        if job.state in (PushState.WAIT_TARGET, PushState.PUSHING):
            job.state = PushState.ABORTED
            job.error = why
            job.outcome = outcome

    def _fail(self, job: PushJob, why: str) -> None:
        if job.state in (PushState.DONE, PushState.FAILED):
            return
        if job.error is None:
            logger.warning("push of %s failed: %s", job.rid or job.req_id, why)
        job.state = PushState.FAILED
        job.error = why
        job.outcome = Outcome.ERROR
        if job.peer is not None and self.transport is not None:
            # The peer may have died or restarted: rebuild it from Redis on next use.
            self.registry.forget(job.peer.engine_id, job.peer.rank)
            self.transport.drop_peer(job.peer)

    # -- per step: results -----------------------------------------------------------------
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        self._progress()
        if self._recvs:
            self._poll_recvs()
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def _poll_recvs(self) -> None:
        assert self.transport is not None
        for agent, raw in self.transport.notifications():
            try:
                msg = decode(raw, PushDone)
            except WireError as exc:
                logger.warning("ignoring malformed notification from %s: %s", agent, exc)
                continue
            self._on_push_done(msg, agent)
        now = now_ms()
        grace = int(self.cfg.late_write_grace_s * 1000)
        for job in list(self._recvs.values()):
            if now > job.spec.deadline_ms + grace:
                self._end_recv(job, ok=False, error="push deadline passed",
                               outcome=Outcome.DEADLINE)
        cutoff = now - _EARLY_NOTIF_TTL_MS
        for rid in [r for r, (_m, _a, t) in self._early.items() if t < cutoff]:
            del self._early[rid]

    def _on_push_done(self, msg: PushDone, agent: str) -> None:
        req_id = self._recv_by_rid.get(msg.request_id)
        job = self._recvs.get(req_id) if req_id else None
        if job is None:
            if len(self._early) < _EARLY_NOTIF_MAX:
                self._early[msg.request_id] = (msg, agent, now_ms())
            return
        # Agent names are <engine>-r<rank>-<generation>: only the prefill rank the
        # assignment named may end this receive.
        if not re.fullmatch(rf"{re.escape(job.spec.prefill_engine)}-r{self.tp_rank}-\d+",
                            agent):
            logger.warning("ignoring PushDone for %s from %s (assigned prefill is %s)",
                           msg.request_id, agent, job.spec.prefill_engine)
            return
        verified, bad, verify_ms, error = None, None, 0.0, msg.error
        if msg.ok and msg.checksums is not None:
            t0 = time.perf_counter()
            got = integrity.checksums(self._layers, job.spec.block_ids,
                                      msg.checksums.first_block, msg.checksums.num_tokens,
                                      self.block_size)
            verify_ms = (time.perf_counter() - t0) * 1e3
            bad = integrity.first_mismatch(msg.checksums, got)
            verified = bad is None
            if bad is not None:
                blocks = job.spec.block_ids
                where = blocks[bad[1]] if bad[1] < len(blocks) else -1
                error = (f"KV checksum mismatch at layer {bad[0]}, request block {bad[1]} "
                         f"(decode block {where})")
        self._end_recv(job, ok=msg.ok and verified is not False, error=error,
                       nbytes=msg.bytes_written, last_layer_done_ms=msg.last_layer_done_ms,
                       outcome=Outcome.CORRUPT if verified is False else None,
                       verified=verified, verify_ms=verify_ms, bad=bad)

    def _end_recv(self, job: RecvJob, ok: bool, error: str | None, nbytes: int = 0,
                  outcome: str | None = None, last_layer_done_ms: int = 0,
                  verified: bool | None = None, verify_ms: float = 0.0,
                  bad: tuple[int, int] | None = None) -> None:
        end_unix_ns = time.time_ns()
        self._recvs.pop(job.req_id, None)
        self._recv_by_rid.pop(job.spec.rid, None)
        self._finished_recving.add(job.req_id)
        if not ok and job.state is RecvState.RECEIVING:
            self._failed_recving.add(job.req_id)
        if outcome is None:
            if ok:
                outcome = Outcome.OK
            elif job.state is RecvState.ABANDONED:
                outcome = Outcome.CANCELLED  # decode's request ended first and said so
            else:
                outcome = Outcome.ERROR
        exposed = None
        if ok and last_layer_done_ms:
            # Wall clocks of two hosts: skew shows up here, not hidden by clamping.
            exposed = round(end_unix_ns / 1e6 - last_layer_done_ms, 3)
        rec = PushRecord("recv", job.spec.rid, self.cfg.engine_id, job.spec.prefill_engine,
                         self.tp_rank, ok=ok, error=error, outcome=outcome, bytes=nbytes,
                         blocks=len(job.spec.block_ids) - job.spec.skip_blocks,
                         notify_ns=time.monotonic_ns(),
                         wait_ms=(time.monotonic_ns() - job.since_ns) / 1e6,
                         start_unix_ns=job.spec.allocated_ns or unix_ns(job.since_ns),
                         end_unix_ns=end_unix_ns, last_layer_done_ms=last_layer_done_ms,
                         exposed_ms=exposed, traceparent=job.spec.traceparent,
                         verified=verified, verify_ms=verify_ms,
                         bad_layer=bad[0] if bad else None, bad_block=bad[1] if bad else None)
        self.observer.finished(rec)

    def failed_block_ids(self) -> set[int]:
        """Blocks of failed receives: reported through ``failed_recving`` instead."""
        return set()

    def take_stats(self) -> KVPushStats | None:
        """Finished transfers since the last call."""
        return self.observer.take()

    def has_inflight(self) -> bool:
        """True while this rank has pushes or receives in progress."""
        return bool(self._jobs or self._recvs)

    def pending_ids(self) -> Iterable[str]:
        """Request ids this rank still tracks (for shutdown diagnostics)."""
        return [*self._jobs, *self._recvs]

    def shutdown(self) -> None:
        """Stop heartbeats and drop peers; in-flight pushes are abandoned."""
        self.registry.close()
        if self.transport is not None:
            self.transport.close()
