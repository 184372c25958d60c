"""``kvpush bench multiturn``: multi-turn chat with shared prefixes on a 1P2D kvpush fleet
whose KV caches are small enough to evict, placements or history strategies side by side
in one run, each on a fleet of its own.

Placements (the default ``--modes``): least-loaded, remembered placement (where a prefix
went last), placement on the engines' KV events, and KV events with conditional
disaggregation at 256 tokens. Strategies for a turn's history (``--modes
recompute,history-push,history-push-always,decode-alone``), all on KV-event placement:
prefill recomputes what it does not hold; the engine holding more of it pushes it to
prefill where the schedulers' cost model says it pays (past
``KVPUSH_SCHEDULER_HISTORY_PUSH_TOKENS``), or always past that threshold; decode computes
every turn whose history it holds alone.

Each conversation keeps a shared system prompt and grows every turn by the model's answer
and new input, so every turn's prompt starts with the whole previous one: a user message
(chat), or a tool's output and a short instruction (``--shape agent``). Per mode it reports
the prompt tokens each role computed, took from its own cache and received by push, the KV
bytes moved each way, the requests prefill served, and the TTFT of every turn (streamed).
The machine's load average is recorded before each fleet and a loaded start is marked.
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

from kvpush.common.history_cost import HistoryChoice
from kvpush.loadtest.bench_probes import wait_for_quiet

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a terse assistant. " + " ".join(
    f"Rule {i}: answer in at most {i + 3} words." for i in range(40))
# Per placement: the environment of its fleet (KVPUSH_*) and whether engines relay events.
MODES: dict[str, tuple[dict[str, str], bool]] = {
    "least-loaded": ({"SCHEDULER_PREFIX_AFFINITY": "0", "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                      "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, True),
    "remembered": ({"SCHEDULER_PREFIX_AFFINITY": "1", "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                    "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, False),
    "kv-events": ({"SCHEDULER_PREFIX_AFFINITY": "1", "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                   "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, True),
    "kv-events+decode-alone": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                                "SCHEDULER_DECODE_ALONE_TOKENS": "256",
                                "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, True),
    "recompute": ({"SCHEDULER_PREFIX_AFFINITY": "1", "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                   "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, True),
    # The setting's default threshold unless --history-push-tokens names one; the cost
    # model chooses past it (common/history_cost.py), or every history is pushed (always).
    "history-push": ({"SCHEDULER_PREFIX_AFFINITY": "1", "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                      "SCHEDULER_HISTORY_COST_MODEL": "1"}, True),
    "history-push-always": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                             "SCHEDULER_DECODE_ALONE_TOKENS": "0",
                             "SCHEDULER_HISTORY_COST_MODEL": "0"}, True),
    "decode-alone": ({"SCHEDULER_PREFIX_AFFINITY": "1",
                      "SCHEDULER_DECODE_ALONE_TOKENS": str(2**20),
                      "SCHEDULER_HISTORY_PUSH_TOKENS": "0"}, True),
}
PLACEMENTS = "least-loaded,remembered,kv-events,kv-events+decode-alone"
STRATEGIES = ("recompute", "history-push", "history-push-always", "decode-alone")
_ENV = ("SCHEDULER_PREFIX_AFFINITY", "SCHEDULER_DECODE_ALONE_TOKENS",
        "SCHEDULER_HISTORY_PUSH_TOKENS", "SCHEDULER_HISTORY_COST_MODEL")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench multiturn`` (with the common ``--out``)."""
    p.add_argument("--conversations", type=int, default=8, help="multiturn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--parallel", type=int, default=2,
                   help="multiturn: conversations in flight at once")
    p.add_argument("--multiturn-kv-cache-gib", type=float, default=0.012,
                   help="multiturn: KV cache of each engine (GiB; the default holds about "
                        "6,000 tiny tokens, so conversations evict each other)")
    p.add_argument("--modes", default=PLACEMENTS,
                   help=f"multiturn: placements or strategies to run, of {','.join(MODES)}")
    p.add_argument("--shape", choices=("chat", "agent"), default="chat",
                   help="multiturn: each turn adds a user message (chat), or a tool's output "
                        "and a short instruction (agent)")
    p.add_argument("--multiturn-model", default="tiny",
                   help="multiturn: the model the fleet serves (tiny, smollm2-135m, ...)")
    p.add_argument("--answer-tokens", type=int, default=16,
                   help="multiturn: tokens of each answer")
    p.add_argument("--history-push-tokens", type=int, default=None,
                   help="multiturn: KVPUSH_SCHEDULER_HISTORY_PUSH_TOKENS of the history-push "
                        "mode (default: the setting's default)")
    p.add_argument("--interleave", action="store_true",
                   help="multiturn: every conversation's turn t before any turn t+1 (many "
                        "live sessions, each waiting on its tool or user), instead of each "
                        "conversation to its end in turn")
    p.add_argument("--prefill-kv-cache-gib", type=float, default=None,
                   help="multiturn: the prefill engine's KV cache (GiB; default: as every "
                        "engine's), smaller to make it evict the histories decode keeps")


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int,
          tpots: list[float] | None = None) -> tuple[float, str]:
    """Stream one chat turn; (seconds to the first token, the answer's text). The mean
    time per output token after the first goes to ``tpots``."""
    import httpx

    t0 = time.monotonic()
    first: float | None = None
    last = t0
    n = 0
    parts: list[str] = []
    # No model named: the gateway's, whatever the fleet serves.
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/chat/completions", json={
            "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                last = time.monotonic()
                first = first or last - t0
                n += 1
                parts.append(delta["content"])
    if tpots is not None and first is not None and n > 1:
        tpots.append((last - t0 - first) / (n - 1))
    return first or time.monotonic() - t0, "".join(parts)


