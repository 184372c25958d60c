"""Per-transfer statistics, Prometheus series and spans: the one place a transfer ends."""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from pydantic import TypeAdapter, ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpush.connector.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class Outcome:
    """How a transfer ended (``PushRecord.outcome``, the ``outcome`` metric label)."""

    OK = "ok"
    ERROR = "error"  # NIXL or peer failure
    DEADLINE = "deadline"  # the push deadline passed first
    CANCELLED = "cancelled"  # the other side gave up (request ended), nothing wrong
    CORRUPT = "corrupt"  # decode's checksum of the received KV differs from prefill's


class KVTransferFailed(RuntimeError):
    """A push or receive that did not complete; recorded on its span as the exception."""


PUSH_LAYERWISE = "layer-wise"
"""Prefill posts each layer's WRITEs from its ``save_kv_layer`` hook, as the layer is done."""
PUSH_PER_STEP = "per-step"
"""Prefill posts a step's WRITEs, every layer at once, after its forward pass."""


def layerwise_on(extra_config: dict[str, Any] | None) -> bool:
    """Whether ``kv_connector_extra_config`` turns layer-wise writes on, read as
    :class:`ConnectorConfig` reads it (an invalid value, refused when the connector starts,
    reads as the default)."""
    default = bool(ConnectorConfig.model_fields["layerwise"].default)
    try:
        return TypeAdapter(bool).validate_python((extra_config or {}).get("layerwise", default))
    except ValidationError:
        return default


