"""``kvpush up`` on a local three-master Redis Cluster with four request shards: a tenant's
completions, streamed and not, are served through the gateway by real engines, one request's
trace spans the gateway, the scheduler and both engines, and nothing is left behind
(reservations, quota leases, pending entries, engine records, processes)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import usage
from kvpush.common.redis_client import sync_redis
from kvpush.common.reservations import live_reservations
from kvpush.common.tenancy import Quotas, create_tenant
from kvpush.loadtest.otlp_receiver import OTLPReceiver
from kvpush.services.local.ports import free_port, free_port_range
from kvpush.services.local.redis_topologies import LocalCluster
from kvpush.services.local.stack import engine_rows
from tests.fleet_util import engine_pid, healthy, port_of, process_tree
from tests.polling import until

pytestmark = pytest.mark.slow

K = RedisKeys()
SHARDS = 4


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "prompt": f"# request {i}\ndef f(x):\n    return x" + " + 1" * i,
            "max_tokens": 4, "temperature": 0, "stream": stream}


async def _one(c: httpx.AsyncClient, url: str, auth: dict[str, str], i: int,
               stream: bool) -> tuple[int, str]:
    """Status and generated text of one completion (SSE chunks joined when streamed)."""
    if not stream:
        r = await c.post(f"{url}/v1/completions", json=_body(i, False), headers=auth)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    text, done = [], False
    async with c.stream("POST", f"{url}/v1/completions", json=_body(i, True),
                        headers=auth) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
        return (r.status_code if done else -1), "".join(text)


@pytest.fixture
def otlp() -> Any:
    with OTLPReceiver() as rx:
        yield rx


# One trace per request, as on one Redis: gateway, stream, scheduler, both engines.
TRACE_SPANS = {"POST /v1/completions", "kvpush.match", "kvpush.dispatch.prefill",
               "kvpush.dispatch.decode", "kvpush.kv.push", "kvpush.kv.write", "kvpush.kv.wait",
               "llm_request"}


def test_up_serves_a_tenant_on_a_redis_cluster_with_request_shards(
        tmp_path: Path, redis_cluster: LocalCluster, otlp: OTLPReceiver) -> None:
    settings = redis_cluster.settings()
    admin = sync_redis(settings)
    admin.flushall()
    api = free_port()
    env = dict(os.environ, KVPUSH_REDIS_URL=redis_cluster.url, KVPUSH_REDIS_CLUSTER="true",
               KVPUSH_OTLP_ENDPOINT=otlp.endpoint,
               KVPUSH_REQUEST_SHARDS=str(SHARDS), KVPUSH_GATEWAY_AUTH="true",
               KVPUSH_STACK_PORT=str(api), KVPUSH_RUN_DIR=str(tmp_path),
               KVPUSH_STACK_PREFILL_PORT=str(free_port_range(2)),
               KVPUSH_STACK_DECODE_PORT=str(free_port_range(2)))
    url = f"http://127.0.0.1:{api}"
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    engines: list[psutil.Process] = []
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli", "up"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        until(lambda: healthy(url) or proc.poll() is not None, "the stack", 300)
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        rows = until(lambda: len(engine_rows(redis_cluster.url, settings=settings)) == 2
                      and engine_rows(redis_cluster.url, settings=settings),
                      "two engines registered in the cluster", 30)
        assert sorted(r["role"] for r in rows) == ["decode", "prefill"]
        for r in rows:
            engines += process_tree(engine_pid(port_of(r["url"])))

        tenant, key = create_tenant(admin, "acme", quotas=Quotas(concurrent_requests=16))
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{url}/v1/completions", json=_body(0, False),
                          timeout=30).status_code == 401

        async def burst() -> list[tuple[int, str]]:
            async with httpx.AsyncClient(timeout=120) as c:
                first = [await _one(c, url, auth, 0, False), await _one(c, url, auth, 1, True)]
                rest = await asyncio.gather(*(_one(c, url, auth, i, i % 2 == 1)
                                              for i in range(2, 10)))
                return first + list(rest)

        got = asyncio.run(burst())
        assert [status for status, _ in got] == [200] * 10, got
        assert all(text for _, text in got), got
        # Same prompt, greedy: the streamed answer is the one the plain request got.
        trace_id = secrets.token_hex(16)
        traced = {**auth, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        assert asyncio.run(_again(url, traced)) == got[1][1]
        # vLLM's exporter sends every few seconds.
        spans = until(lambda: (got := otlp.by_trace({trace_id})[trace_id])
                      and {s.name for s in got} >= TRACE_SPANS and got,
                      "the traced request's spans", 60)
        kinds = {s.kind for s in spans}
        assert {4, 5} <= kinds, kinds  # the stream's PRODUCER (gateway) and CONSUMER (scheduler)
        assert any(s.kind == 4 and s.name.startswith(f"send {K.requests(0)}") for s in spans)
        roots = [s for s in spans if not s.parent_span_id]
        assert [s.name for s in roots] == [], roots  # all under the client's traceparent

        # Every request went through a shard (one schedule entry each), each was answered.
        added = [int(admin.xinfo_stream(K.requests(s))["entries-added"]) for s in range(SHARDS)]
        assert sum(added) == 11, added
        assert [admin.xpending(K.requests(s), "schedulers")["pending"]
                for s in range(SHARDS)] == [0] * SHARDS
        until(lambda: not live_reservations(admin), "reservations released", 30)
        until(lambda: usage(admin, tenant.id)["concurrent_leases"] == 0,
               "quota leases released", 30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert engine_rows(redis_cluster.url, settings=settings) == []  # withdrawn on the way out
    assert live_reservations(admin) == []
    assert [p.pid for p in engines if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE] == []
    admin.close()


async def _again(url: str, auth: dict[str, str]) -> str:
    async with httpx.AsyncClient(timeout=120) as c:
        status, text = await _one(c, url, auth, 1, False)
    assert status == 200
    return text
