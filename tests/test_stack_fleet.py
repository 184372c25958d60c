"""``kvpush up`` with several engines per role: a real fleet on one machine that outlives an
engine. 1P2D: requests spread over both decodes, a SIGKILLed decode is restarted while the
other serves. 2P1D: requests spread over both prefills, every prompt token arrives as pushed
KV, and a prefill SIGKILLed under load fails no request (they are placed again on the other).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import httpx
import pytest

from kvpush.services.engine.status import metric_sum, scrape
from tests.e2e_util import external_kv_tokens
from tests.fleet_util import kvpush_up, signal_engine, stream_request, until

pytestmark = pytest.mark.slow


async def _burst(url: str, n: int, lines: int, tag: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int) -> httpx.Response:
            return await c.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"# {tag} {i}\n" + "x = 1\n" * lines,
                "max_tokens": 8, "temperature": 0})
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _served(urls: list[str]) -> dict[str, float]:
    return {u: metric_sum(scrape(u), "vllm:request_success_total") for u in urls}


def _by_source(urls: list[str], source: str) -> dict[str, float]:
    return {u: metric_sum(scrape(u), "vllm:prompt_tokens_by_source_total", source=source)
            for u in urls}


def _conversation_stays_on_its_decode(url: str, decodes: list[str]) -> None:
    """Prefix affinity: a conversation's second turn goes back to the decode of its first,
    although least-loaded placement alone would send it to the other one, and that decode
    takes the shared prefix from its own prefix cache instead of a push."""
    turn1 = "# a conversation\n" + "".join(f"v{i} = {i} * 3\n" for i in range(60))
    with httpx.Client(timeout=120) as c:
        # A long stream holds the first decode (ties go by engine id), so turn 1 goes to
        # the other one; it has ended by turn 2, when both are idle again.
        with c.stream("POST", f"{url}/v1/completions", json={
                "model": "tiny", "prompt": "# hold\n" + "y = 2\n" * 30, "max_tokens": 300,
                "temperature": 0, "stream": True, "ignore_eos": True}) as hold:
            lines = hold.iter_lines()
            next(lines)
            before = _by_source(decodes, "local_cache_hit")
            ext_before = _by_source(decodes, "external_kv_transfer")
            r1 = c.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": turn1, "max_tokens": 8, "temperature": 0})
            assert r1.status_code == 200, r1.text
            for _ in lines:
                pass
        mid = _by_source(decodes, "external_kv_transfer")
        first = max(decodes, key=lambda u: mid[u] - ext_before[u])
        turn2 = turn1 + r1.json()["choices"][0]["text"] + "\n# and then\nw = 4\n"
        r2 = c.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": turn2, "max_tokens": 8, "temperature": 0})
        assert r2.status_code == 200, r2.text
    hits = {u: n - before[u] for u, n in _by_source(decodes, "local_cache_hit").items()}
    pushed = {u: n - mid[u] for u, n in _by_source(decodes, "external_kv_transfer").items()}
    prompt2 = r2.json()["usage"]["prompt_tokens"]
    # Turn 2 ran on turn 1's decode: most of its prompt came from that decode's cache, the
    # rest was pushed; the other decode saw nothing of it.
    assert hits[first] >= 256 and pushed[first] > 0, (hits, pushed, first)
    assert hits[first] + pushed[first] == prompt2, (hits, pushed, prompt2)
    other = next(u for u in decodes if u != first)
    assert pushed[other] == 0 and hits[other] == 0, (hits, pushed)


def test_up_runs_a_fleet_and_keeps_serving_while_an_engine_restarts(tmp_path: Path) -> None:
    with kvpush_up(tmp_path, prefill=1, decode=2) as fleet:
        rows = fleet.rows()
        decodes = fleet.urls("decode")
        # The engines take requests from the stack's own front only (internal token).
        direct = httpx.post(f"{decodes[0]}/v1/completions", timeout=30,
                            json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert direct.status_code == 401

        # Concurrent requests spread over both decode engines.
        before = _served(decodes)
        assert [r.status_code for r in asyncio.run(_burst(fleet.url, 12, 40, "burst"))] \
            == [200] * 12
        served = {u: n - before[u] for u, n in _served(decodes).items()}
        assert sum(served.values()) == 12 and all(n > 0 for n in served.values()), served

        _conversation_stays_on_its_decode(fleet.url, decodes)

        # SIGKILL one decode engine's whole process tree: the stack keeps serving.
        victim = decodes[1]
        old_gen = next(r["generation"] for r in rows if r["url"] == victim)
        signal_engine(victim, signal.SIGKILL)
        until(lambda: victim not in {r["url"] for r in fleet.rows()},
              "the dead engine withdrawn", 30)
        assert [fleet.complete(f"survivor {i}") for i in range(6)] == [200] * 6
        assert fleet.proc.poll() is None

        # The supervisor restarts it: back in Redis with a new generation, serving again.
        back = until(lambda: next((r for r in fleet.rows() if r["url"] == victim), None),
                     "the engine restarted", 300)
        assert back["generation"] != old_gen
        fleet.track()
        assert [fleet.complete(f"after restart {i}") for i in range(4)] == [200] * 4


def test_2p1d_spreads_prefills_pushes_every_token_and_outlives_a_prefill_kill(
        tmp_path: Path) -> None:
    with kvpush_up(tmp_path, prefill=2, decode=1) as fleet:
        rows = fleet.rows()
        prefills, (decode,) = fleet.urls("prefill"), fleet.urls("decode")

        # Concurrent requests spread over both prefill engines, and decode computes none of
        # the prompts itself: every prompt token arrives as pushed KV.
        before, ext_before = _served(prefills), external_kv_tokens(decode)
        resps = asyncio.run(_burst(fleet.url, 12, 40, "burst"))
        assert [r.status_code for r in resps] == [200] * 12
        prompt_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in resps)
        assert external_kv_tokens(decode) - ext_before == prompt_tokens > 0
        served = {u: n - before[u] for u, n in _served(prefills).items()}
        assert sum(served.values()) == 12 and all(n > 0 for n in served.values()), served

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