def push_mode(vllm_config: Any) -> str:
    """How this engine's prefill pushes, from its vLLM config: :data:`PUSH_LAYERWISE`, or
    :data:`PUSH_PER_STEP` when layer-wise writes are off or every batch may replay a FULL
    CUDA graph (its replay skips the per-layer hooks; vLLM turns FULL modes into PIECEWISE
    for a layer-wise connector where it can). Missing config parts read as defaults."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if not layerwise_on(getattr(ktc, "kv_connector_extra_config", None)):
        return PUSH_PER_STEP
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    # FULL_AND_PIECEWISE and FULL_DECODE_ONLY run batches with prefill piecewise or eager.
    return PUSH_PER_STEP if getattr(mode, "name", mode) == "FULL" else PUSH_LAYERWISE


def unix_ns(monotonic_ns: int) -> int:
    """``time.monotonic_ns()`` reading as unix ns (for spans and the wire; 0 stays 0)."""
    if not monotonic_ns:
        return 0
    return monotonic_ns + time.time_ns() - time.monotonic_ns()


@dataclass
class PushRecord:
    """What one worker rank did for one request's push (or one receive on decode)."""

    kind: str  # "push" | "recv" | "recheck" (a verified receive checked again at its end)
    # | "quarantine" (a given-up receive's blocks held: outcome entered, fenced, cut_off,
    # or held, a snapshot)
    rid: str
    engine_id: str
    peer_engine: str
    rank: int
    ok: bool = True
    error: str | None = None
    outcome: str = Outcome.OK
    bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    xfers: int = 0
    layers: int = 0
    layerwise_xfers: int = 0
    backend: str = ""
    start_ns: int = 0  # push: time.monotonic_ns() when the target was accepted
    first_post_ns: int = 0  # time.monotonic_ns() of the first WRITE post
    last_done_ns: int = 0  # when the last WRITE was seen complete
    notify_ns: int = 0  # when PushDone was sent (push) or received (recv)
    # (layer index, post time) of the layer-wise WRITEs of the step that ended the prompt
    layer_posts_ns: list[tuple[int, int]] = field(default_factory=list)
    forward_end_ns: int = 0  # end of the forward pass of that step
    wait_ms: float = 0.0  # recv: blocks published -> PushDone
    # Wall clock (unix ns) of the span: push first post (or target) -> PushDone sent;
    # recv blocks allocated -> KV complete.
    start_unix_ns: int = 0
    end_unix_ns: int = 0
    last_layer_done_ms: int = 0  # prefill's forward pass over the last chunk ended (unix ms)
    exposed_ms: float | None = None  # recv: KV complete - last_layer_done_ms
    traceparent: str | None = None
    # KV checksums: push: computed and sent; recv: True matched, False mismatched;
    # None: this transfer was not sampled for verification.
    verified: bool | None = None
    verify_ms: float = 0.0  # time spent computing this side's checksums
    bad_layer: int | None = None  # recv: first layer and request block that mismatched
    bad_block: int | None = None
    # quarantine: this rank's quarantined blocks after the event, and the oldest one's age
    held_blocks: int = 0
    held_age_s: float = 0.0
    history: bool = False  # recv: a prefill leg's history (its wait feeds the cost model)

    @property
    def post_to_done_ms(self) -> float:
        """First WRITE posted to last WRITE complete, in milliseconds."""
        if not self.first_post_ns or not self.last_done_ns:
            return 0.0
        return (self.last_done_ns - self.first_post_ns) / 1e6

    @property
    def post_to_notify_s(self) -> float | None:
        """First WRITE posted to PushDone sent, in seconds (``kvpush_kv_transfer_seconds``)."""
        if not self.first_post_ns or not self.notify_ns:
            return None
        return (self.notify_ns - self.first_post_ns) / 1e9

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view, with the derived timing."""
        out = asdict(self)
        out["post_to_done_ms"] = round(self.post_to_done_ms, 3)
        out["post_to_notify_s"] = self.post_to_notify_s
        return out


@dataclass
class WriteSpan:
    """One batch of WRITEs (one step's layers, or a catch-up of every layer)."""

    start_unix_ns: int
    end_unix_ns: int
    bytes: int
    descriptors: int
    blocks: int
    layer_start: int
    layer_end: int  # exclusive
    ok: bool


class KVPushStats(KVConnectorStats):
    """Stats vLLM moves from the workers to its logger: a list of finished transfers."""

    def reset(self) -> None:
        """Forget the interval's records."""
        self.data = {"transfers": []}

    def _records(self) -> list[dict[str, Any]]:
        return self.data.setdefault("transfers", [])

    def add(self, record: PushRecord) -> None:
        """Add one finished transfer."""
        self._records().append(record.to_dict())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Concatenate another interval's (or worker's) records."""
        self._records().extend(other.data.get("transfers", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counts, bytes and post-to-done time percentiles of the interval's pushes."""
        pushes = [r for r in self._records() if r["kind"] == "push"]
        recvs = [r for r in self._records() if r["kind"] == "recv"]
        times = sorted(r["post_to_done_ms"] for r in pushes if r["ok"])
        out: dict[str, int | float] = {
            "pushes": len(pushes),
            "push_failures": sum(1 for r in pushes if not r["ok"]),
            "recvs": len(recvs),
            "recv_failures": sum(1 for r in recvs if not r["ok"]),
            "bytes": sum(r["bytes"] for r in pushes),
            "blocks": sum(r["blocks"] for r in pushes),
            "descriptors": sum(r["descriptors"] for r in pushes),
            "verified": sum(1 for r in recvs if r.get("verified") is not None),
            "verify_failures": sum(1 for r in recvs if r.get("verified") is False),
        }
        if times:
            out["post_to_done_ms_p50"] = round(statistics.median(times), 3)
            out["post_to_done_ms_max"] = round(times[-1], 3)
        exposed = sorted(r["exposed_ms"] for r in recvs
                         if r["ok"] and r.get("exposed_ms") is not None)
        if exposed:
            out["exposed_ms_p50"] = round(statistics.median(exposed), 3)
            out["exposed_ms_max"] = round(exposed[-1], 3)
        return out

    def is_empty(self) -> bool:
        """True when no transfer finished in the interval."""
        return not self._records()


# Transfer times: a few hundred microseconds (small prompt, local UCX) to seconds (long
# prompts over a congested fabric).
_TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0]
# Quarantines: a push that ends within the grace (seconds) to quarantine_max_s (a minute).
_QUARANTINE_BUCKETS = [0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_OUTCOMES = (Outcome.OK, Outcome.ERROR, Outcome.DEADLINE, Outcome.CANCELLED, Outcome.CORRUPT)
METRIC_NAMES = ("kvpush_kv_bytes_pushed_total", "kvpush_kv_blocks_pushed_total",
                "kvpush_kv_bytes_received_total", "kvpush_kv_blocks_received_total",
                "kvpush_kv_transfer_seconds", "kvpush_kv_exposed_transfer_seconds",
                "kvpush_kv_transfers_total", "kvpush_kv_verified_total",
                "kvpush_kv_verify_failures_total", "kvpush_push_mode_info")
VLLM_NIXL_NAMES = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred",
                   "vllm:nixl_num_descriptors", "vllm:nixl_num_failed_transfers",
                   "vllm:nixl_num_kv_expired_reqs")
