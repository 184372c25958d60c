"""Gateway ceiling: the concurrent streams and relayed tokens per second one gateway process
carries, against the same client reading the upstream directly and against vLLM's own API
server.

The upstream is a synthetic engine (this module with ``--serve-upstream``): an OpenAI
streaming completions endpoint that sends its tokens as fast as it can, registered in Redis
as a colocated engine. The gateway and the scheduler (processes of their own, as deployed)
then do all of their real work per request (admission, tokenizing, the request stream,
match, reservation, relay, release) while the engine does none, so the figures are the
control plane's and the relay's. The same closed-loop client (``--concurrency`` workers,
each sending its next request when the last one ended) also measures:

* ``direct``: the synthetic upstream without the gateway (the client's and upstream's own
  ceiling on this machine);
* ``gateway-h11`` / ``gateway-httptools``: the gateway with each of uvicorn's HTTP parsers;
* ``vllm``: vLLM's API server with a real colocated engine (``tiny``) on every core, what one
  vLLM server streams here.

All processes share this machine's cores: a ceiling here is a lower bound. Asserts nothing.

    kvpush bench gateway --concurrency 1,16,64,256 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_ID = "synthetic-0"
PROMPT = "def fibonacci(n):\n    " * 8
_CHUNK = ('data: {{"id":"cmpl-{rid}","object":"text_completion","created":0,"model":"tiny",'
          '"choices":[{{"index":0,"text":" tok","logprobs":null,"finish_reason":{fin},'
          '"stop_reason":null}}]}}\n\n')


# -- the synthetic upstream (its own process) -------------------------------------------------

def upstream_app() -> Any:
    """A completions endpoint that streams ``max_tokens`` tokens with no compute."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> Any:
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or 16))
        rid = os.urandom(6).hex()
        if not body.get("stream"):
            return JSONResponse({"id": f"cmpl-{rid}", "object": "text_completion",
                                 "choices": [{"index": 0, "text": " tok" * n,
                                              "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": n}})

        async def events() -> Any:
            for i in range(n):
                fin = '"length"' if i == n - 1 else "null"
                yield _CHUNK.format(rid=rid, fin=fin)
                if i % 16 == 15:
                    await asyncio.sleep(0)  # let other streams go, as an engine step would
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Any:
        return PlainTextResponse("")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health)])


def serve_upstream(port: int) -> None:
    """Run the synthetic upstream on ``port`` (httptools, like vLLM's server)."""
    import uvicorn

    uvicorn.run(upstream_app(), host="127.0.0.1", port=port, log_level="warning",
                http="httptools", backlog=4096)


# -- the client ------------------------------------------------------------------------------

@dataclass
class CeilingRow:
    """One (target, concurrency) measurement."""

    target: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    load_avg: float
    gateway_cpu_us: float | None = None
    """The gateway process's CPU (user + system) per request, microseconds."""
    scheduler_cpu_us: float | None = None
    """The scheduler process's CPU per request, microseconds."""


async def _closed_loop(url: str, model: str, concurrency: int, seconds: float,
                       max_tokens: int) -> tuple[int, int, int, list[float]]:
    import aiohttp

    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    stop_at = time.monotonic() + seconds
    ttfts: list[float] = []
    counts = {"requests": 0, "errors": 0, "tokens": 0}
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                first = None
                tokens = 0
                try:
                    async with session.post(f"{url}/v1/completions", json=body) as resp:
                        if resp.status != 200:
                            counts["errors"] += 1
                            await resp.read()
                            continue
                        async for line in resp.content:
                            if line.startswith(b"data: {"):
                                tokens += 1
                                if first is None:
                                    first = time.monotonic() - t0
                except (aiohttp.ClientError, TimeoutError):
                    counts["errors"] += 1
                    continue
                counts["requests"] += 1
                counts["tokens"] += tokens
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts["requests"], counts["errors"], counts["tokens"], ttfts


