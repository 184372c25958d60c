"""The OpenAI API beyond one choice, through the gateway on the package's real engine pair:
batched completion prompts (unary and streaming), ``n > 1``, and ``/tokenize`` /
``/detokenize``.

Batched prompts run concurrently on the engines, and this model's near-tied logits let
batching change a greedy token (see ``test_e2e_gateway``), so their KV is proven by the
decode engine's counters (every prompt token arrived by push, every push checksummed and
verified), and the answer's shape (one id, each choice at its prompt's index, usage
summed) is asserted exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpush.common.reservations import live_reservations
from kvpush.services.engine.status import metric_sum, scrape
from tests.e2e_tiny.conftest import BLOCK
from tests.e2e_tiny.gateway_util import (
    MODEL,
    TENANT_B,
    GatewayStack,
    gateway_stack,
    no_leftovers,
    prompt_of,
    responses_text,
    until,
)
from tests.e2e_util import external_kv_tokens, prompt_tokens
from tests.openai_fields import REFUSED, TABLES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw_stack(stack: dict[str, Any]) -> Iterator[GatewayStack]:
    """The module's gateway on the package's pair, with a 20 s request deadline: a request
    that decode refuses after prefill answered (the conformance sweep sends several) leaves
    prefill holding its blocks for a target until that deadline, and the next module
    checks that prefill holds none."""
    with gateway_stack(stack, gateway_request_timeout_s=20.0) as st:
        yield st


def _verified(url: str) -> tuple[float, float]:
    m = scrape(url)
    return (metric_sum(m, "kvpush_kv_verified_total"),
            metric_sum(m, "kvpush_kv_verify_failures_total"))


def _served(url: str) -> float:
    return metric_sum(scrape(url), "vllm:request_success_total")


def _moved(url: str) -> tuple[float, float, float]:
    """An engine's KV bytes pushed and received, and vLLM's NIXL transfer count."""
    m = scrape(url)
    return (metric_sum(m, "kvpush_kv_bytes_pushed_total"),
            metric_sum(m, "kvpush_kv_bytes_received_total"),
            metric_sum(m, "vllm:nixl_bytes_transferred_count"))


class _PushedIntact:
    """The engines' counters around a block of requests: every prompt token of ``prompts``
    arrived by push, every push was checksummed and verified, and decode received the
    bytes prefill wrote, in kvpush's series and in vLLM's NIXL ones."""

    def __init__(self, st: GatewayStack, prompts: list[str], tokens: int | None = None
                 ) -> None:
        self.st, self.n = st, len(prompts)
        self.prefill, self.decode = st.pair.prefill.url, st.pair.decode.url
        self.tokens = sum(prompt_tokens(self.decode, p) for p in prompts) \
            if tokens is None else tokens
        self.ext = external_kv_tokens(self.decode)
        self.verified, self.failed = _verified(self.decode)
        self.moved = (_moved(self.prefill), _moved(self.decode))

    def check(self) -> None:
        assert external_kv_tokens(self.decode) - self.ext == self.tokens
        until(lambda: _verified(self.decode)[0] - self.verified >= self.n,
              "every push verified")
        assert _verified(self.decode) == (self.verified + self.n, self.failed)
        (p0, _, pn0), (_, d0, dn0) = self.moved

        def deltas() -> tuple[float, float, float, float]:
            (p, _, pn), (_, d, dn) = _moved(self.prefill), _moved(self.decode)
            return p - p0, d - d0, pn - pn0, dn - dn0

        until(lambda: deltas()[2:] == (self.n, self.n), "every transfer in vLLM's series")
        pushed, received, _, _ = deltas()
        assert pushed == received > 0
        no_leftovers(self.st)


def test_batched_prompts_answer_in_order_with_usage_summed(gw_stack: GatewayStack) -> None:
    st = gw_stack
    prompts = [prompt_of(f"batch{i}", 3 + i) for i in range(3)]
    pushed = _PushedIntact(st, prompts)
    r = httpx.post(f"{st.url}/v1/completions", headers=st.headers(), timeout=120, json={
        "model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert all(c["text"] and c["finish_reason"] == "length" for c in doc["choices"])
    assert doc["usage"]["prompt_tokens"] == pushed.tokens
    assert doc["usage"]["completion_tokens"] == 3 * 6
    assert doc["usage"]["total_tokens"] == pushed.tokens + 18
    pushed.check()


def test_batched_token_id_prompts_stream_interleaved_with_one_done(
        gw_stack: GatewayStack) -> None:
    st = gw_stack
    texts = [prompt_of(f"idbatch{i}", 4) for i in range(2)]
    ids = [httpx.post(f"{st.pair.decode.url}/tokenize", timeout=30, json={
        "model": MODEL, "prompt": t}).json()["tokens"] for t in texts]
    pushed = _PushedIntact(st, texts)
    events: list[str] = []
    with httpx.stream("POST", f"{st.url}/v1/completions", headers=st.headers(), timeout=120,
                      json={"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert usage_chunk["usage"]["completion_tokens"] == 2 * 5
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for c in token_chunks:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        assert "".join(ch["text"] for ch in choices)
        assert choices[-1]["finish_reason"] == "length"
    pushed.check()


def test_n_samples_are_prefilled_and_pushed_once_and_decoded_from_its_cache(
        gw_stack: GatewayStack) -> None:
    """``n: 3``, streamed: prefill serves the prompt once and pushes its KV once; the two
    other samples run on the same decode engine alone, where the prompt's full blocks are
    prefix-cache hits (a stream's first event shows decode holds them)."""
    st = gw_stack
    prefill, decode = st.pair.prefill.url, st.pair.decode.url
    prompt = prompt_of("nsamples", 6)
    tokens = prompt_tokens(decode, prompt)
    pushed = _PushedIntact(st, [prompt])
    served = (_served(prefill), _served(decode))
    hits = metric_sum(scrape(decode), "vllm:prefix_cache_hits_total")
    with httpx.stream("POST", f"{st.url}/v1/completions", headers=st.headers(), timeout=120,
                      json={"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 5,
                            "temperature": 0.8, "seed": 11, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1, 2}
    # The prompt counted once, as vLLM counts it for n > 1.
    assert chunks[-1]["usage"]["prompt_tokens"] == tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 15
    pushed.check()  # pushed once: every prompt token once, one verified push
    assert (_served(prefill), _served(decode)) == (served[0] + 1, served[1] + 3)
    # vLLM computes at least the prompt's last token itself: the blocks before it hit.
    cached = (tokens - 1) // BLOCK * BLOCK
    assert metric_sum(scrape(decode), "vllm:prefix_cache_hits_total") - hits \
        >= 2 * cached > 0


def test_a_bad_prompt_fails_the_batch_before_anything_is_held(
        gw_stack: GatewayStack) -> None:
    st = gw_stack
    prefill, decode = st.pair.prefill.url, st.pair.decode.url
    before = (_served(prefill), _served(decode))
    good = prompt_of("badbatch", 3)
    cases = [
        ([good, "", good], "prompt[1]"),
        ([good, good, "x " * 5000], "prompt[2]"),  # longer than the context
        ([good, [1, 2, 3]], "prompt"),  # strings and token ids mixed
        ([good] * 65, "prompt"),  # more than gateway_max_choices
        ([[1, 2], [3, -1]], "prompt[1]"),
    ]
    for prompt, param in cases:
        r = httpx.post(f"{st.url}/v1/completions", headers=st.headers(), timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert live_reservations(st.redis) == []
    assert (_served(prefill), _served(decode)) == before
    no_leftovers(st)


def test_a_client_leaving_a_batched_stream_leaves_nothing_held(
        gw_stack: GatewayStack) -> None:
    """Two prompts, two samples each, streamed; the client hangs up after a few events:
    every choice's reservation, quota lease and engine request is given back (vLLM's own
    connector leaks blocks when one of n streams is cancelled)."""
    st = gw_stack
    prompts = [prompt_of(f"leavebatch{i}", 3) for i in range(2)]

    async def leave_after_first_events() -> int:
        async with httpx.AsyncClient(timeout=120) as c, c.stream(
                "POST", f"{st.url}/v1/completions", headers=st.headers(), json={
                    "model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 200,
                    "temperature": 0.5, "seed": 1, "ignore_eos": True,
                    "stream": True}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n >= 4:
                    break  # leaving the block hangs up mid-stream
            return n

    assert asyncio.run(leave_after_first_events()) == 4
    no_leftovers(st)


def test_tokenize_and_detokenize_answer_as_the_engine(gw_stack: GatewayStack) -> None:
    st = gw_stack
    engine = st.pair.decode.url
    for path, body in [
        ("/tokenize", {"model": MODEL, "prompt": "def f(x):\n    return x"}),
        ("/tokenize", {"model": MODEL, "prompt": "hello", "add_special_tokens": False,
                       "return_token_strs": True}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3, 400]}),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}),  # the engine's 404
    ]:
        got = httpx.post(f"{st.url}{path}", headers=st.headers(), json=body, timeout=30)
        want = httpx.post(f"{engine}{path}", json=body, timeout=30)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), (path, body)
    r = httpx.post(f"{st.url}/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{st.url}/detokenize", headers=st.headers(), content=b"[1, 2]",
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_responses_are_served_through_p_d_as_the_engine_answers(
        gw_stack: GatewayStack) -> None:
    """``/v1/responses``, unary and streamed, through the push path with the tenant's
    auth and quota: its input rendered once by an engine to size the reservation, the
    prompt pushed and verified, and the greedy text a lone colocated request gives."""
    st = gw_stack
    prefill, decode = st.pair.prefill.url, st.pair.decode.url
    body = {"model": MODEL, "input": prompt_of("responses", 5),
            "instructions": "Answer in code.", "max_output_tokens": 8, "temperature": 0}
    ids = httpx.post(f"{decode}/v1/responses/render", json=body, timeout=30).json()["token_ids"]
    want = httpx.post(f"{prefill}/v1/responses", json=body, timeout=60).json()

    pushed = _PushedIntact(st, ["unary"], tokens=len(ids))
    r = httpx.post(f"{st.url}/v1/responses", headers=st.headers(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "response" and got["status"] == want["status"]
    assert responses_text(got) == responses_text(want)
    assert got["usage"]["input_tokens"] == len(ids)
    pushed.check()

    # The same input again, streamed, under another tenant (no prefix shared with the
    # first): decode receives the whole prompt by push again.
    pushed = _PushedIntact(st, ["stream"], tokens=len(ids))
    with httpx.stream("POST", f"{st.url}/v1/responses", headers=st.headers(TENANT_B),
                      json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        kinds, deltas, final = [], [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            elif line.startswith("data: ") and kinds[-1] == "response.output_text.delta":
                deltas.append(json.loads(line[6:])["delta"])
            elif line.startswith("data: ") and kinds[-1] == "response.completed":
                final = json.loads(line[6:])["response"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "".join(deltas) == responses_text(want) == responses_text(final)
    pushed.check()

    r = httpx.post(f"{st.url}/v1/responses", headers=st.headers(),
                   json={**body, "background": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    no_leftovers(st)


def _outcome(r: httpx.Response, endpoint: str) -> tuple[str, Any]:
    """What an answer says, comparably: refused / failed, or the text of each choice."""
    if r.status_code >= 500:
        return "failed", None
    if r.status_code != 200:
        return "refused", None
    doc = r.json()
    if endpoint == "responses":
        return "ok", (responses_text(doc), doc.get("status"))
    if endpoint == "chat":
        return "ok", [(c["message"].get("content"), c["finish_reason"]) for c in doc["choices"]]
    return "ok", [(c["text"], c["finish_reason"]) for c in doc["choices"]]


def test_every_vllm_request_field_answers_as_a_colocated_engine(
        gw_stack: GatewayStack) -> None:
    """Generated from vLLM's own request models (``tests/openai_fields.py``): for every
    field of the completion, chat and responses requests, the gateway's answer (P/D) equals
    the prefill engine's answer to the same request sent straight to it (colocated: greedy,
    one request at a time), or the gateway refuses the field with a 400 naming it."""
    st = gw_stack
    engine = st.pair.prefill.url
    text = prompt_of("conformance", 3)
    bases = {
        "completions": {"model": MODEL, "prompt": text, "max_tokens": 3, "temperature": 0.0},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": text}],
                 "max_tokens": 3, "temperature": 0.0},
        "responses": {"model": MODEL, "input": text, "max_output_tokens": 3,
                      "temperature": 0.0},
    }
    paths = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
             "responses": "/v1/responses"}
    differ: list[tuple[str, str, Any, Any]] = []
    checked = 0
    with httpx.Client(timeout=120) as c:
        # vLLM's first request with logprobs on a CPU engine takes seconds (3.4 s measured on
        # a fresh engine alone, more beside the other one), which the 20 s deadline may not
        # cover: both engines pay it here, outside the comparison.
        for url in (engine, st.pair.decode.url):
            warm = c.post(f"{url}/v1/completions", json={**bases["completions"],
                                                         "logprobs": 2, "prompt": "warm"})
            assert warm.status_code == 200, warm.text
        for endpoint, table in TABLES.items():
            for field, sample in table.items():
                body = {**bases[endpoint], field: True if sample is REFUSED else sample}
                got = c.post(f"{st.url}{paths[endpoint]}", headers=st.headers(), json=body)
                if sample is REFUSED:
                    if got.status_code != 400 or got.json()["error"]["param"] != field:
                        differ.append((endpoint, field, got.status_code, got.text[:200]))
                    continue
                want = c.post(f"{engine}{paths[endpoint]}", json=body)
                if _outcome(got, endpoint) != _outcome(want, endpoint):
                    differ.append((endpoint, field, (got.status_code, got.text[:300]),
                                   (want.status_code, want.text[:300])))
                checked += 1
    assert checked > 120
    assert differ == [], "\n".join(map(str, differ))
    no_leftovers(st)
    # Requests decode refused after prefill had answered (stream_options without stream,
    # an unconfigured reasoning budget) leave prefill holding their blocks for a target
    # that never comes, until their deadline: nothing is held past it.
    until(lambda: metric_sum(scrape(st.pair.prefill.url), "vllm:kv_cache_usage_perc") == 0,
          "prefill's held blocks given back at their deadline", 90)
