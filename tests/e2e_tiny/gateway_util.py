"""The local push stack's front (Redis, the push scheduler and the gateway in one process, as
``kvpush up`` runs them) over the package's engine pair, and what tests of it need."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvpush.common.quotas import usage
from kvpush.common.reservations import live_reservations
from kvpush.common.settings import GatewaySettings, SchedulerSettings
from kvpush.common.tenancy import Quotas, TenantExists, create_tenant, issue_api_key
from kvpush.loadtest.otlp_receiver import OTLPReceiver
from kvpush.services.engine.status import metric_sum, scrape
from kvpush.services.gateway import Gateway, create_app
from kvpush.services.local.local_redis import free_port
from kvpush.services.local.models import ensure_model
from kvpush.services.local.push_front import in_process_scheduler
from kvpush.services.local.stack import UvicornThread
from tests.e2e_util import EnginePair, complete

MODEL = "tiny"
TENANT_A, TENANT_B = "tenant-a", "tenant-b"


@dataclass
class GatewayStack:
    """The running stack and what the tests need to reach into it."""

    url: str
    pair: EnginePair
    redis: redis.Redis
    keys: dict[str, str]  # tenant id -> API key
    gateway: Gateway
    logs: Path
    traces: OTLPReceiver

    def headers(self, tenant: str = TENANT_A) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def until(pred: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    """Poll ``pred``; the timeout only keeps a broken build from hanging."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def gateway_stack(stack: dict[str, Any], scheduler: dict[str, Any] | None = None,
                  **settings: Any) -> Iterator[GatewayStack]:
    """The package's engine pair behind a scheduler and a gateway with tenant auth, shared
    by every test of the module; the gateway's spans go to the pair's span receiver.
    ``settings`` are the gateway's, ``scheduler`` the scheduler's."""
    pair: EnginePair = stack["pair"]
    rx: OTLPReceiver = stack["otlp"]
    r = redis.Redis.from_url(stack["redis_url"])
    saved_env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    provider = TracerProvider(resource=Resource.create({"service.name": "kvpush-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"{rx.endpoint}/v1/traces"), schedule_delay_millis=200))
    try:
        keys = {}
        for tid in (TENANT_A, TENANT_B):
            # A concurrency quota makes every admission hold a lease we can check is freed.
            # The package's Redis outlives each module's gateway: a later module gets a
            # key of its own for the tenants an earlier one made.
            try:
                _, keys[tid] = create_tenant(r, tid, tenant_id=tid,
                                             quotas=Quotas(concurrent_requests=64))
            except TenantExists:
                keys[tid] = issue_api_key(r, tid)
        port = free_port()
        gs = GatewaySettings(redis_url=stack["redis_url"], gateway_id="gw-e2e",
                             gateway_port=port, gateway_model=MODEL,
                             gateway_tokenizer=str(ensure_model(MODEL)),
                             gateway_max_model_len=2048,  # as `kvpush up` sets it
                             **settings,
                             gateway_auth=True, gateway_expose_metrics=True)
        ss = SchedulerSettings(redis_url=stack["redis_url"], scheduler_id="sched-e2e",
                               **(scheduler or {}))
        gw = Gateway(gs, tracer_provider=provider)
        # The scheduler runs in the gateway's event loop, as ``kvpush up`` wires it.
        app = create_app(gs, gw, background=[in_process_scheduler(ss)])
        front = UvicornThread(app, "127.0.0.1", port).start()
        try:
            st = GatewayStack(front.url, pair, r, keys, gw, stack["logs"], rx)
            until(lambda: httpx.get(f"{st.url}/health").status_code == 200, "health")
            yield st
        finally:
            front.stop()
    finally:
        provider.shutdown()
        if saved_env is None:
            os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
        else:
            os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = saved_env
        r.close()


def responses_text(doc: dict[str, Any]) -> str:
    """The output text of a ``/v1/responses`` answer (its messages' ``output_text`` parts)."""
    return "".join(part["text"] for item in doc["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def prompt_of(tag: str, n: int) -> str:
    return f"# {tag}\n" + " ".join(
        f"def f_{tag}_{i}(x):\n    return x * {i} + {len(tag)}\n" for i in range(n))


def reference(st: GatewayStack, prompt: str, max_tokens: int = 16) -> str:
    return complete(st.pair.prefill.url, {"model": MODEL, "prompt": prompt,
                                          "max_tokens": max_tokens, "temperature": 0.0}
                    )["choices"][0]["text"]


def no_leftovers(st: GatewayStack) -> None:
    """No reservation, no quota lease, no request running on either engine."""
    until(lambda: not live_reservations(st.redis), "reservations released")
    for tid in st.keys:
        until(lambda tid=tid: usage(st.redis, tid)["concurrent_leases"] == 0,
               f"{tid}'s quota leases released")
    for e in (st.pair.prefill, st.pair.decode):
        until(lambda e=e: metric_sum(scrape(e.url), "vllm:num_requests_running") == 0,
               f"{e.engine_id} idle")
    assert live_reservations(st.redis) == []


def gateway_metric(st: GatewayStack, name: str, **labels: str) -> float:
    from kvpush.services.engine.status import parse_metrics

    text = httpx.get(f"{st.url}/metrics", timeout=10).text
    return metric_sum(parse_metrics(text), name, **labels)


