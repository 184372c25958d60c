"""``kvpush bench``: the serving benchmark, every system on the same model and prompts, one run.

Systems, started one after another (the machine may have only two cores), prefill and
decode pinned to different cores:

* ``colocated`` (a): one engine, no connector; the reference for outputs and latency;
* ``nixl-pull`` (b): vLLM's ``NixlConnector`` behind ``services.pd_proxy`` in its sequential
  (toy proxy) mode, vLLM's own thread pinning left as it is ("stock");
* ``nixl-pull-repin`` (b'): the same with every engine thread re-pinned onto its core;
* ``nixl-push`` (c) / ``nixl-push-repin`` (c'): vLLM's ``NixlPushConnector`` behind the
  proxy's concurrent mode;
* ``kvpush`` (d): the full push stack (Redis, scheduler, gateway, engines with
  ``--connector kvpush``) as ``services.stack.LocalStack`` brings it up; ``kvpush-1p2d``
  with two decode engines sharing the decode core; ``kvpush-phases`` with every request
  traced, its TTFT cut into phases (``loadtest.bench_phases``); ``kvpush-no-lead`` (not
  in the default set) with every stream's first token from decode, not prefill's answer;
  ``kvpush-no-early`` (not in the default set) with every prompt sent to prefill only once
  its assignment is in;
* what a user could run instead of P/D: ``colocated-all`` (one engine on every core) and
  ``colocated-dp2`` (two colocated engines, one per core, behind kvpush's gateway).

The systems themselves are defined in ``loadtest.bench_systems``.

Per (model, input/output lengths, rate) point it runs an open-loop Poisson client
(``loadtest.bench_client``) and records TTFT/TPOT/ITL/throughput/goodput, the KV bytes moved
and the exposed transfer time (NIXL metrics on the stock engines, the connector's per-push
records for kvpush), and whether the first request's greedy output equals the colocated
engine's. Reports: JSON, markdown with ratios against (b) and (c), PNG plots
(``loadtest.report``). Prompts differ per point (no prefix-cache hits between points) and are
the same for every system on a point.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.loadtest.bench_phases import phases_markdown
from kvpush.loadtest.bench_probes import (
    greedy,
    kvpush_records,
    kvpush_transfer_figures,
    scrape_counters,
    settle_counters,
    wait_for_quiet,
)
from kvpush.loadtest.bench_systems import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    BenchError,
    RunningSystem,
    SystemDef,
    SystemUnavailable,
    default_cpus,
    start_system,
)
from kvpush.loadtest.prompts import Workload, completion_body
from kvpush.loadtest.report import SYSTEM_LABELS, BenchPoint, write_report

if TYPE_CHECKING:
    from kvpush.loadtest.bench_client import RequestResult

# httpx and the client load lazily: `kvpush --help` builds this module's parser.

logger = logging.getLogger(__name__)




@dataclass
class BenchConfig:
    """One ``kvpush bench`` run."""

    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    models: list[str] = field(default_factory=lambda: ["tiny", "kv-heavy"])
    lengths: list[tuple[int, int]] = field(default_factory=lambda: [(512, 64), (512, 128)])
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    num_prompts: int = 40
    warmup: int = 2
    seed: int = 0
    out: Path = Path("out/bench")
    slo_ttft_s: float = 0.5
    slo_tpot_s: float = 0.05
    request_timeout_s: float = 120.0
    kv_cache_gib: float | None = None  # None: DEFAULT_KV_GIB per model
    block_size: int | None = None  # None: vLLM's platform default (128 on CPU)
    prefill_cpus: str | None = None  # None: first allowed core
    decode_cpus: str | None = None  # None: last allowed core
    colocated_cpus: str | None = None  # None: the decode cores
    guard_tokens: int = 32
    quiet_wait_s: float = 90.0  # longest wait for a quiet machine before each point


@dataclass
class Skipped:
    """A (system, model) that was not measured, and why."""

    system: str
    model: str
    reason: str


@dataclass
class BenchResult:
    """Everything one run measured."""

    points: list[BenchPoint] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    guard: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> system -> check
    paths: list[Path] = field(default_factory=list)


# -- helpers -------------------------------------------------------------------------------

def parse_lengths(text: str) -> list[tuple[int, int]]:
    """``512/64,512/128`` -> [(512, 64), (512, 128)]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        isl, sep, osl = part.partition("/")
        if not sep or not isl.isdigit() or not osl.isdigit():
            raise BenchError(f"length {part!r} is not ISL/OSL")
        out.append((int(isl), int(osl)))
    return out


