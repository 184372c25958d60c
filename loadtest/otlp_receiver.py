"""A real OTLP/HTTP trace receiver for tests and the benchmark's phase breakdown: decodes
protobuf ExportTraceServiceRequest."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    """One span as it arrived over the wire."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    start_unix_ns: int = 0
    end_unix_ns: int = 0
    event_unix_ns: dict[str, int] = field(default_factory=dict)
    """Time of each event name's first occurrence."""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _first_events(events: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        out.setdefault(e.name, e.time_unix_nano)
    return out


class OTLPReceiver:
    """Listens on 127.0.0.1; ``spans`` grows as exporters post batches."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._ingest(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL to hand to an OTLP/HTTP exporter."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _ingest(self, req: ExportTraceServiceRequest) -> None:
        with self._lock:
            for rs in req.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            ReceivedSpan(
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                status_code=s.status.code,
                                service=str(res.get("service.name", "")),
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                events=[e.name for e in s.events],
                                start_unix_ns=s.start_time_unix_nano,
                                end_unix_ns=s.end_time_unix_nano,
                                event_unix_ns=_first_events(s.events),
                            )
                        )

    def by_name(self, name: str) -> list[ReceivedSpan]:
        """Spans received so far with this name."""
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def by_trace(self, trace_ids: set[str]) -> dict[str, list[ReceivedSpan]]:
        """Spans received so far of each of ``trace_ids``."""
        out: dict[str, list[ReceivedSpan]] = {t: [] for t in trace_ids}
        with self._lock:
            for s in self.spans:
                if s.trace_id in out:
                    out[s.trace_id].append(s)
        return out

    def clear(self) -> None:
        """Forget every span received so far."""
        with self._lock:
            self.spans.clear()

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