def _cpu_s(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def measure(target: str, url: str, model: str, concurrency: int, seconds: float,
            max_tokens: int, gateway_pid: int | None = None,
            scheduler_pid: int | None = None) -> CeilingRow:
    """Run the closed loop against ``url`` and summarise it, with the CPU the gateway and
    scheduler processes (when given) spent per request."""
    from kvpush.loadtest.bench_client import percentile

    load = os.getloadavg()[0]
    t0 = time.monotonic()
    cpu0 = _cpu_s(gateway_pid), _cpu_s(scheduler_pid)
    requests, errors, tokens, ttfts = asyncio.run(
        _closed_loop(url, model, concurrency, seconds, max_tokens))
    took = time.monotonic() - t0
    cpu1 = _cpu_s(gateway_pid), _cpu_s(scheduler_pid)

    def per_request(pid: int | None, i: int) -> float | None:
        if pid is None or not requests:
            return None
        return round((cpu1[i] - cpu0[i]) / requests * 1e6, 1)

    def pct(q: float) -> float:
        return round((percentile(ttfts, q) or 0.0) * 1000, 2)

    row = CeilingRow(target, concurrency, round(took, 2), requests, errors, tokens,
                     round(tokens / took, 1), round(requests / took, 2), pct(50), pct(99),
                     round(load, 2), per_request(gateway_pid, 0),
                     per_request(scheduler_pid, 1))
    logger.info("gateway bench: %s", row)
    return row


# -- the stack ---------------------------------------------------------------------------------

class _Heartbeat(threading.Thread):
    """Keeps the synthetic engine's status fresh in Redis, as an engine's connector would."""

    def __init__(self, redis_url: str, url: str) -> None:
        super().__init__(daemon=True)
        self.redis_url, self.url = redis_url, url
        self.stop = threading.Event()

    def run(self) -> None:
        from kvpush.common.keys import RedisKeys
        from kvpush.common.redis_client import sync_redis
        from kvpush.common.settings import CommonSettings
        from kvpush.common.wire import EngineStatus, now_ms
        from kvpush.services.engine.status import publish_status

        client = sync_redis(CommonSettings(redis_url=self.redis_url))
        while not self.stop.is_set():
            st = EngineStatus(engine_id=ENGINE_ID, role="both", url=self.url, model="tiny",
                              block_size=16, total_blocks=10**9, free_blocks=10**9,
                              generation=1, updated_ms=now_ms(), connector="kvpush")
            publish_status(client, RedisKeys(), st, ttl_s=5.0)
            self.stop.wait(1.0)
        client.close()


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen([sys.executable, *args], env=env, stdout=fh,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    """Wait for ``url``/health to answer 200."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


def stop_procs(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate ``procs``; kill the ones still running after 20 s."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def run(concurrency: list[int], seconds: float, max_tokens: int, out: Path,
        with_vllm: bool = True, parsers: tuple[str, ...] = ("h11", "httptools")
        ) -> list[CeilingRow]:
    """Every target at every concurrency; writes ``gateway.json`` and ``gateway.md``."""
    from kvpush.services.local.local_redis import LocalRedis
    from kvpush.services.local.models import ensure_model
    from kvpush.services.local.ports import free_port

    out = out.resolve()  # Redis resolves paths from its own working directory
    out.mkdir(parents=True, exist_ok=True)
    rows: list[CeilingRow] = []
    tokenizer = str(ensure_model("tiny"))
    redis = LocalRedis(out / "redis", port=free_port()).start()
    up_port = free_port()
    up_url = f"http://127.0.0.1:{up_port}"
    upstream = _spawn(["-m", "kvpush.loadtest.bench_gateway", "--serve-upstream",
                       str(up_port)], dict(os.environ), out / "upstream.log")
    beat = _Heartbeat(redis.url, up_url)
    try:
        wait_http(up_url)
        beat.start()
        for c in concurrency:
            rows.append(measure("direct", up_url, "tiny", c, seconds, max_tokens))
        for http in parsers:
            gw_port = free_port()
            env = dict(os.environ, KVPUSH_REDIS_URL=redis.url, KVPUSH_GATEWAY_PORT=str(gw_port),
                       KVPUSH_GATEWAY_MODEL="tiny", KVPUSH_GATEWAY_TOKENIZER=tokenizer,
                       KVPUSH_GATEWAY_HTTP=http, KVPUSH_LOG_LEVEL="WARNING",
                       KVPUSH_SCHEDULER_MIN_DISAGG_TOKENS=str(2**31 - 1))
            env.pop("KVPUSH_OTLP_ENDPOINT", None)
            procs = [_spawn(["-m", "kvpush.services.cli", "scheduler"], env,
                            out / f"scheduler-{http}.log"),
                     _spawn(["-m", "kvpush.services.cli", "gateway"], env,
                            out / f"gateway-{http}.log")]
            try:
                wait_http(f"http://127.0.0.1:{gw_port}")
                for c in concurrency:
                    rows.append(measure(f"gateway-{http}", f"http://127.0.0.1:{gw_port}",
                                        "tiny", c, seconds, max_tokens,
                                        gateway_pid=procs[1].pid,
                                        scheduler_pid=procs[0].pid))
            finally:
                stop_procs(procs)
    finally:
        beat.stop.set()
        stop_procs([upstream])
        redis.stop()
    if with_vllm:
        rows += _vllm_rows(concurrency, seconds, max_tokens, out)
    (out / "gateway.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out / "gateway.md").write_text(markdown(rows))
    return rows


def _vllm_rows(concurrency: list[int], seconds: float, max_tokens: int, out: Path
               ) -> list[CeilingRow]:
    from kvpush.services.engine.launcher import EngineProcess, EngineSpec
    from kvpush.services.local.models import resolve
    from kvpush.services.local.ports import free_port_pair

    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    spec = EngineSpec(role="both", connector="none", model="tiny", port=free_port_pair(),
                      cpus=cpus, engine_id="vllm-ceiling", kv_cache_gib=1.0,
                      log_path=out / "vllm.log", ready_timeout_s=600.0)
    engine = EngineProcess(spec, resolve=resolve)
    engine.start()
    try:
        engine.wait_ready()
        return [measure("vllm", engine.url, spec.served_model_name, c, seconds, max_tokens)
                for c in concurrency]
    finally:
        engine.stop()


def markdown(rows: list[CeilingRow]) -> str:
    """The table of every measurement, with the gateway's share of the direct ceiling."""
    direct = {r.concurrency: r for r in rows if r.target == "direct"}
    out = ("| target | streams | requests/s | tokens/s | of direct | TTFT p50 ms | TTFT p99 ms "
           "| gateway CPU us/req | scheduler CPU us/req | errors | load avg |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|\n")

    def us(x: float | None) -> str:
        return "—" if x is None else f"{x:.0f}"

    for r in rows:
        d = direct.get(r.concurrency)
        share = f"{r.tokens_per_s / d.tokens_per_s:.2f}" if d and d.tokens_per_s else "—"
        out += (f"| {r.target} | {r.concurrency} | {r.requests_per_s:.1f} "
                f"| {r.tokens_per_s:.0f} | {share} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} "
                f"| {us(r.gateway_cpu_us)} | {us(r.scheduler_cpu_us)} "
                f"| {r.errors} | {r.load_avg:.2f} |\n")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench gateway`` (``--seconds`` is shared with the scheduler mode)."""
    p.add_argument("--concurrency", default="1,16,64,256",
                   help="gateway: concurrent streams per measurement")
    p.add_argument("--stream-tokens", type=int, default=256,
                   help="gateway: tokens per streamed answer")
    p.add_argument("--no-vllm", action="store_true",
                   help="gateway: skip the vLLM API server rows (no engine boots)")
    p.add_argument("--parsers", default="h11,httptools",
                   help="gateway: uvicorn HTTP parsers to measure the gateway with")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench gateway``."""
    conc = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    rows = run(conc, float(args.seconds or 8.0), args.stream_tokens,
               Path(args.out or "out/gateway"), with_vllm=not args.no_vllm,
               parsers=tuple(x for x in str(args.parsers).split(",") if x.strip()))
    print(markdown(rows))
    return 0


def main() -> None:
    """``python -m kvpush.loadtest.bench_gateway --serve-upstream PORT`` (the upstream)."""
    p = argparse.ArgumentParser()
    p.add_argument("--serve-upstream", type=int, required=True)
    serve_upstream(p.parse_args().serve_upstream)


if __name__ == "__main__":
    main()

