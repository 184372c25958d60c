"""The gateway's engine calls with each HTTP client: wall time and client CPU per call.

Every request costs the gateway one JSON POST (prefill's one-token answer) and one streamed
answer (decode's SSE), all on the event loop that also admits and relays every other
request, so the client library's CPU per call is on every request's time to first token.
This measures the two candidates on exactly those calls, side by side in one run, against
one synthetic upstream in a process of its own (``bench_gateway``'s, httptools like vLLM's
server): ``aiohttp`` through the gateway's own code (``services/gateway/engines.py``) and
``httpx`` spelled as the gateway called it before. Rounds alternate between the clients, so
a change of machine load hits both. Asserts nothing.

    kvpush bench http-clients --calls 500 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.loadtest.bench_gateway import stop_procs, wait_http
from kvpush.services.local.ports import free_port

Call = Callable[[], Awaitable[None]]


@dataclass
class ClientRow:
    """One client on one call shape, over every round."""

    client: str
    call: str
    calls: int
    wall_us: float
    """Median over rounds of the mean wall time per call."""
    cpu_us: float
    """Median over rounds of this process's CPU time per call."""
    load_avg: float


def _body(stream: bool, tokens: int) -> dict[str, Any]:
    # The shape of an engine leg: token ids and kv_transfer_params, as the gateway sends.
    return {"model": "tiny", "prompt": list(range(512)), "max_tokens": tokens,
            "stream": stream, "kv_transfer_params": {"kvpush": "prefill",
                                                     "request_id": "cmpl-" + "0" * 32}}


async def _aiohttp_calls(url: str, tokens: int) -> tuple[dict[str, Call], Callable[[], Any]]:
    from kvpush.services.gateway.engines import EngineClient, open_stream, post_json, sse_events

    http = EngineClient()
    headers = {"X-Request-Id": "bench"}

    async def post() -> None:
        await post_json(http, "prefill", "e", f"{url}/v1/completions", _body(False, 1),
                        headers)

    async def stream() -> None:
        resp = await open_stream(http, "e", f"{url}/v1/completions", _body(True, tokens),
                                 headers)
        try:
            async for _ in sse_events(resp, "e"):
                pass
        finally:
            resp.close()

    return {"post": post, "stream": stream}, http.close


async def _httpx_calls(url: str, tokens: int) -> tuple[dict[str, Call], Callable[[], Any]]:
    import httpx

    http = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=30.0),
        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
    headers = {"X-Request-Id": "bench"}

    async def post() -> None:
        resp = await http.post(f"{url}/v1/completions", json=_body(False, 1), headers=headers)
        resp.raise_for_status()
        resp.json()

    async def stream() -> None:
        req = http.build_request("POST", f"{url}/v1/completions", json=_body(True, tokens),
                                 headers=headers)
        resp = await http.send(req, stream=True)
        try:
            resp.raise_for_status()
            buf = b""
            async for chunk in resp.aiter_raw():
                buf += chunk
                while (cut := buf.find(b"\n\n")) >= 0:
                    buf = buf[cut + 2:]
        finally:
            await resp.aclose()

    return {"post": post, "stream": stream}, http.aclose


async def _measure(make: Callable[[str, int], Awaitable[tuple[dict[str, Call], Any]]],
                   url: str, tokens: int, calls: int) -> dict[str, tuple[float, float]]:
    fns, close = await make(url, tokens)
    try:
        out = {}
        for name, fn in fns.items():
            for _ in range(20):
                await fn()  # warm: connections pooled, code paths imported
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                await fn()
            out[name] = ((time.perf_counter() - wall) / calls * 1e6,
                         (time.process_time() - cpu) / calls * 1e6)
        return out
    finally:
        await close()


def run(calls: int, rounds: int, tokens: int, out: Path) -> list[ClientRow]:
    """Start the upstream, measure both clients ``rounds`` times, alternating."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with (out / "upstream.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpush.loadtest.bench_gateway", "--serve-upstream",
             str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    loads: list[float] = []
    try:
        wait_http(url)
        makers = {"aiohttp": _aiohttp_calls, "httpx": _httpx_calls}
        for r in range(rounds):
            order = list(makers) if r % 2 == 0 else list(reversed(makers))
            for client in order:
                loads.append(os.getloadavg()[0])
                res = asyncio.run(_measure(makers[client], url, tokens, calls))
                for call, v in res.items():
                    samples.setdefault((client, call), []).append(v)
    finally:
        stop_procs([proc])
    load = max(loads) if loads else 0.0
    return [ClientRow(client, call, calls * len(v),
                      statistics.median(w for w, _ in v), statistics.median(c for _, c in v),
                      load)
            for (client, call), v in sorted(samples.items())]


def markdown(rows: list[ClientRow]) -> str:
    """Per call shape: each client's wall and CPU per call, and httpx's over aiohttp's."""
    by = {(r.client, r.call): r for r in rows}
    out = ("| call | client | calls | wall us / call | client CPU us / call "
           "| CPU vs aiohttp | load avg (max) |\n|---|---|---|---|---|---|---|\n")
    for r in rows:
        base = by.get(("aiohttp", r.call))
        ratio = f"{r.cpu_us / base.cpu_us:.2f}x" if base and base.cpu_us else "—"
        out += (f"| {r.call} | {r.client} | {r.calls} | {r.wall_us:.0f} | {r.cpu_us:.0f} "
                f"| {ratio} | {r.load_avg:.2f} |\n")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench http-clients``."""
    p.add_argument("--calls", type=int, default=500, help="http-clients: calls per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="http-clients: rounds per client, alternating")
    p.add_argument("--client-stream-tokens", type=int, default=16,
                   help="http-clients: tokens per streamed answer")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench http-clients``."""
    rows = run(args.calls, args.rounds, args.client_stream_tokens,
               Path(args.out or "out/http-clients"))
    print(markdown(rows))
    return 0
