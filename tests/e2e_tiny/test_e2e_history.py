"""History push on the package's real engine pair: a prompt's first blocks, held by the
decode engine (a conversation's earlier turns), pushed into blocks the prefill engine
reserved for them; prefill computes only the rest and pushes decode only what it lacks.

The three legs are sent straight to the engines, as the gateway sends them: the holder
runs the history as a prefill leg of its own (``decode_engine`` = the prefill), the
prefill leg names the holder in ``history_engine``, and the decode leg is a plain one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.prefix_hashes import CHUNK_TOKENS, prefix_hashes
from kvpush.common.tenancy import cache_salt, get_tenant
from kvpush.common.wire import history_digest
from kvpush.services.local.ports import free_port
from tests.e2e_tiny.conftest import BLOCK, HISTORY_DEADLINE_S
from tests.e2e_tiny.gateway_util import (
    TENANT_A,
    GatewayStack,
    gateway_metric,
    gateway_stack,
    no_leftovers,
    until,
)
from tests.e2e_tiny.test_e2e_push import _records, _wait_kv_usage_zero, _wait_records
from tests.e2e_util import (
    Call,
    EnginePair,
    code_prompt,
    complete,
    completion_body,
    external_kv_tokens,
    metric,
    prompt_ids,
    push_decode_params,
    push_prefill_params,
)
from tests.sched_util import engine_status, publish

pytestmark = pytest.mark.slow


def _computed(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="local_compute")


def _conversation(pair: EnginePair, tag: str) -> tuple[list[int], int]:
    """A prompt whose first ``hist`` tokens (whole blocks) decode alone computed before,
    as it holds a conversation's earlier turns; (prompt ids, hist)."""
    history = prompt_ids(pair.decode.url, code_prompt(f"history-{tag}", 14))
    tail = prompt_ids(pair.decode.url, code_prompt(f"turn-{tag}", 3))[1:]
    complete(pair.decode.url, completion_body(history, 1, None))
    hist = len(history) // BLOCK * BLOCK
    assert hist >= 3 * BLOCK and len(tail) > BLOCK
    return history + tail, hist


def _legs(pair: EnginePair, ids: list[int], hist: int, *, holder: bool = True,
          holder_salt: str | None = None) -> tuple[str, str, str]:
    """The three legs of one request whose history decode holds; (rid, history rid,
    decode's text). ``holder=False``: the holder's leg is never sent (a holder that died
    or never heard of it). ``holder_salt``: the holder's leg looks its cache up under
    this salt, so it finds none of the history there (as after an eviction)."""
    rid, hrid = f"cmpl-{uuid.uuid4().hex}", f"hist-{uuid.uuid4().hex}"
    key = uuid.uuid4().hex
    # The holder's prompt goes one token past the history, so all of the history is a
    # prefix-cache hit there; it pushes only the history.
    source = {**push_prefill_params(hrid, pair.prefill.engine_id), "push_key": key,
              "push_tokens": hist}
    leg = {**push_prefill_params(rid, pair.decode.engine_id),
           "history_engine": pair.decode.engine_id, "history_request_id": hrid,
           "history_tokens": hist, "history_push_key": key,
           "history_digest": history_digest(ids[:hist])}
    calls = [Call(pair.prefill.url, completion_body(ids, 1, leg), rid),
             Call(pair.decode.url, completion_body(ids, 16, push_decode_params(
                 rid, pair.prefill.engine_id)), rid)]
    if holder:
        body = completion_body(ids[:hist + 1], 1, source)
        if holder_salt is not None:
            body["cache_salt"] = holder_salt
        calls.append(Call(pair.decode.url, body, hrid))
    for c in calls:
        c.start()
    for c in calls:
        c.join(180)
        assert c.error is None, c.error
    out = calls[1].result
    assert out is not None
    return rid, hrid, out["choices"][0]["text"]