def parse_list(text: str) -> list[str]:
    """Comma-separated names."""
    return [p.strip() for p in text.split(",") if p.strip()]


def point_seed(seed: int, model: str, isl: int, osl: int, rate: float) -> int:
    """Prompt seed of one point: same for every system, different between points."""
    return zlib.crc32(f"{seed}:{model}:{isl}:{osl}:{rate:g}".encode())


# -- one system ----------------------------------------------------------------------------

def warm_up(system: RunningSystem, cfg: BenchConfig, isl: int,
            stop_on_first_error: bool = False) -> list[str]:
    """A few sequential requests on prompts no point uses; returns their errors."""
    import httpx

    errors = []
    w = Workload(input_len=isl, output_len=8, seed=point_seed(cfg.seed, "warmup", isl, 0, 0))
    for i in range(max(1, cfg.warmup)):
        body = completion_body(system.model, w, i, stream=False)
        try:
            resp = httpx.post(f"{system.url}/v1/completions", json=body,
                              timeout=min(cfg.request_timeout_s, 60.0))
            if resp.status_code != 200:
                errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc!s}"[:300])
        if stop_on_first_error and errors:
            break
    return errors


def guard_prompt(cfg: BenchConfig, model: str, isl: int) -> list[int]:
    """The isolated correctness-guard prompt of ``model`` (used by no point)."""
    from kvpush.loadtest.prompts import prompt_ids

    return prompt_ids(Workload(input_len=isl, seed=point_seed(cfg.seed, "guard", isl, 0, 0)),
                      0)


# -- the run ---------------------------------------------------------------------------------

def _order(systems: list[str]) -> list[str]:
    # Colocated first: its outputs are the reference every other system is checked against.
    return sorted(systems, key=lambda s: (s != "colocated", list(SYSTEMS).index(s)))


