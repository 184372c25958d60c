"""``kvpush up`` with several engines per role: a real fleet on one machine that outlives an
engine. 1P2D here: requests spread over both decodes, a conversation follows its KV (the
engines' KV events) and skips prefill, as does one chained by ``previous_response_id``, a
SIGKILLed decode is restarted while the other serves, then every engine in turn (one of each
role at a time) is drained with ``kvpush drain`` and restarted under load with no failed
request (on the same fleet: booting three more engines for the rolling restart cost CI a
minute and a half). 2P1D is ``test_stack_fleet_2p1d.py``, a module of its own so that the
two fleets never run at once.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.services.engine.drain import clear_draining, mark_draining
from kvpush.services.engine.status import metric_sum, scrape
from tests.fleet_util import Fleet, burst, kvpush_up, served, signal_engine
from tests.polling import until

pytestmark = pytest.mark.slow


def _by_source(urls: list[str], source: str) -> dict[str, float]:
    return {u: metric_sum(scrape(u), "vllm:prompt_tokens_by_source_total", source=source)
            for u in urls}


def _held(fleet: Fleet, url: str) -> set[bytes]:
    """The prefix chunks the engine at ``url`` holds, as its KV events put them in Redis."""
    engine_id = next(r["engine_id"] for r in fleet.rows() if r["url"] == url)
    client = redis.Redis.from_url(fleet.redis_url)
    try:
        return client.smembers(RedisKeys().kv_chunks(engine_id))
    finally:
        client.close()


def _turn_one_beside_a_hold(fleet: Fleet, decodes: list[str], c: httpx.Client, tag: str,
                            send: Callable[[], httpx.Response]
                            ) -> tuple[httpx.Response, str, set[bytes], dict[str, float]]:
    """Turn 1 of a conversation (``send()``), sent while a long stream holds the decode
    that wins ties (by engine id), so it goes to the other one; the hold has ended on
    return, when both decodes are idle again. Returns turn 1's answer, the decode it went
    to, the prefix chunks that decode held before it, and each decode's pushed-token count
    after it."""
    with c.stream("POST", f"{fleet.url}/v1/completions", json={
            "model": "tiny", "prompt": f"# {tag}\n" + "y = 2\n" * 30, "max_tokens": 300,
            "temperature": 0, "stream": True, "ignore_eos": True}) as hold:
        lines = hold.iter_lines()
        next(lines)
        held_before = {u: _held(fleet, u) for u in decodes}
        ext_before = _by_source(decodes, "external_kv_transfer")
        r1 = send()
        assert r1.status_code == 200, r1.text
        for _ in lines:
            pass
    ext = _by_source(decodes, "external_kv_transfer")
    first = max(decodes, key=lambda u: ext[u] - ext_before[u])
    return r1, first, held_before[first], ext


def _conversation_goes_where_its_prefix_is_held(fleet: Fleet, decodes: list[str]) -> str:
    """KV-event routing and conditional disaggregation: a conversation's second turn goes
    to the decode holding its first turn's blocks (by that engine's KV events), although
    least-loaded placement alone would send it to the other one, and that decode, holding
    all but a short tail of the prompt, computes the tail itself: prefill serves nothing
    and nothing is pushed. Turn 1's prompt sent again gets turn 1's P/D answer from decode
    alone. Returns the decode that holds the conversation."""
    prefill = fleet.urls("prefill")
    turn1 = "# a conversation\n" + "".join(f"v{i} = {i} * 3\n" for i in range(60))
    with httpx.Client(timeout=120) as c:
        r1, first, held_before, mid = _turn_one_beside_a_hold(
            fleet, decodes, c, "hold", lambda: c.post(f"{fleet.url}/v1/completions", json={
                "model": "tiny", "prompt": turn1, "max_tokens": 8, "temperature": 0}))
        other = next(u for u in decodes if u != first)
        # Its engine's events say it holds turn 1's chunks (about 7 of 64 tokens).
        chunks = until(lambda: (_held(fleet, first) - held_before) or None,
                       "turn 1's chunks relayed", 10)
        assert len(chunks) >= 5, chunks
        served_before = served(prefill + decodes)
        hits_before = _by_source(decodes, "local_cache_hit")
        alone = fleet.gateway_metric("kvpush_gateway_placements_total",
                                     path="decode_alone_cached")
        turn2 = turn1 + r1.json()["choices"][0]["text"] + "\n# and then\nw = 4\n"
        r2 = c.post(f"{fleet.url}/v1/completions", json={
            "model": "tiny", "prompt": turn2, "max_tokens": 8, "temperature": 0})
        assert r2.status_code == 200, r2.text
        again = c.post(f"{fleet.url}/v1/completions", json={
            "model": "tiny", "prompt": turn1, "max_tokens": 8, "temperature": 0})
        assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == r1.json()["choices"][0]["text"]
    counts = {u: n - served_before[u] for u, n in served(prefill + decodes).items()}
    assert counts == {**dict.fromkeys(prefill + decodes, 0), first: 2}, counts
    hits = {u: n - hits_before[u] for u, n in _by_source(decodes, "local_cache_hit").items()}
    pushed = {u: n - mid[u] for u, n in _by_source(decodes, "external_kv_transfer").items()}
    # Both ran on turn 1's decode from its own cache, nothing was pushed anywhere, and
    # the other decode saw nothing of them.
    assert hits[first] >= 2 * 256, hits
    assert pushed == dict.fromkeys(decodes, 0) and hits[other] == 0, (hits, pushed)
    assert fleet.gateway_metric("kvpush_gateway_placements_total",
                                path="decode_alone_cached") == alone + 2
    return first


def _a_draining_decode_hands_its_conversation_on(fleet: Fleet, decodes: list[str]) -> None:
    """The decode holding a chat conversation is drained: it takes no new turn, but the
    next one is placed on the other decode with the history pushed from it to prefill
    (which holds only turn 1, which it computed), so the conversation moves with its KV
    instead of being recomputed once the drain ends the engine. The drain is then called
    off. (A chat's later turn carries an earlier answer, so the gateway sends prefill no
    prompt at admission: only the placement knows who holds the history.)"""
    prefill = fleet.urls("prefill")
    client = redis.Redis.from_url(fleet.redis_url)
    engine_id = ""
    messages = [{"role": "system", "content": "# rules\n" + "".join(
        f"r{i} = {i} + 7\n" for i in range(60))},
        {"role": "user", "content": "first"}]

    def turn(c: httpx.Client) -> str:
        r = c.post(f"{fleet.url}/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    try:
        with httpx.Client(timeout=120) as c:
            ext = _by_source(decodes, "external_kv_transfer")
            messages.append({"role": "assistant", "content": turn(c)})
            got = _by_source(decodes, "external_kv_transfer")
            holder = max(decodes, key=lambda u: got[u] - ext[u])
            other = next(u for u in decodes if u != holder)
            engine_id = next(r["engine_id"] for r in fleet.rows() if r["url"] == holder)
            # Turn 2, a tail short enough for its decode alone (under 256 tokens with what
            # turn 1 left of a chunk), long enough to fill one chunk more than prefill holds.
            messages.append({"role": "user", "content": "# more\n" + "".join(
                f"t{i} = {i} - 1\n" for i in range(14))})
            alone = fleet.gateway_metric("kvpush_gateway_placements_total",
                                         path="decode_alone_cached")
            held = _held(fleet, holder)
            messages.append({"role": "assistant", "content": turn(c)})
            assert fleet.gateway_metric("kvpush_gateway_placements_total",
                                        path="decode_alone_cached") == alone + 1
            until(lambda: _held(fleet, holder) - held or None, "turn 2 relayed", 10)
            mark_draining(client, RedisKeys(), engine_id)
            time.sleep(1.5)  # the schedulers' refresh sees the mark
            pushes = fleet.gateway_metric("kvpush_gateway_placements_total",
                                          path="history_push")
            ext = _by_source(prefill + decodes, "external_kv_transfer")
            messages.append({"role": "user", "content": "# next\n" + "".join(
                f"n{i} = {i} * {i}\n" for i in range(25))})
            turn(c)
    finally:
        if engine_id:
            clear_draining(client, RedisKeys(), engine_id)
        client.close()
    got = {u: n - ext[u] for u, n in _by_source(prefill + decodes, "external_kv_transfer")
           .items()}
    assert fleet.gateway_metric("kvpush_gateway_placements_total",
                                path="history_push") == pushes + 1
    # Prefill received what the drained decode held beyond turn 1; the other decode
    # received the prompt; the drained one received nothing.
    assert all(got[u] >= 64 for u in prefill) and got[other] > 0 and got[holder] == 0, got


def _stored_conversation_stays_on_its_decode(fleet: Fleet, decodes: list[str]) -> None:
    """A ``/v1/responses`` conversation chained by ``previous_response_id``: its second turn
    goes to the decode that holds the first turn (the gateway sends the whole conversation,
    whose prefix that decode's KV events say it holds), although the tie between two idle
    decodes goes the other way, and that decode computes the short new tail itself."""
    prefill = fleet.urls("prefill")
    base = {"model": "tiny", "max_output_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as c:
        r1, first, held_before, _ = _turn_one_beside_a_hold(
            fleet, decodes, c, "hold on", lambda: c.post(f"{fleet.url}/v1/responses", json={
                **base, "input": "# a stored one\n" + "".join(f"u{i} = {i} + 5\n"
                                                            for i in range(60))}))
        assert r1.json()["store"] is True, r1.text
        until(lambda: (_held(fleet, first) - held_before) or None,
              "turn 1's chunks relayed", 10)
        before = served(prefill + decodes)
        r2 = c.post(f"{fleet.url}/v1/responses", json={
            **base, "input": "# and now\nq = 1\n", "previous_response_id": r1.json()["id"]})
        assert r2.status_code == 200, r2.text
        assert r2.json()["previous_response_id"] == r1.json()["id"]
    counts = {u: n - before[u] for u, n in served(prefill + decodes).items()}
    assert counts == {**dict.fromkeys(prefill + decodes, 0), first: 1}, counts


@pytest.fixture(scope="module")
def fleet_1p2d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Conditional disaggregation up to a tail of 256 tokens (16 by default), computed by
    # a decode holding the rest; a history push from 64 tokens (512), so that a short
    # conversation moves with its KV.
    with kvpush_up(tmp_path_factory.mktemp("fleet-1p2d"), prefill=1, decode=2,
                   KVPUSH_SCHEDULER_DECODE_ALONE_TOKENS="256",
                   KVPUSH_SCHEDULER_HISTORY_PUSH_TOKENS="64") as fleet:
        yield fleet


def test_up_runs_a_fleet_and_keeps_serving_while_an_engine_restarts(fleet_1p2d: Fleet
                                                                     ) -> None:
    fleet = fleet_1p2d
    rows = fleet.rows()
    decodes = fleet.urls("decode")
    # The engines take requests from the stack's own front only (internal token).
    direct = httpx.post(f"{decodes[0]}/v1/completions", timeout=30,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert direct.status_code == 401

    # Concurrent requests spread over both decode engines.
    before = served(decodes)
    assert [r.status_code for r in asyncio.run(burst(fleet.url, 12, 40, "burst"))] \
        == [200] * 12
    counts = {u: n - before[u] for u, n in served(decodes).items()}
    assert sum(counts.values()) == 12 and all(n > 0 for n in counts.values()), counts

    # SIGKILL the decode holding the conversation (its whole process tree): the stack
    # keeps serving.
    _stored_conversation_stays_on_its_decode(fleet, decodes)
    _a_draining_decode_hands_its_conversation_on(fleet, decodes)
    victim = _conversation_goes_where_its_prefix_is_held(fleet, decodes)
    chunks = _held(fleet, victim)
    assert chunks
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
    # Its view went with it: the restarted engine holds none of what it held.
    assert not chunks & _held(fleet, victim)
    fleet.track()
    assert [fleet.complete(f"after restart {i}") for i in range(4)] == [200] * 4


def test_rolling_drain_restart_under_load_fails_nothing(fleet_1p2d: Fleet) -> None:
    """Every engine in turn, one of each role at a time: ``kvpush drain --wait``, then
    SIGTERM; the supervisor starts it again with a new generation while one client keeps
    sending."""
    fleet = fleet_1p2d
    codes: list[int] = []
    stop = threading.Event()

    def load(url: str) -> None:
        """One client in a loop for the whole rolling restart."""
        with httpx.Client(timeout=120) as c:
            i = 0
            while not stop.is_set():
                r = c.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": f"# roll {i}\n" + "x = 1\n" * 20,
                    "max_tokens": 8, "temperature": 0})
                codes.append(r.status_code)
                i += 1

    loader = threading.Thread(target=load, args=(fleet.url,))
    loader.start()
    try:
        rows = fleet.rows()
        prefills = [r for r in rows if r["role"] == "prefill"]
        decodes = [r for r in rows if r["role"] == "decode"]
        # One engine of each role at a time, as two Deployments roll side by side.
        for pairing in itertools.zip_longest(prefills, decodes):
            batch = [row for row in pairing if row is not None]
            for row in batch:
                drain = subprocess.run(
                    [sys.executable, "-m", "kvpush.services.cli", "drain", row["engine_id"],
                     "--wait", "--timeout", "120"],
                    env=dict(fleet.env, KVPUSH_REDIS_URL=fleet.redis_url),
                    capture_output=True, text=True, timeout=180)
                assert drain.returncode == 0, drain.stdout + drain.stderr
                assert "drained" in drain.stdout
            # Drained: stopping them now costs no request; the supervisor starts them again.
            for row in batch:
                signal_engine(row["url"], signal.SIGTERM)
            for row in batch:
                until(lambda eid=row["engine_id"], gen=row["generation"]: next(
                    (r for r in fleet.rows() if r["engine_id"] == eid
                     and r["generation"] != gen and r["state"] == "ok"), None),
                    f"{row['engine_id']} back with a new generation", 300)
            fleet.track()
    finally:
        stop.set()
        loader.join(180)
    assert codes and set(codes) == {200}, codes