"""The series vLLM's NIXL connectors export, which kvpush exports too (same names, buckets
and labels), so vLLM's dashboards and P/D tests read kvpush engines unchanged."""
# vLLM's own buckets for those series (nixl/stats.py), kept equal so the series aggregate.
_VLLM_XFER_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
_VLLM_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
_VLLM_DESC_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


def _unregister_stale() -> None:
    """Drop kvpush collectors a previous logger registered in this process (as vLLM does
    for its own), so building the metrics twice does not raise duplicate-series errors."""
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith(("kvpush_kv_", "kvpush_push_", "vllm:nixl_")) for n in names):
            REGISTRY.unregister(collector)


class KVPushPromMetrics(KVConnectorPromMetrics):
    """The connector's series on the engine's ``/metrics`` (names the dashboard queries).

    Built in vLLM's API-server process; :meth:`observe` gets the records every worker rank
    reported (``KVPushStats.data``), so pushes and receives count once per rank.
    """

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_stale()
        self.bytes_pushed = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_bytes_pushed_total",
            documentation="Bytes NIXL-written into decode blocks by completed pushes.",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.transfer_seconds = create_metric_per_engine(self._histogram_cls(
            name="kvpush_kv_transfer_seconds",
            documentation="Completed pushes: first NIXL WRITE posted to PushDone sent.",
            buckets=_TIME_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.exposed_seconds = create_metric_per_engine(self._histogram_cls(
            name="kvpush_kv_exposed_transfer_seconds",
            documentation="Decode: KV complete minus prefill's last layer done (wall "
                          "clocks of two hosts; negative skew counts as 0).",
            buckets=_TIME_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.blocks_pushed = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_blocks_pushed_total",
            documentation="KV blocks NIXL-written into decode blocks by completed pushes.",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.bytes_received = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_bytes_received_total",
            documentation="Decode: bytes prefill wrote into this engine's blocks, by "
                          "completed receives.",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.blocks_received = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_blocks_received_total",
            documentation="Decode: KV blocks filled by completed receives (prefix-cache "
                          "hits are not pushed and not counted).",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.history_wait = create_metric_per_engine(self._histogram_cls(
            name="kvpush_kv_history_wait_seconds",
            documentation="Prefill: completed history receives, blocks allocated to the "
                          "holder's PushDone (the wait the history cost model weighs "
                          "against recomputing).",
            buckets=_TIME_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self._vllm_series(labelnames, per_engine_labelvalues)
        transfers = self._counter_cls(
            name="kvpush_kv_transfers_total",
            documentation="Finished pushes (prefill) and receives (decode) by outcome.",
            labelnames=[*labelnames, "outcome"],
        )
        self.verified = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_verified_total",
            documentation="Decode: received pushes whose KV checksums were compared.",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.verify_failures = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_verify_failures_total",
            documentation="Decode: received pushes whose KV differed from prefill's "
                          "checksums (the receive failed; the failure policy applied).",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self._quarantine_series(labelnames, per_engine_labelvalues)
        self.rechecked = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_rechecked_total",
            documentation="Decode: verified receives whose blocks were checked again when "
                          "their request ended (KVPUSH_VERIFY_KV).",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.changed_in_use = create_metric_per_engine(self._counter_cls(
            name="kvpush_kv_changed_in_use_total",
            documentation="Decode: of those, requests whose pushed blocks changed while "
                          "they used them: written by someone they were not given to (the "
                          "log names the request and the agent that wrote them).",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        # Every outcome exists from the start, so rate() works before the first failure.
        self.transfers = {
            (idx, outcome): transfers.labels(*values, outcome)
            for idx, values in per_engine_labelvalues.items() for outcome in _OUTCOMES
        }
        self.push_mode = push_mode(vllm_config)
        mode_info = self._gauge_cls(
            name="kvpush_push_mode_info",
            documentation="1 for how prefill pushes KV: layer-wise (each layer once it is "
                          "computed) or per-step (every layer after the forward pass).",
            multiprocess_mode="mostrecent", labelnames=[*labelnames, "mode"],
        )
        for values in per_engine_labelvalues.values():
            mode_info.labels(*values, self.push_mode).set(1)

    def _quarantine_series(self, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> None:
        """Decode: blocks of given-up receives held from vLLM until prefill fenced its
        WRITEs (connector/fence.py)."""
        quarantines = self._counter_cls(
            name="kvpush_kv_quarantines_total",
            documentation="Decode: given-up receives whose blocks were quarantined, by how "
                          "the quarantine ended: fenced (prefill said no WRITE can land) "
                          "or cut_off (quarantine_max_s passed first).",
            labelnames=[*labelnames, "end"])
        self.quarantines = {
            (idx, end): quarantines.labels(*values, end)
            for idx, values in per_engine_labelvalues.items()
            for end in ("entered", "fenced", "cut_off")}
        self.quarantine_seconds = create_metric_per_engine(self._histogram_cls(
            name="kvpush_kv_quarantine_seconds",
            documentation="Decode: how long ended quarantines held their blocks.",
            buckets=_QUARANTINE_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.quarantined_blocks = create_metric_per_engine(self._gauge_cls(
            name="kvpush_kv_quarantined_blocks",
            documentation="Decode: KV blocks held from vLLM now, waiting for a fence.",
            multiprocess_mode="mostrecent", labelnames=labelnames,
        ), per_engine_labelvalues)
        self.quarantine_age = create_metric_per_engine(self._gauge_cls(
            name="kvpush_kv_quarantine_oldest_seconds",
            documentation="Decode: age of the oldest quarantine now (0: none).",
            multiprocess_mode="mostrecent", labelnames=labelnames,
        ), per_engine_labelvalues)
        self._held: dict[tuple[int, int], tuple[int, float]] = {}  # (engine, rank) -> now

    def _observe_quarantine(self, r: dict[str, Any], engine_idx: int) -> None:
        end = r.get("outcome")
        if (counter := self.quarantines.get((engine_idx, end))) is not None:
            counter.inc()
        if end in ("fenced", "cut_off"):
            self.quarantine_seconds[engine_idx].observe(r.get("wait_ms", 0.0) / 1e3)
        self._held[(engine_idx, r.get("rank", 0))] = (r.get("held_blocks", 0),
                                                      r.get("held_age_s", 0.0))
        ranks = [v for (idx, _rank), v in self._held.items() if idx == engine_idx]
        self.quarantined_blocks[engine_idx].set(sum(b for b, _a in ranks))
        self.quarantine_age[engine_idx].set(max((a for _b, a in ranks), default=0.0))

    def _vllm_series(self, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
        """vLLM's NIXL connector series (:data:`VLLM_NIXL_NAMES`), fed by both sides."""
        self.nixl_xfer_time = create_metric_per_engine(self._histogram_cls(
            name="vllm:nixl_xfer_time_seconds",
            documentation="Histogram of transfer duration for NIXL KV Cache transfers "
                          "(kvpush: prefill, first WRITE posted to the last done; decode, "
                          "the transfer time not hidden behind prefill's compute).",
            buckets=_VLLM_XFER_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.nixl_bytes = create_metric_per_engine(self._histogram_cls(
            name="vllm:nixl_bytes_transferred",
            documentation="Histogram of bytes transferred per NIXL KV Cache transfers "
                          "(kvpush: written by prefill, received by decode).",
            buckets=_VLLM_BYTES_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.nixl_descriptors = create_metric_per_engine(self._histogram_cls(
            name="vllm:nixl_num_descriptors",
            documentation="Histogram of number of descriptors per NIXL KV Cache transfers.",
            buckets=_VLLM_DESC_BUCKETS, labelnames=labelnames,
        ), per_engine_labelvalues)
        self.nixl_failed = create_metric_per_engine(self._counter_cls(
            name="vllm:nixl_num_failed_transfers",
            documentation="Number of failed NIXL KV Cache transfers (kvpush: pushes and "
                          "receives that failed, were corrupt or passed their deadline).",
            labelnames=labelnames,
        ), per_engine_labelvalues)
        self.nixl_expired = create_metric_per_engine(self._counter_cls(
            name="vllm:nixl_num_kv_expired_reqs",
            documentation="Number of requests that had their KV expire (kvpush: pushes "
                          "and receives whose deadline passed first).",
            labelnames=labelnames,
        ), per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's finished transfers."""
        for r in transfer_stats_data.get("transfers", ()):
            if r["kind"] == "quarantine":
                self._observe_quarantine(r, engine_idx)
                continue
            if r["kind"] == "recheck":
                self.rechecked[engine_idx].inc()
                if not r["ok"]:
                    self.changed_in_use[engine_idx].inc()
                continue
            outcome = r.get("outcome") or (Outcome.OK if r["ok"] else Outcome.ERROR)
            counter = self.transfers.get((engine_idx, outcome))
            if counter is not None:
                counter.inc()
            if r["kind"] == "recv" and r.get("verified") is not None:
                self.verified[engine_idx].inc()
                if r["verified"] is False:
                    self.verify_failures[engine_idx].inc()
            if outcome == Outcome.DEADLINE:
                self.nixl_expired[engine_idx].inc()
            if not r["ok"]:
                if outcome != Outcome.CANCELLED:  # the request ended first: no failure
                    self.nixl_failed[engine_idx].inc()
                continue
            self.nixl_bytes[engine_idx].observe(r["bytes"])
            if r["kind"] == "push":
                self.bytes_pushed[engine_idx].inc(r["bytes"])
                self.blocks_pushed[engine_idx].inc(r.get("blocks", 0))
                self.nixl_descriptors[engine_idx].observe(r.get("descriptors", 0))
                if (seconds := r.get("post_to_notify_s")) is not None:
                    self.transfer_seconds[engine_idx].observe(seconds)
                if done_ms := r.get("post_to_done_ms"):
                    self.nixl_xfer_time[engine_idx].observe(done_ms / 1e3)
                continue
            self.bytes_received[engine_idx].inc(r["bytes"])
            if r.get("history"):
                self.history_wait[engine_idx].observe(r.get("wait_ms", 0.0) / 1e3)
            self.blocks_received[engine_idx].inc(r.get("blocks", 0))
            if (exposed := r.get("exposed_ms")) is not None:
                self.exposed_seconds[engine_idx].observe(max(exposed, 0.0) / 1e3)
                self.nixl_xfer_time[engine_idx].observe(max(exposed, 0.0) / 1e3)


class TransferObserver:
    """Where a push or receive starts and ends: logs, stats, stats file and spans.

    Spans are built once a transfer finished, from the timestamps its record already
    holds, so tracing adds nothing to the per-layer path and nothing at all when off.
    """

    def __init__(self, stats_file: str | None = None, tracing: bool = False) -> None:
        self._stats = KVPushStats()
        self._stats.reset()
        self._lock = threading.Lock()
        self._file = stats_file
        self.tracing = tracing
        """True when spans are exported (an OTLP endpoint is configured)."""

    def started(self, kind: str, rid: str, peer_engine: str) -> None:
        """A push posted its first WRITE, or a receive published its target."""
        logger.debug("kvpush %s start rid=%s peer=%s", kind, rid, peer_engine)

    def finished(self, record: PushRecord, writes: list[WriteSpan] | None = None) -> None:
        """A push was sealed or given up, or a receive completed or failed."""
        if record.kind == "quarantine":
            pass  # the receiver logs its quarantines as they start and end
        elif record.ok:
            logger.info(
                "kvpush %s rid=%s peer=%s rank=%s bytes=%s blocks=%s descs=%s xfers=%s "
                "layers=%s post_to_done_ms=%.3f verified=%s",
                record.kind, record.rid, record.peer_engine, record.rank, record.bytes,
                record.blocks, record.descriptors, record.xfers, record.layers,
                record.post_to_done_ms, record.verified,
            )
        else:
            logger.warning("kvpush %s rid=%s peer=%s %s: %s", record.kind, record.rid,
                           record.peer_engine, record.outcome, record.error)
        with self._lock:
            self._stats.add(record)
        if self._file:
            try:
                with open(self._file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record.to_dict()) + "\n")
            except OSError as exc:
                logger.warning("cannot append to stats file %s: %s", self._file, exc)
        if self.tracing and record.kind in ("push", "recv"):
            emit_spans(record, writes or [])

    def take(self) -> KVPushStats | None:
        """The records since the last call, or None when there are none."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVPushStats()
            self._stats.reset()
            return out


def emit_spans(record: PushRecord, writes: list[WriteSpan],
               tracer: trace.Tracer | None = None) -> None:
    """``kvpush.kv.push`` with its ``kvpush.kv.write`` children, or ``kvpush.kv.wait``,
    parented on the request's traceparent, timed by the record's wall-clock stamps.

    ``tracer`` defaults to kvpush's tracer of the process-wide provider.
    """
    from opentelemetry.trace import Status, StatusCode

    from kvpush.common.telemetry import context_from_traceparent
    from kvpush.common.telemetry import tracer as kvpush_tracer

    ctx = context_from_traceparent(record.traceparent)
    t = tracer or kvpush_tracer()
    end = record.end_unix_ns or time.time_ns()
    start = min(record.start_unix_ns or end, end)
    push = record.kind == "push"
    src, dst = ((record.engine_id, record.peer_engine) if push
                else (record.peer_engine, record.engine_id))
    attrs: dict[str, Any] = {
        "kvpush.request_id": record.rid,
        "kvpush.src_engine": src,
        "kvpush.dst_engine": dst,
        "kvpush.tp_rank": record.rank,
        "kvpush.bytes": record.bytes,
        "kvpush.blocks": record.blocks,
        "kvpush.outcome": record.outcome,
    }
    if push:
        attrs.update({
            "kvpush.descriptors": record.descriptors,
            "kvpush.backend": record.backend,
            "kvpush.layer_start": 0,
            "kvpush.layer_end": record.layers,
            "kvpush.xfers": record.xfers,
            "kvpush.layerwise_xfers": record.layerwise_xfers,
        })
    elif record.exposed_ms is not None:
        attrs["kvpush.exposed_transfer_ms"] = record.exposed_ms
    if record.last_layer_done_ms:
        # Where prefill's forward pass ended: splits a trace's TTFT into compute and transfer.
        attrs["kvpush.forward_end_unix_ms"] = record.last_layer_done_ms
    if record.verified is not None:
        attrs["kvpush.kv.verified"] = record.verified
        attrs["kvpush.kv.verify_ms"] = record.verify_ms
    if record.bad_layer is not None:
        attrs["kvpush.kv.bad_layer"] = record.bad_layer
        attrs["kvpush.kv.bad_block"] = record.bad_block if record.bad_block is not None else -1
    span = t.start_span("kvpush.kv.push" if push else "kvpush.kv.wait", context=ctx,
                        start_time=start, attributes=attrs)
    if writes:
        child = trace.set_span_in_context(span, ctx)
        for w in writes:
            ws = t.start_span("kvpush.kv.write", context=child, start_time=w.start_unix_ns,
                              attributes={
                                  "kvpush.request_id": record.rid,
                                  "kvpush.src_engine": src,
                                  "kvpush.dst_engine": dst,
                                  "kvpush.tp_rank": record.rank,
                                  "kvpush.backend": record.backend,
                                  "kvpush.bytes": w.bytes,
                                  "kvpush.blocks": w.blocks,
                                  "kvpush.descriptors": w.descriptors,
                                  "kvpush.layer_start": w.layer_start,
                                  "kvpush.layer_end": w.layer_end,
                                  "kvpush.outcome": Outcome.OK if w.ok else record.outcome,
                              })
            if not w.ok:
                ws.set_status(Status(StatusCode.ERROR, record.error or "WRITE failed"))
            ws.end(end_time=max(w.end_unix_ns, w.start_unix_ns) or end)
    if record.outcome in (Outcome.ERROR, Outcome.DEADLINE, Outcome.CORRUPT):
        span.set_status(Status(StatusCode.ERROR, record.error or record.outcome))
        span.record_exception(KVTransferFailed(record.error or record.outcome),
                              timestamp=end)
    span.end(end_time=end)