def _new_input(idx: int, t: int, shape: str) -> str:
    if shape == "agent" and t > 0:
        # A tool's output, then a short instruction: what an agent appends each step.
        rows = "\n".join(f"{idx}-{t}-{k}\tfile_{k}.py\t{(idx * 37 + t * 11 + k) % 997} lines"
                         for k in range(12))
        return f"Tool output:\n{rows}\nNext step {t}: summarize."
    return f"Conversation {idx}, question {t}: " + " ".join(
        f"item{idx}_{t}_{k}" for k in range(40))


def _conversation(url: str, idx: int, turns: int, ttfts: list[tuple[int, float]],
                  shape: str = "chat", answer_tokens: int = 16,
                  tpots: list[float] | None = None) -> None:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(turns):
        messages.append({"role": "user", "content": _new_input(idx, t, shape)})
        ttft, answer = _chat(url, messages, answer_tokens, tpots)
        ttfts.append((t, ttft))
        messages.append({"role": "assistant", "content": answer})


def _counters(stack: Any) -> dict[str, float]:
    from kvpush.services.engine.status import metric_sum, scrape

    out: dict[str, float] = {}
    name = "vllm:prompt_tokens_by_source_total"
    for role, engines in (("decode", stack.decodes), ("prefill", stack.prefills)):
        for eng in engines:
            s = scrape(eng.url, timeout_s=5)
            for key, source in (("cache_hit", "local_cache_hit"),
                                ("external", "external_kv_transfer"),
                                ("computed", "local_compute")):
                out[f"{role}_{key}"] = out.get(f"{role}_{key}", 0.0) + metric_sum(
                    s, name, source=source)
            # Prefill pushes to decode; a decode pushes only histories, to prefill.
            out[f"{role}_pushed_bytes"] = out.get(f"{role}_pushed_bytes", 0.0) + metric_sum(
                s, "kvpush_kv_bytes_pushed_total")
            out[f"{role}_requests"] = out.get(f"{role}_requests", 0.0) + metric_sum(
                s, "vllm:request_success_total")
    gw = scrape(stack.url, timeout_s=5)
    for choice in HistoryChoice:
        out[f"choice_{choice.value}"] = metric_sum(
            gw, "kvpush_gateway_history_decisions_total", choice=choice.value)
    return out


