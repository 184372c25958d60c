"""``kvpush bench autoscale``: the fleet planner and ``kvpush up --autoscale`` under a load step,
as a trace: replicas (desired by the planner, serving), TTFT and time per output token over
time, while the load goes from one client to a step of many and back.

The stack is ``kvpush up --autoscale --max-prefill 1 --max-decode 2`` (tiny) with a small
KV cache per engine, so that the step needs more decode blocks than one engine has: the
planner sees decode's KV usage pass ``KVPUSH_PLANNER_KV_HIGH`` (or requests wait for a
slot) and asks for a second decode engine; after the step it finds room for one fewer and
the stack drains the added engine before removing it. Every request's outcome is counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.loadtest.bench_probes import wait_for_quiet
from kvpush.loadtest.sse_metrics import StreamTimings, consume_sse

logger = logging.getLogger(__name__)

PROMPT = "# autoscale\n" + "value = compute(value) + 1\n" * 24  # ~200 tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench autoscale`` (with the common ``--out``)."""
    p.add_argument("--step-clients", type=int, default=12,
                   help="autoscale: concurrent clients during the load step")
    p.add_argument("--step-s", type=float, default=150.0,
                   help="autoscale: length of the load step in seconds")


class _Clients:
    """Closed-loop streaming clients whose number can change while they run."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.done: list[tuple[float, StreamTimings]] = []
        self.failed: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []

    def resize(self, n: int) -> None:
        while len(self._stops) < n:
            stop = threading.Event()
            t = threading.Thread(target=self._run, args=(stop, len(self._stops)), daemon=True)
            self._stops.append(stop)
            self._threads.append(t)
            t.start()
        while len(self._stops) > n:
            self._stops.pop().set()

    def _run(self, stop: threading.Event, i: int) -> None:
        import httpx

        n = 0
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                n += 1
                start = time.perf_counter()
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json={
                            "model": "tiny", "prompt": f"{PROMPT}# {i}.{n}\n",
                            "max_tokens": self.max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
                        if r.status_code != 200:
                            err = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                            timings = None
                        else:
                            timings = consume_sse(r.iter_lines(), start)
                            err = timings.error
                except httpx.HTTPError as exc:
                    timings, err = None, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if err or timings is None:
                        self.failed.append((time.perf_counter(), err or "no stream"))
                        time.sleep(0.5)
                    else:
                        self.done.append((time.perf_counter(), timings))

    def stop(self) -> None:
        self.resize(0)
        for t in self._threads:
            t.join(300)


def _sample(redis_url: str, plan_key: str) -> dict[str, Any]:
    import redis

    from kvpush.common.wire import FleetPlan, WireError, decode
    from kvpush.services.local.stack import engine_rows

    rows = engine_rows(redis_url)
    ready = sum(1 for r in rows if r["role"] == "decode" and r["state"] == "ok")
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.get(plan_key)
    finally:
        client.close()
    desired = None
    if raw is not None:
        try:
            desired = decode(raw, FleetPlan).decode.desired
        except WireError:
            desired = None
    return {"decode_ready": ready, "decode_desired": desired,
            "load_avg": os.getloadavg()[0]}


def run(out: Path, step_clients: int, step_s: float, quiet_wait_s: float) -> dict[str, Any]:
    """Boot the stack, run the step, return the trace."""
    from kvpush.common.keys import RedisKeys
    from kvpush.services.local.ports import free_port, free_port_range

    api, redis_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = dict(os.environ, KVPUSH_REDIS_URL="", KVPUSH_STACK_REDIS_PORT=str(redis_port),
               KVPUSH_STACK_PORT=str(api), KVPUSH_RUN_DIR=str(out / "run"),
               KVPUSH_STACK_PREFILL_PORT=str(free_port_range(2)),
               KVPUSH_STACK_DECODE_PORT=str(free_port_range(4)),
               KVPUSH_ENGINE_KV_CACHE_GIB="0.006", KVPUSH_PLANNER_PERIOD_S="1",
               KVPUSH_PLANNER_UP_STABLE_S="3", KVPUSH_PLANNER_DOWN_STABLE_S="20")
    log = open(out / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli", "up", "--autoscale",
                             "--max-prefill", "1", "--max-decode", "2"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{api}"
    trace: list[dict[str, Any]] = []
    clients = _Clients(url, max_tokens=256)
    try:
        _wait_healthy(url, proc, 600)
        load, quiet = wait_for_quiet(quiet_wait_s)
        t0 = time.perf_counter()
        phases = [("before", 1, 30.0), ("step", step_clients, step_s), ("after", 1, 0.0)]
        plan_key = RedisKeys().fleet_plan()
        for name, n, length in phases:
            clients.resize(n)
            began = time.perf_counter()
            while True:
                time.sleep(1.0)
                now = time.perf_counter()
                point = {"t": now - t0, "phase": name, "clients": n,
                         **_sample(redis_url, plan_key)}
                trace.append(point)
                if name != "after" and now - began >= length:
                    break
                if name == "after" and (now - began > 300 or (
                        now - began >= 30 and point["decode_ready"] == 1
                        and any(e.startswith("removed ") for e in _events(out / "up.log")))):
                    break
        clients.stop()
        return {"trace": trace, "requests": _requests(clients, t0), "load_avg": load,
                "quiet": quiet, "events": _events(out / "up.log"), "step_s": step_s,
                "step_clients": step_clients}
    finally:
        clients.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("kvpush up exited before it served")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("kvpush up did not serve in time")


def _requests(clients: _Clients, t0: float) -> dict[str, Any]:
    done = [{"t": at - t0, "ttft": s.ttft, "tpot": s.tpot} for at, s in clients.done]
    return {"ok": done, "failed": [{"t": at - t0, "error": e} for at, e in clients.failed]}


def _events(log: Path) -> list[str]:
    return [line.split("kvpush autoscale: ", 1)[1] for line in
            log.read_text(errors="replace").splitlines()
            if line.startswith("kvpush autoscale: ")]


def plot(result: dict[str, Any], path: Path) -> None:
    """Replicas, TTFT and time per output token over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, ok = result["trace"], result["requests"]["ok"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    t = [p["t"] for p in tr]
    axes[0].step(t, [p["decode_ready"] for p in tr], where="post", label="decode serving")
    axes[0].step(t, [p["decode_desired"] or 0 for p in tr], where="post", linestyle="--",
                 label="decode desired (planner)")
    axes[0].step(t, [p["clients"] for p in tr], where="post", alpha=0.4, label="clients")
    axes[0].set_ylabel("count")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].plot([r["t"] for r in ok], [1000 * r["ttft"] for r in ok], ".", markersize=3)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_yscale("log")
    tp = [r for r in ok if r["tpot"] is not None]
    axes[2].plot([r["t"] for r in tp], [1000 * r["tpot"] for r in tp], ".", markersize=3)
    axes[2].set_ylabel("time per output token (ms)")
    axes[2].set_xlabel("seconds")
    fig.suptitle("kvpush up --autoscale --max-decode 2 (tiny): a load step and back")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def scale_up_wait(trace: list[dict[str, Any]]) -> tuple[float, float] | None:
    """When the planner first wanted a second decode engine, and when one first served
    (seconds into the run, to the trace's 1 s sampling); None if either never happened."""
    asked = next((p["t"] for p in trace if (p["decode_desired"] or 0) >= 2), None)
    if asked is None:
        return None
    serving = next((p["t"] for p in trace if p["t"] >= asked and p["decode_ready"] >= 2), None)
    return None if serving is None else (asked, serving)