def measure_point(system: RunningSystem, cfg: BenchConfig, isl: int, osl: int, rate: float,
                  stats_offset: int) -> tuple[BenchPoint, list[RequestResult], int]:
    """Run one point on a running system; returns the point, its results, the new offset."""
    from kvpush.loadtest.bench_client import run_open_loop_apart, summary_dict

    workload = Workload(input_len=isl, output_len=osl,
                        seed=point_seed(cfg.seed, system.model, isl, osl, rate))
    # Records of the warm-up (or the last point's stragglers) are not this point's.
    _, stats_offset = kvpush_records(system.stats_file, stats_offset)
    load_before, quiet = wait_for_quiet(cfg.quiet_wait_s)
    before = scrape_counters(system.engine_urls)
    logger.info("bench %s %s %s/%s rate %g: %s prompts", system.sysdef.name, system.model,
                isl, osl, rate, cfg.num_prompts)
    traced = system.receiver is not None
    if traced:
        system.receiver.clear()
    summary, results = run_open_loop_apart(
        base_url=system.url, model=system.model, workload=workload,
        num_requests=cfg.num_prompts, rate=rate, timeout_s=cfg.request_timeout_s,
        slo_ttft_s=cfg.slo_ttft_s, slo_tpot_s=cfg.slo_tpot_s, trace=traced,
    )
    after = settle_counters(system.engine_urls, before)
    delta = {k: after[k] - before[k] for k in after}
    records, stats_offset = kvpush_records(system.stats_file, stats_offset)
    # The box is shared: the load around each point says how noisy it was.
    extra: dict[str, Any] = {"counters": delta, "loadavg_1m_before": load_before,
                             "loadavg_1m_after": round(os.getloadavg()[0], 2), "quiet": quiet}
    kv_bytes: int | None = None
    exposed: float | None = None
    phases: dict[str, float] = {}
    if traced:
        from kvpush.loadtest.bench_phases import collect

        extra["phases"] = collect(system.receiver, results)
        phases = {k: v["mean"] / 1000 for k, v in extra["phases"].get("phases", {}).items()}
    if system.sysdef.connector in ("nixl-pull", "nixl-push"):
        kv_bytes = int(delta["bytes"])
        if delta["xfers"] > 0:
            # The stock connectors move the whole prompt after prefill ends, and decode
            # cannot start before it lands: all of the transfer time is exposed.
            exposed = delta["xfer_time_s"] / delta["xfers"]
    elif system.sysdef.connector == "kvpush" and not system.sysdef.data_parallel:
        # (Colocated engines behind the gateway transfer nothing.)
        figs = kvpush_transfer_figures(records)
        extra["kvpush"] = figs
        kv_bytes = figs["bytes"] if records else None
        exposed = figs["exposed_mean_s"]
    point = BenchPoint(
        system=system.sysdef.name, model=system.model, input_len=isl, output_len=osl,
        rate=rate, summary=summary_dict(summary),
        ttfts=[r.ttft for r in results if r.ok and r.ttft is not None],
        tpots=[r.tpot for r in results if r.ok and r.tpot is not None],
        kv_bytes=kv_bytes, exposed_transfer_s=exposed, phases=phases, extra=extra,
    )
    logger.info("bench %s %s %s/%s rate %g: %s/%s ok, TTFT mean %s, TPOT mean %s",
                system.sysdef.name, system.model, isl, osl, rate, summary.completed,
                summary.requests, summary.ttft_mean, summary.tpot_mean)
    return point, results, stats_offset


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Run every system on every point and write the reports into ``cfg.out``."""
    import httpx

    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    result = BenchResult()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    # First output text per (model, isl, osl, rate) and the guard text per model, of (a).
    reference_first: dict[tuple, str] = {}
    for model in cfg.models:
        guards = result.guard.setdefault(model, {})
        reference_guard: str | None = None
        gprompt = guard_prompt(cfg, model, cfg.lengths[0][0])
        for name in _order(cfg.systems):
            sysdef = SYSTEMS[name]
            t0 = time.monotonic()
            try:
                system = _start_with_retry(sysdef, model, cfg)
            except SystemUnavailable as exc:
                logger.warning("bench: %s on %s not available: %s", name, model, exc)
                result.skipped.append(Skipped(name, model, f"not available: {exc}"))
                continue
            except Exception as exc:  # an engine that fails to boot is a result too
                logger.exception("bench: %s on %s failed to start", name, model)
                result.skipped.append(Skipped(name, model, f"failed to start: {exc}"))
                continue
            boot_s = time.monotonic() - t0
            try:
                # One hung request is enough to tell that the push path does not serve.
                warm_errors = warm_up(system, cfg, cfg.lengths[0][0],
                                      stop_on_first_error=sysdef.connector == "kvpush")
                if sysdef.connector == "kvpush" and warm_errors:
                    # The push path is up but does not serve: report it, measure nothing.
                    # (Stock systems are measured even then: their failures are the result.)
                    reason = f"not available: every warm-up request failed ({warm_errors[0]})"
                    logger.warning("bench: kvpush on %s %s", model, reason)
                    result.skipped.append(Skipped(name, model, reason))
                    continue
                guard: dict[str, Any] = {"boot_s": round(boot_s, 1),
                                         "warmup_errors": warm_errors}
                try:
                    text = greedy(system.url, model, gprompt, cfg.guard_tokens,
                                  min(cfg.request_timeout_s, 60.0))
                    guard["text"] = text
                    if name == "colocated":
                        reference_guard = text
                        guard["match"] = None  # it is the reference
                    else:
                        guard["match"] = (None if reference_guard is None
                                          else text == reference_guard)
                except httpx.HTTPError as exc:
                    guard["error"] = f"{type(exc).__name__}: {exc}"
                    guard["match"] = False
                guards[name] = guard
                if guard.get("match") is False:
                    logger.error("bench: %s on %s: guard output differs from colocated",
                                 name, model)
                offset = 0
                for isl, osl in cfg.lengths:
                    for rate in cfg.rates:
                        point, results, offset = measure_point(system, cfg, isl, osl, rate,
                                                               offset)
                        first = results[0] if results else None
                        key = (model, isl, osl, rate)
                        check: dict[str, Any] = {"first_ok": bool(first and first.ok)}
                        if first is not None and first.ok:
                            if name == "colocated":
                                reference_first[key] = first.text
                            ref = reference_first.get(key)
                            check["first_matches_colocated"] = (
                                None if ref is None else first.text == ref)
                        point.extra["correctness"] = check
                        point.extra["boot_s"] = round(boot_s, 1)
                        result.points.append(point)
                        # Written after every point, so an interrupted run keeps its data.
                        _write(result, cfg, started)
            finally:
                system.stop()
    result.paths = _write(result, cfg, started)
    return result


def render(out_dir: Path) -> list[Path]:
    """Re-write the reports of a finished run from its ``results.json``
    (:class:`~kvpush.loadtest.report.ResultsError` where there is none to read)."""
    from kvpush.loadtest.report import load_points

    points, data = load_points(out_dir)
    result = BenchResult(points=points, skipped=[Skipped(**s) for s in data.get("skipped", [])],
                         guard=data.get("guard", {}))
    return write_report(points, out_dir, data["meta"], extra_md=correctness_markdown(result),
                        extra_json={"skipped": data.get("skipped", []), "guard": result.guard})


def _start_with_retry(sysdef: SystemDef, model: str, cfg: BenchConfig) -> RunningSystem:
    """Start a system, retrying once: on a shared box an engine can fail to boot for reasons
    that have nothing to do with the system (memory pressure, a package being reinstalled)."""
    from kvpush.services.engine.launcher import EngineError

    run_dir = cfg.out / "run" / f"{sysdef.name}-{model}"
    try:
        return start_system(sysdef, model, cfg, run_dir)
    except EngineError as exc:
        logger.warning("bench: %s on %s failed to start (%s); retrying once", sysdef.name,
                       model, exc)
        return start_system(sysdef, model, cfg, run_dir.with_name(run_dir.name + "-retry"))


def _meta(cfg: BenchConfig, started: str) -> dict[str, Any]:
    p, d = default_cpus()
    return {
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "systems": cfg.systems,
        "models": cfg.models,
        "lengths": [f"{i}/{o}" for i, o in cfg.lengths],
        "rates": cfg.rates,
        "num_prompts": cfg.num_prompts,
        "warmup": cfg.warmup,
        "slo_ttft_s": cfg.slo_ttft_s,
        "slo_tpot_s": cfg.slo_tpot_s,
        "request_timeout_s": cfg.request_timeout_s,
        "block_size": cfg.block_size or "vLLM default",
        "prefill_cpus": cfg.prefill_cpus or p,
        "decode_cpus": cfg.decode_cpus or d,
        "colocated_cpus": cfg.colocated_cpus or cfg.decode_cpus or d,
        "host_cpus": os.cpu_count(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def correctness_markdown(result: BenchResult) -> str:
    """Sections for the report: skipped systems, the output guard, per-point first outputs."""
    out = ""
    if result.skipped:
        out += "\n### Not measured\n\n| system | model | reason |\n|---|---|---|\n"
        for s in result.skipped:
            out += f"| {SYSTEM_LABELS.get(s.system, s.system)} | {s.model} | {s.reason} |\n"
    out += ("\n### Correctness guard (greedy output vs the colocated engine)\n\n"
            "| model | system | boot s | warm-up errors | isolated guard prompt "
            "| first request of each point |\n|---|---|---|---|---|---|\n")
    for model, systems in result.guard.items():
        for name, g in systems.items():
            pts = [p for p in result.points if p.model == model and p.system == name]
            firsts = [p.extra.get("correctness", {}).get("first_matches_colocated")
                      for p in pts]
            ok = sum(1 for f in firsts if f is True)
            bad = sum(1 for f in firsts if f is False)
            unk = len(firsts) - ok - bad
            gm = {True: "match", False: "MISMATCH", None: "reference"}[g.get("match")]
            if g.get("error"):
                gm = f"error: {g['error'][:80]}"
            out += (f"| {model} | {name} | {g.get('boot_s')} | {len(g.get('warmup_errors', []))} "
                    f"| {gm} | {ok} match, {bad} MISMATCH, {unk} n/a |\n")
    out += phases_markdown(result.points)
    kv = [p for p in result.points if "kvpush" in p.extra]
    if kv:
        out += ("\n### kvpush transfer records (connector stats file)\n\n"
                "| model | ISL/OSL | rate | system | pushes | failed | bytes | descs "
                "| layer-wise xfers | post→done ms mean | exposed ms mean "
                "| decode wait ms mean |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for p in kv:
            f = p.extra["kvpush"]

            def ms(v: float | None, scale: float = 1.0) -> str:
                return "—" if v is None else f"{v * scale:.2f}"

            out += (f"| {p.model} | {p.input_len}/{p.output_len} | {p.rate:g} | {p.system} "
                    f"| {f['pushes']} "
                    f"| {f['push_failures']} | {f['bytes']} | {f['descriptors']} "
                    f"| {f['layerwise_xfers']} | {ms(f['post_to_done_mean_ms'])} "
                    f"| {ms(f['exposed_mean_s'], 1000)} | {ms(f['recv_wait_mean_ms'])} |\n")
    stock = [p for p in result.points if p.system.startswith("nixl-")]
    if stock:
        out += ("\n### Stock NIXL counters (deltas over each point, both engines)\n\n"
                "| model | ISL/OSL | rate | system | xfers | bytes | descs | xfer s | post s "
                "| failed | expired | external KV tokens |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for p in stock:
            c = p.extra.get("counters", {})
            out += (f"| {p.model} | {p.input_len}/{p.output_len} | {p.rate:g} | {p.system} "
                    f"| {c.get('xfers', 0):.0f} | {c.get('bytes', 0):.0f} "
                    f"| {c.get('descriptors', 0):.0f} | {c.get('xfer_time_s', 0):.3f} "
                    f"| {c.get('post_time_s', 0):.4f} | {c.get('failed_transfers', 0):.0f} "
                    f"| {c.get('kv_expired', 0):.0f} | {c.get('external_tokens', 0):.0f} |\n")
    return out


def _write(result: BenchResult, cfg: BenchConfig, started: str) -> list[Path]:
    return write_report(
        result.points, cfg.out, _meta(cfg, started),
        extra_md=correctness_markdown(result),
        extra_json={"skipped": [asdict(s) for s in result.skipped], "guard": result.guard},
    )


# -- command line ----------------------------------------------------------------------------

# A smoke run proves the harness, not a number: it takes its points at once, marked loaded
# when the machine is (booting the next system's engines keeps it so for a minute).
SMOKE = {"models": "tiny", "lengths": "512/64", "rates": "4", "num_prompts": 6,
         "systems": "colocated,nixl-pull-repin,kvpush", "warmup": 1, "quiet_wait_s": 0.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench``."""
    from kvpush.loadtest import (
        bench_autoscale,
        bench_conditional,
        bench_gateway,
        bench_goodput,
        bench_http_clients,
        bench_multiturn,
        bench_overload,
        bench_placement,
        bench_scheduler,
        bench_transfer,
    )

    p.add_argument("mode", nargs="?",
                   choices=["serve", "transfer", "placement", "multiturn", "scheduler",
                            "gateway", "http-clients", "overload", "goodput", "conditional",
                            "autoscale"],
                   default="serve",
                   help="serve: the serving benchmark (default); transfer: the NIXL "
                        "transfer microbenchmark; placement: the scheduler's cost per "
                        "decision from 2 to 64 registered engines (no engines run); "
                        "multiturn: least-loaded, remembered and KV-event placement on a "
                        "1P2D fleet that evicts; conditional: TTFT and decode stall of a "
                        "held prefix's tail computed on decode alone against P/D; "
                        "autoscale: kvpush up --autoscale under a load step, as a trace; "
                        "scheduler: the control plane alone against simulated "
                        "engines; gateway: the gateway's ceiling in streams and relayed "
                        "tokens/s against a synthetic upstream and vLLM's API server; "
                        "http-clients: the gateway's engine calls with aiohttp and httpx, "
                        "CPU per call; overload: 1x, 2x and 4x the push stack's capacity, "
                        "shedding against queueing; goodput: the highest rate each system "
                        "serves within TTFT and TPOT objectives, P/D against colocated")
    p.add_argument("--transfer", action="store_true", help="same as the 'transfer' mode")
    p.add_argument("--systems", default=None,
                   help=f"comma separated, from {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--models", default=None,
                   help="local models, from `kvpush models list` (default: tiny,kv-heavy)")
    p.add_argument("--lengths", default=None, help="ISL/OSL list (default 512/64,512/128)")
    p.add_argument("--rates", default=None,
                   help="request rates per second (default 1,2,4; scheduler: 250,500,1000,2000)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per point (40)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per system (2)")
    p.add_argument("--out", default=None,
                   help="report directory (out/bench, out/transfer, out/scheduler)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput TPOT SLO")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV memory per engine (default: 1 for tiny, 3 for kv-heavy)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: vLLM's, 128 on CPU)")
    p.add_argument("--prefill-cpus", default=None)
    p.add_argument("--decode-cpus", default=None)
    p.add_argument("--colocated-cpus", default=None)
    p.add_argument("--render", default=None, metavar="DIR",
                   help="only re-render the reports of DIR/results.json (no engines)")
    p.add_argument("--quiet-wait-s", type=float, default=None,
                   help="longest wait before each point for the 1-minute load average to "
                        "fall to a quiet machine's (default 90; 0 with --smoke); a point "
                        "taken above it is marked loaded")
    p.add_argument("--smoke", action="store_true",
                   help="tiny, 512/64, rate 4, 6 prompts, colocated + stock pull (re-pinned) "
                        "+ kvpush: a few minutes")
    bench_transfer.add_arguments(p)
    bench_placement.add_arguments(p)
    bench_multiturn.add_arguments(p)
    bench_conditional.add_arguments(p)
    bench_autoscale.add_arguments(p)
    bench_scheduler.add_arguments(p, rates=False, redis_url=False)
    bench_gateway.add_arguments(p)
    bench_http_clients.add_arguments(p)
    bench_overload.add_arguments(p)
    bench_goodput.add_arguments(p)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed flags (explicit flags win over ``--smoke``)."""
    smoke = SMOKE if args.smoke else {}

    def pick(name: str, default: Any) -> Any:
        v = getattr(args, name)
        return v if v is not None else smoke.get(name, default)

    systems = pick("systems", None)
    models = pick("models", None)
    lengths = pick("lengths", None)
    rates = pick("rates", None)
    return BenchConfig(
        systems=parse_list(systems) if systems else list(DEFAULT_SYSTEMS),
        models=parse_list(models) if models else ["tiny", "kv-heavy"],
        lengths=parse_lengths(lengths) if lengths else [(512, 64), (512, 128)],
        rates=[float(r) for r in parse_list(rates)] if rates else [1.0, 2.0, 4.0],
        num_prompts=pick("num_prompts", 40),
        warmup=pick("warmup", 2),
        seed=args.seed,
        out=Path(args.out or "out/bench"),
        slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_tpot_s=args.slo_tpot_ms / 1000,
        request_timeout_s=args.request_timeout_s,
        kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        colocated_cpus=args.colocated_cpus,
        quiet_wait_s=pick("quiet_wait_s", 90.0),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench``."""
    if args.mode == "transfer" or args.transfer:
        from kvpush.loadtest import bench_transfer

        args.out = args.out or "out/transfer"
        return bench_transfer.run_from_args(args)
    if args.mode == "placement":
        from kvpush.loadtest import bench_placement

        return bench_placement.run_from_args(args)
    if args.mode == "multiturn":
        from kvpush.loadtest import bench_multiturn

        return bench_multiturn.run_from_args(args)
    if args.mode == "autoscale":
        from kvpush.loadtest import bench_autoscale

        return bench_autoscale.run_from_args(args)
    if args.mode == "conditional":
        from kvpush.loadtest import bench_conditional

        return bench_conditional.run_from_args(args)
    if args.mode == "gateway":
        from kvpush.loadtest import bench_gateway

        return bench_gateway.run_from_args(args)
    if args.mode == "overload":
        from kvpush.loadtest import bench_overload

        return bench_overload.run_from_args(args)
    if args.mode == "goodput":
        from kvpush.loadtest import bench_goodput

        return bench_goodput.run_from_args(args)
    if args.mode == "http-clients":
        from kvpush.loadtest import bench_http_clients

        return bench_http_clients.run_from_args(args)
    if args.mode == "scheduler":
        from kvpush.loadtest import bench_scheduler

        args.out = args.out or "out/scheduler"
        return bench_scheduler.run_from_args(args)
    if args.render:
        from kvpush.loadtest.report import ResultsError

        try:
            paths = render(Path(args.render))
        except ResultsError as exc:
            print(f"--render: {exc}")
            return 2
        print("\n".join(str(p) for p in paths))
        return 0
    cfg = config_from_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run_bench(cfg)
    print((cfg.out / "results.md").read_text())
    for s in result.skipped:
        print(f"skipped {s.system} on {s.model}: {s.reason}")
    print(f"report written to {cfg.out}")
    mismatches = [p for p in result.points
                  if p.extra.get("correctness", {}).get("first_matches_colocated") is False]
    if mismatches:
        print(f"WARNING: {len(mismatches)} point(s) whose first output differs from colocated")
    return 0
