"""Connector stats: spans built from finished transfer records, Prometheus series, wire field.

Spans go to an in-memory exporter of a private tracer provider (the process-wide one is
left alone); the spans of real engines are checked in tests/test_e2e_push.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvpush.common.wire import SCHEMA_VERSION, PushDone, decode, encode
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.push_job import PushJob
from kvpush.connector.stats import (
    METRIC_NAMES,
    VLLM_NIXL_NAMES,
    KVPushPromMetrics,
    KVPushStats,
    Outcome,
    PushRecord,
    TransferObserver,
    WriteSpan,
    emit_spans,
    unix_ns,
)
from kvpush.connector.worker_side import WorkerSide

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TP = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture
def spans() -> tuple[InMemorySpanExporter, object]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("test")


def _push(ok: bool = True, **kw: object) -> PushRecord:
    t0 = time.time_ns()
    base = dict(rid="cmpl-1", engine_id="P", peer_engine="D", rank=0, ok=ok, bytes=4 * 3 * 100,
                blocks=3, descriptors=12, xfers=4, layers=4, backend="UCX",
                start_unix_ns=t0, end_unix_ns=t0 + 5_000_000, traceparent=TP)
    base.update(kw)
    return PushRecord("push", **base)  # type: ignore[arg-type]


def test_push_span_with_write_children_on_the_request_trace(spans) -> None:
    exporter, tracer = spans
    rec = _push()
    t0 = rec.start_unix_ns
    writes = [WriteSpan(t0, t0 + 2_000_000, 2 * 100 * 4, 8, 2, 0, 4, True),
              WriteSpan(t0 + 2_500_000, t0 + 4_000_000, 100 * 4, 4, 1, 0, 4, True)]
    emit_spans(rec, writes, tracer)
    got = {s.name: s for s in exporter.get_finished_spans()}
    push = got["kvpush.kv.push"]
    assert format(push.context.trace_id, "032x") == TRACE
    assert format(push.parent.span_id, "016x") == PARENT
    assert (push.start_time, push.end_time) == (t0, t0 + 5_000_000)
    a = push.attributes
    assert (a["kvpush.bytes"], a["kvpush.blocks"], a["kvpush.descriptors"]) == (1200, 3, 12)
    assert (a["kvpush.src_engine"], a["kvpush.dst_engine"]) == ("P", "D")
    assert (a["kvpush.layer_start"], a["kvpush.layer_end"]) == (0, 4)
    assert a["kvpush.backend"] == "UCX" and a["kvpush.outcome"] == "ok"
    assert push.status.status_code is StatusCode.UNSET
    children = [s for s in exporter.get_finished_spans() if s.name == "kvpush.kv.write"]
    assert len(children) == 2
    assert all(c.parent.span_id == push.context.span_id for c in children)
    assert all(c.context.trace_id == push.context.trace_id for c in children)
    assert sum(c.attributes["kvpush.bytes"] for c in children) == rec.bytes
    assert [c.attributes["kvpush.blocks"] for c in children] == [2, 1]


def test_failed_push_is_an_error_with_the_exception(spans) -> None:
    exporter, tracer = spans
    rec = _push(ok=False, error="WRITE failed: peer gone", outcome=Outcome.ERROR)
    t0 = rec.start_unix_ns
    emit_spans(rec, [WriteSpan(t0, t0 + 1000, 400, 4, 1, 0, 4, False)], tracer)
    got = {s.name: s for s in exporter.get_finished_spans()}
    push, write = got["kvpush.kv.push"], got["kvpush.kv.write"]
    assert push.status.status_code is StatusCode.ERROR
    assert "peer gone" in push.status.description
    (event,) = push.events
    assert event.name == "exception"
    assert event.attributes["exception.type"].endswith("KVTransferFailed")
    assert write.status.status_code is StatusCode.ERROR
    assert write.attributes["kvpush.outcome"] == "error"


def test_cancelled_push_is_not_an_error(spans) -> None:
    exporter, tracer = spans
    emit_spans(_push(ok=False, error="cancelled", outcome=Outcome.CANCELLED), [], tracer)
    (push,) = exporter.get_finished_spans()
    assert push.status.status_code is StatusCode.UNSET
    assert push.attributes["kvpush.outcome"] == "cancelled"


def test_wait_span_carries_exposed_time_and_deadline_errors(spans) -> None:
    exporter, tracer = spans
    t0 = time.time_ns()
    ok = PushRecord("recv", "cmpl-2", "D", "P", 0, bytes=1200, blocks=3, start_unix_ns=t0,
                    end_unix_ns=t0 + 9_000_000, exposed_ms=1.5, traceparent=TP)
    late = PushRecord("recv", "cmpl-3", "D", "P", 0, ok=False, error="push deadline passed",
                      outcome=Outcome.DEADLINE, blocks=3, start_unix_ns=t0,
                      end_unix_ns=t0 + 1, traceparent=TP)
    emit_spans(ok, [], tracer)
    emit_spans(late, [], tracer)
    a, b = exporter.get_finished_spans()
    assert a.name == b.name == "kvpush.kv.wait"
    assert a.attributes["kvpush.exposed_transfer_ms"] == 1.5
    assert (a.attributes["kvpush.src_engine"], a.attributes["kvpush.dst_engine"]) == ("P", "D")
    assert a.attributes["kvpush.bytes"] == 1200 and a.status.status_code is StatusCode.UNSET
    assert "kvpush.exposed_transfer_ms" not in b.attributes
    assert b.status.status_code is StatusCode.ERROR
    assert b.attributes["kvpush.outcome"] == "deadline"


def test_without_traceparent_the_push_is_a_root_span(spans) -> None:
    exporter, tracer = spans
    emit_spans(_push(traceparent=None), [], tracer)
    (push,) = exporter.get_finished_spans()
    assert push.parent is None


def test_observer_without_tracing_keeps_no_write_batches(redis_url) -> None:
    observer = TransferObserver(tracing=False)
    observer.finished(_push())  # tracing off: no tracer is touched, stats still recorded
    stats = observer.take()
    assert stats is not None and stats.reduce()["bytes"] == 1200
    side = WorkerSide(ConnectorConfig(redis_url=redis_url, engine_id="P"), tp_rank=0,
                      tp_size=1, block_size=16, num_blocks=8, generation=1)
    job = PushJob("v-1", "cmpl-1")
    assert side.sender._batch(job, 3) is None and job.batches == []
    side.observer.tracing = True
    assert side.sender._batch(job, 3) is not None and len(job.batches) == 1


def _samples(name: str) -> dict[tuple, float]:
    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_prometheus_series_from_worker_records() -> None:
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    cfg = SimpleNamespace(kv_transfer_config=None)
    metrics = KVPushPromMetrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    # Built twice in one process (vLLM re-creates loggers in tests): no duplicate error.
    metrics = KVPushPromMetrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    stats = KVPushStats()
    stats.reset()
    stats.add(_push(first_post_ns=1_000, notify_ns=3_001_000))
    stats.add(_push(ok=False, error="x", outcome=Outcome.DEADLINE, bytes=999))
    stats.add(PushRecord("recv", "cmpl-2", "D", "P", 0, bytes=1200, exposed_ms=2.0))
    stats.add(PushRecord("recv", "cmpl-3", "D", "P", 0, bytes=7, exposed_ms=-1.0))
    other = KVPushStats()
    other.reset()
    other.add(_push(rank=1))  # a second worker rank, aggregated by vLLM
    data = stats.aggregate(other).data
    metrics.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(data)), 0)
    labels = (("engine", "0"), ("model_name", "tiny"))
    assert _samples("kvpush_kv_bytes_pushed_total")[labels] == 2 * 1200
    assert _samples("kvpush_kv_transfer_seconds_count")[labels] == 1
    assert _samples("kvpush_kv_transfer_seconds_sum")[labels] == pytest.approx(0.003)
    assert _samples("kvpush_kv_exposed_transfer_seconds_count")[labels] == 2
    # Clock skew (negative) lands in the lowest bucket rather than vanishing.
    assert _samples("kvpush_kv_exposed_transfer_seconds_sum")[labels] == pytest.approx(0.002)
    by_outcome = {dict(k)["outcome"]: v for k, v in _samples("kvpush_kv_transfers_total").items()}
    assert by_outcome == {"ok": 4, "deadline": 1, "error": 0, "cancelled": 0, "corrupt": 0}
    assert {n.removesuffix("_total") for n in METRIC_NAMES} <= {
        f.name for f in REGISTRY.collect()}
    # What decode received, beside what prefill pushed.
    assert _samples("kvpush_kv_bytes_received_total")[labels] == 1207
    # vLLM's NIXL series, fed by both sides: vLLM's dashboards read kvpush engines.
    assert set(VLLM_NIXL_NAMES) <= {f.name for f in REGISTRY.collect()}
    assert _samples("vllm:nixl_bytes_transferred_count")[labels] == 4  # 2 pushes, 2 recvs
    assert _samples("vllm:nixl_bytes_transferred_sum")[labels] == 2 * 1200 + 1207
    assert _samples("vllm:nixl_num_failed_transfers_total")[labels] == 1
    assert _samples("vllm:nixl_num_kv_expired_reqs_total")[labels] == 1
    assert _samples("vllm:nixl_xfer_time_seconds_count")[labels] >= 2  # the recvs at least


def test_quarantine_series_follow_the_ranks_records() -> None:
    """Two decode ranks quarantine blocks; the gauges add their blocks and keep the oldest
    age; each ended quarantine counts by how it ended, with how long it held."""
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    cfg = SimpleNamespace(kv_transfer_config=None)
    metrics = KVPushPromMetrics(cfg, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    labels = (("engine", "0"), ("model_name", "tiny"))

    def observe(*records: PushRecord) -> None:
        stats = KVPushStats()
        stats.reset()
        for r in records:
            stats.add(r)
        metrics.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(stats.data)), 0)

    observe(PushRecord("quarantine", "a", "D", "P", 0, outcome="entered", blocks=3,
                       held_blocks=3),
            PushRecord("quarantine", "a", "D", "P", 1, outcome="entered", blocks=3,
                       held_blocks=3, held_age_s=0.5))
    assert _samples("kvpush_kv_quarantined_blocks")[labels] == 6
    assert _samples("kvpush_kv_quarantine_oldest_seconds")[labels] == 0.5
    observe(PushRecord("quarantine", "", "D", "", 1, outcome="held", held_blocks=3,
                       held_age_s=7.0),
            PushRecord("quarantine", "a", "D", "P", 0, outcome="fenced", blocks=3,
                       wait_ms=7_000))
    assert _samples("kvpush_kv_quarantined_blocks")[labels] == 3
    assert _samples("kvpush_kv_quarantine_oldest_seconds")[labels] == 7.0
    observe(PushRecord("quarantine", "a", "D", "P", 1, ok=False, outcome="cut_off",
                       blocks=3, wait_ms=60_000))
    assert _samples("kvpush_kv_quarantined_blocks")[labels] == 0
    ends = {dict(k)["end"]: v for k, v in _samples("kvpush_kv_quarantines_total").items()}
    assert ends == {"entered": 2, "fenced": 1, "cut_off": 1}
    assert _samples("kvpush_kv_quarantine_seconds_sum")[labels] == pytest.approx(67.0)
    # Not transfers: the transfer counters never saw them.
    assert sum(_samples("kvpush_kv_transfers_total").values()) == 0


def test_reduce_reports_exposed_time() -> None:
    stats = KVPushStats()
    stats.reset()
    stats.add(PushRecord("recv", "a", "D", "P", 0, exposed_ms=1.0))
    stats.add(PushRecord("recv", "b", "D", "P", 0, exposed_ms=3.0))
    out = stats.reduce()
    assert (out["recvs"], out["exposed_ms_p50"], out["exposed_ms_max"]) == (2, 2.0, 3.0)


def test_push_done_carries_last_layer_wall_clock() -> None:
    now_ms = time.time_ns() // 1_000_000
    msg = decode(encode(PushDone(request_id="r", last_layer_done_ms=now_ms)), PushDone)
    assert msg.last_layer_done_ms == now_ms
    # A PushDone from a prefill without the field still decodes (additive field).
    old = msgspec.msgpack.encode({"v": SCHEMA_VERSION, "request_id": "r", "ok": True})
    assert decode(old, PushDone).last_layer_done_ms == 0
    assert unix_ns(0) == 0
    assert abs(unix_ns(time.monotonic_ns()) - time.time_ns()) < 1_000_000_000
