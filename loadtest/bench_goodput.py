"""``kvpush bench goodput``: the highest request rate each system serves within its latency
objectives, the way the P/D literature (DistServe) compares systems on equal hardware.

A system's goodput is the highest Poisson arrival rate at which at least ``attainment``
(90 %) of the requests sent complete with TTFT and TPOT within their objectives. It is
found by doubling the rate from ``start_rps`` until attainment falls short, then bisecting
between the last rate that met it and the first that did not. Every point waits for a quiet
machine first and records the load average; a point taken loaded is measured again once.
With ``--goodput-samples N`` each rate is measured with N arrival samples (seeds) pooled
into one point: with ~20 requests a point's attainment turns on one draw of bursts.
Each point keeps every request's TTFT and TPOT, so ``--render DIR`` can tell what the same
requests attained under other objectives (at the rates measured: the search itself followed
the run's objectives).

The systems compared by default share this machine's cores:
- ``kvpush``: one prefill engine and one decode engine, one core each;
- ``colocated-dp2``: two colocated engines behind the same gateway and scheduler;
- ``colocated-all``: one colocated engine on every core;
- ``nixl-pull-repin``: vLLM's stock pull connector, one core each (best of the stock ones
  in BENCHMARKS.md's serving table).
The workload should make prefill and decode interfere: long prompts and long outputs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush.loadtest.bench_client import (
    RequestResult,
    run_open_loop_apart,
    summarize,
    within_objectives,
    within_slo,
)
from kvpush.loadtest.bench_probes import wait_for_quiet
from kvpush.loadtest.prompts import Workload
from kvpush.loadtest.report import ResultsError, read_results

logger = logging.getLogger(__name__)

GOODPUT_SYSTEMS = ["kvpush", "colocated-dp2", "colocated-all", "nixl-pull-repin"]


@dataclass
class GoodputConfig:
    """What ``kvpush bench goodput`` runs."""

    model: str = "tiny"
    input_len: int = 1536
    output_len: int = 256
    systems: list[str] = field(default_factory=lambda: list(GOODPUT_SYSTEMS))
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    attainment: float = 0.9
    start_rps: float = 1.0
    max_doublings: int = 5
    bisections: int = 2
    seconds: float = 20.0  # of arrivals per point
    min_requests: int = 20
    samples: int = 1  # arrival samples per rate, pooled: one sample is one draw of bursts
    out: Path = Path("out/goodput")
    quiet_wait_s: float = 90.0
    request_timeout_s: float = 120.0
    also: list[tuple[float, float]] = field(default_factory=list)  # objectives also reported


@dataclass
class Point:
    """One rate on one system."""

    rate_rps: float
    sent: int
    met: int  # requests that completed within both objectives
    failed: int
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    loadavg_1m_before: float
    quiet: bool
    # Per request sent, in order: TTFT and TPOT in ms (None: failed, or no second token).
    ttft_ms: list[float | None] = field(default_factory=list)
    tpot_ms: list[float | None] = field(default_factory=list)
    samples: int = 1  # arrival samples pooled into this point

    @property
    def attainment(self) -> float:
        """Share of the requests sent that met both objectives."""
        return self.met / self.sent if self.sent else 0.0


def search(measure: Callable[[float], Point], start_rps: float, attainment: float,
           max_doublings: int, bisections: int) -> tuple[float, bool, list[Point]]:
    """The highest rate found whose point meets ``attainment``, whether a rate above it
    was seen to fall short (False: goodput is at least this, the ladder ended first), and
    every point measured, in order."""
    points: list[Point] = []
    good, bad = 0.0, None
    rate = start_rps
    for _ in range(max_doublings + 1):
        p = measure(rate)
        points.append(p)
        if p.attainment < attainment:
            bad = rate
            break
        good, rate = rate, rate * 2
    if bad is None:
        return good, False, points
    lo, hi = good, bad
    for _ in range(bisections):
        mid = (lo + hi) / 2 if lo > 0 else hi / 2
        p = measure(mid)
        points.append(p)
        if p.attainment >= attainment:
            lo = mid
        else:
            hi = mid
    return lo, True, points


def point_from(results: list[RequestResult], rate: float, cfg: GoodputConfig,
               load: float, quiet: bool) -> Point:
    """A :class:`Point` from one rate's client results."""
    s = summarize(results, cfg.seconds, cfg.slo_ttft_s, cfg.slo_tpot_s)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return Point(rate_rps=round(rate, 3), sent=len(results),
                 met=sum(within_slo(r, cfg.slo_ttft_s, cfg.slo_tpot_s) for r in results),
                 failed=s.failed, ttft_p99_ms=ms(s.ttft_p99), tpot_p99_ms=ms(s.tpot_p99),
                 loadavg_1m_before=load, quiet=quiet,
                 ttft_ms=[_exact_ms(r.ttft) if r.ok else None for r in results],
                 tpot_ms=[_exact_ms(r.tpot) if r.ok else None for r in results])