def markdown(result: dict[str, Any], image: str) -> str:
    """Per phase: clients, requests served, shed at admission (429 with a Retry-After,
    retried by the client after 0.5 s) and failed otherwise, TTFT and TPOT."""
    tr, ok, failed = (result["trace"], result["requests"]["ok"], result["requests"]["failed"])
    lines = [f"Load average at the start: {result['load_avg']:.2f}"
             f"{'' if result['quiet'] else ' (loaded)'}. Autoscaler: "
             + ("; ".join(result["events"]) or "no change") + ".", "",
             *_scale_up_line(tr),
             f"![autoscaling trace]({image})", "",
             "| phase | clients | seconds | decode serving | served | shed (429) | failed | "
             "TTFT p50 | TTFT p90 | TPOT p50 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for phase in ("before", "step", "after"):
        pts = [p for p in tr if p["phase"] == phase]
        if not pts:
            continue
        lo, hi = pts[0]["t"] - 1.0, pts[-1]["t"]
        rs = [r for r in ok if lo <= r["t"] < hi]
        refused = [f for f in failed if lo <= f["t"] < hi]
        shed = [f for f in refused if f["error"].startswith("HTTP 429")]
        ttft = sorted(1000 * r["ttft"] for r in rs)
        tpot = [1000 * r["tpot"] for r in rs if r["tpot"] is not None]
        served = sorted({p["decode_ready"] for p in pts})
        ttft_cells = (f"{statistics.median(ttft):.0f} ms | "
                      f"{ttft[math.ceil(0.9 * len(ttft)) - 1]:.0f} ms") if ttft else "- | -"
        tpot_cell = f"{statistics.median(tpot):.1f} ms" if tpot else "-"
        lines.append(f"| {phase} | {pts[0]['clients']} | {hi - lo:.0f} | "
                     f"{served[0]}-{served[-1]} | {len(rs)} | {len(shed)} | "
                     f"{len(refused) - len(shed)} | {ttft_cells} | "
                     f"{tpot_cell} |")
    return "\n".join(lines) + "\n"


def _scale_up_line(trace: list[dict[str, Any]]) -> list[str]:
    wait = scale_up_wait(trace)
    if wait is None:
        return []
    asked, serving = wait
    return [f"Scale-up: the planner asked for a second decode at {asked:.0f} s; it served "
            f"at {serving:.0f} s, **{serving - asked:.0f} s** later (its boot, mostly).", ""]


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench autoscale``."""
    out = Path(args.out or "out/autoscale")
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run(out, args.step_clients, args.step_s,
                 args.quiet_wait_s if args.quiet_wait_s is not None else 90.0)
    (out / "autoscale.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "autoscale.png")
    md = markdown(result, "autoscale.png")
    (out / "autoscale.md").write_text(md)
    print(md)
    return 0
