"""``kvpush bench multiturn``: multi-turn chat with shared prefixes on a 1P2D kvpush fleet
whose KV caches are small enough to evict, four placements side by side in one run:
least-loaded, remembered placement (where a prefix went last), placement on the engines'
KV events, and KV events with conditional disaggregation (decode computes a short uncached
tail itself).

Each conversation keeps a shared system prompt and grows by the model's answer and a new
user message every turn, so every turn's prompt starts with the whole previous one. Per
placement it reports the share of decode prompt tokens served from the decode's own prefix
cache, the KV bytes prefill pushed, the requests prefill served, and TTFT of the follow-up
turns (streamed). The machine's load average is recorded before each system and a loaded
start is marked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.loadtest.bench_probes import wait_for_quiet

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a terse assistant. " + " ".join(
    f"Rule {i}: answer in at most {i + 3} words." for i in range(40))
# Per placement: the environment of its fleet (KVPUSH_*) and whether engines relay events.
MODES: dict[str, tuple[dict[str, str], bool]] = {
    "least-loaded": ({"SCHEDULER_PREFIX_AFFINITY": "0",
                      "SCHEDULER_DECODE_ALONE_TOKENS": "0"}, True),
    "remembered": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                    "SCHEDULER_DECODE_ALONE_TOKENS": "0"}, False),
    "kv-events": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                   "SCHEDULER_DECODE_ALONE_TOKENS": "0"}, True),
    "kv-events+decode-alone": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                                "SCHEDULER_DECODE_ALONE_TOKENS": "256"}, True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench multiturn`` (with the common ``--out``)."""
    p.add_argument("--conversations", type=int, default=8, help="multiturn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--parallel", type=int, default=2,
                   help="multiturn: conversations in flight at once")
    p.add_argument("--multiturn-kv-cache-gib", type=float, default=0.012,
                   help="multiturn: KV cache of each engine (GiB; the default holds about "
                        "6,000 tiny tokens, so conversations evict each other)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"multiturn: placements to run, of {','.join(MODES)}")


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """Stream one chat turn; (seconds to the first token, the answer's text)."""
    import httpx

    t0 = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                first = first or time.monotonic() - t0
                parts.append(delta["content"])
    return first or time.monotonic() - t0, "".join(parts)


def _conversation(url: str, idx: int, turns: int, ttfts: list[float]) -> None:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {idx}, question {t}: "
                         + " ".join(f"item{idx}_{t}_{k}" for k in range(40))})
        ttft, answer = _chat(url, messages, 16)
        if t > 0:
            ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})


def _counters(stack: Any) -> dict[str, float]:
    from kvpush.services.engine.status import metric_sum, scrape

    out = {"cache_hit": 0.0, "external": 0.0, "computed": 0.0, "pushed_bytes": 0.0,
           "prefill_requests": 0.0}
    for eng in stack.decodes:
        s = scrape(eng.url, timeout_s=5)
        name = "vllm:prompt_tokens_by_source_total"
        out["cache_hit"] += metric_sum(s, name, source="local_cache_hit")
        out["external"] += metric_sum(s, name, source="external_kv_transfer")
        out["computed"] += metric_sum(s, name, source="local_compute")
    for eng in stack.prefills:
        s = scrape(eng.url, timeout_s=5)
        out["pushed_bytes"] += metric_sum(s, "kvpush_kv_bytes_pushed_total")
        out["prefill_requests"] += metric_sum(s, "vllm:request_success_total")
    return out


