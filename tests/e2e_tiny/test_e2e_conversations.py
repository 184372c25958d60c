"""Conversations through the gateway on the package's real engine pair: ``/v1/responses``
turns chained by ``previous_response_id`` (unary and streamed, through P/D), the stored
responses' ``GET`` and ``DELETE``, tenant isolation, and hostile ids and histories.

Each turn's prompt is compared with the same conversation sent in full, as a client that
keeps its own history would send it, and every prompt token of every turn reaches decode
by a verified push.
"""

from __future__ import annotations

import csv
import json
import secrets
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import StoredResponse, decode
from kvpush.services.engine.status import metric_sum, scrape
from tests.e2e_tiny.gateway_util import (
    MODEL,
    TENANT_A,
    TENANT_B,
    GatewayStack,
    gateway_metric,
    gateway_stack,
    no_leftovers,
    prompt_of,
    responses_text,
    until,
)
from tests.e2e_util import external_kv_tokens, metric

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent.parent
# The bound on one stored conversation: the module's last turns pass it.
MAX_CONVERSATION_BYTES = 3000


@pytest.fixture(scope="module")
def gw_stack(stack: dict[str, Any]) -> Iterator[GatewayStack]:
    """The module's gateway on the package's pair, with a small bound on a stored
    conversation so that a history can outgrow it within the model's context."""
    with gateway_stack(stack, gateway_response_max_bytes=MAX_CONVERSATION_BYTES) as st:
        yield st


