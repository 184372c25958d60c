"""The gateway's Prometheus metrics and the app that serves them off the API port."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The gateway's Prometheus metrics, in a registry of its own.

    ``kvpush_ttft_seconds``, ``kvpush_tpot_seconds``, ``kvpush_queue_wait_seconds`` and
    ``kvpush_reservations_in_use`` are the names the Grafana dashboard queries
    (docker/grafana/provisioning/dashboards/dashboards.yaml).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpush_gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status", "tenant"], registry=r)
        self.errors = Counter("kvpush_gateway_errors", "Failed requests by kind",
                              ["kind", "tenant"], registry=r)
        self.queue_wait = Histogram("kvpush_queue_wait_seconds",
                                    "XADD to kvpush:requests -> assignment received",
                                    ["tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvpush_ttft_seconds", "Arrival -> first token sent to the "
                              "client", ["tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvpush_tpot_seconds", "Mean time per output token after "
                              "the first", ["tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.reservations = Gauge("kvpush_reservations_in_use",
                                  "Live decode reservations held by this gateway's requests",
                                  ["engine"], registry=r)
        self.in_flight = Gauge("kvpush_gateway_requests_in_flight", "Requests being served",
                               registry=r)
        self.tokens = Counter("kvpush_gateway_tokens", "Tokens of finished requests",
                              ["tenant", "kind"], registry=r)
        self.backlog = Gauge("kvpush_gateway_backlog_prompt_tokens", "Prompt tokens of "
                             "admitted requests not at their first token yet", registry=r)
        self.est_wait = Gauge("kvpush_gateway_estimated_wait_seconds", "Estimated wait for "
                              "a first token of a request admitted now (load shedding)",
                              registry=r)
        self.shed_headroom = Gauge(
            "kvpush_gateway_shed_headroom", "Share of the TTFT objective the estimated wait "
            "may reach before requests are shed (learned from the admitted requests' p99 "
            "wait when gateway_shed_learn is on)", registry=r)
        self.placements = Counter(
            "kvpush_gateway_placements", "Assignments by path: prefill and decode "
            "(disaggregated), with another engine pushing the prompt's held prefix to "
            "prefill (history_push), or decode alone because it held all but a short tail "
            "of the prompt (decode_alone_cached) or for another reason (decode_alone)",
            ["path"], registry=r)
        self.history_tokens = Counter(
            "kvpush_gateway_history_tokens", "Prompt tokens of history pushes: pushed to "
            "prefill by the engine holding them (pushed), and what prefill held itself "
            "(held_by_prefill)", ["source"], registry=r)
        self.history_decisions = Counter(
            "kvpush_gateway_history_decisions", "Placements where another engine held more "
            "of the prompt than the prefill picked, by the schedulers' cost model's choice: "
            "push (its measured wait is shorter than recomputing), unmeasured (pushed to "
            "measure), explore (recompute chosen, pushed to measure again), short (under "
            "scheduler_history_push_tokens), slower (recomputed: the push's measured wait "
            "is longer)", ["choice"], registry=r)
        self.first_token = Counter(
            "kvpush_gateway_first_token_from_prefill", "Streams whose first token was "
            "prefill's answer (led), and those whose decode then chose another (differed); "
            "answers, streamed or not, whose decode went on from prefill's first token "
            "(continued)",
            ["outcome"], registry=r)
        self.early_prefill = Counter(
            "kvpush_gateway_early_prefill", "Prompts sent to a prefill engine at admission, "
            "by what became of the call: kept by the placement, replaced (another prefill "
            "or none), refused (the request was), left (the client did)",
            ["outcome"], registry=r)
        self.responses_stored = Counter(
            "kvpush_gateway_responses_stored", "/v1/responses answers asked to be kept, by "
            "outcome: stored, too_large (over the stored-response bounds, served unstored) "
            "or failed (Redis, or an answer that ended in failure)",
            ["outcome"], registry=r)


def metrics_route(registry: CollectorRegistry) -> Route:
    """``GET /metrics``: ``registry`` in Prometheus text format."""
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", metrics, methods=["GET"])


def metrics_app(registry: CollectorRegistry) -> Starlette:
    """An app serving only ``/metrics`` (for ``gateway_metrics_port``)."""
    return Starlette(routes=[metrics_route(registry)])
