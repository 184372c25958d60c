"""Tracing setup: spans reach a real OTLP/HTTP receiver and one traceparent links processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvpush.common import telemetry
from kvpush.loadtest.otlp_receiver import OTLPReceiver

_CHILD = textwrap.dedent(
    """
    import sys
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from kvpush.common import telemetry
    assert telemetry.init_tracing("kvpush-test-child", sys.argv[1], engine_id="e1", role="decode")
    ctx = telemetry.context_from_traceparent(sys.argv[2])
    with telemetry.tracer().start_as_current_span("child.work", context=ctx,
                                                   kind=SpanKind.CONSUMER) as span:
        span.set_attribute("kvpush.bytes", 1234)
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
    telemetry.shutdown_tracing()
    """
)


def _wait_for(receiver: OTLPReceiver, name: str, timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.by_name(name)
        if spans:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"span {name!r} never arrived")


def test_traceparent_links_parent_and_child_process() -> None:
    parent_tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with OTLPReceiver() as receiver:
        subprocess.run(
            [sys.executable, "-c", _CHILD, receiver.endpoint, parent_tp], check=True, timeout=60
        )
        (span,) = _wait_for(receiver, "child.work")
    assert span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent_span_id == "00f067aa0ba902b7"
    assert span.service == "kvpush-test-child"
    assert span.attributes["kvpush.bytes"] == 1234
    assert span.status_code == 2  # STATUS_CODE_ERROR
    assert "exception" in span.events


def test_tracing_off_still_propagates_context() -> None:
    # With no endpoint the API's no-op provider stays; context must still flow through.
    assert telemetry.init_tracing("x", None) is False
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = telemetry.context_from_traceparent(tp)
    with telemetry.tracer().start_as_current_span("noop", context=ctx):
        assert telemetry.current_traceparent() == tp


@pytest.mark.parametrize("bad", ["", None, "garbage", b"00-zz-yy-01"])
def test_invalid_traceparent_is_ignored(bad: object) -> None:
    assert telemetry.context_from_traceparent(bad) is None  # type: ignore[arg-type]


def test_bad_endpoint_scheme_is_a_named_error() -> None:
    with pytest.raises(telemetry.TelemetryConfigError):
        telemetry.init_tracing("x", "ftp://nowhere:1")
