"""``kvpush bench overload``: the push stack past its capacity, with and without shedding.

The stack's capacity is measured first: the requests/s a closed loop of clients gets
through it, enough clients to fill the engines' batches. Then Poisson arrivals at 1x, 2x
and 4x that rate, for the same number of seconds each, on two stacks side by side: the
gateway shedding past its TTFT and TPOT objectives (``gateway_shed_ttft_s``,
``gateway_shed_tpot_s``), and the same gateway queueing everything. Each point reports the
requests served and shed, the latency of each (a shed request's is the time to its 429),
goodput (requests per second served within the TTFT and TPOT objectives) and what the
stack still held afterwards (reservations, requests running on an engine, KV blocks in
use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvpush.loadtest.bench_client import (
    RequestResult,
    percentile,
    run_open_loop_apart,
    summarize,
)
from kvpush.loadtest.bench_probes import wait_for_quiet
from kvpush.loadtest.prompts import Workload, completion_body

logger = logging.getLogger(__name__)

SHED, SERVED, FAILED = "shed", "served", "failed"


@dataclass
class OverloadConfig:
    """What ``kvpush bench overload`` runs."""

    model: str = "tiny"
    input_len: int = 512
    output_len: int = 64
    factors: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    seconds: float = 20.0
    capacity_rps: float | None = None  # measured when None
    objective_s: float = 2.0  # the gateway's TTFT objective (gateway_shed_ttft_s)
    slo_tpot_s: float = 0.1
    contrast: bool = True  # the same points with shedding off
    out: Path = Path("out/overload")
    quiet_wait_s: float = 90.0
    request_timeout_s: float = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench overload`` (``--models``/``--lengths`` are shared)."""
    p.add_argument("--overload-factors", default="1,2,4",
                   help="overload: offered rates as multiples of the measured capacity")
    p.add_argument("--overload-seconds", type=float, default=20.0,
                   help="overload: seconds of arrivals per point")
    p.add_argument("--capacity-rps", type=float, default=None,
                   help="overload: the stack's capacity in requests/s (measured if unset)")
    p.add_argument("--shed-ttft-ms", type=float, default=2000.0,
                   help="overload: the gateway's TTFT objective (KVPUSH_GATEWAY_SHED_TTFT_S)")
    p.add_argument("--no-contrast", action="store_true",
                   help="overload: skip the same points with shedding off")


def config_from_args(args: argparse.Namespace) -> OverloadConfig:
    """An :class:`OverloadConfig` from parsed flags."""
    model = (args.models or "tiny").split(",")[0]
    isl, osl = (int(x) for x in (args.lengths or "512/64").split(",")[0].split("/"))
    return OverloadConfig(
        model=model, input_len=isl, output_len=osl,
        factors=[float(x) for x in args.overload_factors.split(",")],
        seconds=args.overload_seconds, capacity_rps=args.capacity_rps,
        objective_s=args.shed_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000,
        contrast=not args.no_contrast, out=Path(args.out or "out/overload"),
        quiet_wait_s=90.0 if args.quiet_wait_s is None else args.quiet_wait_s,
        request_timeout_s=args.request_timeout_s)


def classify(r: RequestResult) -> str:
    """served (a complete answer), shed (HTTP 429/503 at admission) or failed."""
    if r.ok:
        return SERVED
    if r.status in (429, 503):
        return SHED
    return FAILED


def point_figures(results: list[RequestResult], duration_s: float, objective_s: float,
                  slo_tpot_s: float) -> dict[str, Any]:
    """One point's counts, latencies and goodput."""
    kinds = [classify(r) for r in results]
    shed_s = [r.e2e for r, k in zip(results, kinds, strict=True)
              if k == SHED and r.e2e is not None]
    # Served is what the client summary counts as completed, goodput included.
    s = summarize(results, duration_s, objective_s, slo_tpot_s)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "sent": len(results), "served": kinds.count(SERVED), "shed": kinds.count(SHED),
        "failed": kinds.count(FAILED),
        "errors": sorted({r.error for r, k in zip(results, kinds, strict=True)
                          if r.error and k == FAILED})[:5],
        "ttft_p50_ms": ms(s.ttft_p50), "ttft_p99_ms": ms(s.ttft_p99),
        "tpot_p99_ms": ms(s.tpot_p99),
        "shed_p50_ms": ms(percentile(shed_s, 50)), "shed_p99_ms": ms(percentile(shed_s, 99)),
        "goodput_rps": round(s.goodput_req_per_s, 2),
        "duration_s": round(duration_s, 1),
    }


