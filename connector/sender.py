"""Prefill worker side: pushes each request's KV into decode's blocks, layer by layer."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable

import redis
import torch

from kvpush.common.wire import KVLayout, PushDone, PushTarget, encode, now_ms
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.device import DONE, Device, Event, HostDevice
from kvpush.connector.fence import Fence
from kvpush.connector.groups import NULL_BLOCK
from kvpush.connector.metadata import FenceTo, KVPushMetadata, PrefillStep, SendTarget
from kvpush.connector.page_layout import PageGeometry
from kvpush.connector.post_queue import Post, PostQueue
from kvpush.connector.push_job import PushJob, WriteBatch, blocks_ready
from kvpush.connector.rank_targets import RankTargets
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.state import PushState
from kvpush.connector.stats import Outcome, PushRecord, TransferObserver, unix_ns
from kvpush.connector.targets import TargetRejected, engine_peers, peers_for
from kvpush.connector.transport import (
    Peer,
    Transport,
    TransportError,
    Xfer,
    XferState,
    geometry_of,
)

logger = logging.getLogger(__name__)

# In-flight WRITEs get this long past the push deadline before the push fails without
# them; they are still polled (fence.py) and decode keeps its blocks until they ended.
_XFER_GRACE_MS = 1_000
# Longest the forward pass waits for WRITEs still reading a preempted request's blocks;
# past it the push fails and they are left to the fence (a frozen peer must not stall the
# engine).
_PREEMPT_WAIT_MS = 5_000

Notifications = list[tuple[str, bytes]]  # (sender agent name, message)


class Sender:
    """The pushes of one prefill worker rank; vLLM calls it from the model runner's thread.

    Each step's metadata says which requests compute which blocks and where decode wants
    them; blocks are written as soon as they are final (from ``save_kv_layer`` when
    layer-wise, else after the forward pass), and once every WRITE of the prompt completed
    PushDone goes to decode. Requests whose prefill ended are held by vLLM until then.

    A hook runs once the layer's kernels are queued, not done: each WRITE waits in
    ``_posts`` until the device event recorded after the kernels writing its data completed
    (``post_queue.py``; at once on a CPU).
    """

    def __init__(self, cfg: ConnectorConfig, *, tp_rank: int, block_size: int,
                 registry: AgentRegistry, observer: TransferObserver, verify_rate: float,
                 on_notifications: Callable[[Notifications], None] | None = None,
                 targets: collections.deque[PushTarget] | None = None) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.block_size = block_size
        self.registry = registry
        self.observer = observer
        self.verify_rate = verify_rate
        # Reading notifications is what flushes PushDone out; what it reads belongs to
        # the receiver (an engine that both prefills and decodes).
        self._on_notifications = on_notifications
        self.transport: Transport | None = None
        self.regions: dict[str, int] = {}
        self._groups: list[int] = []  # KV cache group of each region
        self._geometry: PageGeometry | None = None
        self.layout: KVLayout | None = None
        self._layers: list[torch.Tensor] = []  # region order, for KV checksums
        self.device: Device = HostDevice()
        self.jobs: dict[str, PushJob] = {}
        # (job, first block, end block, batch or None when not tracing) of this step
        self._layer_jobs: list[tuple[PushJob, int, int, WriteBatch | None]] = []
        self._step_ids: set[str] = set()
        # WRITEs whose data the device may not have computed yet (see device.py).
        self._posts = PostQueue(self._send)
        # After the last forward pass that computed prefill steps (and every block in it).
        self._step_event: Event = DONE
        self._finished: set[str] = set()
        # Targets this rank read from Redis itself (TargetReader): rank_targets.py.
        self._rank_targets = RankTargets(targets)
        self._in_forward = False
        self._seen_regions: list[int] = []  # layers already saved in this forward pass
        # After the last of them: events of one stream complete in order, so it covers all.
        self._seen_event: Event = DONE
        # Requests whose prompt's last token this step computed: their first output token
        # is sampled after wait_for_save, so PushDone (and its checksums) wait for the
        # next step's metadata and never delay the answer.
        self._answering: set[str] = set()
        self.fence = Fence(cfg.quarantine_max_s, self._send_push_done)

    def bind(self, transport: Transport, layout: KVLayout, layers: list[torch.Tensor], *,
             device: Device | None = None) -> None:
        """Use ``transport``, registered over ``layers`` as ``layout`` describes them (one
        region per layer name), on ``device`` (the host when None)."""
        self.transport = transport
        self.device = device if device is not None else HostDevice()
        self.layout = layout
        self.regions = {n: i for i, n in enumerate(layout.layer_names)}
        self._groups = list(layout.layer_groups) or [0] * len(layout.layer_names)
        self._geometry = geometry_of(layout)
        self._layers = layers

    # -- per step: metadata ----------------------------------------------------------------
    def on_metadata(self, meta: KVPushMetadata) -> None:
        """Take this step's prefill instructions; runs before the forward pass."""
        self._layer_jobs = []
        self._step_ids = set(meta.steps)
        self._in_forward = True
        self._seen_regions = []
        self._seen_event = DONE
        # Normally done already by handle_preemptions; a no-op then.
        self.handle_preemptions(meta.preempted)
        for req_id in meta.forget:
            job = self.jobs.get(req_id)
            if job is not None and job.peers and not job.notified:
                # A target this rank took itself: stop, and seal once its WRITEs ended.
                job.forgotten = True
                self._stop(job, "request ended", Outcome.CANCELLED)
            elif job := self.jobs.pop(req_id, None):
                self._posts.drop(job)
        for req_id, step in meta.steps.items():
            self._on_step(req_id, step)
        for req_id, target in meta.targets.items():
            self._on_target(req_id, target)
        for req_id, block_ids in meta.held.items():
            job = self.jobs.get(req_id)
            if job is None:
                # Finished without a step seen here (prefix fully cached elsewhere).
                job = self.jobs[req_id] = PushJob(req_id, rid="")
            job.held = True
            job.first_token = meta.first_tokens.get(req_id, -1)
            if block_ids:
                job.block_ids = [list(g) for g in block_ids]
        for req_id in meta.cancel:
            job = self.jobs.get(req_id)
            if job is not None:
                self._stop(job, "cancelled", Outcome.CANCELLED)
        for req_id in meta.release:
            job = self.jobs.get(req_id)
            if job is not None:
                job.released = True
                self._stop(job, "released", Outcome.CANCELLED)
        for req_id, to in meta.fence.items():
            job = self.jobs.get(req_id)
            if job is not None:
                job.fence_to = to
            else:
                self._fence_only(to)
        # The previous step's answers are sampled and on their way: seal their pushes.
        sealing = bool(self._answering)
        self._answering.clear()
        # Layer-wise WRITEs of this step are decided now, before the forward pass, for the
        # requests this forward pass computes; others catch up in wait_for_save.
        if self.cfg.layerwise and meta.steps:
            now = now_ms()
            for req_id in meta.steps:
                job = self.jobs.get(req_id)
                if job is not None and job.writable and job.target is not None:
                    if self._past_deadline(job, now):
                        continue
                    start = max(job.written, job.first_block)
                    end = min(job.ready, job.total_blocks)
                    if end > start:
                        job.step_regions = set()
                        batch = self._batch(job, end - start)
                        self._layer_jobs.append((job, start, end, batch))
        # After the plan above: a target taken here plans its own layer-wise writes.
        if self._rank_targets:
            self._take_targets()
        if sealing:
            self.progress()

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """vLLM preempted these requests and freed their blocks, which this very step may
        hand to other requests: drain the WRITEs still reading them (as vLLM's offloading
        connector flushes its stores), and post nothing more from them until the request
        is rescheduled. Blocks already written stay valid on decode: recomputing them
        yields the same KV. Queued WRITEs are dropped, written again from new blocks."""
        for req_id in preempted:
            job = self.jobs.get(req_id)
            if job is None:
                continue
            job.ready = 0
            job.block_ids = []
            self._posts.drop(job)
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
            self._leave(job)
            self._fail(job, f"WRITEs from preempted blocks did not finish: {exc}")
        if job.record is not None:
            for xfer in job.xfers:
                if xfer.state is XferState.DONE:
                    job.record.last_done_ns = max(job.record.last_done_ns, xfer.done_ns)
        job.xfers = [x for x in job.xfers if x.state is XferState.IN_PROGRESS]

    def _on_step(self, req_id: str, step: PrefillStep) -> None:
        job = self.jobs.get(req_id)
        if job is None:
            job = self.jobs[req_id] = PushJob(req_id, step.rid)
        job.block_ids = [list(g) for g in step.block_ids]
        job.prompt_len = step.prompt_len
        job.step = step
        if job.fence_to is None and step.decode_engine:
            job.fence_to = FenceTo(step.rid, step.decode_engine)
        job.ready = blocks_ready(step.computed_after, step.prompt_len, self.block_size)

    def _on_target(self, req_id: str, target: SendTarget) -> None:
        if self.fence.closed(target.rid):
            logger.info("ignoring a target for %s: its push already ended here", target.rid)
            return
        job = self.jobs.get(req_id)
        if job is None:
            job = self.jobs[req_id] = PushJob(req_id, target.rid)
        if job.state is not PushState.WAIT_TARGET:
            return
        job.rid = target.rid
        job.target = target
        job.written = job.first_block
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
            assert self.transport is not None and self.layout is not None
            job.peers = peers_for(target, self.layout, self.registry, self.transport,
                                  self.block_size)
        except (TransportError, LookupError, TargetRejected, redis.RedisError) as exc:
            self._fail(job, f"cannot reach decode {target.decode_engine}: {exc}")
            return
        # No peers: other prefill ranks write every head this rank holds.
        job.state = PushState.PUSHING if job.peers else PushState.DONE
        self.observer.started("push", target.rid, target.decode_engine)

    # -- targets read by this rank -----------------------------------------------------------
    def _take_targets(self) -> None:
        """Accept the targets this rank read from Redis for requests it is computing."""
        for job, target in self._rank_targets.take(self.jobs.values()):
            self._on_target(job.req_id, target)
            if job.writable:
                self._start_taken(job)

    def _start_taken(self, job: PushJob) -> None:
        """Write what ``job`` has computed so far. In the middle of the forward pass that
        computes it: the layers saved so far now, the rest layer by layer as they come."""
        if not (self._in_forward and job.req_id in self._step_ids):
            # Its blocks are final: computed by forward passes up to the last that
            # recorded a step event (this one, if it already ended), which covers them.
            self._catch_up(job, self._step_event)
            return
        if not self.cfg.layerwise:
            return  # wait_for_save catches this step's blocks up
        span = self._unwritten(job)
        if span is None:
            return
        start, end = span
        batch = self._batch(job, end - start)
        job.step_regions = set()
        seen = list(self._seen_regions)
        if seen:
            self._posts.submit(Post(self._seen_event, job, seen, start, end, batch))
            if not job.writable:
                return
            job.step_regions.update(seen)
        self._layer_jobs.append((job, start, end, batch))

    # -- per step: writes ------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str) -> None:
        """Post each pushed request's WRITEs of this layer once its kernels are done."""
        if self.jobs:
            # Without a progress thread, the layer hooks of the next forward pass are the
            # earliest chance to see an earlier push's WRITEs done and send its PushDone;
            # waiting for the end of that pass costs decode a whole (long) prefill step.
            self.progress()
        region = self.regions.get(layer_name)
        if region is None:
            return
        # Only a forward pass computing prefill steps writes KV that may be pushed (and
        # never a CUDA graph capture, whose metadata is empty).
        if self._step_ids:
            event = self._seen_event = self.device.record()
            if self._layer_jobs:
                self._post_layer(region, event)
        self._seen_regions.append(region)

    def _post_layer(self, region: int, event: Event) -> None:
        for job, start, end, batch in self._layer_jobs:
            if job.writable:
                self._posts.submit(Post(event, job, [region], start, end, batch, True))
                # Queued counts as posted: it will be, or the push ends, or a preemption
                # drops it and rewinds ``written``.
                job.step_regions.add(region)

    def wait_for_save(self) -> None:
        """After the forward pass: finish the step's layer-wise writes, post catch-ups."""
        forward_end = time.monotonic_ns()
        self._in_forward = False
        before = self._step_event
        if self._step_ids:
            # Orders this step's catch-ups, and the whole step when its layer hooks did not
            # run (a full CUDA graph replay skips them): the fallback below writes it then.
            self._step_event = self.device.record()
        for req_id in self._step_ids:
            job = self.jobs.get(req_id)
            # The step that computed the prompt's last token: its last layer's KV is in
            # the cache now (PushDone.last_layer_done_ms, for decode's exposed time).
            if (job is not None and not job.compute_done_ns and job.prompt_len
                    and job.ready * self.block_size >= job.prompt_len):
                job.compute_done_ns = forward_end
                self._answering.add(req_id)
        for job, _start, end, _batch in self._layer_jobs:
            # Only a step whose every layer was posted (or queued) counts; otherwise the
            # catch-up below writes the whole range again, all layers at once.
            if job.writable and len(job.step_regions) == len(self.regions):
                job.written = max(job.written, end)
                if job.record is not None and end >= job.total_blocks:
                    job.record.forward_end_ns = forward_end
        self._layer_jobs = []
        for job in self.jobs.values():
            if job.writable:
                self._catch_up(job, self._step_event if job.req_id in self._step_ids
                               else before)
        self.progress()

    def _catch_up(self, job: PushJob, event: Event) -> None:
        """Post every layer of the blocks computed before the target was known (or of
        this step's blocks when layer-wise writes are off) once ``event`` completed."""
        span = self._unwritten(job)
        if span is None:
            return
        start, end = span
        regions = list(range(len(self.regions)))
        self._posts.submit(Post(event, job, regions, start, end, self._batch(job, end - start)))
        if job.writable:
            job.written = end

    def _send(self, post: Post) -> None:
        """Post a WRITE whose data is in the cache (a push past its deadline ends)."""
        job = post.job
        if job.writable and not self._past_deadline(job, now_ms()):
            self._post(job, post.regions, post.start, post.end, post.batch, post.layerwise)

    def _unwritten(self, job: PushJob) -> tuple[int, int] | None:
        """The final blocks of ``job`` not yet posted for every layer, as (start, end);
        None when there are none or its deadline passed."""
        assert job.target is not None
        start = max(job.written, job.first_block)
        end = min(job.ready, job.total_blocks)
        if end <= start or self._past_deadline(job, now_ms()):
            return None
        return start, end

    def _post(self, job: PushJob, regions: list[int], start: int, end: int,
              batch: WriteBatch | None, layerwise: bool = False) -> bool:
        """Post the WRITEs of blocks ``start:end`` of ``regions``: one per KV cache group
        among them, each from that group's first pushed block on. False (and the push
        failed) when prefill no longer holds a block or the transport refuses a post."""
        assert job.target is not None and self.transport is not None
        by_group: dict[int, list[int]] = {}
        for region in regions:
            by_group.setdefault(self._groups[region], []).append(region)
        for g, group_regions in by_group.items():
            if not job.writable:
                return False
            lo = max(start, job.target.skip_blocks[g])
            if end <= lo:
                continue
            local = job.block_ids[g][lo:end] if g < len(job.block_ids) else []
            if len(local) != end - lo or NULL_BLOCK in local:
                # A sliding group frees blocks that fall out of the window; decode's
                # target never names them, so this is a window mismatch, never written.
                self._fail(job, f"prefill holds no block for request blocks {lo}:{end} of "
                                f"KV cache group {g}")
                return False
            remote = job.target.block_ids[g][lo:end]
            for peer, _heads in job.peers:
                try:
                    xfer = self.transport.write(peer, group_regions, local, remote)
                except TransportError as exc:
                    self._fail(job, f"WRITE post failed: {exc}")
                    return False
                self._track(job, xfer,
                            layerwise_region=group_regions[0] if layerwise else None)
                if batch is not None:
                    batch.xfers.append((xfer, min(group_regions), max(group_regions) + 1))
        return job.writable

    def _past_deadline(self, job: PushJob, now: int) -> bool:
        """Stop ``job`` if its deadline passed: decode reuses its blocks a grace period
        after the deadline, so no WRITE may be posted once it has passed."""
        deadline = job.target.deadline_ms if job.target else 0
        if deadline and now > deadline:
            self._stop(job, "push deadline passed", Outcome.DEADLINE)
            return True
        return False

    def _batch(self, job: PushJob, blocks: int) -> WriteBatch | None:
        """A new ``kvpush.kv.write`` batch for ``job``; None (nothing kept) when not tracing."""
        if not self.observer.tracing:
            return None
        batch = WriteBatch(blocks)
        job.batches.append(batch)
        return batch

    def _track(self, job: PushJob, xfer: Xfer, layerwise_region: int | None = None) -> None:
        job.xfers.append(xfer)
        name = xfer.peer.agent_name
        job.peer_bytes[name] = job.peer_bytes.get(name, 0) + xfer.nbytes
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

    def progress(self) -> None:
        """Take targets read from Redis, poll in-flight WRITEs, enforce deadlines, seal
        finished pushes."""
        if self._rank_targets:
            self._take_targets()
        if self.fence.lingering and self.transport is not None:
            self.fence.poll(self.transport)
        if not self.jobs:
            return
        assert self.transport is not None
        self._posts.flush()
        now = now_ms()
        for job in list(self.jobs.values()):
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
                # A frozen peer keeps a WRITE in progress forever: the push fails now,
                # and the fence tells decode once the WRITEs ended.
                self._leave(job)
                self._fail(job, "WRITEs still in progress past the deadline")
            if job.xfers or self._posts.holds(job):
                continue
            # Decode needs PushDone as soon as the whole prompt's KV is written, not when
            # prefill's request ends a step later; the blocks stay held until it ends.
            prompt_done = job.held or (
                job.prompt_len > 0 and job.ready * self.block_size >= job.prompt_len)
            if (job.state is PushState.PUSHING and prompt_done
                    and job.written >= job.total_blocks):
                job.state = PushState.DONE
            if job.state is PushState.DONE and job.target is not None \
                    and job.target.first_token and not (job.held or job.forgotten):
                continue  # decode goes on from prefill's first token: PushDone carries it
            if job.state.ended and not job.notified and job.req_id not in self._answering:
                self._seal(job, ok=job.state is PushState.DONE)
            if job.notified and (job.held or job.forgotten):
                if job.held:
                    self._finished.add(job.req_id)
                self.jobs.pop(job.req_id, None)

    def _seal(self, job: PushJob, ok: bool) -> None:
        """Send PushDone once every WRITE completed (a completed NIXL WRITE is flushed
        to the peer, so the notification cannot overtake the data)."""
        job.notified = True
        if job.peers or job.fence_to is None:
            self.fence.close(job.rid, owes=not job.peers)
        elif job.rid:
            self._fence_only(job.fence_to)
        rec = job.record
        if rec is not None:
            rec.last_layer_done_ms = unix_ns(job.compute_done_ns) // 1_000_000
        for peer, heads in job.peers if self.transport is not None else ():
            sums = None
            if ok:
                try:
                    sums = job.checksums(self._layers, self._groups, self._geometry, heads,
                                         self.verify_rate)
                except (RuntimeError, ValueError, IndexError) as exc:
                    # Never an engine crash; never an unverified push passed as verified.
                    logger.warning("KV checksums of %s failed: %s", job.rid, exc)
                    ok, job.error = False, f"KV checksums failed: {exc}"
            self._send_push_done(peer, PushDone(
                request_id=job.rid, ok=ok, error=job.error, num_tokens=job.prompt_len,
                bytes_written=job.peer_bytes.get(peer.agent_name, 0),
                last_layer_done_ms=rec.last_layer_done_ms if rec else 0, checksums=sums,
                tp_size=self.layout.tp_size if self.layout else 1,
                first_token=job.first_token, fenced=job.fenced))
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
            rec.blocks = sum(max(0, job.written - skip) for skip in job.target.skip_blocks)
            rec.layers = len(self.regions)
        self.observer.finished(rec, [b.span() for b in job.batches if b.xfers])
        job.batches = []

    def _send_push_done(self, peer: Peer, msg: PushDone) -> None:
        """Send ``msg`` to ``peer`` and read what arrived meanwhile (which flushes it)."""
        assert self.transport is not None
        try:
            self.transport.notify(peer, encode(msg))
            # No progress thread: push the notification out before the engine idles.
            notifs = self.transport.notifications()
            if notifs and self._on_notifications is not None:
                self._on_notifications(notifs)
        except TransportError as exc:
            logger.warning("PushDone for %s to %s not sent: %s", msg.request_id,
                           peer.agent_name, exc)
            self.registry.forget(peer.engine_id, peer.rank)

    def _fence_only(self, to: FenceTo) -> None:
        layout, transport = self.layout, self.transport
        if layout is None or transport is None:
            return
        self.fence.unpushed(to.rid, lambda: [p for p, _h in engine_peers(
            to.decode_engine, to.decode_generation, layout, self.registry, transport)],
            layout.tp_size)

    def _leave(self, job: PushJob) -> None:
        """Stop waiting for ``job``'s WRITEs in flight; the fence polls them on."""
        self.fence.leave(job.rid, [p for p, _h in job.peers], job.xfers,
                         self.layout.tp_size if self.layout else 1)
        job.xfers = []
        job.fenced = False

    def _stop(self, job: PushJob, why: str, outcome: str) -> None:
        self._posts.drop(job)
        if job.state in (PushState.WAIT_TARGET, PushState.PUSHING):
            job.state = PushState.ABORTED
            job.error = why
            job.outcome = outcome

    def _fail(self, job: PushJob, why: str) -> None:
        self._posts.drop(job)
        if job.state in (PushState.DONE, PushState.FAILED):
            return
        if job.error is None:
            logger.warning("push of %s failed: %s", job.rid or job.req_id, why)
        job.state = PushState.FAILED
        job.error = why
        job.outcome = Outcome.ERROR
        if self.transport is not None and job.fenced and not job.xfers:
            for peer, _heads in job.peers:
                # The peer may have died or restarted: rebuild it from Redis on next use
                # (not while WRITEs to it are in flight: NIXL would lose their handles).
                self.registry.forget(peer.engine_id, peer.rank)
                self.transport.drop_peer(peer)

    # -- per step: results -----------------------------------------------------------------
    def take_finished(self) -> set[str]:
        """Held requests whose push ended since the last call: vLLM may free their blocks."""
        self.progress()
        finished, self._finished = self._finished, set()
        return finished