def _exact_ms(v: float | None) -> float | None:
    # To the microsecond: re-rendered at the run's own objectives, every request counts
    # as it did in the run.
    return None if v is None else round(v * 1000, 3)


def attainment_at(point: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float | None:
    """Share of a recorded point's requests that met these objectives (goodput's criterion,
    as :func:`within_slo`); None for a point recorded without its requests."""
    ttfts, tpots = point.get("ttft_ms") or [], point.get("tpot_ms") or []
    if not ttfts or len(ttfts) != len(tpots) or len(ttfts) != point.get("sent"):
        return None
    met = sum(within_objectives(t, p, ttft_ms, tpot_ms)
              for t, p in zip(ttfts, tpots, strict=True))
    return met / len(ttfts)


def goodput_at(points: list[dict[str, Any]], ttft_ms: float, tpot_ms: float,
               attainment: float) -> tuple[float, bool] | None:
    """The highest rate measured whose requests met ``attainment`` under these objectives,
    and whether a higher rate measured fell short (False: at least this); None when a point
    lacks its requests."""
    shares = [(p["rate_rps"], attainment_at(p, ttft_ms, tpot_ms)) for p in points]
    if not shares or any(a is None for _, a in shares):
        return None
    met = [r for r, a in shares if a is not None and a >= attainment]
    best = max(met, default=0.0)
    return best, any(r > best for r, a in shares if a is not None and a < attainment)


def measure_rate(url: str, cfg: GoodputConfig, rate: float) -> Point:
    """Poisson arrivals at ``rate`` for ``cfg.seconds`` (at least ``min_requests``) on a
    quiet machine, once per arrival sample (``cfg.samples``, each its own seed), pooled;
    a sample is measured once more when its first try started loaded."""
    n = max(cfg.min_requests, round(rate * cfg.seconds))
    taken: list[tuple[list[RequestResult], float, bool]] = []
    for sample in range(cfg.samples):
        for attempt in range(2):
            load, quiet = wait_for_quiet(cfg.quiet_wait_s)
            # Sample 0's seed is a single-sample run's, so their points compare.
            wl = Workload(input_len=cfg.input_len, output_len=cfg.output_len,
                          seed=int(rate * 1000) + attempt + 7919 * sample)
            _, results = run_open_loop_apart(
                base_url=url, model=cfg.model, workload=wl, num_requests=n, rate=rate,
                timeout_s=cfg.request_timeout_s, slo_ttft_s=cfg.slo_ttft_s,
                slo_tpot_s=cfg.slo_tpot_s)
            logger.info("goodput: %.2f req/s, sample %d: %d of %d within the objectives "
                        "(load %.2f)", rate, sample + 1,
                        sum(within_slo(r, cfg.slo_ttft_s, cfg.slo_tpot_s) for r in results),
                        len(results), load)
            if quiet:
                break
        taken.append((results, load, quiet))
    return pooled_point(taken, rate, cfg)


def pooled_point(taken: list[tuple[list[RequestResult], float, bool]], rate: float,
                 cfg: GoodputConfig) -> Point:
    """One :class:`Point` over every sample's requests: attainment over all of them, the
    highest load average seen before a sample, quiet only if every sample was."""
    results = [r for rs, _, _ in taken for r in rs]
    p = point_from(results, rate, cfg, max(load for _, load, _ in taken),
                   all(quiet for _, _, quiet in taken))
    p.samples = len(taken)
    return p


def run_goodput(cfg: GoodputConfig) -> dict[str, Any]:
    """Bring each system up in turn, search its goodput, write ``results.json`` and
    ``results.md``."""
    from kvpush.loadtest.bench import BenchConfig
    from kvpush.loadtest.bench_systems import SYSTEMS, SystemUnavailable, start_system

    bcfg = BenchConfig(models=[cfg.model], out=cfg.out, slo_ttft_s=cfg.slo_ttft_s,
                       slo_tpot_s=cfg.slo_tpot_s, request_timeout_s=cfg.request_timeout_s,
                       quiet_wait_s=cfg.quiet_wait_s)
    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    for name in cfg.systems:
        try:
            running = start_system(SYSTEMS[name], cfg.model, bcfg, cfg.out / name)
        except SystemUnavailable as exc:
            rows.append({"system": name, "skipped": str(exc)})
            continue
        try:
            warm = Workload(input_len=cfg.input_len, output_len=cfg.output_len, seed=1)
            run_open_loop_apart(base_url=running.url, model=cfg.model, workload=warm,
                                num_requests=2, rate=float("inf"),
                                timeout_s=cfg.request_timeout_s)
            goodput, bounded, points = search(
                lambda r, url=running.url: measure_rate(url, cfg, r), cfg.start_rps,
                cfg.attainment, cfg.max_doublings, cfg.bisections)
        finally:
            running.stop()
        rows.append({"system": name, "goodput_rps": round(goodput, 3), "bounded": bounded,
                     "points": [{**asdict(p), "attainment": round(p.attainment, 3)}
                                for p in points]})
        _write(cfg, started, rows)  # after every system: a long run keeps its part
    return _write(cfg, started, rows)


def _write(cfg: GoodputConfig, started: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
           "model": cfg.model, "input_len": cfg.input_len, "output_len": cfg.output_len,
           "slo_ttft_ms": cfg.slo_ttft_s * 1000, "slo_tpot_ms": cfg.slo_tpot_s * 1000,
           "attainment": cfg.attainment, "cpus": len(os.sched_getaffinity(0)),
           "rows": rows, "total_s": round(time.time() - started)}
    (cfg.out / "results.json").write_text(json.dumps(res, indent=1))
    (cfg.out / "results.md").write_text(render(res, cfg.also))
    return res


def render(res: dict[str, Any], also: Sequence[tuple[float, float]] = ()) -> str:
    """The report's markdown: goodput per system and per core, then every point, then what
    the same requests attained under the objectives in ``also`` (TTFT ms, TPOT ms)."""
    cpus = res["cpus"]
    lines = [
        f"Measured {res['when']} on {cpus} CPUs (every system uses all of them): "
        f"{res['model']} {res['input_len']}/{res['output_len']}. Goodput is the highest "
        f"Poisson rate at which {res['attainment']:.0%} of the requests sent complete "
        f"with TTFT <= {res['slo_ttft_ms']:.0f} ms and TPOT <= {res['slo_tpot_ms']:.0f} ms.",
        "", "| system | goodput req/s | per core | vs colocated-dp2 |", "|---|---|---|---|",
    ]
    ref = next((r["goodput_rps"] for r in res["rows"]
                if r["system"] == "colocated-dp2" and "goodput_rps" in r), None)
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['system']} | skipped: {r['skipped']} | | |")
            continue
        g = r["goodput_rps"]
        at_least = "" if r["bounded"] else ">= "
        vs = f"{g / ref:.2f}x" if ref else "-"
        lines.append(f"| {r['system']} | {at_least}{g:g} | {g / cpus:.2f} | {vs} |")
    lines += ["", "Points, in the order measured (rate: requests within both objectives "
              "of those sent; TTFT p99 / TPOT p99; load average before):", ""]
    for r in res["rows"]:
        if "points" not in r:
            continue
        pts = "; ".join(
            f"{p['rate_rps']:g}/s: {p['met']}/{p['sent']}"
            f"{'' if p.get('samples', 1) == 1 else ' in ' + str(p['samples']) + ' samples'}"
            f" ({p['ttft_p99_ms']} / "
            f"{p['tpot_p99_ms']} ms; {p['loadavg_1m_before']}"
            f"{'' if p['quiet'] else ', loaded'})" for p in r["points"])
        lines.append(f"- {r['system']}: {pts}")
    if also:
        lines += ["", *_render_also(res, also)]
    return "\n".join(lines) + "\n"


