"""Synthetic workloads are deterministic and SSE timing reads TTFT from the first content token."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvpush.loadtest.prompts import Workload, completion_body, prompt_ids
from kvpush.loadtest.sse_metrics import consume_sse


def test_prompts_are_exact_length_and_deterministic() -> None:
    w = Workload(input_len=300, output_len=7, seed=42)
    a, b = prompt_ids(w, 3), prompt_ids(w, 3)
    assert a == b and len(a) == 300
    assert prompt_ids(w, 4) != a
    assert prompt_ids(Workload(input_len=300, seed=43), 3) != a
    assert all(w.vocab_low <= t < w.vocab_high for t in a)
    body = completion_body("m", w, 0)
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and "min_tokens" not in body


def _sse(events: list[dict]) -> list[bytes]:
    return [f"data: {json.dumps(e)}".encode() for e in events] + [b"data: [DONE]"]


def test_ttft_counts_from_first_content_token_not_first_chunk() -> None:
    lines = _sse(
        [
            {"choices": [{"text": ""}]},  # role/empty chunk must not count as a token
            {"choices": [{"text": "a"}]},
            {"choices": [{"text": "b"}]},
            {"choices": [{"delta": {"content": "c"}}]},
            {"choices": [], "usage": {"completion_tokens": 3}},
        ]
    )
    t = consume_sse(lines, start=0.0)
    assert t.text == "abc" and t.output_tokens == 3
    assert t.ttft is not None and t.first_token == t.token_times[0]
    assert len(t.itls) == 2 and t.tpot is not None


def test_error_event_is_reported() -> None:
    t = consume_sse(_sse([{"error": {"message": "boom"}}]), start=0.0)
    assert t.error and "boom" in t.error and t.first_token is None


def test_summary_percentiles_and_goodput() -> None:
    from kvpush.loadtest.bench_client import RequestResult, percentile, summarize

    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    results = [
        RequestResult(0, True, None, 0.1, 0.01, 1.0, [0.01], 10, "x"),
        RequestResult(1, True, None, 2.0, 0.01, 3.0, [0.01], 10, "y"),  # misses TTFT SLO
        RequestResult(2, False, "HTTP 503", None, None, None, [], 0, ""),
    ]
    s = summarize(results, duration_s=2.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.output_tok_per_s == 10.0 and s.goodput_req_per_s == 0.5
    assert s.errors == ["HTTP 503"]


def test_report_writes_json_markdown_ratios_and_plots(tmp_path) -> None:
    from kvpush.loadtest.report import BenchPoint, write_report

    def point(system: str, ttft: float) -> BenchPoint:
        summary = {
            "requests": 2, "completed": 2, "ttft_mean": ttft, "ttft_p50": ttft,
            "ttft_p99": ttft, "tpot_mean": 0.01, "itl_p99": 0.02, "output_tok_per_s": 5.0,
            "goodput_req_per_s": 1.0,
        }
        return BenchPoint(system, "tiny", 512, 64, 1.0, summary, ttfts=[ttft, ttft * 2],
                          phases={"queue": 0.001, "prefill": ttft / 2})

    pts = [point("nixl-pull", 0.3), point("nixl-push", 0.2), point("kvpush", 0.1)]
    paths = write_report(pts, tmp_path, {"cmd": "test"})
    assert {p.name for p in paths} == {
        "results.json", "results.md", "ttft_cdf.png", "tpot.png", "ttft_phases.png"
    }
    md = (tmp_path / "results.md").read_text()
    # kvpush vs pull: 0.3 / 0.1 = 3.00x; vs push: 2.00x
    assert "| kvpush | nixl-pull | 3.00x" in md and "| kvpush | nixl-push | 2.00x" in md
    assert all(p.stat().st_size > 1000 for p in paths if p.suffix == ".png")


def test_failover_accounting_counts_repeated_tokens_and_double_placements() -> None:
    from kvpush.common.wire import Assignment
    from kvpush.loadtest.faults.failover import placements

    def a(rid: str, token: int, resv: str | None = None, engine: str = "D1") -> Assignment:
        return Assignment(request_id=rid, decode_engine=engine, reservation_id=resv or rid,
                          fencing_token=token)

    got = placements([
        a("r1", 1), a("r2", 2),
        a("r2", 2),  # the same placement answered again (a redelivered entry)
        a("r3", 2),  # token 2 again on D1, another reservation: a repeat
        a("r4", 2, engine="D2"),  # token 2 on another engine: its own counter
        a("r5", 5), a("r5", 6),  # r5 placed twice
        Assignment(request_id="r6", ok=False, error="no engine"),
    ])
    assert got.tokens == 5  # (D1,1) (D1,2) (D2,2) (D1,5) (D1,6)
    assert got.repeats == ["D1 token 2 -> reservations r2, r3"]
    assert got.duplicated == ["r5"]
    assert got.repeated_answers == 1


def test_failover_accounting_reads_double_pushes_from_engine_logs(tmp_path) -> None:
    from kvpush.loadtest.faults.failover import served_twice

    log = tmp_path / "decode.log"
    line = ("INFO kvpush recv rid={} peer=P rank=0 bytes=1 blocks=1 descs=1 xfers=1 layers=1 "
            "post_to_done_ms=1.0 verified=False\n")
    old = line.format("cmpl-old") * 2
    log.write_text(old + line.format("cmpl-a") + line.format("cmpl-b") * 2
                   + "WARNING kvpush recv rid=cmpl-a peer=P failed: deadline\n")
    assert served_twice(log, offset=len(old)) == ["recv cmpl-b"]
    assert served_twice(tmp_path / "missing.log", 0) == []


def test_reliability_report_has_a_failover_table() -> None:
    from kvpush.loadtest.faults.failover import FailoverResult
    from kvpush.loadtest.faults.outcomes import FaultConfig, ScenarioResult
    from kvpush.loadtest.reliability import render

    single = ScenarioResult("baseline", "no fault", sent=2, ok=2, recovery_s=0.5)
    fo = FailoverResult("sentinel_failover_lagging", "Sentinel failover, replica behind",
                        sent=16, ok=11, failed_clean=5, recovery_s=3.2, failover_s=2.3,
                        tokens=12, token_repeats=1, topology="sentinel")
    meta = {"when": "now", "host": "h", "cpus": 2, "total_s": 1.0, "netns": False,
            "leftover": [], "stack_notes": [], "verify": None}
    md = render([single, fo], FaultConfig(), meta)
    main, failover = md.split("## Redis failover")
    assert "| no fault | 2 | 2 |" in main and "Sentinel failover" not in main.split("## Per")[0]
    row = next(ln for ln in failover.splitlines() if ln.startswith("| Sentinel failover"))
    assert "| 16 | 11 | 5 | 0 | 0 | 0 | none | 12 (1) | 2.3 s | 3.2 s |" in row
    assert row.endswith("pass, but fencing tokens repeated (see Findings) |")


def test_reliability_report_opens_with_its_summary() -> None:
    from kvpush.loadtest.faults.failover import FailoverResult
    from kvpush.loadtest.faults.hostile import HostileReport, ProbeResult
    from kvpush.loadtest.faults.outcomes import FaultConfig, ScenarioResult
    from kvpush.loadtest.reliability import render

    good = ScenarioResult("baseline", "no fault", sent=2, ok=2, recovery_s=0.5)
    lost = ScenarioResult("redis_delay", "Redis delayed", sent=2, ok=1, lost=1, recovery_s=0.5)
    skipped = ScenarioResult("netns_link_cut", "link down", skipped="no netns")
    fo = FailoverResult("sentinel_failover", "Sentinel failover", sent=4, ok=4,
                        recovery_s=3.2, failover_s=2.3, tokens=4, topology="sentinel")
    hostile = HostileReport(probes=[ProbeResult("client", "p1", "400", "400", True),
                                    ProbeResult("engine", "p2", "400", "500", False)])
    meta = {"when": "2026-12-04 18:07 UTC", "commit": "abc1234", "host": "vm", "cpus": 2,
            "total_s": 1.0, "netns": False, "leftover": [], "stack_notes": [],
            "verify": None, "hostile": hostile}
    md = render([good, lost, skipped, fo], FaultConfig(), meta)
    title, summary, generated = md.split("\n\n")[:3]
    assert title == "# kvpush reliability: fault injection"
    assert summary.startswith("**Summary.** 4 faults injected under load on real local "
                              "stacks (3 on one prefill and one decode engine, 1 Redis "
                              "failover), then 2 hostile-input probes; run on 2026-12-04 "
                              "18:07 UTC at commit abc1234 (vm, 2 CPUs).")
    assert ("**2 of 3 faults pass and 1 of 2 probes are answered as expected** (1 skipped); "
            "no process was left over.") in summary
    assert "deadline + 20 s" in summary and "deadline + 3 s" in summary
    assert generated.startswith("Generated by `kvpush reliability --out RELIABILITY.md`")
    # Outside a git checkout the commit is unknown, not a crash.
    meta["commit"] = None
    assert "at an unknown commit" in render([good], FaultConfig(), meta)


def test_a_late_write_row_passes_only_when_the_fence_guarded_its_victim() -> None:
    from kvpush.loadtest.faults.late_write import LateWriteResult

    def row(**kw: object) -> LateWriteResult:
        base: dict[str, object] = dict(
            victim_equal=True, colocated_equal=True, victim_waited=True, rechecked=3,
            after_give_up_s=5.6, failed_request="failed",
            quarantines={"entered": 1, "fenced": 1, "cut_off": 0})
        return LateWriteResult("sigstop", "A stopped", "TP1 -> TP1", **{**base, **kw})

    assert row().violations() == []
    bad = {
        "victim_equal": False, "colocated_equal": False, "changed": 1, "rechecked": 0,
        "victim_waited": False, "after_give_up_s": -0.5, "failed_request": "answered",
        "quarantines": {"entered": 1, "fenced": 0, "cut_off": 1}, "lost": 1,
        "leaks": {"decode_kv_blocks": "usage 0.2"}, "victim_error": "504",
    }
    for field_name, value in bad.items():
        assert row(**{field_name: value}).violations(), field_name
    # A measurement with the quarantine off breaks no invariant, whatever it found.
    assert row(guarded=False, victim_equal=False, changed=1).violations() == []


def test_reliability_report_has_a_late_write_section_with_the_measurement_off() -> None:
    from kvpush.loadtest.faults.late_write import LateWriteResult
    from kvpush.loadtest.faults.outcomes import FaultConfig
    from kvpush.loadtest.reliability import render

    ok = dict(victim_equal=True, colocated_equal=True, victim_waited=True, rechecked=4,
              late_bytes=819200, after_give_up_s=5.6, failed_request="failed",
              quarantines={"entered": 1, "fenced": 1, "cut_off": 0})
    guarded = [LateWriteResult("sigstop", "A stopped", "TP1 -> TP1", **ok),  # type: ignore[arg-type]
               LateWriteResult("link_cut", "A's link cut", "TP2 -> TP1",
                               skipped="no netns")]
    off = [LateWriteResult("sigstop_unguarded", "A stopped", "TP1 -> TP1", guarded=False,
                           **{**ok, "victim_equal": False, "changed": 1,  # type: ignore[arg-type]
                              "quarantines": {"entered": 1, "fenced": 0, "cut_off": 1}})]
    meta = {"when": "now", "commit": "abc", "host": "h", "cpus": 2, "total_s": 1.0,
            "netns": True, "leftover": [], "stack_notes": [], "verify": None,
            "late": (guarded, off, [])}
    md = render([], FaultConfig(), meta)
    assert "(2 late-write rows on two prefill engines and a decode)" in md
    assert "**1 of 1 faults pass** (1 skipped)" in md
    section = md.split("## Late WRITEs")[1].split("## Per fault")[0]
    main, measured = section.split("### The same faults with the quarantine off (measured)")
    assert ("| A stopped | TP1 -> TP1 | as alone and colocated | 4 (0) | 819200 | 5.6 s | "
            "1 / 1 / 0 | 0 | none | pass |") in main
    assert "skipped: no netns" in main
    assert "**1 of 1 victims answered differently from their answer alone" in measured
    assert "| **different** | 4 (1) |" in measured and measured.count("| measured |") == 1


def test_git_commit_names_head_or_nothing(tmp_path) -> None:
    from kvpush.loadtest.reliability import git_commit

    assert git_commit(tmp_path) is None  # not a checkout
    head = git_commit()
    assert head is None or head.split()[0].isalnum()


def _point(rate: float, attainment: float, sent: int = 100) -> object:
    from kvpush.loadtest.bench_goodput import Point

    return Point(rate_rps=rate, sent=sent, met=round(attainment * sent), failed=0,
                 ttft_p99_ms=None, tpot_p99_ms=None, loadavg_1m_before=0.0, quiet=True)


def test_goodput_search_doubles_then_bisects_to_the_last_rate_that_met_it() -> None:
    from kvpush.loadtest.bench_goodput import search

    def measure(rate: float) -> object:  # a system that holds 90 % up to 5 req/s
        return _point(rate, 0.95 if rate <= 5.0 else 0.5)

    goodput, bounded, points = search(measure, 1.0, 0.9, max_doublings=5, bisections=2)
    assert [p.rate_rps for p in points] == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]
    assert (goodput, bounded) == (5.0, True)


def test_goodput_search_reports_a_lower_bound_when_the_ladder_ends_first() -> None:
    from kvpush.loadtest.bench_goodput import render, search

    goodput, bounded, points = search(lambda r: _point(r, 1.0), 1.0, 0.9, 2, 2)
    assert (goodput, bounded, len(points)) == (4.0, False, 3)
    # Nothing met even the first rate: the search goes below it.
    goodput, bounded, points = search(lambda r: _point(r, 0.9 if r <= 0.25 else 0.0),
                                      1.0, 0.9, 3, 2)
    assert [p.rate_rps for p in points] == [1.0, 0.5, 0.25] and goodput == 0.25
    md = render({"when": "now", "cpus": 2, "model": "tiny", "input_len": 8, "output_len": 4,
                 "attainment": 0.9, "slo_ttft_ms": 1000, "slo_tpot_ms": 50, "rows": [
                     {"system": "colocated-dp2", "goodput_rps": 2.0, "bounded": True,
                      "points": []},
                     {"system": "kvpush", "goodput_rps": 3.0, "bounded": False, "points": []},
                     {"system": "nixl-pull-repin", "skipped": "no NIXL"}]})
    assert "| kvpush | >= 3 | 1.50 | 1.50x |" in md
    assert "| nixl-pull-repin | skipped: no NIXL |" in md


def _result(i: int, ttft: float | None, tpot: float | None) -> object:
    from kvpush.loadtest.bench_client import RequestResult

    ok = ttft is not None
    return RequestResult(i, ok, None if ok else "HTTP 502", ttft, tpot, None, [], 4, "")


def test_a_goodput_point_keeps_its_requests_and_attains_again_under_other_objectives(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the same requests attained under a looser TPOT objective, re-rendered from
    results.json with no engines (`kvpush bench goodput --render DIR --goodput-also`)."""
    from kvpush.loadtest.bench_goodput import (
        GoodputConfig,
        attainment_at,
        goodput_at,
        parse_also,
        point_from,
    )
    from kvpush.services.cli.main import main

    cfg = GoodputConfig(slo_ttft_s=5.0, slo_tpot_s=0.1)
    # 0.2/s: all within 5 s / 100 ms; 0.4/s: TPOT 120 ms for half, one failed request.
    low = point_from([_result(i, 1.0, 0.09) for i in range(4)], 0.2, cfg, 0.5, True)
    high = point_from([_result(0, 1.0, 0.12), _result(1, 1.0, 0.12), _result(2, 1.0, 0.05),
                       _result(3, None, None)], 0.4, cfg, 0.5, True)
    assert (low.met, high.met) == (4, 1)
    assert high.ttft_ms == [1000.0, 1000.0, 1000.0, None] and high.tpot_ms[0] == 120.0
    pts = [{**asdict(p), "attainment": p.attainment} for p in (low, high)]
    assert attainment_at(pts[1], 5000, 100) == 0.25 and attainment_at(pts[1], 5000, 150) == 0.75
    assert goodput_at(pts, 5000, 100, 0.9) == (0.2, True)
    assert goodput_at(pts, 5000, 150, 0.7) == (0.4, False)  # nothing above fell short
    assert goodput_at(pts, 500, 150, 0.9) == (0.0, True)
    # A point recorded before requests were kept: no answer rather than a wrong one.
    old = {k: v for k, v in pts[0].items() if k not in ("ttft_ms", "tpot_ms")}
    assert attainment_at(old, 5000, 100) is None and goodput_at([old], 5000, 100, 0.9) is None
    with pytest.raises(ValueError):
        parse_also("5000")
    with pytest.raises(ValueError):
        parse_also("5000/0")

    res = {"when": "now", "cpus": 2, "model": "kv-heavy", "input_len": 512, "output_len": 128,
           "attainment": 0.7, "slo_ttft_ms": 5000, "slo_tpot_ms": 100, "total_s": 1,
           "rows": [{"system": "kvpush", "goodput_rps": 0.2, "bounded": True, "points": pts},
                    {"system": "colocated-dp2", "goodput_rps": 0.2, "bounded": False,
                     "points": [old]}]}
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert main(["bench", "goodput", "--render", str(tmp_path),
                 "--goodput-also", "5000/100,5000/150"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| kvpush | 0.2 | >= 0.4 |" in md
    assert "| colocated-dp2 | no requests recorded | no requests recorded |" in md
    assert main(["bench", "goodput", "--render", str(tmp_path), "--goodput-also", "x/1"]) == 2
    assert "expected TTFT_MS/TPOT_MS" in capsys.readouterr().out


def test_a_goodput_point_pools_its_arrival_samples() -> None:
    """Several arrival samples of one rate make one point: attainment over every request,
    the worst load average, quiet only if every sample was."""
    from kvpush.loadtest.bench_goodput import GoodputConfig, pooled_point, render

    cfg = GoodputConfig(slo_ttft_s=1.0, slo_tpot_s=0.05)
    bursty = [_result(0, 2.0, 0.01), _result(1, 2.0, 0.01), _result(2, 0.5, 0.01)]
    calm = [_result(i, 0.5, 0.01) for i in range(3)]
    p = pooled_point([(bursty, 0.4, True), (calm, 0.9, False)], 1.0, cfg)
    assert (p.sent, p.met, p.samples) == (6, 4, 2)
    assert (p.loadavg_1m_before, p.quiet) == (0.9, False)
    assert len(p.ttft_ms) == 6
    md = render({"when": "now", "cpus": 2, "model": "tiny", "input_len": 8, "output_len": 4,
                 "attainment": 0.9, "slo_ttft_ms": 1000, "slo_tpot_ms": 50, "rows": [
                     {"system": "kvpush", "goodput_rps": 0.0, "bounded": True,
                      "points": [{**asdict(p), "attainment": p.attainment}]}]})
    assert "1/s: 4/6 in 2 samples (" in md and "loaded" in md


@pytest.mark.parametrize("mode", [[], ["goodput"]])
def test_render_of_a_directory_that_holds_no_such_run_is_an_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    """`kvpush bench [goodput] --render DIR` names what is wrong with DIR/results.json and
    exits 2: missing, not JSON, or the other benchmark's results."""
    from kvpush.services.cli.main import main

    def render() -> str:
        assert main(["bench", *mode, "--render", str(tmp_path)]) == 2
        return capsys.readouterr().out

    assert "no such file" in render()
    (tmp_path / "results.json").write_text("{not json")
    assert "not readable as JSON" in render()
    other = ({"meta": {}, "points": []} if mode else
             {"when": "now", "cpus": 2, "model": "tiny", "rows": []})
    (tmp_path / "results.json").write_text(json.dumps(other))
    assert "another benchmark's results" in render()
    broken = ({"cpus": 2, "model": "tiny", "rows": [{"system": "kvpush"}]} if mode else
              {"meta": {}, "points": [{"system": "kvpush", "no_such_field": 1}]})
    (tmp_path / "results.json").write_text(json.dumps(broken))
    assert "--render:" in render()