async def _closed_loop(url: str, model: str, workload: Workload, clients: int,
                       seconds: float) -> int:
    """Requests completed by ``clients`` sequential clients in ``seconds``."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def client(c: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < stop_at:
            body = completion_body(model, workload, 100_000 + i, stream=False)
            r = await c.post(f"{url}/v1/completions", json=body)
            if r.status_code == 200:
                done += 1
            i += clients

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*[client(c, k) for k in range(clients)])
    return done


CAPACITY_CLIENTS = 32


def measure_capacity(url: str, cfg: OverloadConfig, clients: int = CAPACITY_CLIENTS,
                     seconds: float = 20.0) -> float:
    """Requests/s the stack completes with ``clients`` always waiting on it: enough to fill
    the engines' batches (a few clients leave batching capacity unused), too few to keep a
    backlog past the objective."""
    wl = Workload(input_len=cfg.input_len, output_len=cfg.output_len, seed=7)
    t0 = time.monotonic()
    done = asyncio.run(_closed_loop(url, cfg.model, wl, clients, seconds))
    return done / (time.monotonic() - t0)


def leftovers(stack: Any, timeout_s: float = 150.0) -> list[str]:
    """What the stack still holds once every answer is in (waits for it to settle)."""
    import redis

    from kvpush.common.reservations import live_reservations
    from kvpush.services.engine.status import metric_sum, scrape

    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            held = []
            if resv := live_reservations(r):
                held.append(f"{len(resv)} reservations")
            for e in stack.engines:
                m = scrape(e.url)
                if (n := metric_sum(m, "vllm:num_requests_running")) > 0:
                    held.append(f"{e.engine_id}: {n:.0f} running")
                if (u := metric_sum(m, "vllm:kv_cache_usage_perc")) > 0:
                    held.append(f"{e.engine_id}: KV {u:.1%} in use")
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(1.0)
    finally:
        r.close()


def run_points(url: str, stack: Any, cfg: OverloadConfig, capacity: float, shedding: bool
               ) -> list[dict[str, Any]]:
    """Every factor on one running stack."""
    rows = []
    for f in cfg.factors:
        rate = f * capacity
        n = max(1, round(rate * cfg.seconds))
        load_before, quiet = wait_for_quiet(cfg.quiet_wait_s)
        logger.info("overload %s shedding: %gx = %.1f req/s, %d requests",
                    "with" if shedding else "without", f, rate, n)
        wl = Workload(input_len=cfg.input_len, output_len=cfg.output_len, seed=int(f * 100))
        t0 = time.monotonic()
        summary, results = run_open_loop_apart(
            base_url=url, model=cfg.model, workload=wl, num_requests=n, rate=rate,
            timeout_s=cfg.request_timeout_s, slo_ttft_s=cfg.objective_s,
            slo_tpot_s=cfg.slo_tpot_s)
        # Goodput over the arrival window: what was asked for, not how long the tail took.
        row = point_figures(results, max(cfg.seconds, 1e-9), cfg.objective_s, cfg.slo_tpot_s)
        row.update(factor=f, rate_rps=round(rate, 2), shedding=shedding,
                   served_rps=round(row["served"] / max(cfg.seconds, 1e-9), 2),
                   of_capacity=round(row["served"] / max(cfg.seconds, 1e-9) / capacity, 3),
                   client_cpu=round(summary.client_cpu_s / max(time.monotonic() - t0, 1e-9),
                                    2),
                   client_lag_p99_ms=(None if summary.client_lag_p99_s is None
                                      else round(summary.client_lag_p99_s * 1000, 1)),
                   headroom=_headroom(url) if shedding else None,
                   took_s=round(time.monotonic() - t0, 1), loadavg_1m_before=load_before,
                   quiet=quiet, leaked=leftovers(stack))
        rows.append(row)
    return rows


def _headroom(url: str) -> float | None:
    """The shedding gateway's headroom after the point (learned, or as set)."""
    from kvpush.services.engine.status import metric_sum, scrape

    samples = scrape(url)
    if not any(s.name == "kvpush_gateway_shed_headroom" for s in samples):
        return None
    return round(metric_sum(samples, "kvpush_gateway_shed_headroom"), 2)


