"""Requests for several choices (batched completion prompts, ``n > 1``) at the gateway: the
pure parts (splitting a body, summing usage, rewriting stream events), then the gateway over
real HTTP, Redis and the scheduler against the stand-in engines of ``test_gateway``, and the
scheduler's placement of a sample on the decode engine that holds its prompt. Real engines:
``tests/e2e_tiny/test_e2e_openai``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis

from kvpush.common.reservations import Reservations
from kvpush.common.runtime import run
from kvpush.services.gateway.fanout import _MergedStream, _summed
from kvpush.services.gateway.openai_api import BadRequest, split_batch
from tests.sched_util import (
    assignments,
    engine_status,
    enqueue,
    publish,
    release_all,
    request,
    running,
    settings,
    wait_for,
)
from tests.test_gateway import PROMPT, no_leaks, pd, stack, tokenizer_dir

__all__ = ["no_leaks", "tokenizer_dir"]  # fixtures, used by name


def test_split_batch_takes_strings_or_token_id_lists_and_nothing_mixed() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "max_tokens": 3}
    assert split_batch(body, 8) == [dict(body, prompt="a"), dict(body, prompt="b")]
    ids = {"prompt": [[1, 2], [3]]}
    assert split_batch(ids, 8) == [{"prompt": [1, 2]}, {"prompt": [3]}]
    # One prompt, in any of its spellings, is not a batch.
    for one in ("a", [1, 2, 3], ["a"], [[1, 2]], [], None, 5):
        assert split_batch({"prompt": one}, 8) is None
    assert split_batch(["not", "a", "dict"], 8) is None
    with pytest.raises(BadRequest) as mixed:
        split_batch({"prompt": ["a", [1]]}, 8)
    assert mixed.value.param == "prompt"
    with pytest.raises(BadRequest) as big:
        split_batch({"prompt": ["a"] * 9}, 8)
    assert big.value.param == "prompt" and "at most 8" in str(big.value)


def test_usage_is_summed_field_by_field() -> None:
    a = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
         "prompt_tokens_details": {"cached_tokens": 1}}
    b = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
         "prompt_tokens_details": None}
    assert _summed([a, None, b]) == {"prompt_tokens": 7, "completion_tokens": 3,
                                     "total_tokens": 10,
                                     "prompt_tokens_details": {"cached_tokens": 1}}
    assert _summed([None, "x"]) is None


def test_stream_events_take_the_requests_id_and_their_prompts_index() -> None:
    m = _MergedStream(None, [], [], "cmpl-batch", include_usage=True)  # type: ignore[arg-type]
    tok = {"id": "cmpl-x-p1", "object": "text_completion", "created": 7, "model": "tiny",
           "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    usage = {"id": "cmpl-x-p1", "created": 7, "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    chunk = (f"data: {json.dumps(tok)}\n\ndata: {json.dumps(usage)}\n\n"
             "data: [DONE]\n\n").encode()
    out = m._rewritten(1, chunk)
    (ev,) = [e for e in out.split(b"\n\n") if e]
    doc = json.loads(ev[6:])
    assert doc["id"] == "cmpl-batch" and doc["choices"][0]["index"] == 1
    assert doc["choices"][0]["text"] == "hi"
    assert m.usage == [(1, usage["usage"])]  # held for the one summed usage chunk
    err = b'data: {"error": {"message": "x", "code": 502}}\n\n'
    assert m._rewritten(0, err) == err  # an error event goes to the client as it is


def test_a_batch_is_one_request_per_prompt_answered_in_order(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", json={
                "model": "tiny", "prompt": [PROMPT, "hello world", "user assistant"],
                "max_tokens": 3})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
            assert doc["usage"] == {"completion_tokens": 9}
            assert doc["id"].startswith("cmpl-")
            rids = {c.headers["x-request-id"] for c in d.calls}
            assert rids == {f"{doc['id']}-c{i}" for i in range(3)}
            assert sorted(len(c.body["prompt"]) for c in p.calls) == [2, 2, 10]
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_a_batched_stream_interleaves_prompts_and_ends_once(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            async with s.client.stream("POST", "/v1/completions", json={
                    "prompt": [PROMPT, "hello world"], "max_tokens": 4,
                    "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] async for line in r.aiter_lines()
                          if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            docs = [json.loads(e) for e in events[:-1]]
            assert len({doc["id"] for doc in docs}) == 1
            for i in (0, 1):
                texts = [doc["choices"][0]["text"] for doc in docs
                         if doc["choices"][0]["index"] == i]
                assert "".join(texts) == "t0 t1 t2 t3 "
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_one_failing_prompt_fails_the_batch_and_releases_the_others(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()
    d.mode = "refuse"  # every decode call is refused: the first failure is the answer

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", json={
                "prompt": [PROMPT, "hello world"], "max_tokens": 3})
            assert r.status_code == 400, r.text
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_leaving_a_batched_stream_aborts_every_prompt(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()
    d.mode = "hang_after"

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            async with s.client.stream("POST", "/v1/completions", json={
                    "prompt": [PROMPT, "hello world"], "max_tokens": 50,
                    "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                assert Reservations(redis_client).count("d1") == 2
            await asyncio.wait_for(d.aborted.wait(), 30)
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_requests_in_flight 0.0' in m

    run(main())


def test_n_samples_prefill_and_push_once_and_run_on_the_same_decode(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 3, "seed": 5,
                "temperature": 1.0, "best_of": 3})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
            assert doc["usage"] == {"completion_tokens": 12}
            # Prefilled (and pushed) once; every sample decoded on the one decode engine.
            (pc,) = p.calls
            assert len(d.calls) == 3
            params = [c.body.get("kv_transfer_params") for c in d.calls]
            assert sum(x is not None for x in params) == 1
            assert pc.body["kv_transfer_params"]["request_id"] == f"{doc['id']}-c0"
            # Each sample as vLLM's parallel sampling seeds it, and each asks for one.
            assert sorted(c.body["seed"] for c in d.calls) == [5, 6, 7]
            assert all(c.body["n"] == 1 for c in d.calls + p.calls)
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_n_samples_of_batched_prompts_stream_at_prompt_times_n_plus_sample(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            async with s.client.stream("POST", "/v1/completions", json={
                    "prompt": [PROMPT, "hello world the a of and"], "max_tokens": 3,
                    "n": 2, "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] async for line in r.aiter_lines()
                          if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            indexes = {json.loads(e)["choices"][0]["index"] for e in events[:-1]}
            assert indexes == {0, 1, 2, 3}
            assert len(p.calls) == 2 and len(d.calls) == 4  # each prompt prefilled once
            r = await s.client.post("/v1/completions", json={
                "prompt": [PROMPT] * 9, "max_tokens": 3, "n": 8})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            await wait_for(lambda: not Reservations(redis_client).count("d1"), "release")

    run(main())


def test_a_sample_goes_to_the_decode_that_holds_its_prompt_or_nowhere(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The scheduler's side of ``colocate_on``: placed there with no prefill, and refused
    at once (``no_engine``, its gateway places it afresh) when that engine is gone."""
    for e in (engine_status("d1"), engine_status("d2"), engine_status("p1", role="prefill")):
        publish(redis_client, e)

    async def main() -> None:
        async with running(settings(redis_url)):
            for rid, pin in (("cmpl-pin-a", "d2"), ("cmpl-pin-b", "d2"), ("cmpl-gone", "d9")):
                req = request(prompt_tokens=100, rid=rid)
                req.colocate_on = pin
                enqueue(redis_client, req)
            await wait_for(lambda: len(assignments(redis_client)) == 3, "three answers")

    run(main())
    got = {a.request_id: a for a in assignments(redis_client)}
    for rid in ("cmpl-pin-a", "cmpl-pin-b"):
        a = got[rid]
        assert a.ok and a.decode_engine == "d2" and a.prefill_engine is None
        assert not a.disaggregated
    assert not got["cmpl-gone"].ok and got["cmpl-gone"].error_kind == "no_engine"
    release_all(redis_client, list(got.values()))


def test_a_response_never_stored_is_vllms_404(redis_url: str, redis_client: redis.Redis,
                                              tokenizer_dir: Path) -> None:
    """The error body is the one vLLM's own response store answers with."""
    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir) as s:
            for method in ("GET", "DELETE"):
                r = await s.client.request(method, "/v1/responses/resp_123")
                assert r.status_code == 404
                assert r.json()["error"] == {
                    "message": "Response with id 'resp_123' not found.",
                    "type": "invalid_request_error", "param": "response_id", "code": 404}

    run(main())