def _pct(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _interleaved(url: str, conversations: int, turns: int, parallel: int,
                 ttfts: list[tuple[int, float]], shape: str, answer_tokens: int,
                 tpots: list[float]) -> None:
    """Turn t of every conversation, ``parallel`` at a time, then turn t+1 of every one."""
    convs = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(conversations)]
    for t in range(turns):
        pending = list(range(conversations))
        lock = threading.Lock()

        def worker(t: int = t, pending: list[int] = pending, lock: threading.Lock = lock
                   ) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    idx = pending.pop(0)
                messages = convs[idx]
                messages.append({"role": "user", "content": _new_input(idx, t, shape)})
                ttft, answer = _chat(url, messages, answer_tokens, tpots)
                with lock:
                    ttfts.append((t, ttft))
                messages.append({"role": "assistant", "content": answer})

        threads = [threading.Thread(target=worker) for _ in range(max(1, parallel))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def run_mode(mode: str, conversations: int, turns: int, parallel: int,
             run_dir: Path, kv_cache_gib: float = 1.0, quiet_wait_s: float = 90.0,
             shape: str = "chat", model: str = "tiny", answer_tokens: int = 16,
             interleave: bool = False, prefill_kv_cache_gib: float | None = None
             ) -> dict[str, Any]:
    """One fleet with one placement or strategy: start it, run the conversations, stop
    it."""
    from kvpush.services.local.ports import free_port_pair
    from kvpush.services.local.stack import LocalStack, stack_settings

    env, events = MODES[mode]
    for k in _ENV:
        os.environ.pop(f"KVPUSH_{k}", None)
    os.environ.update({f"KVPUSH_{k}": v for k, v in env.items()})
    settings = stack_settings(
        connector="kvpush", model=model, port=free_port_pair(),
        prefill_port=free_port_pair(), decode_port=free_port_pair(),
        redis_port=free_port_pair(),
    ).model_copy(update={"run_dir": run_dir.resolve(), "redis_url": None,
                         "stack_prefill_engines": 1, "stack_decode_engines": 2})
    stack = LocalStack(settings, kv_cache_gib=kv_cache_gib,
                       engine_overrides={"ready_timeout_s": 600.0, "kv_events": events},
                       # Every turn is measured: a long recomputed history must queue, not
                       # be shed, or the strategies would serve different turns.
                       gateway_overrides={"gateway_shed_ttft_s": 0.0},
                       role_overrides={"prefill": {"kv_cache_gib": prefill_kv_cache_gib}}
                       if prefill_kv_cache_gib else {})
    stack.start()
    try:
        _chat(stack.url, [{"role": "user", "content": "warm up"}], 4)
        load, quiet = wait_for_quiet(quiet_wait_s)
        before = _counters(stack)
        ttfts: list[tuple[int, float]] = []
        tpots: list[float] = []
        t0 = time.monotonic()
        pending = list(range(conversations))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    idx = pending.pop(0)
                _conversation(stack.url, idx, turns, ttfts, shape, answer_tokens, tpots)

        if interleave:
            _interleaved(stack.url, conversations, turns, parallel, ttfts, shape,
                         answer_tokens, tpots)
        else:
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
    prompt = d["decode_cache_hit"] + d["decode_external"] + d["decode_computed"]
    follow = [x for t, x in ttfts if t > 0]
    by_turn = {t: [x for u, x in ttfts if u == t] for t in range(turns)}
    return {
        "mode": mode, "model": model, "shape": shape, "interleave": interleave,
        "prefill_kv_cache_gib": prefill_kv_cache_gib, "load_avg": load, "quiet": quiet,
        "seconds": round(took, 1),
        "prompt_tokens": int(prompt),
        "prefix_hit_rate": d["decode_cache_hit"] / prompt if prompt else 0.0,
        "pushed_mib": d["prefill_pushed_bytes"] / 2**20,
        "history_mib": d["decode_pushed_bytes"] / 2**20,
        "prefill_requests": int(d["prefill_requests"]),
        # Prompt tokens computed anywhere: what the strategies trade against moving KV.
        "computed_tokens": int(d["prefill_computed"] + d["decode_computed"]),
        "prefill_computed": int(d["prefill_computed"]),
        "prefill_received": int(d["prefill_external"]),
        "decode_computed": int(d["decode_computed"]),
        "follow_up_turns": len(follow),
        "ttft_mean_ms": 1000 * statistics.fmean(follow) if follow else None,
        "ttft_p50_ms": 1000 * statistics.median(follow) if follow else None,
        "ttft_p90_ms": 1000 * _pct(follow, 0.9) if follow else None,
        "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
        "tpot_p90_ms": 1000 * _pct(tpots, 0.9) if tpots else None,
        # The schedulers' cost model, per placement a holder had more than prefill.
        "choices": {c.value: int(d[f"choice_{c.value}"]) for c in HistoryChoice
                    if d[f"choice_{c.value}"]},
        "turns": {t: {"p50_ms": 1000 * statistics.median(xs), "p90_ms": 1000 * _pct(xs, 0.9)}
                  for t, xs in by_turn.items() if xs},
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def strategy_markdown(rows: list[dict[str, Any]], conversations: int, turns: int,
                      parallel: int, kv_cache_gib: float) -> str:
    """The report of the history strategies: costs per mode, then TTFT per turn."""
    r0 = rows[0]
    order = "every conversation's turn before the next turn" if r0.get("interleave") \
        else "each conversation to its end in turn"
    pre = r0.get("prefill_kv_cache_gib")
    caches = f"{kv_cache_gib:g} GiB of KV cache per decode, {pre:g} GiB on prefill" if pre \
        else f"{kv_cache_gib:g} GiB of KV cache per engine"
    lines = [
        f"{conversations} conversations x {turns} turns ({r0['shape']}, {order}), "
        f"{parallel} in flight; kvpush 1P2D ({r0['model']}), {caches}. "
        "Computed: prompt tokens computed by prefill and decode together; received: the "
        "history tokens prefill took by push; KV moved: prefill to decode, and holders to "
        "prefill. TTFT over turns 2 and later (streamed). Choices: the schedulers' history "
        "cost model, per placement where a holder had more of the prompt than prefill.", "",
        "| strategy | load avg | computed | prefill computed | prefill received | decode "
        "computed | KV to decode | KV to prefill | TTFT p50 | TTFT p90 | TPOT p50 / p90 "
        "| choices |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "" if r["quiet"] else " (loaded)"
        lines.append(
            f"| {r['mode']} | {r['load_avg']:.2f}{mark} | {r['computed_tokens']} | "
            f"{r['prefill_computed']} | {r['prefill_received']} | {r['decode_computed']} | "
            f"{r['pushed_mib']:.1f} MiB | {r['history_mib']:.1f} MiB | "
            f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms | "
            f"{_ms(r.get('tpot_p50_ms'))} / {_ms(r.get('tpot_p90_ms'))} | "
            + (", ".join(f"{k} {v}" for k, v in (r.get("choices") or {}).items()) or "-")
            + " |")
    lines += ["", "TTFT p50 / p90 by turn:", "",
              "| turn | " + " | ".join(r["mode"] for r in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for t in range(turns):
        cells = [f"{c['p50_ms']:.0f} / {c['p90_ms']:.0f} ms"
                 if (c := r["turns"].get(t) or r["turns"].get(str(t))) else "-" for r in rows]
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
    if args.history_push_tokens is not None:
        for mode in ("history-push", "history-push-always"):
            MODES[mode][0]["SCHEDULER_HISTORY_PUSH_TOKENS"] = str(args.history_push_tokens)
    rows = [run_mode(mode, args.conversations, args.turns, args.parallel, out / mode, gib,
                     wait, args.shape, args.multiturn_model, args.answer_tokens,
                     args.interleave, args.prefill_kv_cache_gib)
            for mode in modes]
    (out / "multiturn.json").write_text(json.dumps(rows, indent=1))
    if set(modes) <= set(STRATEGIES):
        md = strategy_markdown(rows, args.conversations, args.turns, args.parallel, gib)
    else:
        md = markdown(rows, args.conversations, args.turns, args.parallel, gib)
    (out / "multiturn.md").write_text(md)
    print(md)
    return 0
