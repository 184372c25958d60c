"""Traces of the gateway and the scheduler, received by a real OTLP/HTTP receiver.

Gateway and scheduler run in this process over real HTTP and real Redis, each with a
tracer provider of its own (``service.name`` ``kvpush-gateway`` / ``kvpush-scheduler``)
exporting OTLP/HTTP protobuf, as separate processes would. The engines are the stand-ins
of tests/test_gateway.py; vLLM's own spans joining the trace are checked on real engines
in tests/test_e2e_gateway.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvpush.common.runtime import run
from kvpush.loadtest.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.sched_util import assert_no_reservations
from tests.test_gateway import PROMPT, pd, stack, tokenizer_dir  # noqa: F401 (fixture)

# OTLP SpanKind / StatusCode numbers.
SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5
STATUS_ERROR = 2
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TP = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def _provider(service: str, endpoint: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    return provider


async def _spans(rx: OTLPReceiver, names: set[str], *providers: TracerProvider
                 ) -> dict[str, ReceivedSpan]:
    """Wait until a span of every name in ``names`` arrived; one span per name."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while True:
        got = {n: rx.by_name(n) for n in names}
        if all(got.values()):
            break
        if loop.time() > end:
            raise AssertionError(f"spans missing: {[n for n, s in got.items() if not s]}; "
                                 f"got {[s.name for s in rx.spans]}")
        await asyncio.sleep(0.05)
    for n, spans in got.items():
        assert len(spans) == 1, (n, spans)
    return {n: s[0] for n, s in got.items()}


def test_one_trace_covers_gateway_and_scheduler(redis_url: str, redis_client: redis.Redis,
                                                tokenizer_dir: Path,  # noqa: F811
                                                receiver: OTLPReceiver) -> None:
    p, d = pd()
    gwp = _provider("kvpush-gateway", receiver.endpoint)
    scp = _provider("kvpush-scheduler", receiver.endpoint)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw_tracer=gwp, sched_tracer=scp) as s:
            r = await s.client.post("/v1/completions", headers={"traceparent": CLIENT_TP},
                                    json={"model": "tiny", "prompt": PROMPT,
                                          "max_tokens": 4, "stream": True})
            assert r.status_code == 200
            sp = await _spans(receiver, {
                "POST /v1/completions", "send kvpush:requests", "process kvpush:requests",
                "kvpush.match", "kvpush.dispatch.prefill", "kvpush.dispatch.decode"})
            server, send = sp["POST /v1/completions"], sp["send kvpush:requests"]
            consume, match = sp["process kvpush:requests"], sp["kvpush.match"]
            pre, dec = sp["kvpush.dispatch.prefill"], sp["kvpush.dispatch.decode"]
            # One trace, continuing the client's.
            assert {x.trace_id for x in sp.values()} == {CLIENT_TRACE}
            assert server.parent_span_id == "00f067aa0ba902b7" and server.kind == SERVER
            assert server.service == "kvpush-gateway"
            a = server.attributes
            assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.request.max_tokens"] == 4
            assert a["gen_ai.usage.input_tokens"] == 10 and a["kvpush.tenant"] == "default"
            assert a["http.response.status_code"] == 200
            # The stream entry carried the PRODUCER's context to the scheduler.
            assert send.kind == PRODUCER and send.parent_span_id == server.span_id
            assert send.attributes["messaging.system"] == "redis"
            assert send.attributes["messaging.destination.name"] == "kvpush:requests"
            entry_id = send.attributes["messaging.message.id"]
            assert consume.kind == CONSUMER and consume.parent_span_id == send.span_id
            assert consume.service == "kvpush-scheduler"
            assert consume.attributes["messaging.message.id"] == entry_id
            assert match.parent_span_id == consume.span_id
            m = match.attributes
            assert (m["kvpush.decode_engine"], m["kvpush.prefill_engine"]) == ("d1", "p1")
            assert m["kvpush.blocks"] == 1 and m["kvpush.reservation_id"].startswith("cmpl-")
            assert m["kvpush.fencing_token"] > 0 and m["kvpush.queue_wait_ms"] >= 0
            # Each engine call is a CLIENT span whose context went out in both places.
            for span, eng in ((pre, p), (dec, d)):
                assert span.kind == CLIENT and span.parent_span_id == server.span_id
                (call,) = eng.calls
                tp = f"00-{CLIENT_TRACE}-{span.span_id}-01"
                assert call.headers["traceparent"] == tp
                assert call.body["kv_transfer_params"]["traceparent"] == tp
            assert pre.status_code != STATUS_ERROR and dec.status_code != STATUS_ERROR

    run(main())
    gwp.shutdown()
    scp.shutdown()


def test_failed_dispatch_marks_its_span(redis_url: str, redis_client: redis.Redis,
                                        tokenizer_dir: Path,  # noqa: F811
                                        receiver: OTLPReceiver) -> None:
    p, d = pd()
    p.mode, d.mode = "fail", "hang"
    gwp = _provider("kvpush-gateway", receiver.endpoint)
    scp = _provider("kvpush-scheduler", receiver.endpoint)

    async def main() -> None:
        # No re-route: the single decode would serve a second attempt by itself.
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={"gateway_dispatch_retries": 0,
                             "gateway_suspect_cooldown_s": 0},
                         gw_tracer=gwp, sched_tracer=scp) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 502
            sp = await _spans(receiver, {"POST /v1/completions", "kvpush.dispatch.prefill",
                                         "kvpush.dispatch.decode", "kvpush.match"})
            pre, server = sp["kvpush.dispatch.prefill"], sp["POST /v1/completions"]
            assert pre.status_code == STATUS_ERROR and "exception" in pre.events
            assert pre.attributes["http.response.status_code"] == 500
            assert server.status_code == STATUS_ERROR
            assert server.attributes["http.response.status_code"] == 502
            # The decode call was cut short, not failed by its engine.
            assert sp["kvpush.dispatch.decode"].status_code != STATUS_ERROR
            assert len({x.trace_id for x in sp.values()}) == 1

    run(main())
    gwp.shutdown()
    scp.shutdown()


def test_rejection_marks_the_match_span(redis_url: str, redis_client: redis.Redis,
                                        tokenizer_dir: Path,  # noqa: F811
                                        receiver: OTLPReceiver) -> None:
    gwp = _provider("kvpush-gateway", receiver.endpoint)
    scp = _provider("kvpush-scheduler", receiver.endpoint)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, gw_tracer=gwp,
                         sched_tracer=scp, sched={"scheduler_queue_timeout_s": 0.1}) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 503  # no engine at all
            sp = await _spans(receiver, {"POST /v1/completions", "kvpush.match"})
            assert sp["kvpush.match"].status_code == STATUS_ERROR
            assert sp["kvpush.match"].attributes["kvpush.rejected"] == "no_engine"
            assert sp["POST /v1/completions"].status_code == STATUS_ERROR

    run(main())
    gwp.shutdown()
    scp.shutdown()


def test_tracing_off_sends_no_placeholder(redis_url: str, redis_client: redis.Redis,
                                          tokenizer_dir: Path) -> None:  # noqa: F811
    """Without a collector no traceparent is made up; a client's one is passed on."""
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", headers={"traceparent": CLIENT_TP},
                                    json={"prompt": PROMPT})
            assert r.status_code == 200
            assert p.calls[0].headers["traceparent"] == CLIENT_TP
            assert d.calls[0].body["kv_transfer_params"]["traceparent"] == CLIENT_TP

    run(main())
