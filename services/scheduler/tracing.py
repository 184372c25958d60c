"""Spans of one answered request: ``process kvpush:requests`` (CONSUMER) and ``kvpush.match``.

Built only when tracing is on (``Scheduler.tracing``): they cost something per request.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvpush.common.telemetry import context_from_traceparent
from kvpush.common.wire import Assignment
from kvpush.services.scheduler.fair_queue import Pending


def trace_answer(tracer: trace.Tracer, p: Pending, a: Assignment, end_ns: int, done: float, *,
                 stream: str, group: str, scheduler: str) -> None:
    """CONSUMER span (child of the gateway's PRODUCER span via ``tp``) and the match."""
    req = p.request
    consumer = tracer.start_span(
        f"process {stream}", context=context_from_traceparent(p.traceparent),
        kind=SpanKind.CONSUMER, start_time=p.read_ns or end_ns, attributes={
            "messaging.system": "redis", "messaging.destination.name": stream,
            "messaging.operation.type": "process",
            "messaging.consumer.group.name": group,
            "messaging.message.id": p.entry_id, "kvpush.request_id": req.request_id,
            "kvpush.tenant": req.tenant, "kvpush.scheduler": scheduler,
            "kvpush.redelivered": p.redelivered})
    attrs: dict[str, Any] = {
        "kvpush.request_id": req.request_id, "kvpush.tenant": req.tenant,
        "kvpush.prompt_tokens": req.prompt_tokens, "kvpush.max_tokens": req.max_tokens,
        # Read -> answered (held back for capacity, if it waited) and XADD -> read.
        "kvpush.queue_wait_ms": round((done - p.arrived) * 1000, 3),
        "kvpush.stream_wait_ms": max(0, p.read_ns // 1_000_000 - req.enqueued_ms)
        if req.enqueued_ms and p.read_ns else 0,
    }
    if a.ok:
        attrs.update({
            "kvpush.decode_engine": a.decode_engine or "",
            "kvpush.prefill_engine": a.prefill_engine or "",
            "kvpush.blocks": a.blocks, "kvpush.reservation_id": a.reservation_id or "",
            "kvpush.fencing_token": a.fencing_token,
            "kvpush.disaggregated": a.disaggregated,
            "kvpush.cached_tokens": a.cached_tokens,
            # The history push decision and its inputs (common/history_cost.py).
            "kvpush.prefill_held_tokens": a.prefill_held_tokens,
            "kvpush.history_engine": a.history_engine or "",
            "kvpush.history_tokens": a.history_tokens,
            "kvpush.history_choice": a.history_choice,
            "kvpush.history_recompute_ms": a.history_recompute_ms,
            "kvpush.history_wait_ms": a.history_wait_ms})
    else:
        attrs["kvpush.rejected"] = a.error_kind or "rejected"
    match = tracer.start_span("kvpush.match", context=trace.set_span_in_context(
        consumer), start_time=p.read_ns or end_ns, attributes=attrs)
    if not a.ok:
        status = Status(StatusCode.ERROR, a.error or a.error_kind or "rejected")
        match.set_status(status)
        consumer.set_status(status)
    match.end(end_ns)
    consumer.end(end_ns)
