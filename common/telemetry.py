"""OpenTelemetry setup and W3C trace-context helpers shared by every kvpush process.

Tracing is off unless an OTLP endpoint is configured; then the global tracer provider stays
the API's no-op one, so spans cost a function call and no allocation of exporter state.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACER_NAME = "kvpush"
_PROPAGATOR = TraceContextTextMapPropagator()
_initialised = False


class TelemetryConfigError(ValueError):
    """The OTLP endpoint or sampling settings cannot be used."""


def make_provider(
    service_name: str,
    otlp_endpoint: str,
    sample_ratio: float = 1.0,
    **resource_attrs: Any,
) -> Any:
    """A tracer provider exporting to ``otlp_endpoint``, not installed anywhere.

    ``grpc://host:port`` exports OTLP/gRPC; ``http(s)://host:port`` exports OTLP/HTTP
    (``/v1/traces`` appended when no path is given).
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if otlp_endpoint.startswith("grpc://"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter: Any = OTLPSpanExporter(
            endpoint=otlp_endpoint.removeprefix("grpc://"), insecure=True
        )
    elif otlp_endpoint.startswith(("http://", "https://")):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )

        endpoint = otlp_endpoint
        if endpoint.rstrip("/").count("/") <= 2:
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        exporter = HTTPExporter(endpoint=endpoint)
    else:
        raise TelemetryConfigError(
            f"OTLP endpoint must start with grpc://, http:// or https://: {otlp_endpoint!r}"
        )
    attrs = {
        "service.name": service_name,
        "service.namespace": "kvpush",
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
    }
    attrs.update({f"kvpush.{k}": v for k, v in resource_attrs.items() if v is not None})
    provider = TracerProvider(
        resource=Resource.create(attrs),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def init_tracing(
    service_name: str,
    otlp_endpoint: str | None,
    sample_ratio: float = 1.0,
    **resource_attrs: Any,
) -> bool:
    """Install a tracer provider exporting to ``otlp_endpoint`` (see :func:`make_provider`)
    as the process's global one; returns whether tracing is on.

    Safe to call more than once per process: only the first call with an endpoint installs
    a provider.
    """
    global _initialised
    if not otlp_endpoint or _initialised:
        return _initialised
    trace.set_tracer_provider(make_provider(service_name, otlp_endpoint, sample_ratio,
                                            **resource_attrs))
    _initialised = True
    logger.info("tracing to %s as %s", otlp_endpoint, service_name)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter so a process exits with its spans delivered."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def tracer() -> trace.Tracer:
    """The kvpush tracer (a no-op one while tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


def current_traceparent() -> str | None:
    """W3C ``traceparent`` of the current span, for stream fields, headers and params."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_from_traceparent(traceparent: str | bytes | None) -> otel_context.Context | None:
    """An OTel context whose parent is ``traceparent``; None when it is absent or invalid."""
    if not traceparent:
        return None
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", "replace")
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context carried by HTTP headers, if any."""
    return context_from_traceparent(headers.get("traceparent"))
