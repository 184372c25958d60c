"""What a benchmark point reads from the machine and the systems under test: the load
average, the engines' transfer counters, the connector's push records, a greedy answer."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# A point is taken on a quiet machine only: 1-minute load average at most this per core
# when it starts (engines idle between points add nothing).
QUIET_LOAD_PER_CPU = 0.5


# Stock NIXL metrics: pull posts READs on decode, stock push WRITEs on prefill; both sides
# are scraped and summed (only the posting side records).
NIXL_METRICS = {
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "xfers": "vllm:nixl_bytes_transferred_count",
    "xfer_time_s": "vllm:nixl_xfer_time_seconds_sum",
    "post_time_s": "vllm:nixl_post_time_seconds_sum",
    "descriptors": "vllm:nixl_num_descriptors_sum",
    "failed_transfers": "vllm:nixl_num_failed_transfers_total",
    "kv_expired": "vllm:nixl_num_kv_expired_reqs_total",
}
EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"


def greedy(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float
           ) -> str:
    """Greedy, non-streamed completion text of a token-id prompt."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": False}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["text"])


def scrape_counters(urls: list[str]) -> dict[str, float]:
    """Stock NIXL counters summed over ``urls``, plus decode-side external KV tokens."""
    from kvpush.services.engine.status import MetricsUnavailable, metric_sum, scrape

    out = dict.fromkeys([*NIXL_METRICS, "external_tokens"], 0.0)
    for i, url in enumerate(urls):
        try:
            samples = scrape(url, timeout_s=5.0)
        except MetricsUnavailable as exc:
            logger.warning("metrics of %s unavailable: %s", url, exc)
            continue
        for key, name in NIXL_METRICS.items():
            out[key] += metric_sum(samples, name)
        if i == len(urls) - 1:  # decode is last
            out["external_tokens"] += metric_sum(samples, EXTERNAL_TOKENS,
                                                 source="external_kv_transfer")
    return out


def settle_counters(urls: list[str], before: dict[str, float], settle_s: float = 6.0
                    ) -> dict[str, float]:
    """Counters after a point; engines publish metrics asynchronously, so wait until two
    scrapes a second apart agree (at most ``settle_s``)."""
    deadline = time.monotonic() + settle_s
    last = scrape_counters(urls)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = scrape_counters(urls)
        if now == last:
            return now
        last = now
    return last


def kvpush_records(path: Path | None, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Transfer records the connector appended to ``path`` after byte ``offset``."""
    if path is None or not path.exists():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    # A line still being written has no newline yet: leave it for the next read.
    cut = data.rfind(b"\n") + 1
    recs = []
    for line in data[:cut].splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs, offset + cut


def kvpush_transfer_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes and exposed transfer time from the connector's push and receive records.

    Exposed time of one request: end of prefill's forward pass over the prompt to its KV
    complete on decode (the receive record's ``exposed_ms``), which includes waiting for
    decode's target when it reached prefill after the forward pass. Layer-wise WRITEs posted
    during that pass are hidden behind it. Records without it (older decode engines) fall
    back to the push side: forward end to PushDone, or a catch-up push's post-to-done time.
    """
    pushes = [r for r in records if r.get("kind") == "push"]
    recvs = [r for r in records if r.get("kind") == "recv"]
    ok = [r for r in pushes if r.get("ok")]
    exposed = [r["exposed_ms"] / 1e3 for r in recvs
               if r.get("ok") and r.get("exposed_ms") is not None]
    for r in ok if not exposed else []:
        if r.get("forward_end_ns") and r.get("notify_ns"):
            exposed.append(max(0, r["notify_ns"] - r["forward_end_ns"]) / 1e9)
        elif r.get("post_to_done_ms") is not None:
            exposed.append(r["post_to_done_ms"] / 1e3)
    return {
        "pushes": len(pushes),
        "push_failures": len(pushes) - len(ok),
        "recvs": len(recvs),
        "recv_failures": sum(1 for r in recvs if not r.get("ok")),
        "bytes": sum(int(r.get("bytes") or 0) for r in ok),
        "descriptors": sum(int(r.get("descriptors") or 0) for r in ok),
        "layerwise_xfers": sum(int(r.get("layerwise_xfers") or 0) for r in ok),
        "xfers": sum(int(r.get("xfers") or 0) for r in ok),
        "exposed_mean_s": sum(exposed) / len(exposed) if exposed else None,
        "post_to_done_mean_ms": (sum(r.get("post_to_done_ms") or 0 for r in ok) / len(ok)
                                 if ok else None),
        "recv_wait_mean_ms": (sum(r.get("wait_ms") or 0 for r in recvs) / len(recvs)
                              if recvs else None),
        "verified": sum(1 for r in recvs if r.get("verified") is not None),
        "verify_failures": sum(1 for r in recvs if r.get("verified") is False),
        "verify_ms_mean_prefill": _mean([r["verify_ms"] for r in pushes if r.get("verified")]),
        "verify_ms_mean_decode": _mean([r["verify_ms"] for r in recvs
                                        if r.get("verified") is not None]),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def wait_for_quiet(timeout_s: float = 90.0) -> tuple[float, bool]:
    """Wait (bounded) for the 1-minute load average to fall to a quiet machine's; returns
    it and whether it got there. A point taken on a loaded machine is marked, not hidden."""
    limit = QUIET_LOAD_PER_CPU * len(os.sched_getaffinity(0))
    deadline = time.monotonic() + timeout_s
    load = os.getloadavg()[0]
    while load > limit and time.monotonic() < deadline:
        time.sleep(2.0)
        load = os.getloadavg()[0]
    if load > limit:
        logger.warning("load average %.2f above %.2f: this point is marked as loaded",
                       load, limit)
    return round(load, 2), load <= limit
