"""Decode worker side: waits for each request's PushDone, verifies it, reports it over."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpush.common.wire import KVChecksums, KVLayout, PushDone, WireError, decode, now_ms
from kvpush.connector import integrity, tp_mapping
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.device import Device, HostDevice
from kvpush.connector.metadata import KVPushMetadata, RecvSpec
from kvpush.connector.page_layout import PageGeometry
from kvpush.connector.state import RecvState
from kvpush.connector.stats import Outcome, PushRecord, TransferObserver, unix_ns
from kvpush.connector.transport import Transport, geometry_of

logger = logging.getLogger(__name__)

# A bare notification that never arrived would leave decode waiting for its deadline,
# so an unknown PushDone is kept this long in case its receive is registered late.
_EARLY_NOTIF_TTL_MS = 60_000
# Bound on those kept notifications: a flood of bogus ones must not grow memory.
_EARLY_NOTIF_MAX = 4096


@dataclass
class RecvJob:
    """One request on this rank waiting for its push."""

    req_id: str
    spec: RecvSpec
    state: RecvState = RecvState.RECEIVING
    since_ns: int = field(default_factory=time.monotonic_ns)
    prefill_tp: int = 0  # as the first PushDone said
    parts: dict[int, _Part] = field(default_factory=dict)  # by prefill rank
    first_token: int = -1  # prefill's, as its PushDone said (spec.first_token)
    abandoned: bool = False  # the request ended meanwhile: the receive ends quietly
    fenced: set[int] = field(default_factory=set)  # prefill ranks with no WRITE in flight
    quarantined_ns: int = 0  # monotonic, when the receive was given up
    ending: dict[str, Any] = field(default_factory=dict)  # how it ended, reported once fenced


@dataclass
class _Part:
    """One prefill rank's verified PushDone."""

    nbytes: int
    verified: bool | None
    verify_ms: float
    last_layer_done_ms: int
    agent: str = ""
    heads: tuple[int, int] = (0, 0)  # (first, count) of this rank's heads it wrote
    checksums: KVChecksums | None = None


@dataclass
class _Kept:
    """A verified receive's checksums, checked again when its request ends: a block that
    changed while the request used it was written by someone it was not given to."""

    spec: RecvSpec
    parts: list[_Part]


def _but_last_block(sums: KVChecksums) -> KVChecksums:
    return KVChecksums(first_blocks=sums.first_blocks, num_tokens=sums.num_tokens,
                       crcs=[row[:-1] for row in sums.crcs])