def _render_also(res: dict[str, Any], also: Sequence[tuple[float, float]]
                 ) -> list[str]:
    heads = [f"{t:g} / {p:g} ms" for t, p in also]
    lines = ["Under other objectives (TTFT / TPOT), from the same requests: goodput among "
             "the rates measured, which the search chose for the run's own objectives "
             "(\">=\": no rate measured above it fell short).", "",
             "| system | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for r in res["rows"]:
        if "points" not in r:
            continue
        cells = []
        for t, p in also:
            g = goodput_at(r["points"], t, p, res["attainment"])
            cells.append("no requests recorded" if g is None
                         else f"{'' if g[1] else '>= '}{g[0]:g}")
        lines.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench goodput`` (``--models``, ``--lengths`` and ``--systems`` are
    shared)."""
    p.add_argument("--goodput-start-rps", type=float, default=1.0,
                   help="goodput: the first rate tried (then doubled)")
    p.add_argument("--goodput-seconds", type=float, default=20.0,
                   help="goodput: seconds of arrivals per point")
    p.add_argument("--goodput-attainment", type=float, default=0.9,
                   help="goodput: share of requests that must meet both objectives")
    p.add_argument("--goodput-ttft-ms", type=float, default=1000.0,
                   help="goodput: the TTFT objective")
    p.add_argument("--goodput-tpot-ms", type=float, default=50.0,
                   help="goodput: the TPOT objective")
    p.add_argument("--goodput-samples", type=int, default=1,
                   help="goodput: arrival samples per rate (each its own seed), pooled")
    p.add_argument("--goodput-also", default=None, metavar="TTFT_MS/TPOT_MS,...",
                   help="goodput: also report what the requests attained under these "
                        "objectives (with --render DIR: of a finished run, no engines)")


def config_from_args(args: argparse.Namespace) -> GoodputConfig:
    """A :class:`GoodputConfig` from parsed flags."""
    isl, osl = (int(x) for x in (args.lengths or "1536/256").split(",")[0].split("/"))
    return GoodputConfig(
        model=(args.models or "tiny").split(",")[0], input_len=isl, output_len=osl,
        systems=args.systems.split(",") if args.systems else list(GOODPUT_SYSTEMS),
        slo_ttft_s=args.goodput_ttft_ms / 1000, slo_tpot_s=args.goodput_tpot_ms / 1000,
        attainment=args.goodput_attainment, start_rps=args.goodput_start_rps,
        seconds=args.goodput_seconds, out=Path(args.out or "out/goodput"),
        samples=max(1, args.goodput_samples),
        quiet_wait_s=90.0 if args.quiet_wait_s is None else args.quiet_wait_s,
        request_timeout_s=args.request_timeout_s)


def parse_also(text: str | None) -> list[tuple[float, float]]:
    """``--goodput-also``'s "TTFT_MS/TPOT_MS,..." as pairs; ValueError when malformed."""
    pairs = []
    for item in (text or "").split(","):
        if item.strip():
            ttft, tpot = (float(x) for x in item.split("/"))
            if ttft <= 0 or tpot <= 0:
                raise ValueError(f"objectives must be positive: {item!r}")
            pairs.append((ttft, tpot))
    return pairs


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench goodput`` (with ``--render DIR``: re-render a finished run)."""
    try:
        also = parse_also(args.goodput_also)
    except ValueError as exc:
        print(f"--goodput-also: {exc} (expected TTFT_MS/TPOT_MS,...)")
        return 2
    if args.render:
        out = Path(args.render)
        try:
            res = read_results(out, ("rows", "cpus", "model"))
            md = render(res, also)
        except ResultsError as exc:
            print(f"--render: {exc}")
            return 2
        except (KeyError, TypeError, ValueError) as exc:
            print(f"--render: {out / 'results.json'}: not a goodput run's results ({exc!r})")
            return 2
        (out / "results.md").write_text(md)
        print((out / "results.md").read_text())
        return 0
    cfg = config_from_args(args)
    cfg.also = also
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_goodput(cfg)
    print((cfg.out / "results.md").read_text())
    print(f"report written to {cfg.out}")
    return 0
