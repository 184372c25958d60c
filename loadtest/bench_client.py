"""Open-loop benchmark client: Poisson arrivals of streamed completions, as vllm bench serve."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvpush.common.runtime import watch_loop_lag
from kvpush.loadtest.bench_phases import new_traceparent
from kvpush.loadtest.prompts import Workload, completion_body
from kvpush.loadtest.sse_metrics import StreamTimings, consume_timed_sse


@dataclass
class RequestResult:
    """One request's outcome as the client saw it."""

    index: int
    ok: bool
    error: str | None
    ttft: float | None
    tpot: float | None
    e2e: float | None
    itls: list[float]
    output_tokens: int
    text: str
    trace_id: str | None = None  # the trace the client opened for it (phase breakdown)
    sent_unix_ns: int = 0
    status: int | None = None  # the HTTP status (None: no answer)


@dataclass
class RunSummary:
    """Aggregates of one (system, workload, rate) point, seconds unless named otherwise."""

    requests: int
    completed: int
    failed: int
    duration_s: float
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_mean: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    itl_mean: float | None
    itl_p99: float | None
    e2e_mean: float | None
    output_tok_per_s: float
    request_per_s: float
    goodput_req_per_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    errors: list[str] = field(default_factory=list)
    client_cpu_s: float = 0.0  # CPU the load generator's process took for the point
    # How late the generator's own timers fired (p99): a late client counts its own delay
    # in every TTFT it measures, shed answers included.
    client_lag_p99_s: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def within_objectives(ttft: float | None, tpot: float | None, slo_ttft: float,
                      slo_tpot: float) -> bool:
    """Goodput's criterion on one completed request's TTFT and TPOT (any one unit for all
    four): a first token within its objective, and no TPOT (one token) or one within its."""
    return ttft is not None and ttft <= slo_ttft and (tpot or 0.0) <= slo_tpot


def within_slo(r: RequestResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """The request completed with its TTFT and TPOT within the objectives (goodput's
    criterion)."""
    return r.ok and within_objectives(r.ttft, r.tpot, slo_ttft_s, slo_tpot_s)


def summarize(
    results: list[RequestResult], duration_s: float, slo_ttft_s: float, slo_tpot_s: float
) -> RunSummary:
    """Fold per-request results into the benchmark's figures; goodput counts SLO-meeting ones."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [g for r in ok for g in r.itls]
    good = [r for r in ok if within_slo(r, slo_ttft_s, slo_tpot_s)]
    return RunSummary(
        requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration_s,
        ttft_mean=_mean(ttfts), ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        tpot_mean=_mean(tpots), tpot_p50=percentile(tpots, 50), tpot_p99=percentile(tpots, 99),
        itl_mean=_mean(itls), itl_p99=percentile(itls, 99),
        e2e_mean=_mean([r.e2e for r in ok if r.e2e is not None]),
        output_tok_per_s=sum(r.output_tokens for r in ok) / duration_s if duration_s else 0.0,
        request_per_s=len(ok) / duration_s if duration_s else 0.0,
        goodput_req_per_s=len(good) / duration_s if duration_s else 0.0,
        slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
        errors=sorted({r.error for r in results if r.error})[:10],
    )


async def _one(
    client: httpx.AsyncClient, url: str, body: dict, index: int, headers: dict[str, str],
    trace: bool = False,
) -> RequestResult:
    # Every request carries a traceparent, sampled only when traced: every system gets the
    # same headers.
    tp, trace_id = new_traceparent(sampled=trace)
    headers = {**headers, "traceparent": tp}
    if not trace:
        trace_id = None
    sent_unix_ns = time.time_ns()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                # e2e: how long the refusal took (a shed request's answer time).
                return RequestResult(index, False, f"HTTP {resp.status_code}: {text}",
                                     None, None, time.perf_counter() - start, [], 0, "",
                                     trace_id, sent_unix_ns, resp.status_code)
            lines = [line async for line in _timed_lines(resp)]
    except httpx.HTTPError as exc:
        return RequestResult(index, False, f"{type(exc).__name__}: {exc}",
                             None, None, None, [], 0, "", trace_id, sent_unix_ns)
    t: StreamTimings = consume_timed_sse(lines, start)
    ok = t.error is None and t.first_token is not None
    return RequestResult(index, ok, t.error or (None if ok else "no content token"),
                         t.ttft, t.tpot, t.e2e, t.itls, t.output_tokens, t.text,
                         trace_id, sent_unix_ns, 200)


async def _timed_lines(resp: httpx.Response) -> AsyncIterator[tuple[float, str]]:
    async for line in resp.aiter_lines():
        yield (time.perf_counter(), line)


async def run_open_loop(
    base_url: str,
    model: str,
    workload: Workload,
    num_requests: int,
    rate: float,
    *,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    slo_ttft_s: float = 1.0,
    slo_tpot_s: float = 0.1,
    trace: bool = False,
) -> tuple[RunSummary, list[RequestResult]]:
    """Send ``num_requests`` at Poisson rate ``rate`` (inf: all at once) and summarise;
    with ``trace`` each request opens a sampled trace of its own."""
    rng = random.Random(workload.seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    lags: list[float] = []
    lag_watch = asyncio.create_task(
        watch_loop_lag(lambda lag: lags.append(max(0.0, lag)), period_s=0.01))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        url = base_url.rstrip("/") + "/v1/completions"
        tasks = []
        t0 = time.perf_counter()
        for i in range(num_requests):
            body = completion_body(model, workload, i)
            tasks.append(asyncio.create_task(_one(client, url, body, i, headers, trace)))
            if rate != float("inf") and i + 1 < num_requests:
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    lag_watch.cancel()
    summary = summarize(results, duration, slo_ttft_s, slo_tpot_s)
    summary.client_lag_p99_s = percentile(lags, 99)
    return summary, results


def summary_dict(summary: RunSummary) -> dict:
    """JSON-ready form of a summary."""
    return asdict(summary)


def _open_loop_in_child(kwargs: dict) -> tuple[RunSummary, list[RequestResult]]:
    # The generator shares the machine with the system under test: what it took is
    # reported beside what the system served.
    cpu0 = time.process_time()
    summary, results = asyncio.run(run_open_loop(**kwargs))
    summary.client_cpu_s = round(time.process_time() - cpu0, 2)
    return summary, results


_pool: Any = None


def run_open_loop_apart(**kwargs: Any) -> tuple[RunSummary, list[RequestResult]]:
    """:func:`run_open_loop` in a client process of its own (kept for the next call).

    A front that runs in the benchmark's process (``kvpush up``'s gateway, the stock proxy)
    would otherwise share the GIL with the client: a thread waiting for it waits up to the
    interpreter's switch interval (5 ms), which would be charged to the system under test.
    """
    global _pool
    if _pool is None:
        import concurrent.futures
        import multiprocessing

        _pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    return _pool.submit(_open_loop_in_child, kwargs).result()