def test_history_arrives_by_push_and_prefill_computes_only_the_rest(stack) -> None:
    pair: EnginePair = stack["pair"]
    ids, hist = _conversation(pair, "pushed")
    p_ext, p_comp = external_kv_tokens(pair.prefill.url), _computed(pair.prefill.url)
    d_ext = external_kv_tokens(pair.decode.url)
    rid, hrid, text = _legs(pair, ids, hist)
    # Prefill took the history from the push and computed only the new turn.
    assert external_kv_tokens(pair.prefill.url) - p_ext == hist
    assert _computed(pair.prefill.url) - p_comp == len(ids) - hist
    # Decode held the history: it received only the new turn.
    assert external_kv_tokens(pair.decode.url) - d_ext == len(ids) - hist
    # The history push and the push on to decode: both complete, both checksummed.
    out = _wait_records(stack["stats"]["decode"], hrid, "push")[0]
    into = _wait_records(stack["stats"]["prefill"], hrid, "recv")[0]
    assert out["ok"] and into["ok"] and out["verified"] is True and into["verified"] is True
    assert out["blocks"] == hist // BLOCK and into["bytes"] == out["bytes"]
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["ok"] and push["verified"] is True
    assert push["blocks"] == -(-len(ids) // BLOCK) - hist // BLOCK
    # The answer is decode's own over the same prompt, and nothing stays held.
    assert text == complete(pair.decode.url, completion_body(ids, 16, None))["choices"][0]["text"]
    assert _wait_kv_usage_zero(pair.prefill.url) == 0
    assert _wait_kv_usage_zero(pair.decode.url) == 0


def test_a_history_prefill_holds_already_is_not_pushed_and_the_holder_lets_go(stack
                                                                               ) -> None:
    """The prefill's own cache has the history (it received it for the turn before):
    nothing is pushed, and the holder's leg, cancelled, frees its blocks at once."""
    pair: EnginePair = stack["pair"]
    ids, hist = _conversation(pair, "held")
    _legs(pair, ids, hist)
    p_ext = external_kv_tokens(pair.prefill.url)
    rid, hrid, text = _legs(pair, ids + ids[-BLOCK:], hist)
    assert external_kv_tokens(pair.prefill.url) == p_ext
    assert text == complete(pair.decode.url, completion_body(ids + ids[-BLOCK:], 16, None)
                            )["choices"][0]["text"]
    assert _wait_records(stack["stats"]["prefill"], rid, "push")[0]["ok"]
    time.sleep(1)
    assert not [r for r in _records_of(stack, hrid) if r["ok"]]
    assert _wait_kv_usage_zero(pair.prefill.url) == 0
    assert _wait_kv_usage_zero(pair.decode.url) == 0


def _records_of(stack: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    return [*_records(stack["stats"]["decode"], rid, "push"),
            *_records(stack["stats"]["prefill"], rid, "recv")]


def test_a_history_that_never_comes_is_recomputed_and_the_request_answers(stack) -> None:
    """The holder never runs its leg (it died, or lost the message): prefill waits its
    history deadline, computes the whole prompt itself and pushes it; the answer is the
    same and nothing is held afterwards."""
    pair: EnginePair = stack["pair"]
    ids, hist = _conversation(pair, "lost")
    p_ext, p_comp = external_kv_tokens(pair.prefill.url), _computed(pair.prefill.url)
    t0 = time.monotonic()
    rid, _hrid, text = _legs(pair, ids, hist, holder=False)
    assert time.monotonic() - t0 >= HISTORY_DEADLINE_S
    assert external_kv_tokens(pair.prefill.url) == p_ext
    assert _computed(pair.prefill.url) - p_comp == len(ids)
    assert _wait_records(stack["stats"]["prefill"], rid, "push")[0]["ok"]
    assert text == complete(pair.decode.url, completion_body(ids, 16, None))["choices"][0]["text"]
    assert _wait_kv_usage_zero(pair.prefill.url) == 0
    assert _wait_kv_usage_zero(pair.decode.url) == 0


def test_a_holder_that_evicted_the_history_computes_it_and_pushes_it(stack) -> None:
    """The holder evicted the history between the scheduler's choice and its leg: its leg
    finds none of it in its prefix cache (looked up under a salt no block has: the same
    miss an eviction leaves), computes the history and pushes it; prefill still computes
    only the new turn and the answer is the same. An eviction cannot fall later, mid-push:
    vLLM frees no block a running request holds, and the holder's connector keeps its leg's
    blocks until their push has ended."""
    pair: EnginePair = stack["pair"]
    ids, hist = _conversation(pair, "evicted")
    p_ext, p_comp = external_kv_tokens(pair.prefill.url), _computed(pair.prefill.url)
    d_comp = _computed(pair.decode.url)
    rid, hrid, text = _legs(pair, ids, hist, holder_salt=uuid.uuid4().hex)
    # The holder computed the whole history (and its one token past it) again.
    assert _computed(pair.decode.url) - d_comp >= hist + 1
    assert external_kv_tokens(pair.prefill.url) - p_ext == hist
    assert _computed(pair.prefill.url) - p_comp == len(ids) - hist
    out = _wait_records(stack["stats"]["decode"], hrid, "push")[0]
    into = _wait_records(stack["stats"]["prefill"], hrid, "recv")[0]
    assert out["ok"] and into["ok"] and out["verified"] is True and into["verified"] is True
    assert _wait_records(stack["stats"]["prefill"], rid, "push")[0]["ok"]
    assert text == complete(pair.decode.url, completion_body(ids, 16, None))["choices"][0]["text"]
    assert _wait_kv_usage_zero(pair.prefill.url) == 0
    assert _wait_kv_usage_zero(pair.decode.url) == 0


def test_the_prefill_publishes_what_the_cost_model_weighs(stack) -> None:
    """After a history push, the prefill's heartbeat carries its measured wait for a
    pushed history and its prompt throughput, read from its own /metrics (the connector's
    ``kvpush_kv_history_wait_seconds`` and vLLM's per-request prefill series)."""
    pair: EnginePair = stack["pair"]
    ids, hist = _conversation(pair, "measured")
    waits = metric(pair.prefill.url, "kvpush_kv_history_wait_seconds_count")
    _legs(pair, ids, hist)
    until(lambda: metric(pair.prefill.url, "kvpush_kv_history_wait_seconds_count") > waits,
          "the history's wait on prefill's /metrics")
    r = redis.Redis.from_url(stack["redis_url"])
    key = RedisKeys().engine(pair.prefill.engine_id)

    def published() -> tuple[int, int] | None:
        tok_s, wait_ms = (int(v or 0) for v in r.hmget(key, "prefill_tok_s", "history_wait_ms"))
        return (tok_s, wait_ms) if tok_s > 0 and wait_ms > 0 else None

    tok_s, wait_ms = until(published, "the measurements in prefill's status")
    # A tiny model on a CPU: thousands of tokens a second, a wait of a step or more.
    assert 100 < tok_s < 10_000_000 and 0 < wait_ms < HISTORY_DEADLINE_S * 1000
    r.close()


# -- through the gateway --------------------------------------------------------------------

PUSH_AT = 2 * 64  # two of the schedulers' prefix chunks more than prefill holds


@pytest.fixture(scope="module")
def gw_stack(stack: dict[str, Any]) -> Iterator[GatewayStack]:
    """The module's gateway and scheduler on the package's pair, pushing histories. Its
    turns are completions of token ids, which carry no earlier turn the gateway could
    see, so early prefill is off (it stays on for chat and Responses turns). The cost
    model is off: what it chooses from the pair's measurements depends on which tests ran
    before (tests/test_prefix_affinity.py proves its choices on fixed measurements)."""
    with gateway_stack(stack, scheduler={"scheduler_history_push_tokens": PUSH_AT,
                                         "scheduler_history_cost_model": False},
                       scheduler_history_push_tokens=PUSH_AT,
                       gateway_early_prefill=False) as st:
        yield st


def _gw_complete(st: GatewayStack, ids: list[int], max_tokens: int) -> dict[str, Any]:
    resp = httpx.post(f"{st.url}/v1/completions", headers=st.headers(), timeout=120, json={
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_next_turn_gets_the_answer_pushed_from_the_decode_that_wrote_it(
        gw_stack: GatewayStack, stack: dict[str, Any]) -> None:
    """Turn 2's prompt is turn 1's prompt, turn 1's answer and a new message. Prefill
    holds turn 1's prompt (it computed it); decode holds that and the answer it generated.
    The scheduler has decode push what prefill lacks; prefill computes only the new
    message and pushes decode only that."""
    st, pair = gw_stack, gw_stack.pair
    first = prompt_ids(pair.decode.url, code_prompt("gw-turn-1", 9))
    out = _gw_complete(st, first, 160)["choices"][0]["token_ids"]
    new = prompt_ids(pair.decode.url, code_prompt("gw-turn-2", 2))[1:]
    ids = first + out + new
    # The scheduler sees decode hold the answer once its KV events are in Redis.
    chain = prefix_hashes(ids, cache_salt(get_tenant(st.redis, TENANT_A)))
    wanted = chain[(len(first) + 128) // CHUNK_TOKENS - 1]
    until(lambda: st.redis.sismember(RedisKeys().kv_chunks(pair.decode.engine_id), wanted),
          "decode's KV events of the answer")
    pushes = gateway_metric(st, "kvpush_gateway_placements_total", path="history_push")
    chosen = gateway_metric(st, "kvpush_gateway_history_decisions_total", choice="unmeasured")
    p_ext, p_comp = external_kv_tokens(pair.prefill.url), _computed(pair.prefill.url)
    d_ext = external_kv_tokens(pair.decode.url)
    doc = _gw_complete(st, ids, 16)
    assert gateway_metric(st, "kvpush_gateway_placements_total",
                          path="history_push") == pushes + 1
    assert gateway_metric(st, "kvpush_gateway_history_decisions_total",
                          choice="unmeasured") == chosen + 1
    rid = doc["id"].removeprefix("cmpl-")  # vLLM prefixes the id the gateway gave it
    server = until(lambda: [x for x in st.traces.by_name("POST /v1/completions")
                            if x.attributes.get("kvpush.request_id") == rid],
                   "the request's span")[0]
    assert server.attributes["kvpush.history_engine"] == pair.decode.engine_id
    assert server.attributes["kvpush.history_choice"] == "unmeasured"
    hist = int(server.attributes["kvpush.history_tokens"])
    held = len(first) // BLOCK * BLOCK  # prefill's own cache: turn 1's whole blocks
    assert hist % BLOCK == 0 and hist - held >= PUSH_AT - BLOCK and hist < len(ids)
    # Prefill received what it lacked of the history and computed only the rest.
    assert external_kv_tokens(pair.prefill.url) - p_ext == hist - held
    assert _computed(pair.prefill.url) - p_comp == len(ids) - hist
    # Decode received only what it lacked: its cache holds turn 1's prompt and answer
    # (all but the last answer token, never fed back), in whole blocks.
    kept = (len(first) + len(out) - 1) // BLOCK * BLOCK
    assert kept >= hist
    assert external_kv_tokens(pair.decode.url) - d_ext == len(ids) - kept
    hrid = f"{rid}-h"
    out_rec = _wait_records(stack["stats"]["decode"], hrid, "push")[0]
    in_rec = _wait_records(stack["stats"]["prefill"], hrid, "recv")[0]
    assert out_rec["ok"] and out_rec["verified"] is True and in_rec["verified"] is True
    assert out_rec["blocks"] == (hist - held) // BLOCK
    assert doc["choices"][0]["text"] == complete(
        pair.decode.url, completion_body(ids, 16, None))["choices"][0]["text"]
    no_leftovers(st)
    assert _wait_kv_usage_zero(pair.prefill.url) == 0


class _FakeHolder:
    """A holder's address that accepts connections and then, as an engine killed under its
    leg, closes each one unanswered (``drops``), or as a frozen or cut-off engine, holds
    each one open unanswered (``hangs``), health probes included."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                conn.recv(65536)
            if self.kind == "drops":
                conn.close()
            else:
                self._open.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in [*self._open, self._sock]:
            c.close()


@pytest.mark.parametrize("kind", ["refuses", "drops", "hangs"])
def test_a_holder_that_cannot_be_reached_sends_the_turn_elsewhere_at_once(
        gw_stack: GatewayStack, stack: dict[str, Any], kind: str) -> None:
    """The scheduler names as the history's holder an engine that is gone while its
    status has not yet expired, holding the prompt by its KV events and with no room for a
    request of its own: one whose address refuses connections (never had its leg), one
    that drops the leg's connection unanswered (killed under it), one that answers
    nothing, not even health probes (frozen or cut off). None of them will write the
    history or tell prefill so: the gateway places the request again, the holder kept
    off, and it is answered by recompute, instead of waiting out prefill's history
    deadline and a quarantine that no fence from the holder would end. Whatever such a
    holder could still write lands only in the first placement's blocks, which stay
    quarantined."""
    st, pair, keys = gw_stack, gw_stack.pair, RedisKeys()
    gone = f"gone-{kind}-{uuid.uuid4().hex[:8]}"
    fake = _FakeHolder(kind) if kind != "refuses" else None
    port = fake.port if fake is not None else free_port()
    publish(st.redis, engine_status(gone, total=64, free=0, block_size=BLOCK,
                                    url=f"http://127.0.0.1:{port}", kv_events=True))
    salt = cache_salt(get_tenant(st.redis, TENANT_A))
    try:
        for attempt in range(5):
            ids = prompt_ids(pair.decode.url, code_prompt(f"gone-{kind}-{attempt}", 12))
            st.redis.sadd(keys.kv_chunks(gone), *prefix_hashes(ids, salt))
            pushes = gateway_metric(st, "kvpush_gateway_placements_total",
                                    path="history_push")
            rerouted = gateway_metric(st, "kvpush_gateway_errors_total", kind="rerouted")
            p_ext = external_kv_tokens(pair.prefill.url)
            t0 = time.monotonic()
            doc = _gw_complete(st, ids, 16)
            took = time.monotonic() - t0
            if gateway_metric(st, "kvpush_gateway_placements_total",
                              path="history_push") == pushes:
                time.sleep(1)  # the schedulers had not read the holder's status yet
                continue
            # Placed with the gone holder's history, then again without it.
            assert gateway_metric(st, "kvpush_gateway_errors_total",
                                  kind="rerouted") == rerouted + 1
            # vLLM prefixes the id of the placement that answered, the second.
            rid = doc["id"].removeprefix("cmpl-").removesuffix("-r1")
            server = until(lambda rid=rid: [
                x for x in st.traces.by_name("POST /v1/completions")
                if x.attributes.get("kvpush.request_id") == rid], "the request's span")[0]
            assert server.events.count("kvpush.reroute") == 1
            named = until(lambda t=server.trace_id: [
                x for x in st.traces.by_trace({t})[t]
                if x.attributes.get("kvpush.history_engine")], "the first prefill leg's span")
            assert [x.attributes["kvpush.history_engine"] for x in named] == [gone]
            # The second placement's prefill computed the prompt: nothing was pushed in.
            assert external_kv_tokens(pair.prefill.url) == p_ext
            assert doc["choices"][0]["text"] == complete(
                pair.decode.url, completion_body(ids, 16, None))["choices"][0]["text"]
            print(f"answered in {took:.2f} s (history deadline {HISTORY_DEADLINE_S} s)")
            break
        else:
            raise AssertionError("the schedulers never named the gone holder")
        # The first placement's prefill leg, aborted (maybe before it was scheduled), lets
        # its history blocks go at the quarantine's bound (no fence comes from a holder
        # that never had the leg), and prefill goes on serving: the receive's end names a
        # request vLLM still holds (tests/test_connector_scheduler_side.py has the case).
        assert _wait_kv_usage_zero(pair.prefill.url) == 0
        assert complete(pair.prefill.url, completion_body(ids, 2, None))["choices"]
        no_leftovers(st)
    finally:
        st.redis.delete(keys.engine(gone), keys.kv_chunks(gone), keys.targets(gone))
        st.redis.zrem(keys.engines(), gone)
        if fake is not None:
            fake.close()