def run_mode(mode: str, conversations: int, turns: int, parallel: int,
             run_dir: Path, kv_cache_gib: float = 1.0, quiet_wait_s: float = 90.0
             ) -> dict[str, Any]:
    """One fleet with one placement: start it, run the conversations, stop it."""
    from kvpush.services.local.ports import free_port_pair
    from kvpush.services.local.stack import LocalStack, stack_settings

    env, events = MODES[mode]
    for k in ("SCHEDULER_PREFIX_AFFINITY", "SCHEDULER_DECODE_ALONE_TOKENS"):
        os.environ.pop(f"KVPUSH_{k}", None)
    os.environ.update({f"KVPUSH_{k}": v for k, v in env.items()})
    settings = stack_settings(
        connector="kvpush", model="tiny", port=free_port_pair(),
        prefill_port=free_port_pair(), decode_port=free_port_pair(),
        redis_port=free_port_pair(),
    ).model_copy(update={"run_dir": run_dir.resolve(), "redis_url": None,
                         "stack_prefill_engines": 1, "stack_decode_engines": 2})
    stack = LocalStack(settings, kv_cache_gib=kv_cache_gib,
                       engine_overrides={"ready_timeout_s": 600.0, "kv_events": events})
    stack.start()
    try:
        _chat(stack.url, [{"role": "user", "content": "warm up"}], 4)
        load, quiet = wait_for_quiet(quiet_wait_s)
        before = _counters(stack)
        ttfts: list[float] = []
        t0 = time.monotonic()
        pending = list(range(conversations))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    idx = pending.pop(0)
                _conversation(stack.url, idx, turns, ttfts)

        threads = [threading.Thread(target=worker) for _ in range(max(1, parallel))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        took = time.monotonic() - t0
        time.sleep(2)  # engines publish their counters asynchronously
        after = _counters(stack)
    finally:
        stack.stop()
    d = {k: after[k] - before[k] for k in after}
    prompt = d["cache_hit"] + d["external"] + d["computed"]
    return {
        "mode": mode, "load_avg": load, "quiet": quiet, "seconds": round(took, 1),
        "prompt_tokens": int(prompt),
        "prefix_hit_rate": d["cache_hit"] / prompt if prompt else 0.0,
        "pushed_mib": d["pushed_bytes"] / 2**20,
        "prefill_requests": int(d["prefill_requests"]),
        "follow_up_turns": len(ttfts),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
    }


def markdown(rows: list[dict[str, Any]], conversations: int, turns: int,
             parallel: int, kv_cache_gib: float = 1.0) -> str:
    """The report: one row per placement, and each against least-loaded."""
    lines = [
        f"{conversations} conversations x {turns} turns, {parallel} in flight, chat with a "
        f"shared system prompt; kvpush 1P2D (tiny), {kv_cache_gib:g} GiB of KV cache per "
        "engine. Prefix hits: decode prompt tokens taken from the decode's own prefix cache. "
        "TTFT over turns 2 and later (streamed).", "",
        "| placement | load avg | prompt tokens | prefix hits | KV pushed | prefill requests "
        "| TTFT mean | TTFT p50 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "" if r["quiet"] else " (loaded)"
        lines.append(
            f"| {r['mode']} | {r['load_avg']:.2f}{mark} | {r['prompt_tokens']} | "
            f"{100 * r['prefix_hit_rate']:.0f} % | {r['pushed_mib']:.1f} MiB | "
            f"{r.get('prefill_requests', '')} | "
            f"{r['ttft_mean_ms']:.1f} ms | {r['ttft_p50_ms']:.1f} ms |")
    by = {r["mode"]: r for r in rows}
    base = by.get("least-loaded")
    if base and base["pushed_mib"] and base["ttft_mean_ms"]:
        lines.append("")
        for r in rows:
            if r is not base and r["ttft_mean_ms"]:
                lines.append(f"- {r['mode']} against least-loaded: KV pushed "
                             f"{r['pushed_mib'] / base['pushed_mib']:.2f}x, TTFT mean "
                             f"{r['ttft_mean_ms'] / base['ttft_mean_ms']:.2f}x.")
    return "\n".join(lines) + "\n"


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench multiturn``."""
    out = Path(args.out or "out/multiturn")
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown multiturn modes {unknown}; use {list(MODES)}")
    gib = args.multiturn_kv_cache_gib
    wait = args.quiet_wait_s if args.quiet_wait_s is not None else 90.0
    rows = [run_mode(mode, args.conversations, args.turns, args.parallel, out / mode, gib,
                     wait) for mode in modes]
    (out / "multiturn.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows, args.conversations, args.turns, args.parallel, gib)
    (out / "multiturn.md").write_text(md)
    print(md)
    return 0
