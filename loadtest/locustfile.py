"""Locust load test of an OpenAI-compatible kvpush gateway (or any deployment).

Streams ``/v1/completions`` and reports TTFT (first content token), TPOT, ITL and end-to-end
latency as custom locust metrics, next to the HTTP request itself. With ``--turns N``,
each task is instead a conversation of N streamed ``/v1/responses`` turns, each naming the
one before as ``previous_response_id``, with the TTFT of every turn reported apart (the
history grows each turn; the gateway sends it whole to the engines). Two modes:

* closed loop (default): each locust user sends one request after another;
* open loop (``--qps R``): one user launches requests at Poisson arrivals of rate R, whatever
  the latency, which is how ``vllm bench serve`` drives a server.

Headless with reports::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless \
        -u 4 -r 4 -t 60s --csv out/kvpush --html out/kvpush.html \
        --input-len 512 --output-len 64 --api-keys "$KEY_A,$KEY_B"
"""

from __future__ import annotations

import itertools
import json
import random
import time

import gevent
from locust import HttpUser, events, task
from locust.env import Environment
from locust.runners import STATE_RUNNING, STATE_SPAWNING

from kvpush.loadtest.prompts import Workload, completion_body
from kvpush.loadtest.sse_metrics import StreamTimings, consume_sse


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("kvpush")
    group.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    group.add_argument("--output-len", type=int, default=64, help="output tokens")
    group.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    group.add_argument("--qps", type=float, default=0.0, help="open-loop Poisson rate; 0: closed")
    group.add_argument("--model", default="", help="model name; default: first of /v1/models")
    group.add_argument("--api-keys", default="", help="comma-separated keys, one per tenant")
    group.add_argument("--vocab-high", type=int, default=4000, help="prompt ids drawn below this")
    group.add_argument("--turns", type=int, default=0,
                       help="conversations of this many /v1/responses turns; 0: completions")


_counter = itertools.count()


def _report(env: Environment, name: str, seconds: float | None, tenant: str) -> None:
    if seconds is None:
        return
    env.events.request.fire(
        request_type="METRIC", name=f"{name} [{tenant}]", response_time=seconds * 1000.0,
        response_length=0, exception=None, context={},
    )


class CompletionUser(HttpUser):
    """Sends streaming completions; open loop when ``--qps`` is set."""

    abstract = False

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.workload = Workload(
            input_len=opts.input_len, output_len=opts.output_len, seed=opts.seed,
            vocab_high=opts.vocab_high,
        )
        self.model = opts.model or self._first_model()
        keys = [k for k in opts.api_keys.split(",") if k]
        self.keys = keys or [""]
        self.rng = random.Random(opts.seed)
        self.qps = opts.qps
        self.turns = opts.turns

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"/v1/models: {resp.status_code}")
                return "tiny"
            return resp.json()["data"][0]["id"]

    def wait_time(self) -> float:
        return 0.0

    @task
    def send(self) -> None:
        if self.qps <= 0:
            self.one_request(next(_counter))
            return
        # Open loop: arrivals never wait for earlier requests to finish. When the run
        # stops, arrivals stop and the requests in flight finish (instead of locust waiting
        # out its whole --stop-timeout for a task that never returns).
        runner = self.environment.runner
        flying: list[gevent.Greenlet] = []
        while runner is None or runner.state in (STATE_SPAWNING, STATE_RUNNING):
            flying = [g for g in flying if not g.dead]
            flying.append(gevent.spawn(self.one_request, next(_counter)))
            gevent.sleep(self.rng.expovariate(self.qps))
        gevent.joinall(flying)

    def one_request(self, index: int) -> None:
        key = self.keys[index % len(self.keys)]
        tenant = f"tenant{index % len(self.keys)}" if key else "anon"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if self.turns > 0:
            self.conversation(index, headers, tenant)
            return
        body = completion_body(self.model, self.workload, index)
        start = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, headers=headers, stream=True,
            name="/v1/completions", catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            timings: StreamTimings = consume_sse(resp.iter_lines(), start)
            if timings.error:
                resp.failure(timings.error)
                return
            if timings.first_token is None and not timings.output_tokens:
                resp.failure("stream ended without a token")
                return
        env = self.environment
        # A random-weight model can generate tokens that detokenize to no text at all; such
        # a request succeeded but has no content token to time TTFT/TPOT from.
        _report(env, "TTFT", timings.ttft, tenant)
        _report(env, "TPOT", timings.tpot, tenant)
        _report(env, "E2E", timings.e2e, tenant)
        for gap in timings.itls:
            _report(env, "ITL", gap, tenant)

    def conversation(self, index: int, headers: dict[str, str], tenant: str) -> None:
        """One conversation of ``--turns`` streamed turns, chained by
        ``previous_response_id``; a failed turn ends it."""
        previous = None
        for turn in range(1, self.turns + 1):
            words = " ".join(f"w{(index * 7919 + turn * 104729 + i) % 997}"
                             for i in range(self.workload.input_len))
            body = {"model": self.model, "input": f"Turn {turn}: {words}", "stream": True,
                    "max_output_tokens": self.workload.output_len, "temperature": 0}
            if previous is not None:
                body["previous_response_id"] = previous
            start = time.perf_counter()
            first = None
            with self.client.post("/v1/responses", json=body, headers=headers, stream=True,
                                  name=f"/v1/responses turn {turn}",
                                  catch_response=True) as resp:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    return
                kind, previous = "", None
                for raw in resp.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif kind == "response.output_text.delta" and first is None:
                        first = time.perf_counter()
                    elif kind in ("response.completed", "response.incomplete") \
                            and line.startswith("data: "):
                        previous = json.loads(line[6:])["response"]["id"]
                if previous is None:
                    resp.failure(f"turn {turn} ended without its response ({kind})")
                    return
            _report(self.environment, f"TTFT turn {turn}",
                    None if first is None else first - start, tenant)