def run_overload(cfg: OverloadConfig) -> dict[str, Any]:
    """Boot the stack(s), measure, write ``results.json`` and ``results.md``."""
    from kvpush.loadtest.bench import BenchConfig
    from kvpush.loadtest.bench_systems import SYSTEMS, start_system

    bcfg = BenchConfig(models=[cfg.model], out=cfg.out, slo_ttft_s=cfg.objective_s,
                       slo_tpot_s=cfg.slo_tpot_s, request_timeout_s=cfg.request_timeout_s,
                       quiet_wait_s=cfg.quiet_wait_s)
    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    capacity = cfg.capacity_rps
    rows: list[dict[str, Any]] = []
    modes = [True, False] if cfg.contrast else [True]
    for shedding in modes:
        gateway = ((("gateway_shed_ttft_s", cfg.objective_s),
                    ("gateway_shed_tpot_s", cfg.slo_tpot_s)) if shedding
                   else (("gateway_shed_ttft_s", 0.0),))
        sysdef = replace(SYSTEMS["kvpush"], name="kvpush" if shedding else "kvpush-no-shed",
                         gateway=gateway)
        running = start_system(sysdef, cfg.model, bcfg, cfg.out / sysdef.name)
        try:
            wl = Workload(input_len=cfg.input_len, output_len=cfg.output_len, seed=1)
            asyncio.run(_closed_loop(running.url, cfg.model, wl, 1, 5.0))  # warm-up
            if capacity is None:
                wait_for_quiet(cfg.quiet_wait_s)
                capacity = measure_capacity(running.url, cfg)
                logger.info("capacity: %.2f requests/s", capacity)
            rows += run_points(running.url, running.stack, cfg, capacity, shedding)
        finally:
            running.stop()
    assert capacity is not None
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
           "model": cfg.model, "input_len": cfg.input_len, "output_len": cfg.output_len,
           "capacity_rps": round(capacity, 2), "objective_ms": cfg.objective_s * 1000,
           "slo_tpot_ms": cfg.slo_tpot_s * 1000, "seconds": cfg.seconds,
           "cpus": len(os.sched_getaffinity(0)), "rows": rows,
           "total_s": round(time.time() - started)}
    (cfg.out / "results.json").write_text(json.dumps(res, indent=1))
    (cfg.out / "results.md").write_text(render(res))
    return res


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def render(res: dict[str, Any]) -> str:
    """The report's markdown: one row per (shedding, factor)."""
    lines = [
        f"Measured {res['when']} on {res['cpus']} CPUs: {res['model']} "
        f"{res['input_len']}/{res['output_len']}, capacity {res['capacity_rps']} requests/s "
        f"(a closed loop of {CAPACITY_CLIENTS} clients), {res['seconds']:.0f} s of Poisson "
        f"arrivals per point. TTFT objective {res['objective_ms']:.0f} ms, TPOT objective "
        f"{res['slo_tpot_ms']:.0f} ms (the shedding gateway's too); goodput counts the "
        "requests served within both, per second of arrivals. Served req/s is every "
        "complete answer per second of arrivals, and 'of capacity' that over the "
        "capacity measured in this run; headroom is the shedding gateway's after the "
        "point, learned or as set; client CPU is the load generator's share of one "
        "core while the point ran (it shares the machine), and client lag how late its "
        "own timers fired (p99), a delay it counts in every latency it measures.", "",
        "| shedding | load | offered req/s | sent | served | served req/s | of capacity "
        "| shed | failed | TTFT p50 / p99 (served) | TPOT p99 | shed answered p50 / p99 "
        "| goodput req/s | of 1x | headroom | left held | client CPU | client lag p99 "
        "| load avg before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[bool, float] = {}
    for r in res["rows"]:
        if r["factor"] == 1.0:
            base[r["shedding"]] = r["goodput_rps"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    for r in res["rows"]:
        b = base.get(r["shedding"])
        share = f"{r['goodput_rps'] / b:.0%}" if b else "-"
        lines.append(
            f"| {'on' if r['shedding'] else 'off'} | {r['factor']:g}x | {r['rate_rps']} | "
            f"{r['sent']} | {r['served']} | {r.get('served_rps', '-')} | "
            f"{_share(r.get('of_capacity'))} | {r['shed']} | {r['failed']} | "
            f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])} | {ms(r['tpot_p99_ms'])} | "
            f"{ms(r['shed_p50_ms'])} / {ms(r['shed_p99_ms'])} | {r['goodput_rps']} | "
            f"{share} | {r.get('headroom') or '-'} | {'; '.join(r['leaked']) or 'nothing'} | "
            f"{_share(r.get('client_cpu'))} | {ms(r.get('client_lag_p99_ms'))} | "
            f"{r['loadavg_1m_before']}"
            f"{'' if r['quiet'] else ' (loaded)'} |")
    errors = sorted({e for r in res["rows"] for e in r["errors"]})
    if errors:
        lines += ["", "Failures other than shedding:", *[f"- `{e}`" for e in errors]]
    return "\n".join(lines) + "\n"


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench overload``."""
    cfg = config_from_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_overload(cfg)
    print((cfg.out / "results.md").read_text())
    print(f"report written to {cfg.out}")
    return 0
