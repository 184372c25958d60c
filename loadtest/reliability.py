"""``kvpush reliability``: run every fault scenario on a real local stack, write RELIABILITY.md.

The scenarios and the harness live in ``loadtest/faults`` (the same code the slow pytest suites
``tests/test_faults.py`` and ``tests/test_faults_failover.py`` run); this module runs them in
order on one shared stack, then each Redis failover on a stack of its own topology, and turns
the results into tables: fault x (requests ok, failed cleanly, lost, leaked, recovery).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvpush.common.settings import CommonSettings

logger = logging.getLogger(__name__)

RERUN = "kvpush reliability --out RELIABILITY.md"

# What the runs found, kept by hand (the table above it is regenerated on every run).
FINDINGS = """\
## Findings

Open (what the table cannot show; fixed findings are in the commit history):

1. **After the NIXL link comes back, recovery takes about one request deadline**: pushes in
   flight when the link went down stall until their deadline (then NIXL reports the peer
   invalidated), and the first request after the link is back can still wait out its
   deadline before the next one succeeds.
2. **Redis failover: a request-stream entry or assignment that dies with the master is not
   re-sent**: its request fails at its deadline (504). Requests during the promotion ride
   it out (up to `KVPUSH_GATEWAY_REDIS_OUTAGE_S`, then 503 + `Retry-After`). Releases and
   push targets that meet the outage are retried (they used to hold a quota slot for the
   quota lease, or leave their request waiting out its deadline).

The streamed 200 that ended without `[DONE]` or an error event under Redis restarts (an
earlier open finding) was not seen again in the Redis rows of this run or of a dedicated
run of them; the gateway now enforces the end of every stream whatever the engine sends
(no event, an error or aborted choice before the first token, a response closed without
`[DONE]`: `tests/test_hostile_gateway.py::test_every_stream_ends_with_done_or_an_error`),
and an *unclear* answer now fails its row.

## Gaps

- The first table has one engine of each role: a dead decode is routed to until its status
  TTL lapses (those requests fail fast with 502). Re-routing to a surviving peer is the
  second table (2P2D on loopback, no network namespaces).
- The kernel here has no `netem`/`prio` qdiscs: the network fault on the NIXL path is a link
  taken down, not loss or latency. Redis delay and blackhole go through the TCP proxy.
- "Mid-push" and "mid-prefill" are aimed at by watching for decode's push target; on the
  tiny model a push takes ~10-50 ms, so a kill can land just before or after the WRITEs.
