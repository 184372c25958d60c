"""``kvpush bench conditional``: where conditional disaggregation pays, the measurement behind
``KVPUSH_SCHEDULER_DECODE_ALONE_TOKENS``.

A 1P1D kvpush fleet (tiny) twice, side by side in one run: once with every request
disaggregated (threshold 0) and once with decode computing any uncached tail itself
(threshold unbounded). On each, one long stream keeps decoding in the background, as on a
busy decode engine; each measured request's prompt is a prefix decode already holds (sent
once before, through P/D) plus a new tail of T tokens. Per tail length and path it reports
the measured request's TTFT and the longest gap between two tokens of the background stream
while the request was being served: the decode step a tail computed on decode holds up,
which a disaggregated request does not.

Decode computing a tail alone saves the prefill pass and the push; it costs every stream on
that decode one longer step. The default threshold is the longest tail whose stall stays
within the TPOT objective an interactive service would set (50 ms, as ``bench goodput``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.loadtest.bench_probes import wait_for_quiet

logger = logging.getLogger(__name__)

PATHS = {"disaggregated": "0", "decode-alone": str(2**31 - 1)}
PREFIX_TOKENS = 768


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush bench conditional`` (with the common ``--out``)."""
    p.add_argument("--tails", default="32,64,128,256,512,1024",
                   help="conditional: uncached tail lengths in tokens")
    p.add_argument("--conditional-reps", type=int, default=5,
                   help="conditional: requests per tail length and path")


class _Background:
    """One long greedy stream through the front; the times its tokens arrived."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Background:
        self._thread.start()
        while not self.times:
            time.sleep(0.05)
        return self

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            with httpx.Client(timeout=300) as c, c.stream(
                    "POST", f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": [7] * 64, "max_tokens": 1900,
                        "temperature": 0, "stream": True, "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.monotonic())
                    if self._stop.is_set():
                        return

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest gap between two background tokens that arrived in [t0, t1] (with
        the one before t0, so a stall spanning t0 counts)."""
        ts = [t for t in self.times if t <= t1]
        i = next((k for k, t in enumerate(ts) if t >= t0), len(ts))
        window = ts[max(0, i - 1):]
        return max((b - a for a, b in itertools.pairwise(window)), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _first_token(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of ``prompt``."""
    import httpx

    t0 = time.monotonic()
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, "ignore_eos": True}) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                ttft = time.monotonic() - t0
                for _ in lines:
                    pass
                return ttft
    raise RuntimeError("stream ended before its first token")


def run_path(path: str, tails: list[int], reps: int, run_dir: Path,
             quiet_wait_s: float = 90.0) -> list[dict[str, Any]]:
    """One fleet, every tail length on it."""
    from kvpush.services.local.ports import free_port_pair
    from kvpush.services.local.stack import LocalStack, stack_settings

    os.environ["KVPUSH_SCHEDULER_DECODE_ALONE_TOKENS"] = PATHS[path]
    settings = stack_settings(
        connector="kvpush", model="tiny", port=free_port_pair(),
        prefill_port=free_port_pair(), decode_port=free_port_pair(),
        redis_port=free_port_pair(),
    ).model_copy(update={"run_dir": run_dir.resolve(), "redis_url": None})
    stack = LocalStack(settings, kv_cache_gib=1.0, engine_overrides={"ready_timeout_s": 600.0})
    stack.start()
    rows: list[dict[str, Any]] = []
    try:
        _first_token(stack.url, list(range(100, 400)))  # warm both paths' kernels
        load, quiet = wait_for_quiet(quiet_wait_s)
        bg = _Background(stack.url).start()
        try:
            for tail in tails:
                ttfts, stalls = [], []
                for rep in range(reps):
                    rng = random.Random(f"{tail}/{rep}")  # a prefix no other cell shares
                    prefix = [rng.randrange(100, 8000) for _ in range(PREFIX_TOKENS)]
                    _first_token(stack.url, prefix)  # P/D: decode now holds the prefix
                    time.sleep(0.3)  # its KV events reach Redis
                    t0 = time.monotonic()
                    ttft = _first_token(stack.url, prefix + [5 + i % 90 for i in range(tail)])
                    ttfts.append(ttft)
                    stalls.append(bg.longest_gap(t0, t0 + ttft))
                rows.append({
                    "path": path, "tail": tail, "load_avg": load, "quiet": quiet,
                    "ttft_ms": 1000 * statistics.median(ttfts),
                    "stall_ms": 1000 * statistics.median(stalls),
                })
                logger.info("%s tail %d: %s", path, tail, rows[-1])
        finally:
            bg.stop()
    finally:
        stack.stop()
        os.environ.pop("KVPUSH_SCHEDULER_DECODE_ALONE_TOKENS", None)
    return rows


def markdown(rows: list[dict[str, Any]], reps: int) -> str:
    """The report: per tail, both paths' TTFT and stall side by side."""
    by = {(r["path"], r["tail"]): r for r in rows}
    tails = sorted({r["tail"] for r in rows})
    loads = sorted({(r["path"], r["load_avg"], r["quiet"]) for r in rows})
    lines = [
        f"kvpush 1P1D (tiny), a {PREFIX_TOKENS}-token prefix decode holds plus a new tail; "
        f"median of {reps} requests per cell, one background stream decoding throughout. "
        "Stall: the longest gap between two background tokens while the request was "
        "served. Load average at each fleet's start: "
        + ", ".join(f"{p} {la:.2f}{'' if q else ' (loaded)'}" for p, la, q in loads) + ".",
        "", "| uncached tail | TTFT P/D | TTFT decode alone | stall P/D | "
        "stall decode alone |", "|---|---|---|---|---|"]
    for t in tails:
        d, a = by.get(("disaggregated", t)), by.get(("decode-alone", t))
        if d is None or a is None:
            continue
        lines.append(f"| {t} | {d['ttft_ms']:.1f} ms | {a['ttft_ms']:.1f} ms | "
                     f"{d['stall_ms']:.1f} ms | {a['stall_ms']:.1f} ms |")
    return "\n".join(lines) + "\n"


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench conditional``."""
    out = Path(args.out or "out/conditional")
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tails = [int(t) for t in args.tails.split(",") if t]
    rows: list[dict[str, Any]] = []
    for path in PATHS:
        rows += run_path(path, tails, args.conditional_reps, out / path,
                         args.quiet_wait_s if args.quiet_wait_s is not None else 90.0)
        (out / "conditional.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows, args.conditional_reps)
    (out / "conditional.md").write_text(md)
    print(md)
    return 0
