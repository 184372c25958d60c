"""``kvpush up --autoscale``: a load step past one decode engine's KV blocks adds a decode
engine, and after the load the planner drains it and the stack removes it, with no request
failed throughout (real engines, real Redis, the planner in the stack's scheduler).

It boots a stack of its own: the stack resizes itself, which no shared fleet may do under
the other tests. Its engines have a cache of about 3,000 tokens, so six concurrent requests
fill decode's blocks; the planner's latency objectives are set out of reach so that the KV
blocks alone drive it, and shedding waits up to the request deadline: the test is about
what a resize costs the requests, not about admission.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from kvpush.services.engine.status import metric_sum, scrape
from tests.fleet_util import kvpush_up, stream_request
from tests.polling import until

CLIENTS = 6
PROMPT = "# autoscale\n" + "value = compute(value) + 1\n" * 24  # ~200 tokens


class ClosedLoop:
    """``clients`` threads each sending one request after another until stopped (streamed,
    or unary ones)."""

    def __init__(self, url: str, clients: int, max_tokens: int, stream: bool = True) -> None:
        self.url, self.max_tokens, self.stream = url, max_tokens, stream
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def start(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=180) as client:
            n = 0
            while not self.stop.is_set():
                prompt = f"{PROMPT}# {i}.{n}\n"
                n += 1
                if self.stream:
                    out = stream_request(client, self.url, prompt, self.max_tokens)
                    ok = out["status"] == 200 and out["done"] and not out["error"]
                else:
                    out = unary_request(client, self.url, prompt, self.max_tokens)
                    ok = out["status"] == 200 and out["tokens"] == self.max_tokens
                with self._lock:
                    self.outcomes["ok" if ok else "failed"] += 1
                    if not ok:
                        self.errors.append(str(out))

    def join(self) -> Counter[str]:
        self.stop.set()
        for t in self._threads:
            t.join(240)
        return self.outcomes


def unary_request(client: httpx.Client, url: str, prompt: str, max_tokens: int
                  ) -> dict[str, object]:
    """One non-streaming completion (``ignore_eos``: always ``max_tokens`` tokens)."""
    resp = client.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    usage = resp.json().get("usage") or {} if resp.status_code == 200 else {}
    return {"status": resp.status_code, "tokens": usage.get("completion_tokens"),
            "error": None if resp.status_code == 200 else resp.text[:300]}


@pytest.mark.slow
def test_a_unary_load_step_past_the_tpot_objective_adds_a_decode_engine(tmp_path: Path
                                                                        ) -> None:
    """Batch jobs, agents and most SDK calls are unary: their decode slowdown must reach
    the planner as a stream's does. The gateway times a unary request's first token by
    prefill's answer and its time per output token from there to the end. Only unary
    requests are sent, the KV blocks are plenty and the TTFT objective is out of reach,
    so the time per output token alone can add the engine (an objective of 1 ms, which any
    CPU decode step passes). Its own stack, for the reason the module gives."""
    env = {"KVPUSH_PLANNER_PERIOD_S": "0.5", "KVPUSH_PLANNER_UP_STABLE_S": "1",
           "KVPUSH_PLANNER_ITL_S": "0.001", "KVPUSH_PLANNER_TTFT_S": "600",
           "KVPUSH_GATEWAY_SHED_TTFT_S": "120", "KVPUSH_SCHEDULER_QUEUE_TIMEOUT_S": "120"}
    with kvpush_up(tmp_path, 1, 1, args=("--autoscale", "--max-decode", "2",
                                         "--max-prefill", "1"),
                   max_decode=2, **env) as fleet:
        load = ClosedLoop(fleet.url, 3, max_tokens=32, stream=False).start()
        try:
            until(lambda: len(fleet.urls("decode")) == 2 or load.outcomes["failed"],
                  "a second decode engine registered", 240)
            fleet.track()
        finally:
            step = load.join()
        assert step["failed"] == 0 and step["ok"] > 0, (step, load.errors[:3])
        log = fleet.log_tail(50_000)
        assert re.search(r"time per output token \d+ ms over the 1 ms objective", log), \
            log[-3000:]
        assert "kvpush autoscale: added decode-" in log


@pytest.mark.slow
def test_a_load_step_adds_a_decode_engine_and_scale_down_drains_it(tmp_path: Path) -> None:
    env = {"KVPUSH_ENGINE_KV_CACHE_GIB": "0.006", "KVPUSH_PLANNER_PERIOD_S": "0.5",
           "KVPUSH_PLANNER_UP_STABLE_S": "1", "KVPUSH_PLANNER_DOWN_STABLE_S": "5",
           "KVPUSH_PLANNER_ITL_S": "60", "KVPUSH_PLANNER_TTFT_S": "600",
           "KVPUSH_GATEWAY_SHED_TTFT_S": "120", "KVPUSH_SCHEDULER_QUEUE_TIMEOUT_S": "120"}
    with kvpush_up(tmp_path, 1, 1, args=("--autoscale", "--max-decode", "2",
                                         "--max-prefill", "1"),
                   max_decode=2, **env) as fleet:
        first = fleet.urls("decode")
        load = ClosedLoop(fleet.url, CLIENTS, max_tokens=160).start()
        try:
            until(lambda: len(fleet.urls("decode")) == 2 or load.outcomes["failed"],
                  "a second decode engine registered", 300)
            assert not load.outcomes["failed"], load.errors[:3]
            added = next(u for u in fleet.urls("decode") if u not in first)
            fleet.track()  # its processes must be gone at the end too
            until(lambda: metric_sum(scrape(added, timeout_s=5),
                                     "vllm:request_success_total") > 0,
                  "the added decode engine serving requests", 180)
        finally:
            step = load.join()
        assert step["failed"] == 0 and step["ok"] > CLIENTS, (step, load.errors[:3])
        assert "kvpush autoscale: added decode-" in fleet.log_tail(20_000)
        # After the step, one client: the planner finds room for one decode fewer, the
        # stack drains the added engine and removes it, while this client is served.
        trickle = ClosedLoop(fleet.url, 1, max_tokens=32).start()
        try:
            until(lambda: "kvpush autoscale: removed decode-" in fleet.log_tail(50_000),
                  "the added decode engine removed", 240)
        finally:
            after = trickle.join()
        assert after["failed"] == 0 and after["ok"] > 0, (after, trickle.errors[:3])
        log = fleet.log_tail(50_000)
        assert "kvpush autoscale: draining decode-" in log
        assert re.search(r"kvpush autoscale: removed decode-\d+ \(drained\)", log), log[-3000:]
        assert fleet.urls("decode") == first
        fleet.wait_idle(60)
        assert fleet.reservations() == []