def _streamed(st: GatewayStack, body: dict[str, Any], tenant: str = TENANT_A
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``response.created`` and ``response.completed`` response objects of a stream."""
    seen: dict[str, dict[str, Any]] = {}
    with httpx.stream("POST", f"{st.url}/v1/responses", headers=st.headers(tenant),
                      json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        kind = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in ("response.created",
                                                        "response.completed"):
                seen[kind] = json.loads(line[6:])["response"]
    return seen["response.created"], seen["response.completed"]


def _turn(st: GatewayStack, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    if stream:
        created, done = _streamed(st, body)
        assert created["previous_response_id"] == body.get("previous_response_id")
        assert created["id"] == done["id"]
        return done
    r = httpx.post(f"{st.url}/v1/responses", headers=st.headers(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _billed(st: GatewayStack) -> float:
    return gateway_metric(st, "kvpush_gateway_tokens_total", tenant=TENANT_A, kind="prompt")


def _pushed(st: GatewayStack) -> tuple[float, float, float]:
    m = scrape(st.pair.decode.url)
    return (external_kv_tokens(st.pair.decode.url),
            metric_sum(m, "kvpush_kv_verified_total"),
            metric_sum(m, "kvpush_kv_verify_failures_total"))


def test_a_conversation_goes_on_from_its_stored_responses(gw_stack: GatewayStack) -> None:
    """Four turns chained by ``previous_response_id``, unary and streamed: each turn's
    engines render the very prompt a client keeping its own history would send (token ids
    compared on the engine), and that prompt reaches decode by verified pushes; the stored
    response reads back as the client got it; quotas and usage count the whole
    conversation, and the tenant's cache salt carries over (prefill serves the history
    from its prefix cache); decode goes on from prefill's first token. The prompt, not the
    text, is what is compared here: prefill computes each turn past the blocks its cache
    holds, where one engine sent the whole conversation computes it in one pass, and this
    model's near-tied random logits may break another way between the two.
    tests/test_eval_real_model.py compares the text, turn for turn, on the real model."""
    st = gw_stack
    engine = st.pair.prefill.url
    base = {"model": MODEL, "max_output_tokens": 6, "temperature": 0,
            "instructions": "Answer in code."}
    full: list[Any] = []  # what a client keeping its own history sends
    previous: str | None = None
    continued = _continued(st)
    for turn, stream in enumerate([False, True, False, True]):
        new = prompt_of(f"turn{turn}", 2)
        full.append({"role": "user", "content": new})
        body = {**base, "input": new} if previous is None else \
            {**base, "input": new, "previous_response_id": previous}
        before = _pushed(st), _billed(st), \
            metric(engine, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        got = _turn(st, body, stream)
        assert got["status"] == "incomplete" and responses_text(got), got  # 6 tokens, then cut
        assert got["usage"]["output_tokens"] == 6 and got["max_output_tokens"] == 6
        assert (got["previous_response_id"], got["store"]) == (previous, True)
        # The prompt the engines got is the whole conversation, as the client's would be.
        kept = _kept(st, got["id"])
        assert kept.history == full
        want_ids = _render(engine, {**base, "input": full})
        assert _render(engine, {**base, "input": kept.history}) == want_ids
        assert got["usage"]["input_tokens"] == len(want_ids)
        (ext0, ok0, bad0), tokens0, hits0 = before
        ext1, ok1, bad1 = _pushed(st)
        # Every prompt token reached decode by a verified push (prefix-cache hits there
        # aside: an earlier turn's blocks may still be held).
        assert ok1 > ok0 and bad1 == bad0
        assert ext1 > ext0
        # Quotas and usage count the whole conversation (the request ends just after
        # its last event reaches the client).
        billed = tokens0 + got["usage"]["input_tokens"]
        until(lambda billed=billed: _billed(st) == billed, f"turn {turn}'s prompt billed", 10)
        if turn:
            assert metric(engine, "vllm:prompt_tokens_by_source_total",
                          source="local_cache_hit") > hits0
        stored = httpx.get(f"{st.url}/v1/responses/{got['id']}", headers=st.headers(),
                           timeout=30)
        assert stored.status_code == 200 and stored.json() == got
        full.extend(got["output"])
        previous = got["id"]
    assert gateway_metric(st, "kvpush_gateway_responses_stored_total", outcome="stored") >= 4
    # Every turn went on from prefill's first token.
    assert _continued(st) == continued + 4
    no_leftovers(st)


def _continued(st: GatewayStack) -> float:
    return gateway_metric(st, "kvpush_gateway_first_token_from_prefill_total",
                          outcome="continued")


def _kept(st: GatewayStack, rid: str) -> StoredResponse:
    """The response as the gateway stored it, read straight from Redis."""
    blob = st.redis.hget(RedisKeys().tenant_responses(TENANT_A), rid)
    assert blob is not None, rid
    return decode(zlib.decompress(blob), StoredResponse, max_bytes=1 << 24)


def _render(engine: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{engine}/v1/responses/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_stored_responses_are_the_tenants_own(gw_stack: GatewayStack) -> None:
    """Another tenant can neither read, continue nor delete a response: it gets the answer
    an id that was never stored gets. ``store: false`` keeps nothing; a deleted response
    cannot be continued; ids of any shape are answered without a leak."""
    st = gw_stack
    body = {"model": MODEL, "input": prompt_of("mine", 2), "max_output_tokens": 4,
            "temperature": 0}
    r = httpx.post(f"{st.url}/v1/responses", headers=st.headers(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    url = f"{st.url}/v1/responses/{rid}"

    foreign = [httpx.get(url, headers=st.headers(TENANT_B), timeout=30),
               httpx.post(f"{st.url}/v1/responses", headers=st.headers(TENANT_B),
                          json={**body, "previous_response_id": rid}, timeout=30),
               httpx.delete(url, headers=st.headers(TENANT_B), timeout=30)]
    assert [x.status_code for x in foreign] == [404, 404, 404]
    assert httpx.get(url, headers=st.headers(), timeout=30).status_code == 200
    assert httpx.get(url, timeout=30).status_code == 401  # no key, no answer
    # Each read is traced with its tenant and status.
    want = {(TENANT_B, 404), (TENANT_A, 200), (None, 401)}
    until(lambda: want <= {(x.attributes.get("kvpush.tenant"),
                            x.attributes.get("http.response.status_code"))
                           for x in st.traces.by_name("GET /v1/responses/{response_id}")
                           if x.attributes.get("url.path") == f"/v1/responses/{rid}"},
          "the reads' spans", 10)

    # A foreign id and a deleted one answer alike.
    gone = httpx.delete(url, headers=st.headers(), timeout=30)
    assert gone.status_code == 200 and gone.json() == {"id": rid, "object": "response",
                                                       "deleted": True}
    after = [httpx.get(url, headers=st.headers(), timeout=30),
             httpx.post(f"{st.url}/v1/responses", headers=st.headers(),
                        json={**body, "previous_response_id": rid}, timeout=30),
             httpx.delete(url, headers=st.headers(), timeout=30)]
    assert [(x.status_code, x.json()) for x in after] == \
        [(x.status_code, x.json()) for x in foreign]

    # Not stored when asked not to be.
    r = httpx.post(f"{st.url}/v1/responses", headers=st.headers(),
                   json={**body, "store": False}, timeout=120)
    assert r.status_code == 200 and r.json()["store"] is False
    assert httpx.get(f"{st.url}/v1/responses/{r.json()['id']}", headers=st.headers(),
                     timeout=30).status_code == 404

    # A flood of made-up ids: each a 404, nothing written for any of them.
    keys_before = sorted(st.redis.scan_iter(match="kvpush:t:*:resp:*"))
    for rid in [f"resp_{secrets.token_hex(16)}" for _ in range(50)] + \
            ["x" * 200, "resp_%0a", "..%2F..%2Fconfig", "resp_" + "a" * 120]:
        x = httpx.get(f"{st.url}/v1/responses/{rid}", headers=st.headers(), timeout=30)
        assert x.status_code == 404, (rid, x.text)
    assert sorted(st.redis.scan_iter(match="kvpush:t:*:resp:*")) == keys_before
    for bad, status in [("x" * 300, 400), (7, 400), ("resp_\n", 404)]:
        x = httpx.post(f"{st.url}/v1/responses", headers=st.headers(),
                       json={**body, "previous_response_id": bad}, timeout=30)
        assert x.status_code == status, (bad, x.text)
        assert x.json()["error"]["param"] == "previous_response_id"
    no_leftovers(st)


def test_a_conversation_past_its_bound_is_refused_before_anything_runs(
        gw_stack: GatewayStack) -> None:
    """An answer past the bound on one stored conversation is served unstored and says
    so; continuing a conversation that would pass it is a 400 before any engine runs."""
    st = gw_stack
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = httpx.post(f"{st.url}/v1/responses", headers=st.headers(),
                       json={**body, "input": prompt_of("long", 30)}, timeout=120)
    assert first.status_code == 200, first.text
    assert first.json()["store"] is True
    served = metric_sum(scrape(st.pair.decode.url), "vllm:request_success_total")
    grown = httpx.post(f"{st.url}/v1/responses", headers=st.headers(), timeout=120,
                       json={**body, "input": prompt_of("longer", 45),
                             "previous_response_id": first.json()["id"]})
    assert grown.status_code == 400, grown.text
    assert grown.json()["error"]["param"] == "previous_response_id"
    assert metric_sum(scrape(st.pair.decode.url), "vllm:request_success_total") == served
    big = httpx.post(f"{st.url}/v1/responses", headers=st.headers(), timeout=120,
                     json={**body, "input": prompt_of("huge", 80)})
    assert big.status_code == 200, big.text
    assert big.json()["store"] is False
    assert httpx.get(f"{st.url}/v1/responses/{big.json()['id']}", headers=st.headers(),
                     timeout=30).status_code == 404
    assert gateway_metric(st, "kvpush_gateway_responses_stored_total",
                          outcome="too_large") >= 1
    no_leftovers(st)


def test_locust_runs_conversations_through_the_gateway(gw_stack: GatewayStack,
                                                       tmp_path: Path) -> None:
    """The locustfile's conversation mode (``--turns``): every turn of every conversation
    answered, each after the first naming the one before."""
    st = gw_stack
    prefix = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest/locustfile.py"),
         "--host", st.url, "--headless", "-u", "2", "-r", "2", "-t", "10s",
         "--csv", str(prefix), "--input-len", "12", "--output-len", "4", "--turns", "3",
         "--model", MODEL, "--api-keys", st.keys[TENANT_A], "--stop-timeout", "60"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    for turn in (1, 2, 3):
        row = rows[f"/v1/responses turn {turn}"]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
    assert int(rows["TTFT turn 3 [tenant0]"]["Request Count"]) > 0
    no_leftovers(st)