class Receiver:
    """The receives of one decode worker rank; vLLM calls it from the model runner's thread.

    Decode's scheduler published the request's blocks as the push target; the receive
    ends when a PushDone arrived from every assigned prefill rank that writes into this
    rank (one unless the TP sizes differ, ``tp_mapping.writers_of``), each verified when
    it carries checksums; or as soon as one of them reports a failure; or when the
    deadline plus ``late_write_grace_s`` passed. KV reported received is made visible to
    the device's kernels first (``Device.make_visible``).
    """

    def __init__(self, cfg: ConnectorConfig, *, tp_rank: int, block_size: int,
                 observer: TransferObserver) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.block_size = block_size
        self.observer = observer
        self.transport: Transport | None = None
        self.device: Device = HostDevice()
        self._layers: list[torch.Tensor] = []  # region order, for KV checksums
        self._groups: list[int] = []  # KV cache group of each region
        self._page = integrity.HEADS
        self._geometry: PageGeometry | None = None
        self._tp_size = 1
        self._total_heads = 1
        self.jobs: dict[str, RecvJob] = {}
        self._by_rid: dict[str, str] = {}
        self._early: dict[str, tuple[PushDone, str, int]] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._first_tokens: dict[str, int] = {}
        self._kept: dict[str, _Kept] = {}
        self._newly_kept: set[str] = set()
        self._released: set[str] = set()
        self._closing: set[str] = set()  # quarantined since the last take_closing
        self._quarantine_told_ns = 0  # when the last quarantine snapshot was recorded
        self._received = False  # a receive succeeded since the last take_results

    def bind(self, transport: Transport, layout: KVLayout, layers: list[torch.Tensor], *,
             device: Device | None = None) -> None:
        """Use ``transport``, registered over ``layers`` as ``layout`` describes them, on
        ``device`` (the host when None)."""
        self.transport = transport
        self.device = device if device is not None else HostDevice()
        self._layers = layers
        self._groups = list(layout.layer_groups) or [0] * len(layout.layer_names)
        self._page = layout.page
        self._geometry = geometry_of(layout)
        self._tp_size = layout.tp_size
        self._total_heads = layout.total_kv_heads

    def on_metadata(self, meta: KVPushMetadata) -> None:
        """Start this step's receives and mark the abandoned ones."""
        for req_id, spec in meta.recvs.items():
            self.jobs[req_id] = RecvJob(req_id, spec)
            self._by_rid[spec.rid] = req_id
            self.observer.started("recv", spec.rid, spec.prefill_engine)
            early = self._early.pop(spec.rid, None)
            if early is not None:
                self._on_push_done(early[0], early[1])
        for req_id in meta.abandoned:
            job = self.jobs.get(req_id)
            if job is not None:
                job.abandoned = True
        for req_id in meta.unkeep:
            # Preempted: vLLM freed its blocks and recomputes it into others.
            self._kept.pop(req_id, None)
        for req_id in meta.recheck:
            kept = self._kept.pop(req_id, None)
            if kept is not None:
                self._recheck(req_id, kept)
            # Every rank answers, kept or not: vLLM frees the blocks once all did.
            self._released.add(req_id)

    def take_kept(self) -> set[str]:
        """Requests received verified since the last call, whose blocks are checked again
        when they end (the scheduler side then holds their blocks until this rank says)."""
        kept, self._newly_kept = self._newly_kept, set()
        return kept

    def take_closing(self) -> set[str]:
        """Receives quarantined since the last call: prefill must be told to stop (the
        scheduler side publishes the cancel), so that it fences its WRITEs."""
        closing, self._closing = self._closing, set()
        return closing

    def take_released(self) -> set[str]:
        """Ended requests checked again: vLLM may free their blocks."""
        released, self._released = self._released, set()
        return released

    def _recheck(self, req_id: str, kept: _Kept) -> None:
        t0 = time.perf_counter()
        bad: tuple[int, int] | None = None
        agent = ""
        for part in kept.parts:
            assert part.checksums is not None and self._geometry is not None
            got = integrity.checksums(self._layers, self._groups, kept.spec.block_ids,
                                      kept.spec.skip_blocks, part.checksums.num_tokens,
                                      self._geometry, part.heads)
            # Not the prompt's last block: decode writes there itself (the tokens after
            # the prompt, or the prompt's last token again when it recomputes it).
            bad = integrity.first_mismatch(_but_last_block(part.checksums),
                                           _but_last_block(got))
            if bad is not None:
                agent = part.agent
                break
        error = None
        if bad is not None:
            error = (f"KV of layer {bad[0]}, request block {bad[1]} (decode block "
                     f"{self._decode_block(kept.spec, bad)}) changed while the request used "
                     f"it; verified as written by {agent}")
        self.observer.finished(PushRecord(
            "recheck", kept.spec.rid, self.cfg.engine_id, kept.spec.prefill_engine,
            self.tp_rank, ok=bad is None, error=error,
            outcome=Outcome.OK if bad is None else Outcome.CORRUPT,
            verified=bad is None, verify_ms=(time.perf_counter() - t0) * 1e3,
            bad_layer=bad[0] if bad else None, bad_block=bad[1] if bad else None,
            traceparent=kept.spec.traceparent))

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last call."""
        if self.jobs:
            self._poll()
        if self._received:
            # vLLM runs a reported request next: KV that peers wrote outside this device's
            # streams must be visible to its kernels by then (once per call).
            self._received = False
            self.device.make_visible()
        finished, self._finished = self._finished, set()
        failed, self._failed = self._failed, set()
        return finished, failed

    def on_notifications(self, notifs: Iterable[tuple[str, bytes]]) -> None:
        """Handle notifications (sender agent, message) read from the transport."""
        for agent, raw in notifs:
            try:
                msg = decode(raw, PushDone)
            except WireError as exc:
                logger.warning("ignoring malformed notification from %s: %s", agent, exc)
                continue
            self._on_push_done(msg, agent)

    def _poll(self) -> None:
        assert self.transport is not None
        self.on_notifications(self.transport.notifications())
        now = now_ms()
        grace = int(self.cfg.late_write_grace_s * 1000)
        bound = time.monotonic_ns() - int(self.cfg.quarantine_max_s * 1e9)
        for job in list(self.jobs.values()):
            if job.state is RecvState.QUARANTINED:
                if job.quarantined_ns < bound:
                    self._release(job, fenced=False)
            elif now > job.spec.deadline_ms + grace:
                self._end_recv(job, ok=False, error="push deadline passed",
                               outcome=Outcome.DEADLINE)
        self._snapshot()
        cutoff = now - _EARLY_NOTIF_TTL_MS
        for rid in [r for r, (_m, _a, t) in self._early.items() if t < cutoff]:
            del self._early[rid]

    def _decode_block(self, spec: RecvSpec, bad: tuple[int, int]) -> int:
        """Decode's block id of (layer, request block) ``bad``; -1 when out of range."""
        blocks = spec.block_ids[self._groups[bad[0]]] if bad[0] < len(self._groups) else []
        return blocks[bad[1]] if bad[1] < len(blocks) else -1

    def take_first_tokens(self) -> dict[str, int]:
        """Prefill's first token of each request received since the last call that goes
        on from it (``RecvSpec.first_token``)."""
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def _on_push_done(self, msg: PushDone, agent: str) -> None:
        req_id = self._by_rid.get(msg.request_id)
        job = self.jobs.get(req_id) if req_id else None
        if job is None:
            if len(self._early) < _EARLY_NOTIF_MAX:
                self._early[msg.request_id] = (msg, agent, now_ms())
            return
        # Agent names are <engine>-r<rank>-<generation>: only the prefill ranks the
        # assignment named that write into this rank may end this receive.
        m = re.fullmatch(rf"{re.escape(job.spec.prefill_engine)}-r(\d+)-\d+", agent)
        writes = self._writes_into(job, msg, int(m.group(1))) if m else None
        if m is None or writes is None:
            logger.warning("ignoring PushDone for %s from %s (assigned prefill is %s, "
                           "TP %s)", msg.request_id, agent, job.spec.prefill_engine,
                           msg.tp_size)
            return
        rank, (heads, writers) = int(m.group(1)), writes
        if job.prefill_tp and job.prefill_tp != msg.tp_size:
            if job.state is RecvState.RECEIVING:
                self._end_recv(job, ok=False, error=f"prefill rank {rank} says TP "
                               f"{msg.tp_size}, an earlier rank said {job.prefill_tp}")
            return
        job.prefill_tp = msg.tp_size
        if msg.ok or msg.fenced:
            # A PushDone that reports success goes out only once every WRITE completed.
            job.fenced.add(rank)
        if job.state is RecvState.QUARANTINED:
            if self._is_fenced(job):
                self._release(job, fenced=True)
            return
        if rank in job.parts:
            return
        if msg.ok and job.spec.first_token:
            if msg.first_token < 0 or (job.first_token >= 0
                                       and msg.first_token != job.first_token):
                # Decode would otherwise sample a first token of its own after the client
                # got prefill's.
                self._end_recv(job, ok=False, error=f"prefill rank {rank} sent "
                               f"{'a different' if msg.first_token >= 0 else 'no'} first "
                               f"token", nbytes=msg.bytes_written)
                return
            job.first_token = msg.first_token
        verified, bad, verify_ms, error = None, None, 0.0, msg.error
        if msg.ok and msg.checksums is not None and self._geometry is not None:
            t0 = time.perf_counter()
            got = integrity.checksums(self._layers, self._groups, job.spec.block_ids,
                                      job.spec.skip_blocks, msg.checksums.num_tokens,
                                      self._geometry, (heads.first, heads.count))
            verify_ms = (time.perf_counter() - t0) * 1e3
            bad = integrity.first_mismatch(msg.checksums, got)
            verified = bad is None
            if bad is not None:
                error = (f"KV checksum mismatch at layer {bad[0]}, request block {bad[1]} "
                         f"(decode block {self._decode_block(job.spec, bad)}) from prefill "
                         f"rank {rank}")
        if not msg.ok or verified is False:
            # Any rank's failure fails the request: its part of the KV is not there.
            self._end_recv(job, ok=False, error=error, nbytes=msg.bytes_written,
                           last_layer_done_ms=msg.last_layer_done_ms,
                           outcome=Outcome.CORRUPT if verified is False else None,
                           verified=verified, verify_ms=verify_ms, bad=bad)
            return
        job.parts[rank] = _Part(msg.bytes_written, verified, verify_ms,
                                msg.last_layer_done_ms, agent, (heads.first, heads.count),
                                msg.checksums if verified else None)
        if set(job.parts) != set(writers):
            return
        parts = list(job.parts.values())
        checked = [p.verified for p in parts if p.verified is not None]
        self._end_recv(job, ok=True, error=None, nbytes=sum(p.nbytes for p in parts),
                       last_layer_done_ms=max(p.last_layer_done_ms for p in parts),
                       verified=all(checked) if len(checked) == len(parts) else None,
                       verify_ms=sum(p.verify_ms for p in parts))

    def _writes_into(self, job: RecvJob, msg: PushDone, rank: int
                     ) -> tuple[tp_mapping.HeadSlice, list[int]] | None:
        """(this rank's heads that prefill rank ``rank`` writes, every writer's rank), or
        None when that rank writes nothing here (or the TP sizes cannot pair)."""
        mla = self._page == integrity.LATENT
        try:
            writes = tp_mapping.writes_of(rank, msg.tp_size, self._tp_size,
                                          self._total_heads, mla)
            writers = tp_mapping.writers_of(self.tp_rank, msg.tp_size, self._tp_size,
                                            self._total_heads, mla)
        except tp_mapping.UnsupportedTP:
            return None
        mine = [w.remote for w in writes if w.decode_rank == self.tp_rank]
        return (mine[0], writers) if mine and rank < msg.tp_size else None

    def _is_fenced(self, job: RecvJob) -> bool:
        """True when every prefill rank that writes into this rank said that none of its
        WRITEs for ``job`` can still land."""
        if not job.prefill_tp:
            return False  # no PushDone yet: which ranks write is not known
        mla = self._page == integrity.LATENT
        try:
            writers = tp_mapping.writers_of(self.tp_rank, job.prefill_tp, self._tp_size,
                                            self._total_heads, mla)
        except tp_mapping.UnsupportedTP:
            return False
        return set(writers) <= job.fenced

    def _end_recv(self, job: RecvJob, ok: bool, error: str | None, **how: Any) -> None:
        if ok or self._is_fenced(job):
            self._close(job, ok, error, **how)
            return
        # Given up while a prefill rank may still write: vLLM must not hand the blocks to
        # another request until every such rank fenced its WRITEs, or the bound passed.
        job.state = RecvState.QUARANTINED
        job.quarantined_ns = time.monotonic_ns()
        job.ending = {"error": error, **how}
        self._closing.add(job.req_id)
        logger.warning("receive of %s given up (%s); its blocks stay quarantined until "
                       "%s says none of its WRITEs can still land", job.spec.rid, error,
                       job.spec.prefill_engine)
        self._quarantine_record(job, "entered")

    def _release(self, job: RecvJob, *, fenced: bool) -> None:
        """End a quarantined receive: fenced, or cut off at ``quarantine_max_s``."""
        if not fenced:
            logger.error("receive of %s: %s did not fence its WRITEs within %.0f s; its "
                         "blocks go back to vLLM anyway (cut off)", job.spec.rid,
                         job.spec.prefill_engine, self.cfg.quarantine_max_s)
        how = dict(job.ending)
        error = how.pop("error", None)
        self._close(job, False, error, **how)
        self._quarantine_record(job, "fenced" if fenced else "cut_off")

    def _blocks(self, spec: RecvSpec) -> int:
        return sum(max(0, len(ids) - skip)
                   for ids, skip in zip(spec.block_ids, spec.skip_blocks, strict=True))

    def _quarantine_record(self, job: RecvJob, outcome: str) -> None:
        age_ms = (time.monotonic_ns() - job.quarantined_ns) / 1e6
        self.observer.finished(PushRecord(
            "quarantine", job.spec.rid, self.cfg.engine_id, job.spec.prefill_engine,
            self.tp_rank, ok=outcome != "cut_off", outcome=outcome,
            error="not fenced within quarantine_max_s" if outcome == "cut_off" else None,
            blocks=self._blocks(job.spec), wait_ms=age_ms if outcome != "entered" else 0.0,
            **self._held()))
        self._quarantine_told_ns = time.monotonic_ns()

    def _held(self) -> dict[str, Any]:
        """This rank's quarantined blocks and the oldest one's age, now."""
        held = [j for j in self.jobs.values() if j.state is RecvState.QUARANTINED]
        now = time.monotonic_ns()
        return {"held_blocks": sum(self._blocks(j.spec) for j in held),
                "held_age_s": max(((now - j.quarantined_ns) / 1e9 for j in held),
                                  default=0.0)}

    def _snapshot(self) -> None:
        """Once a second while blocks are quarantined: their number and age (gauges)."""
        if not self._quarantine_told_ns:
            return
        now = time.monotonic_ns()
        if now - self._quarantine_told_ns < 1_000_000_000:
            return
        held = self._held()
        self._quarantine_told_ns = now if held["held_blocks"] else 0
        self.observer.finished(PushRecord("quarantine", "", self.cfg.engine_id, "",
                                          self.tp_rank, outcome="held", **held))

    def _close(self, job: RecvJob, ok: bool, error: str | None, nbytes: int = 0,
               outcome: str | None = None, last_layer_done_ms: int = 0,
               verified: bool | None = None, verify_ms: float = 0.0,
               bad: tuple[int, int] | None = None) -> None:
        end_unix_ns = time.time_ns()
        self.jobs.pop(job.req_id, None)
        self._by_rid.pop(job.spec.rid, None)
        self._finished.add(job.req_id)
        self._received = self._received or ok
        if ok and job.spec.first_token:
            self._first_tokens[job.req_id] = job.first_token
        if ok and verified and job.parts:
            self._kept[job.req_id] = _Kept(job.spec, list(job.parts.values()))
            self._newly_kept.add(job.req_id)
        if not ok and not job.abandoned:
            self._failed.add(job.req_id)
        if outcome is None:
            if ok:
                outcome = Outcome.OK
            elif job.abandoned:
                outcome = Outcome.CANCELLED  # decode's request ended first and said so
            else:
                outcome = Outcome.ERROR
        exposed = None
        if ok and last_layer_done_ms:
            # Wall clocks of two hosts: skew shows up here, not hidden by clamping.
            exposed = round(end_unix_ns / 1e6 - last_layer_done_ms, 3)
        rec = PushRecord("recv", job.spec.rid, self.cfg.engine_id, job.spec.prefill_engine,
                         self.tp_rank, ok=ok, error=error, outcome=outcome, bytes=nbytes,
                         blocks=self._blocks(job.spec),
                         notify_ns=time.monotonic_ns(),
                         wait_ms=(time.monotonic_ns() - job.since_ns) / 1e6,
                         start_unix_ns=job.spec.allocated_ns or unix_ns(job.since_ns),
                         end_unix_ns=end_unix_ns, last_layer_done_ms=last_layer_done_ms,
                         exposed_ms=exposed, traceparent=job.spec.traceparent,
                         verified=verified, verify_ms=verify_ms,
                         bad_layer=bad[0] if bad else None, bad_block=bad[1] if bad else None,
                         history=job.spec.history)
        self.observer.finished(rec)