- The gateway runs in the harness process; a gateway crash is not covered.
- The cluster row kills the master holding most of the request path's keys; which keys those
  are follows from hashing (the row names them). Replication on loopback is microseconds
  behind, so only the lagging-replica row loses writes; its lag is a delaying proxy on the
  replication link, cut with the master.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush reliability``."""
    p.add_argument("--out", default="RELIABILITY.md", help="report path (Markdown)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--only", default=None,
                   help="comma-separated scenario names, 'hostile' for the hostile-input "
                   "probes, 'tp' for the heterogeneous-TP rows, 'late_write' for the "
                   "late-write rows (default: all, in order)")
    p.add_argument("--no-tp", action="store_true",
                   help="skip the heterogeneous-TP rows (a TP2 prefill -> TP1 decode stack)")
    p.add_argument("--no-netns", action="store_true",
                   help="engines on loopback (skips the link-cut scenario)")
    p.add_argument("--workdir", default=None, help="logs and Redis data (default: a temp dir)")


def _fmt_s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


TABLE_HEAD = [
    "| fault | sent | ok | failed clean | cancelled | unclear | lost | late | slowest "
    "| leaked | drain | recovery | verdict |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def fault_rows(results: list[Any]) -> list[str]:
    """One table row per fault of the two-engine stack."""
    lines = []
    for r in results:
        if r.skipped:
            lines.append(f"| {r.fault} | - | - | - | - | - | - | - | - | - | - | - | "
                         f"skipped: {r.skipped} |")
            continue
        leaked = "; ".join(f"{k}: {v}" for k, v in r.leaks.items()) or "none"
        verdict = "pass" if not r.violations() else "**FAIL**"
        lines.append(
            f"| {r.fault} | {r.sent} | {r.ok} | {r.failed_clean} | {r.cancelled} | "
            f"{r.unclear} | {r.lost} | {r.late} | {r.max_latency_s:.1f} s | {leaked[:160]} | "
            f"{_fmt_s(r.drain_s)} | "
            f"{_fmt_s(r.recovery_s)} ({r.recovery_from}) | {verdict} |")
    return lines


def git_commit(repo: Path | None = None) -> str | None:
    """The short commit the run measures (``None`` outside a git checkout), noting tracked
    files that differ from it (the report itself aside)."""
    repo = repo or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":(exclude)RELIABILITY.md")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head} with uncommitted changes" if head and dirty else head or None


def summary(results: list[Any], cfg: Any, meta: dict[str, Any],
            fleet: list[Any] | None = None) -> list[str]:
    """The report's opening paragraph: what ran, when, at which commit, how many faults
    passed, and what a pass means (kept by every regeneration)."""
    from kvpush.loadtest.faults.failover import FailoverResult

    tp = meta.get("tp")
    parts = [
        (len([r for r in results if not isinstance(r, FailoverResult)]),
         "on one prefill and one decode engine"),
        (len(tp[0]) if tp is not None else 0,
         f"on a prefill TP{tp[1].prefill_tp} -> decode TP{tp[1].decode_tp} pair"
         if tp is not None else ""),
        (len(fleet or []), "on two engines of each role"),
        (len(meta["late"][0]) if meta.get("late") else 0,
         "late-write rows on two prefill engines and a decode"),
    ]
    failovers = len([r for r in results if isinstance(r, FailoverResult)])
    parts.append((failovers, "Redis failover" + ("s" if failovers != 1 else "")))
    rows = [*results, *(tp[0] if tp is not None else []), *(fleet or []),
            *(meta["late"][0] if meta.get("late") else [])]
    ran = [r for r in rows if not r.skipped]
    passed = [r for r in ran if not r.violations()]
    skipped = len(rows) - len(ran)
    hostile = meta.get("hostile")
    probes = (f", then {len(hostile.probes)} hostile-input probes" if hostile is not None
              else "")
    probes_ok = (f" and {sum(p.ok for p in hostile.probes)} of {len(hostile.probes)} "
                 "probes are answered as expected" if hostile is not None else "")
    commit = meta.get("commit")
    leftover = meta.get("leftover") or []
    return [
        f"**Summary.** {len(rows)} faults injected under load on real local stacks ("
        + ", ".join(f"{n} {what}" for n, what in parts if n) + f"){probes}; run on "
        f"{meta['when']} " + (f"at commit {commit}" if commit else "at an unknown commit")
        + f" ({meta['host']}, {meta['cpus']} CPUs). **{len(passed)} of {len(ran)} faults "
        f"pass{probes_ok}**" + (f" ({skipped} skipped)" if skipped else "") + "; "
        + (f"left-over processes: {', '.join(leftover)}." if leftover
           else "no process was left over.")
        + " A fault passes when every request it sent is accounted for: none lost (no "
        f"answer by its deadline + {cfg.client_margin_s:.0f} s), none ended without a clear "
        "status (an HTTP error or an SSE error event is a clear one), none answered only "
        f"after its deadline + {cfg.late_grace_s:.0f} s, nothing left held once the run "
        "settled (reservations, KV blocks, gateway flights, pending stream entries, quota "
        "units), and requests succeeded again after the fault; a Redis failover must also "
        "serve no request twice, and with a surviving peer no request may fail before its "
        "first token. A request that fails cleanly under its fault is within a pass: the "
        "tables count them.",
        "",
    ]


def render_tp(results: list[Any], cfg: Any, leftover: list[str]) -> list[str]:
    """The heterogeneous-TP section: faults that cut a push on a prefill TP != decode TP
    stack, where every decode rank waits for its own part."""
    return [
        f"## Prefill TP{cfg.prefill_tp} -> decode TP{cfg.decode_tp}", "",
        f"The same stack with a TP{cfg.prefill_tp} prefill and a TP{cfg.decode_tp} decode "
        "engine (each engine's ranks share its core): every push is split into one part per "
        "(decode rank, KV head) and decode finishes a request only when every part arrived, so "
        "a fault mid-push must fail the request at its deadline on every rank, never hang one. "
        "Columns as above. These rows are this report's alone: CI proves the TP push path "
        "itself (`tests/test_e2e_shapes.py`, `tests/test_connector_hetero_tp.py`) without "
        "booting a third stack for them.", "",
        *TABLE_HEAD, *fault_rows(results), "",
        f"Leftover processes after the stack stopped: {', '.join(leftover) or 'none'}.", "",
    ]


def render(results: list[Any], cfg: Any, meta: dict[str, Any],
           fleet: list[Any] | None = None, fleet_cfg: Any = None) -> str:
    """The Markdown report (``fleet``: the rows of ``loadtest/faults/fleet.py``; failover
    rows are told apart by their type)."""
    from kvpush.loadtest.faults.failover import FailoverResult

    lines = [
        "# kvpush reliability: fault injection",
        "",
        *summary(results, cfg, meta, fleet),
        f"Generated by `{RERUN}` on {meta['when']} ({meta['host']}, {meta['cpus']} CPUs), "
        f"{meta['total_s']:.0f} s in all. The same scenarios run in CI as "
        "`pytest -m slow tests/test_faults.py tests/test_faults_fleet.py "
        "tests/test_faults_failover.py tests/test_faults_late_write.py`.",
        "",
        "Stack: real Redis behind a TCP fault proxy, two push schedulers (subprocesses), the "
        "gateway, a prefill and a decode vLLM CPU engine (tiny model) with `--connector "
        "kvpush`" + (", each in its own network namespace with NIXL/UCX (TCP) over a veth "
        "link" if meta["netns"] else ", on loopback") + ".",
        f"Deadlines: request {cfg.request_timeout_s:.0f} s, reservation lease "
        f"{cfg.lease_s:.0f} s, reclaim after {cfg.claim_idle_ms} ms idle, queue timeout "
        f"{cfg.queue_timeout_s:.0f} s, engine status TTL {cfg.engine_status_ttl_s:.0f} s. "
        f"A request unanswered at deadline + {cfg.client_margin_s:.0f} s counts as lost.",
        "",
        "Columns: **ok** answered in full; **failed clean** an HTTP error status (or an SSE "
        "error event) with a message; **cancelled** the client left on purpose; **unclear** "
        "neither (200 with `finish_reason=error`, a cut stream); **lost** no answer; **late** "
        "answered, but only after the request deadline + "
        f"{cfg.late_grace_s:.0f} s; **slowest** the longest time to an answer; "
        "**leaked** what was still held once the run settled (reservations, KV blocks, "
        "gateway flights, pending stream entries); **drain** how long until nothing was "
        "held; **recovery** from the fault being healed (or the restarted component being "
        "ready) to the first successful request.",
        "",
        *TABLE_HEAD,
    ]
    failovers = [r for r in results if isinstance(r, FailoverResult)]
    lines += fault_rows([r for r in results if not isinstance(r, FailoverResult)])
    lines += ["", f"Leftover processes after the stack stopped: "
              f"{', '.join(meta['leftover']) or 'none'}.", ""]
    if meta.get("tp") is not None:
        tp_results, tp_cfg, tp_leftover = meta["tp"]
        lines += render_tp(tp_results, tp_cfg, tp_leftover)
    if fleet:
        from kvpush.loadtest.faults.fleet import render_fleet

        lines += render_fleet(fleet, fleet_cfg)
    if failovers:
        lines += failover_table(failovers)
    if meta.get("late"):
        from kvpush.loadtest.faults.late_write_report import render_late_writes

        lines += render_late_writes(*meta["late"])
    lines += ["## Per fault", ""]
    tp_rows = meta["tp"][0] if meta.get("tp") is not None else []
    late = [*meta["late"][0], *meta["late"][1]] if meta.get("late") else []
    for r in [*results, *tp_rows, *(fleet or []), *late]:
        tp_tag = " (prefill TP != decode TP)" if any(r is x for x in tp_rows) else ""
        if any(r is x for x in late):
            tp_tag = f" (late write, prefill A {r.stack})"
        lines.append(f"### {r.name}{tp_tag}: {r.fault}")
        lines.append("")
        if r.skipped:
            lines += [f"Skipped: {r.skipped}", ""]
            continue
        for n in r.notes:
            lines.append(f"- {n}")
        for msg, n in sorted(getattr(r, "errors", {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"- {n} x {msg}")
        for v in r.violations():
            lines.append(f"- VIOLATION: {v}")
        lines.append(f"- scenario took {r.duration_s:.0f} s")
        lines.append("")
    if meta.get("stack_notes"):
        lines += ["## Harness notes", ""] + [f"- {n}" for n in meta["stack_notes"]] + [""]
    if meta.get("verify"):
        v = meta["verify"]
        lines += ["## KV integrity", "",
                  f"`KVPUSH_VERIFY_KV={v['rate']}` for the whole run: decode compared the "
                  f"checksums of **{v['verified']}** received pushes with prefill's, across every "
                  f"fault above, and **{v['failures']}** differed (counted from the engines' "
                  "logs, which survive their restarts).", ""]
    if meta.get("hostile") is not None:
        lines += render_hostile(meta["hostile"])
    lines += [FINDINGS]
    lines += ["## Rerun", "", "```", RERUN, "pytest -m slow tests/test_faults.py "
              "tests/test_faults_fleet.py tests/test_faults_failover.py "
              "tests/test_faults_late_write.py   # same scenarios and hostile-input probes, "
              "as assertions", "KVPUSH_MEASURE_UNGUARDED=1 pytest -s "
              "tests/test_faults_late_write.py   # also prints the rows with the quarantine "
              "off", "```",
              ""]
    return "\n".join(lines)


def render_hostile(rep: Any) -> list[str]:
    """The "Hostile input" section: every probe at the three edges, and the stack after."""
    edges: dict[str, list[Any]] = {}
    for p in rep.probes:
        edges.setdefault(p.edge, []).append(p)
    summary = ", ".join(f"{e}: {sum(p.ok for p in ps)}/{len(ps)}" for e, ps in edges.items())
    after = {k.lstrip("!"): v for k, v in rep.after.items()}
    harmed = [f"{k}: {v}" for k, v in rep.after.items() if k.startswith("!") and v]
    lines = [
        "## Hostile input", "",
        f"{len(rep.probes)} probes on the same stack, after the faults ({rep.took_s:.0f} s), "
        "through a second gateway with tenant auth and tight limits (the tenant holds a "
        "concurrency quota, so every admission takes a quota unit). Each must get its clear "
        "4xx, naming the field where there is one, with no internal name in the message, or "
        "be dropped with a log line. Answered as expected: " + summary + ".", "",
        "After all of them: " + ("every engine is the same process and healthy, both "
                                 "schedulers run, good requests are served through both "
                                 "gateways, and nothing is held (reservations, KV blocks, "
                                 "flights, pending stream entries, quota units; drained in "
                                 f"{after.get('drained in', '?')}); the engines' internal "
                                 "token is in no log." if not harmed else
                                 "**harm done**: " + "; ".join(harmed)), "",
        "| edge | probe | expected | verdict |", "|---|---|---|---|",
    ]
    for p in rep.probes:
        name = p.name.replace("|", "\\|")
        verdict = "pass" if p.ok else f"**FAIL**: {p.got}"
        lines.append(f"| {p.edge} | `{name}` | {p.expect} | {verdict} |")
    return [*lines, ""]


def failover_table(results: list[Any]) -> list[str]:
    """The Redis failover rows: each ran on a stack of its own topology."""
    lines = [
        "## Redis failover", "",
        "Each row runs the same stack (two schedulers, the gateway with API keys and a "
        "tenant quota, a prefill and a decode engine on loopback) on a Redis topology that "
        "can lose its master: a primary, a replica and three Sentinels, or a Redis Cluster "
        "of three masters with a replica each. Every service reaches Redis through the "
        "client factory (`KVPUSH_REDIS_SENTINELS` / `KVPUSH_REDIS_CLUSTER`) and must follow "
        "the failover without a restart. Under load, the master is SIGKILLed (on the "
        "cluster, the master holding most of the request path's keys) and the topology "
        "promotes its replica by itself.", "",
        "Columns as above, plus: **duplicated** requests served twice (one request id "
        "placed twice, with a different reservation or fencing token, or pushed or received "
        "twice by the engines); **fencing tokens** the tokens handed out during the run "
        "(every assignment, read off the gateway's assignment stream as it was written) and "
        "how many of them were handed out twice on one engine; **promotion** from the kill "
        "to the replica serving as master; **recovery** from the kill to the first "
        "successful request; **leaked** also counts the tenant's quota units still held.",
        "",
        "| fault | sent | ok | failed clean | unclear | lost | duplicated | leaked "
        "| fencing tokens (repeated) | promotion | recovery | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        leaked = "; ".join(f"{k}: {v}" for k, v in r.leaks.items()) or "none"
        verdict = "pass" if not r.violations() else "**FAIL**"
        if verdict == "pass":
            buts = ["fencing tokens repeated (see Findings)"] if r.token_repeats else []
            verdict = ", but ".join(["pass", " and ".join(buts)]) if buts else verdict
        lines.append(
            f"| {r.fault} | {r.sent} | {r.ok} | {r.failed_clean} | {r.unclear} | {r.lost} | "
            f"{r.duplicated} | {leaked[:160]} | {r.tokens} ({r.token_repeats}) | "
            f"{_fmt_s(r.failover_s)} | {_fmt_s(r.recovery_s)} | {verdict} |")
    return [*lines, ""]


def verify_counts(root: Path) -> dict[str, Any] | None:
    """Checked and failed KV verifications in every log under ``root`` (each stack's
    engines); None when it was off."""
    rate = CommonSettings().verify_kv
    if not rate:
        return None
    verified = failures = 0
    for log in root.rglob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "kvpush recv rid=" in line and "verified=True" in line:
                verified += 1
            elif "KV checksum mismatch" in line and "kvpush recv" in line:
                verified += 1
                failures += 1
    return {"rate": rate, "verified": verified, "failures": failures}


def run_fleet(chosen: list[Any], workdir: Path) -> tuple[list[Any], Any]:
    """Run the fleet scenarios ``chosen`` on one 2P2D stack (none started when empty)."""
    from kvpush.loadtest.faults.fleet import FleetStack, run_fleet_scenario

    if not chosen:
        return [], None
    st = FleetStack(workdir)
    results = []
    try:
        st.start()
        for sc in chosen:
            logger.info("fleet fault scenario %s: %s", sc.name, sc.fault)
            res = run_fleet_scenario(st, sc)
            logger.info("  -> %s", json.dumps(res.to_json(), default=str))
            results.append(res)
    finally:
        st.stop()
    return results, st


TP_SCENARIOS = ("decode_sigkill", "netns_link_cut")
"""The faults that cut a push mid-way, run again on a prefill TP2 -> decode TP1 stack."""


def run_tp(workdir: Path, cfg: Any) -> tuple[list[Any], Any, list[str]]:
    """:data:`TP_SCENARIOS` on a prefill TP2 -> decode TP1 stack: (rows, its config, its
    leftover processes)."""
    from kvpush.loadtest.faults.harness import FaultStack
    from kvpush.loadtest.faults.scenarios import BY_NAME, run_scenario

    st = FaultStack(workdir, replace(cfg, prefill_tp=2, decode_tp=1))
    rows: list[Any] = []
    try:
        st.start()
        for name in TP_SCENARIOS:
            logger.info("fault scenario %s on TP2 -> TP1", name)
            rows.append(run_scenario(st, BY_NAME[name]))
            logger.info("  -> %s", json.dumps(rows[-1].to_json(), default=str))
    finally:
        st.stop()
    return rows, st.cfg, st.leaked_processes()


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush reliability``; exit 1 when some fault broke an invariant."""
    from kvpush.loadtest.faults.failover import FAILOVER_BY_NAME, FAILOVER_SCENARIOS, run_failover
    from kvpush.loadtest.faults.fleet import FLEET_BY_NAME, FLEET_SCENARIOS
    from kvpush.loadtest.faults.harness import FaultStack
    from kvpush.loadtest.faults.outcomes import FaultConfig
    from kvpush.loadtest.faults.scenarios import BY_NAME, SCENARIOS, run_scenario

    logging.getLogger("httpx").setLevel(logging.WARNING)
    chosen, failovers = list(SCENARIOS), list(FAILOVER_SCENARIOS)
    fleet_chosen = list(FLEET_SCENARIOS)
    want_hostile, want_tp, want_late = True, not args.no_tp, True
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        want_hostile, want_tp = "hostile" in names, "tp" in names
        want_late = "late_write" in names
        names = [n for n in names if n not in ("hostile", "tp", "late_write")]
        known = {**BY_NAME, **FAILOVER_BY_NAME, **FLEET_BY_NAME}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"unknown scenario(s) {unknown}; known: {sorted(known)}, hostile, tp and "
                  "late_write")
            return 2
        chosen = [BY_NAME[n] for n in names if n in BY_NAME]
        failovers = [FAILOVER_BY_NAME[n] for n in names if n in FAILOVER_BY_NAME]
        fleet_chosen = [FLEET_BY_NAME[n] for n in names if n in FLEET_BY_NAME]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpush-reliability-"))
    cfg = replace(FaultConfig(), netns=not args.no_netns)
    t0 = time.monotonic()
    st = FaultStack(workdir, cfg)
    results: list[Any] = []
    hostile = None
    if chosen or want_hostile:
        try:
            st.start()
            for sc in chosen:
                logger.info("fault scenario %s: %s", sc.name, sc.fault)
                res = run_scenario(st, sc)
                logger.info("  -> %s", json.dumps(res.to_json(), default=str))
                results.append(res)
            if want_hostile:
                from kvpush.loadtest.faults.hostile import run_hostile

                hostile = run_hostile(st)
                logger.info("hostile input: %s probes, violations %s", len(hostile.probes),
                            hostile.violations())
        finally:
            st.stop()
    tp = run_tp(workdir / "tp", cfg) if want_tp else None
    fleet, fleet_st = run_fleet(fleet_chosen, workdir / "fleet")
    late = None
    if want_late:
        from kvpush.loadtest.faults.late_write_report import run_late_writes

        late = run_late_writes(workdir / "late-write", cfg)
    # Each failover runs on a stack of its own topology, after the shared stacks are gone.
    for fo in failovers:
        logger.info("failover scenario %s: %s", fo.name, fo.fault)
        res = run_failover(workdir / "failover", fo, cfg)
        logger.info("  -> %s", json.dumps(res.to_json(), default=str))
        results.append(res)
    leftover = (st.leaked_processes() if chosen or want_hostile else []) + (
        fleet_st.leaked_processes() if fleet_st is not None else []) + (
        tp[2] if tp is not None else []) + (late[2] if late is not None else [])
    meta = {"when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "host": platform.node(),
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "total_s": time.monotonic() - t0, "netns": st.cfg.netns,
            "leftover": leftover, "stack_notes": st.notes,
            "verify": verify_counts(workdir), "hostile": hostile, "tp": tp, "late": late}
    Path(args.out).write_text(render(results, st.cfg, meta, fleet,
                                     fleet_st.cfg if fleet_st is not None else None))
    results += fleet + (tp[0] if tp is not None else []) + (
        late[0] + late[1] if late is not None else [])
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=1,
                                              default=str))
    print(f"wrote {args.out} ({len(results)} faults; logs in {workdir})")
    bad = [r.name for r in results if r.violations()] + (["processes"] if meta["leftover"]
                                                         else [])
    if hostile is not None and hostile.violations():
        bad.append("hostile input")
    if bad:
        print(f"invariants broken: {', '.join(bad)}")
    return 1 if bad else 0
