"""``kvpush up`` with two prefills and one decode: requests spread over both prefills, every
prompt token arrives as pushed KV, and a prefill SIGKILLed under load fails no request (they
are placed again on the other)."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e_util import external_kv_tokens
from tests.fleet_util import burst, kvpush_up, served, signal_engine, stream_request
from tests.polling import until

pytestmark = pytest.mark.slow


def test_2p1d_spreads_prefills_pushes_every_token_and_outlives_a_prefill_kill(
        tmp_path: Path) -> None:
    # Decode holds the blocks it reserved for the killed prefill's requests until their
    # push deadline and then until the quarantine's bound (a frozen prefill could still
    # write into them; a killed one never says it will not), and the test waits for that to
    # end. Every request here answers in seconds (a rerouted one within the 5 s liveness
    # bound and one more placement): a 30 s deadline instead of the default 120 s and a
    # 10 s bound instead of 60 s end the wait sooner, and nothing else.
    with kvpush_up(tmp_path, prefill=2, decode=1,
                   KVPUSH_GATEWAY_REQUEST_TIMEOUT_S="30",
                   KVPUSH_ENGINE_QUARANTINE_MAX_S="10") as fleet:
        rows = fleet.rows()
        prefills, (decode,) = fleet.urls("prefill"), fleet.urls("decode")

        # Concurrent requests spread over both prefill engines, and decode computes none of
        # the prompts itself: every prompt token arrives as pushed KV.
        before, ext_before = served(prefills), external_kv_tokens(decode)
        resps = asyncio.run(burst(fleet.url, 12, 40, "burst"))
        assert [r.status_code for r in resps] == [200] * 12
        prompt_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in resps)
        assert external_kv_tokens(decode) - ext_before == prompt_tokens > 0
        counts = {u: n - before[u] for u, n in served(prefills).items()}
        assert sum(counts.values()) == 12 and all(n > 0 for n in counts.values()), counts

        # One prefill frozen, so that requests are certainly placed on it and wait there,
        # then SIGKILLed under load: each of them is placed again on the other prefill.
        victim = prefills[0]
        victim_id = next(r["engine_id"] for r in rows if r["url"] == victim)
        rerouted = fleet.gateway_metric("kvpush_gateway_errors_total", kind="rerouted")
        targets_before = fleet.targets(victim_id)
        signal_engine(victim, signal.SIGSTOP)
        outcomes: list[dict[str, object]] = []

        def one(i: int) -> None:
            with httpx.Client(timeout=180) as c:
                outcomes.append(stream_request(c, fleet.url, f"# kill {i}\n" + "y = 2\n" * 30,
                                               max_tokens=8))

        threads = []
        for i in range(12):
            threads.append(threading.Thread(target=one, args=(i,), daemon=True))
            threads[-1].start()
            if i == 3:
                until(lambda: fleet.targets(victim_id) > targets_before,
                      "a request placed on the frozen prefill", 60, step_s=0.1)
                signal_engine(victim, signal.SIGKILL)
            threading.Event().wait(0.3)
        for t in threads:
            t.join(240)
        assert len(outcomes) == 12
        # No request failed before its first token; none failed after one either.
        assert [o for o in outcomes if o["error"] or not o["done"] or o["tokens"] == 0] \
            == [], outcomes
        assert fleet.gateway_metric("kvpush_gateway_errors_total", kind="rerouted") \
            - rerouted >= 1

        # Nothing held: no reservation in Redis, no blocks or requests on any engine.
        fleet.wait_idle()
        fleet.track()  # the supervisor's restart of the victim, if it has begun
