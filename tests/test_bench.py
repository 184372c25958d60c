"""The benchmarks produce complete reports: transfer microbenchmark (fast) and serving smoke (slow).

No timing thresholds: the numbers are whatever this machine gives; the tests check that every
byte landed, that every system x point is reported, and that the report files exist.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvpush.loadtest import bench, bench_probes, bench_systems
from kvpush.loadtest.bench_transfer import (
    BlockLayout,
    block_ids,
    merged_runs,
    parse_layouts,
    run_transfer_bench,
)
from kvpush.loadtest.report import BenchPoint, write_report
from kvpush.services.local.redis_topologies import LocalCluster


def test_block_ids_patterns() -> None:
    local, remote = block_ids(8, 8, 16)
    assert local == list(range(8)) and merged_runs(local) == 1 and merged_runs(remote) == 1
    local, remote = block_ids(8, 1, 16)
    assert len(set(local)) == len(set(remote)) == 8
    assert merged_runs(local) == 8 and merged_runs(remote) == 8
    assert max(local) < 16 and max(remote) < 16
    local, _ = block_ids(8, 2, 16)
    assert merged_runs(local) == 4
    with pytest.raises(ValueError):
        block_ids(8, 1, 10)


def test_layouts_follow_the_local_models() -> None:
    tiny, heavy = parse_layouts("tiny-b16,kv-heavy-b32")
    # tiny: 4 layers x 2 KV heads x 64 dims x bf16 x (K, V) = 2 KiB per token
    assert tiny.request_bytes == 512 * 2048 and tiny.request_blocks == 32
    # kv-heavy: 128 KiB per token, like Llama-3-8B
    assert heavy.request_bytes == 512 * 128 * 1024 and heavy.request_blocks == 16
    with pytest.raises(ValueError):
        parse_layouts("tiny")


def test_transfer_microbenchmark_lands_every_byte(tmp_path: Path) -> None:
    # Small: 3 layers, 16-token blocks, 128-token requests (8 blocks, 8 KiB per block).
    layout = BlockLayout("small-b16", num_layers=3, kv_heads=2, head_dim=64, dtype_bytes=2,
                         block_size=16, request_tokens=128)
    report = run_transfer_bench([layout], tmp_path, iters=3, idle_s=0.5,
                                progthread_contrast=False)
    methods = {r["method"] for r in report.results}
    assert methods == {"kvpush-layerwise", "kvpush-one-post", "dynamic-dlist",
                       "raw-contiguous", "memcpy-contiguous", "memcpy-gather"}
    nixl = [r for r in report.results if not r["method"].startswith("memcpy")]
    pool = 3 * layout.pool_blocks * layout.block_len + layout.request_bytes
    for r in nixl:
        # Every receiver byte was compared: written blocks to the sender's, the rest to the
        # sentinel.
        assert r["verified_bytes"] == pool, r
        assert r["wrong_bytes"] == 0, r
        assert r["bytes"] == layout.request_bytes
    # Fragmentation sweep: contiguous, runs of 8 (= contiguous here), 2, fully scattered.
    runs = sorted({r["run"] for r in report.results if r["method"] == "kvpush-one-post"})
    assert runs == [1, 2, 8]
    for r in report.results:
        if r["method"] == "kvpush-layerwise":
            # one post per layer, one descriptor per (layer, block) whatever the pattern
            assert r["posts"] == 3 and r["descriptors"] == 3 * 8
        if r["method"] == "dynamic-dlist":
            assert r["descriptors"] == 3 * merged_runs(block_ids(8, r["run"], 16)[0])
        for key in ("post_us_p50", "total_ms_p50", "gbps"):
            assert r[key] >= 0
    assert set(report.idle) == {"kvpush-sender", "kvpush-receiver"}
    for v in report.idle.values():
        assert v["wall_s"] > 0 and v["cpu_s"] >= 0
    for name in ("transfer.json", "transfer.md", "transfer_post_cost.png",
                 "transfer_gbps.png"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "transfer.json").read_text())
    assert len(data["results"]) == len(report.results)


def _point(system: str, rate: float, ttft: float) -> BenchPoint:
    summary = {
        "requests": 2, "completed": 2, "failed": 0, "duration_s": 1.0, "ttft_mean": ttft,
        "ttft_p50": ttft, "ttft_p99": ttft, "tpot_mean": 0.01, "tpot_p50": 0.01,
        "tpot_p99": 0.01, "itl_mean": 0.01, "itl_p99": 0.01, "e2e_mean": 1.0,
        "output_tok_per_s": 10.0, "request_per_s": 2.0, "goodput_req_per_s": 2.0,
        "slo_ttft_s": 1.0, "slo_tpot_s": 0.1, "errors": [],
    }
    return BenchPoint(system, "tiny", 512, 64, rate, summary, ttfts=[ttft, ttft * 2],
                      tpots=[0.01, 0.01])


def test_report_has_ratios_and_skipped_systems(tmp_path: Path) -> None:
    result = bench.BenchResult(
        points=[_point("nixl-pull", 1, 2.0), _point("kvpush", 1, 0.5)],
        skipped=[bench.Skipped("nixl-push", "tiny", "not available: test")],
        guard={"tiny": {"kvpush": {"boot_s": 1, "warmup_errors": [], "match": True}}},
    )
    md = bench.correctness_markdown(result)
    write_report(result.points, tmp_path, {"t": 1}, extra_md=md)
    text = (tmp_path / "results.md").read_text()
    assert "### Ratios" in text and "| kvpush | nixl-pull | 4.00x" in text
    assert "not available: test" in text and "match" in text


def test_config_from_flags_and_smoke() -> None:
    from kvpush.services.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--smoke", "--num-prompts", "3"])
    cfg = bench.config_from_args(args)
    assert cfg.models == ["tiny"] and cfg.lengths == [(512, 64)] and cfg.num_prompts == 3
    assert len(cfg.rates) == 1 and "colocated" in cfg.systems
    args = build_parser().parse_args(
        ["bench", "--systems", "colocated,kvpush", "--lengths", "512/64,256/32",
         "--rates", "1,2", "--models", "kv-heavy"])
    cfg = bench.config_from_args(args)
    assert cfg.systems == ["colocated", "kvpush"] and cfg.lengths == [(512, 64), (256, 32)]
    assert cfg.rates == [1.0, 2.0] and cfg.models == ["kv-heavy"]
    assert build_parser().parse_args(["bench", "transfer"]).mode == "transfer"
    # Same prompts for every system on a point, different prompts between points.
    assert bench.point_seed(0, "tiny", 512, 64, 1) == bench.point_seed(0, "tiny", 512, 64, 1)
    assert bench.point_seed(0, "tiny", 512, 64, 1) != bench.point_seed(0, "tiny", 512, 64, 2)


def test_kvpush_records_give_bytes_and_exposed_time(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    rec = {"kind": "push", "ok": True, "bytes": 100, "descriptors": 4, "xfers": 4,
           "layerwise_xfers": 4, "forward_end_ns": 1_000_000, "notify_ns": 3_000_000,
           "post_to_done_ms": 2.5}
    f.write_text(json.dumps(rec) + "\n" + json.dumps({"kind": "recv", "ok": True,
                                                      "wait_ms": 5.0}) + "\n" + '{"kind": ')
    records, offset = bench_probes.kvpush_records(f, 0)
    assert len(records) == 2 and offset < f.stat().st_size  # partial line left for later
    figs = bench_probes.kvpush_transfer_figures(records)
    assert figs["bytes"] == 100 and figs["pushes"] == 1 and figs["recvs"] == 1
    assert figs["exposed_mean_s"] == pytest.approx(0.002)
    # Decode's own record wins: it includes waiting for a target that came late.
    records[1]["exposed_ms"] = 9.0
    assert bench_probes.kvpush_transfer_figures(records)["exposed_mean_s"] == pytest.approx(
        0.009)


@pytest.mark.slow
def test_bench_smoke_report_is_complete(tmp_path: Path) -> None:
    """Every kind of system the bench runs: one engine, a stock P/D pair, engines behind the
    gateway, and the push stack. The push stack runs as ``kvpush-phases``: the same stack
    and the same points as ``kvpush``, with every request traced, so its row checks the
    kvpush figures and the phases as well (a separate ``kvpush`` row booted the same two
    engines again)."""
    from kvpush.services.cli.main import build_parser

    systems = ["colocated", "nixl-pull-repin"]
    if bench_systems.kvpush_unavailable_reason() is None:
        systems += ["colocated-dp2", "kvpush-phases"]
    args = build_parser().parse_args([
        "bench", "--smoke", "--num-prompts", "3", "--systems", ",".join(systems),
        "--out", str(tmp_path),
    ])
    cfg = bench.config_from_args(args)
    result = bench.run_bench(cfg)
    data = json.loads((tmp_path / "results.json").read_text())
    measured = {(p["system"], p["model"], p["input_len"], p["output_len"], p["rate"])
                for p in data["points"]}
    skipped = {(s["system"], s["model"]) for s in data["skipped"]}
    for system in systems:
        for model in cfg.models:
            for isl, osl in cfg.lengths:
                for rate in cfg.rates:
                    assert ((system, model, isl, osl, rate) in measured
                            or (system, model) in skipped), (system, model, isl, osl, rate)
    assert ("colocated", "tiny") not in skipped
    for p in data["points"]:
        assert p["summary"]["requests"] == 3
        assert "correctness" in p["extra"]
    md = (tmp_path / "results.md").read_text()
    assert "### Ratios" in md and "Correctness guard" in md
    for png in ("ttft_cdf.png", "tpot.png", "ttft_phases.png"):
        assert (tmp_path / png).stat().st_size > 0
    assert result.paths
    if "kvpush-phases" in systems:
        assert ("colocated-dp2", "tiny") not in skipped
        assert all(p["summary"]["completed"] == 3 for p in data["points"]
                   if p["system"] == "colocated-dp2")
        (traced,) = [p for p in data["points"] if p["system"] == "kvpush-phases"]
        assert traced["extra"]["kvpush"], traced["extra"]
        ph = traced["extra"]["phases"]
        assert ph["cut"] == ph["traced"] == 3, ph
        # The phases of every request add up to the time to first token its client saw.
        total = sum(v["mean"] for v in ph["phases"].values())
        assert total == pytest.approx(traced["summary"]["ttft_mean"] * 1000, abs=0.05)
        # The forward pass's end is stamped in whole ms: nothing is negative beyond that.
        assert all(v["mean"] > -1.0 for v in ph["phases"].values()), ph
        assert "### Time to first token by phase" in md


def test_scheduler_bench_runs_on_a_cluster_with_shards_and_schedulers(
        tmp_path: Path, redis_cluster: LocalCluster) -> None:
    """``kvpush bench scheduler`` flags, on the real Cluster: 2 shards, 2 scheduler processes;
    every request decided, the report written (the figures are whatever this machine gives)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "scheduler", "--redis-url", redis_cluster.url, "--redis-cluster", "--rates", "20",
        "--seconds", "1", "--request-shards", "2", "--schedulers", "2", "--gateways", "2",
        "--decode-engines", "4", "--prefill-engines", "2", "--out", str(tmp_path)])
    assert bench.run_from_args(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    (row,) = res["rows"]
    assert (res["request_shards"], res["schedulers"], res["cluster"]) == (2, 2, True)
    assert len(res["shard_nodes"]) == 2
    assert row["requests"] == 20 and sum(row["assigned_by_scheduler"]) == 20
    assert len(row["assigned_by_scheduler"]) == 2
    assert row["sched_p50_ms"] <= row["sched_p99_ms"]
    assert "| 20 |" in (tmp_path / "results.md").read_text()


def test_phases_of_a_trace_add_up_to_the_client_ttft() -> None:
    from kvpush.loadtest.bench_client import RequestResult
    from kvpush.loadtest.bench_phases import cut, summarize
    from kvpush.loadtest.otlp_receiver import ReceivedSpan

    ms = 1_000_000
    t0 = 1_700_000_000_000 * ms  # client send, unix ns

    def span(name: str, kind: int, start: int, end: int, **kw: Any) -> ReceivedSpan:
        return ReceivedSpan(name, "t", name, "", kind, 0, "svc", start_unix_ns=t0 + start * ms,
                            end_unix_ns=t0 + end * ms, **kw)

    spans = [
        span("POST /v1/completions", 2, 1, 90),
        span("send kvpush:requests", 4, 3, 4),
        span("kvpush.dispatch.prefill", 3, 5, 40),
        span("kvpush.dispatch.decode", 3, 5, 90,
             event_unix_ns={"kvpush.first_event": t0 + 50 * ms}),
        span("kvpush.kv.wait", 1, 8, 44,
             attributes={"kvpush.forward_end_unix_ms": t0 // ms + 40}),
        span("kvpush.kv.push", 1, 30, 43),
        span("kvpush.kv.write", 1, 30, 41, attributes={"kvpush.bytes": 1_000_000}),
        # posted after the forward pass: only these measure the wire (0.5 MB in 2 ms)
        span("kvpush.kv.write", 1, 41, 43, attributes={"kvpush.bytes": 500_000}),
    ]
    r = RequestResult(0, True, None, 0.052, 0.005, 0.3, [], 8, "x", "t", t0)
    got = cut(r, spans)
    assert got.missing is None
    assert got.phases == pytest.approx({"gateway": 3, "schedule": 2, "prefill": 35,
                                        "transfer": 4, "decode": 6, "answer": 0,
                                        "relay": 2})
    assert sum(got.phases.values()) == pytest.approx(52)
    assert got.facts == pytest.approx({"control_plane": 4, "prefill_dispatch": 4,
                                       "target_after_dispatch": 3, "notify_to_complete": 1})
    assert got.overlapped is True and got.write_mb_s == pytest.approx(250)
    # A trace without the decode side is reported, not guessed.
    lost = cut(r, [s for s in spans if s.name != "kvpush.kv.wait"])
    assert lost.missing == "kv.wait"
    summary = summarize([got, lost])
    assert summary["cut"] == 1 and summary["missing"] == ["kv.wait"]
    assert summary["phases"]["prefill"]["mean"] == pytest.approx(35)
    assert summary["led"] == "0/1"

    # The first token from prefill's answer (at 43 ms): the path runs through its answer,
    # and the transfer and decode's first event are facts beside it.
    spans[0] = span("POST /v1/completions", 2, 1, 90,
                    event_unix_ns={"kvpush.first_token_from_prefill": t0 + 43 * ms})
    r = RequestResult(0, True, None, 0.045, 0.005, 0.3, [], 8, "x", "t", t0)
    led = cut(r, spans)
    assert led.led and led.phases == pytest.approx({
        "gateway": 3, "schedule": 2, "prefill": 35, "transfer": 0, "decode": 0,
        "answer": 3, "relay": 2})
    assert led.facts["kv_after_forward"] == pytest.approx(4)
    assert led.facts["decode_after_lead"] == pytest.approx(7)
    assert summarize([got, led])["led"] == "1/2"

    # Prefill sent at admission (2 ms), before the request entered its stream (3 ms):
    # admission ends with that dispatch, the schedulers' part is off the path.
    spans[2] = span("kvpush.dispatch.prefill", 3, 2, 40)
    early = cut(r, spans)
    assert early.phases == pytest.approx({
        "gateway": 2, "schedule": 0, "prefill": 38, "transfer": 0, "decode": 0,
        "answer": 3, "relay": 2})
    assert sum(early.phases.values()) == pytest.approx(45)
    assert early.facts["prefill_dispatch"] == pytest.approx(1)
    assert early.facts["control_plane"] == pytest.approx(4)


def test_http_clients_bench_measures_both_clients_on_both_calls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpush.services.cli.main import main as cli_main

    assert cli_main(["bench", "http-clients", "--calls", "3", "--rounds", "2",
                     "--out", str(tmp_path)]) == 0
    rows = [ln.split("|")[1:4] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("| post") or ln.startswith("| stream")]
    # Each client's calls went through whole (an error would have raised), twice each.
    assert sorted((c.strip(), cl.strip(), n.strip()) for c, cl, n in rows) == [
        ("post", "aiohttp", "6"), ("post", "httpx", "6"),
        ("stream", "aiohttp", "6"), ("stream", "httpx", "6")]


def test_overload_points_count_served_shed_and_goodput() -> None:
    from kvpush.loadtest.bench_client import RequestResult
    from kvpush.loadtest.bench_overload import point_figures, render

    def res(i: int, ok: bool, status: int | None, ttft: float | None = None,
            tpot: float | None = None, e2e: float | None = None) -> RequestResult:
        return RequestResult(i, ok, None if ok else f"HTTP {status}", ttft, tpot, e2e, [], 4,
                             "", status=status)

    results = [res(0, True, 200, 0.5, 0.02, 1.0), res(1, True, 200, 3.0, 0.02, 4.0),
               res(2, False, 429, e2e=0.004), res(3, False, 503, e2e=0.006),
               res(4, False, 502, e2e=1.0), res(5, False, None)]
    row = point_figures(results, duration_s=2.0, objective_s=2.0, slo_tpot_s=0.05)
    assert (row["sent"], row["served"], row["shed"], row["failed"]) == (6, 2, 2, 2)
    assert row["goodput_rps"] == 0.5  # one of the served within both objectives, over 2 s
    assert row["shed_p50_ms"] == 5.0 and row["ttft_p99_ms"] == pytest.approx(2975.0)
    assert row["errors"] == ["HTTP 502", "HTTP None"]
    rows = [dict(row, factor=f, rate_rps=f * 10, shedding=s, took_s=1.0,
                 served_rps=f * 9, of_capacity=f * 0.9, client_cpu=0.25,
                 client_lag_p99_ms=12.0, headroom=0.65 if s else None,
                 loadavg_1m_before=0.1, quiet=True, leaked=[] if s else ["1 reservations"])
            for s in (True, False) for f in (1.0, 4.0)]
    md = render({"when": "now", "model": "tiny", "input_len": 512, "output_len": 64,
                 "capacity_rps": 10.0, "objective_ms": 2000.0, "slo_tpot_ms": 50.0,
                 "seconds": 20.0, "cpus": 2, "rows": rows})
    table = [ln for ln in md.splitlines() if ln.startswith("| on") or ln.startswith("| off")]
    assert len(table) == 4 and all("| 100% |" in ln for ln in table)
    # Served per second over the run's capacity, the shedding gateway's headroom, and the
    # load generator's CPU and lag.
    assert "| 9.0 | 90% |" in table[0] and "| 36.0 | 360% |" in table[1]
    assert table[0].endswith("| 100% | 0.65 | nothing | 25% | 12 ms | 0.1 |")
    assert "| 100% | - | 1 reservations |" in table[2]


def test_autoscale_trace_renders_phases_and_a_plot(tmp_path: Path) -> None:
    """The report of ``kvpush bench autoscale`` from a made-up trace (the real one needs a
    quiet machine and minutes; tests/test_autoscale.py runs the same stack for real)."""
    from kvpush.loadtest import bench_autoscale

    def point(t: float, phase: str, clients: int, ready: int, desired: int) -> dict:
        return {"t": t, "phase": phase, "clients": clients, "decode_ready": ready,
                "decode_desired": desired, "load_avg": 0.1}

    result = {
        "trace": [point(1, "before", 1, 1, 1), point(2, "step", 6, 1, 2),
                  point(3, "step", 6, 2, 2), point(4, "after", 1, 1, 1)],
        "requests": {"ok": [{"t": 2.2, "ttft": 0.1, "tpot": 0.02},
                            {"t": 2.5, "ttft": 0.3, "tpot": None}],
                     "failed": [{"t": 3.5, "error": "HTTP 429"}]},
        "load_avg": 0.2, "quiet": True,
        "events": ["added decode-1 (x)", "removed decode-1 (drained)"]}
    md = bench_autoscale.markdown(result, "autoscale.png")
    assert "![autoscaling trace](autoscale.png)" in md
    assert "| step | 6 | 2 | 1-2 | 2 | 0 | 0 | 200 ms | 300 ms | 20.0 ms |" in md
    assert "| after | 1 | 1 | 1-1 | 0 | 1 | 0 | - | - | - |" in md
    assert "asked for a second decode at 2 s; it served at 3 s, **1 s** later" in md
    assert bench_autoscale.scale_up_wait(result["trace"][:2]) is None
    bench_autoscale.plot(result, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_multiturn_strategies_report_costs_and_ttft_per_turn() -> None:
    from kvpush.loadtest.bench_multiturn import _new_input, strategy_markdown

    def row(mode: str, computed: int, received: int, p50: float) -> dict[str, Any]:
        return {"mode": mode, "model": "tiny", "shape": "agent", "load_avg": 0.5,
                "quiet": True, "computed_tokens": computed, "prefill_computed": computed,
                "prefill_received": received, "decode_computed": 0, "pushed_mib": 1.0,
                "history_mib": received / 1000, "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50,
                "turns": {0: {"p50_ms": 10.0, "p90_ms": 12.0},
                          "1": {"p50_ms": p50, "p90_ms": 2 * p50}}}

    pushed = {**row("history-push", 400, 500, 30.0), "choices": {"push": 5, "slower": 1}}
    md = strategy_markdown([row("recompute", 900, 0, 50.0), pushed], 2, 3, 1, 0.012)
    assert "| history-push | 0.50 | 400 | 400 | 500 | 0 | 1.0 MiB | 0.5 MiB | 30 ms | 60 ms |" \
        in md
    assert md.count("| push 5, slower 1 |") == 1
    assert "| recompute | " in md and md.split("| recompute | ")[1].split("\n")[0].endswith("| - |")
    assert "| 2 | 50 / 100 ms | 30 / 60 ms |" in md  # keys as JSON gives them back
    assert "| 3 | - | - |" in md
    agent = _new_input(1, 2, "agent")
    assert agent.startswith("Tool output:") and agent != _new_input(2, 2, "agent")
    assert _new_input(1, 0, "agent").startswith("Conversation 1, question 0")
