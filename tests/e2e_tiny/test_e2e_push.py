"""End to end: two real vLLM CPU engines with KVPushConnector, real Redis, real NIXL.

The engines export spans to a real OTLP/HTTP receiver (``KVPUSH_OTLP_ENDPOINT`` and vLLM's
``--otlp-traces-endpoint``, set by the launcher) and serve the connector's Prometheus
series on /metrics; both are checked against the per-transfer stats files.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import Reservations
from kvpush.common.wire import AgentInfo, PushTarget, decode, encode, now_ms
from kvpush.loadtest.faults.hostile import HOSTILE_KV_PARAMS
from kvpush.loadtest.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.e2e_tiny.conftest import BLOCK, CHUNK, QUARANTINE_S
from tests.e2e_util import (
    Call,
    EnginePair,
    code_prompt,
    complete,
    completion_body,
    disaggregated,
    external_kv_tokens,
    metric,
    prompt_tokens,
    push_decode_params,
    push_prefill_params,
    start_engine,
    wait_for_target,
)

pytestmark = pytest.mark.slow

MODEL = "tiny"
LAYERS = 4


def _traceparent() -> tuple[str, str, str]:
    """(traceparent, trace id, parent span id) of a fresh sampled trace, as the gateway
    would send it."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _until(pred: Any, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def _records(path: Path, rid: str, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["rid"] == rid and r["kind"] == kind]


def _wait_records(path: Path, rid: str, kind: str, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = _records(path, rid, kind)
        if rows:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"no {kind} record for {rid} in {path}")


STATUS_UNSET, STATUS_ERROR = 0, 2  # OTLP status codes


def _spans(otlp: OTLPReceiver, trace_id: str, name: str, n: int = 1,
           timeout_s: float = 60) -> list[ReceivedSpan]:
    """At least ``n`` spans called ``name`` of ``trace_id`` (vLLM's batch exporter sends
    every few seconds, so this waits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [x for x in otlp.by_name(name) if x.trace_id == trace_id]
        if len(got) >= n or time.monotonic() > deadline:
            assert len(got) >= n, f"{len(got)} {name} spans of trace {trace_id}, want {n}"
            return got
        time.sleep(0.2)


def _kv_bytes(stack: dict[str, Any], n_tokens: int) -> tuple[int, int]:
    """(blocks, bytes) of a prompt's KV on the prefill engine, every layer."""
    pair: EnginePair = stack["pair"]
    r = redis.Redis.from_url(stack["redis_url"])
    layout = decode(r.get(RedisKeys().agent(pair.prefill.engine_id, 0)), AgentInfo).layout
    blocks = -(-n_tokens // BLOCK)
    return blocks, blocks * layout.block_len * len(layout.layer_names)


def _wait_kv_usage_zero(url: str, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    usage = 1.0
    while time.monotonic() < deadline:
        usage = metric(url, "vllm:kv_cache_usage_perc")
        if usage == 0:
            return usage
        time.sleep(0.2)
    return usage


def test_push_output_equals_single_engine_and_counts_external_tokens(stack) -> None:
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("basic", 12)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    assert n_tokens > 3 * BLOCK
    ext_before = external_kv_tokens(pair.decode.url)
    r = redis.Redis.from_url(stack["redis_url"])
    resv = Reservations(r).reserve(pair.decode.engine_id, "resv-basic", 8, 60_000)
    assert resv.reservation is not None
    rid, text = disaggregated(pair, prompt, decode_params={
        "reservation_id": "resv-basic", "fencing_token": resv.reservation.fencing_token})
    # The decode engine computed only the last prompt token; the rest arrived by push.
    assert external_kv_tokens(pair.decode.url) - ext_before == n_tokens
    # The decode connector released the reservation when the request ended.
    _until(lambda: all(x.reservation_id != "resv-basic"
                       for x in Reservations(r).snapshot(pair.decode.engine_id).reservations))
    # Reference: the prefill engine alone (no kv_transfer_params) on the same prompt.
    want = complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
    assert text == want and text
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["ok"] and push["blocks"] == -(-n_tokens // BLOCK)
    assert push["bytes"] == push["blocks"] * LAYERS * (push["bytes"] // (push["blocks"] * LAYERS))
    recv = _wait_records(stack["stats"]["decode"], rid, "recv")[0]
    assert recv["ok"] and recv["bytes"] == push["bytes"]
    # Decode's CRC of every received block of every layer equals prefill's.
    assert push["verified"] is True and recv["verified"] is True
    # Prefill freed its blocks once the push completed.
    assert _wait_kv_usage_zero(pair.prefill.url) == 0


def test_target_after_prefill_finished_is_pushed_from_held_blocks(stack) -> None:
    """Prefill ends before decode even starts: its blocks wait for the target."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("held", 9)
    rid, text = disaggregated(pair, prompt, prefill_first=True)
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["ok"] and push["layerwise_xfers"] == 0 and push["xfers"] == 1
    assert _wait_kv_usage_zero(pair.prefill.url) == 0


def test_layerwise_writes_are_posted_during_the_forward_pass(stack) -> None:
    """Target known before prefill starts: every layer's WRITE is posted from
    save_kv_layer, in layer order, before the forward pass of its step ends."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("overlap", 6)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    assert n_tokens <= CHUNK  # one prefill step
    rid, text = disaggregated(pair, prompt, decode_first=True)
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["ok"]
    assert push["layerwise_xfers"] == push["xfers"] == LAYERS  # no catch-up write needed
    posts = push["layer_posts_ns"]
    assert [layer for layer, _t in posts] == list(range(LAYERS))
    times = [t for _layer, t in posts]
    assert times == sorted(times)
    assert times[-1] < push["forward_end_ns"]


def test_chunked_prefill_longer_than_the_chunk(stack) -> None:
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("chunked", 40)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    assert n_tokens > 3 * CHUNK
    ext_before = external_kv_tokens(pair.decode.url)
    rid, text = disaggregated(pair, prompt, decode_first=True)
    assert external_kv_tokens(pair.decode.url) - ext_before == n_tokens
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    steps = -(-n_tokens // CHUNK)
    assert push["ok"] and push["blocks"] == -(-n_tokens // BLOCK)
    # Each chunk wrote the blocks it completed, layer by layer, as it went.
    assert push["layerwise_xfers"] >= LAYERS * (steps - 1)
    assert _wait_kv_usage_zero(pair.prefill.url) == 0


def test_decode_prefix_hit_pushes_only_the_missing_blocks(stack) -> None:
    pair: EnginePair = stack["pair"]
    prefix = code_prompt("shared-prefix", 15)
    prompt = prefix + "\n# and then some more\n" + code_prompt("suffix", 4)
    # Decode computes the prefix itself first, so it holds those blocks in its cache.
    complete(pair.decode.url, completion_body(prefix, 1))
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    ext_before = external_kv_tokens(pair.decode.url)
    rid, text = disaggregated(pair, prompt)
    pushed_tokens = external_kv_tokens(pair.decode.url) - ext_before
    cached = n_tokens - pushed_tokens
    assert 0 < cached < n_tokens and cached % BLOCK == 0
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["blocks"] == -(-n_tokens // BLOCK) - cached // BLOCK
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]


def _wrong_target(stack: dict[str, Any], rid: str, n_tokens: int,
                  deadline_ms: int | None = None) -> None:
    """Publish, before decode does, a target naming decode's last (unused) blocks."""
    pair: EnginePair = stack["pair"]
    r = redis.Redis.from_url(stack["redis_url"])
    info = decode(r.get(RedisKeys().agent(pair.decode.engine_id, 0)), AgentInfo)
    n_blocks = -(-n_tokens // BLOCK)
    wrong = list(range(info.layout.num_blocks - n_blocks, info.layout.num_blocks))
    r.xadd(RedisKeys().targets(pair.prefill.engine_id), {"m": encode(PushTarget(
        request_id=rid, decode_engine=pair.decode.engine_id,
        decode_generation=info.generation, block_ids=[wrong], skip_blocks=[0],
        num_tokens=n_tokens,
        deadline_ms=deadline_ms or now_ms() + 60_000,
    ))})


def test_control_push_into_wrong_blocks_is_caught_by_the_kv_checksums(stack) -> None:
    """KV written into the wrong decode blocks: decode's checksum of its own blocks
    differs from prefill's, the receive fails (policy ``fail``) and the client gets an
    error, never an answer computed from KV that is not the prompt's."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("control", 10)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    rid = f"cmpl-{uuid.uuid4().hex}"
    failures = metric(pair.decode.url, "kvpush_kv_verify_failures_total")
    _wrong_target(stack, rid, n_tokens)  # a target published first wins
    p = Call(pair.prefill.url,
             completion_body(prompt, 1, push_prefill_params(rid, pair.decode.engine_id)), rid)
    d = Call(pair.decode.url,
             completion_body(prompt, 16, push_decode_params(rid, pair.prefill.engine_id)), rid)
    p.start()
    d.start()
    p.join(180)
    d.join(180)
    assert p.error is None
    assert d.error is not None and d.result is None
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert push["ok"] and push["verified"] is True  # prefill wrote what it was told
    recv = _wait_records(stack["stats"]["decode"], rid, "recv")[0]
    assert not recv["ok"] and recv["outcome"] == "corrupt" and recv["verified"] is False
    assert (recv["bad_layer"], recv["bad_block"]) == (0, 0)
    assert "checksum mismatch" in recv["error"]
    _until(lambda: metric(pair.decode.url, "kvpush_kv_verify_failures_total") == failures + 1)
    # The engines go on serving correctly.
    _rid, text = disaggregated(pair, code_prompt("after-control", 6))
    assert text == complete(pair.prefill.url, completion_body(code_prompt("after-control", 6), 16)
                            )["choices"][0]["text"]


def test_control_late_target_gets_no_write(stack) -> None:
    """A target whose deadline has passed (decode may already reuse its blocks): prefill
    posts no WRITE at all and reports the push as ended by the deadline."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("late-write", 8)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    rid = f"cmpl-{uuid.uuid4().hex}"
    _wrong_target(stack, rid, n_tokens, deadline_ms=now_ms() - 100)
    p = Call(pair.prefill.url,
             completion_body(prompt, 1, push_prefill_params(rid, pair.decode.engine_id)), rid)
    p.start()
    p.join(180)
    assert p.error is None
    push = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    # Stopped by the scheduler side's deadline check or the worker's, before any post.
    assert not push["ok"] and push["outcome"] in ("deadline", "cancelled")
    assert push["xfers"] == 0 and push["bytes"] == 0 and push["first_post_ns"] == 0
    assert _wait_kv_usage_zero(pair.prefill.url) == 0


def test_missing_prefill_fails_the_request_at_the_deadline(stack) -> None:
    """Policy ``fail``: no prefill ever pushes, nor hears of the request (so none fences
    it); decode gives the push up at the deadline, keeps the blocks until the quarantine's
    bound, then fails the request and frees all."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("orphan", 5)
    rid = f"cmpl-{uuid.uuid4().hex}"
    tp, trace_id, parent = _traceparent()
    started = time.monotonic()
    resp = httpx.post(f"{pair.decode.url}/v1/completions", timeout=120, json=completion_body(
        prompt, 8, push_decode_params(rid, pair.prefill.engine_id, deadline_s=2, traceparent=tp)))
    elapsed = time.monotonic() - started
    failed = resp.status_code != 200 or resp.json()["choices"][0]["finish_reason"] == "error"
    assert failed, resp.text
    assert elapsed >= 2 + QUARANTINE_S
    recv = _wait_records(stack["stats"]["decode"], rid, "recv")[0]
    assert not recv["ok"] and "deadline" in recv["error"] and recv["outcome"] == "deadline"
    entered, cut = _wait_records(stack["stats"]["decode"], rid, "quarantine")
    assert (entered["outcome"], cut["outcome"]) == ("entered", "cut_off")
    # The wait span says so too, on the request's trace.
    (wait,) = _spans(stack["otlp"], trace_id, "kvpush.kv.wait")
    assert wait.parent_span_id == parent and wait.status_code == STATUS_ERROR
    assert wait.attributes["kvpush.outcome"] == "deadline" and "exception" in wait.events
    # Prefill was told to drop the push; decode freed its blocks.
    assert _wait_kv_usage_zero(pair.decode.url) == 0
    # And the engine still serves pushed requests.
    _rid, text = disaggregated(pair, code_prompt("after-orphan", 5))
    assert text


def _kill_tree(pid: int) -> None:
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def spare_decode(stack: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A second decode engine with failure policy ``recompute``: the recompute test uses
    it, then the decode-killed test kills it (one extra engine start for both)."""
    stats = stack["logs"] / "spare-decode-stats.jsonl"
    with start_engine(stack["logs"], role="decode", connector="kvpush",
                      extra_config={"stats_file": str(stats), "failure_policy": "recompute",
                                    "quarantine_max_s": QUARANTINE_S},
                      **stack["common"]) as engine:
        yield {"engine": engine, "stats": stats}


def test_recompute_policy_decodes_locally_when_prefill_never_pushes(stack, spare_decode
                                                                    ) -> None:
    """Policy ``recompute``: no prefill ever pushes; past the deadline and the quarantine's
    bound (no prefill fences a request it never heard of) decode computes the prompt
    itself, and the answer is still the single-engine one."""
    pair: EnginePair = stack["pair"]
    spare = spare_decode["engine"]
    prompt = code_prompt("recompute", 5)
    rid = f"cmpl-{uuid.uuid4().hex}"
    tp, trace_id, parent = _traceparent()
    ext_before = external_kv_tokens(spare.url)
    resp = httpx.post(f"{spare.url}/v1/completions", timeout=120, json=completion_body(
        prompt, 16, push_decode_params(rid, pair.prefill.engine_id, deadline_s=2, traceparent=tp)))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] != "error"
    want = complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
    assert choice["text"] == want
    # Nothing arrived by push: every prompt token was computed on decode.
    assert external_kv_tokens(spare.url) == ext_before
    recv = _wait_records(spare_decode["stats"], rid, "recv")[0]
    assert not recv["ok"] and recv["outcome"] == "deadline"
    (wait,) = _spans(stack["otlp"], trace_id, "kvpush.kv.wait")
    assert wait.parent_span_id == parent and wait.status_code == STATUS_ERROR
    assert _wait_kv_usage_zero(spare.url) == 0


def test_decode_killed_mid_push_leaves_prefill_serving_without_leaks(stack, spare_decode
                                                                     ) -> None:
    pair: EnginePair = stack["pair"]
    doomed = spare_decode["engine"]
    prompt = code_prompt("doomed", 20)
    rid = f"cmpl-{uuid.uuid4().hex}"
    d = Call(doomed.url,
             completion_body(prompt, 8, push_decode_params(rid, pair.prefill.engine_id)), rid)
    d.start()
    wait_for_target(pair, rid)
    # Decode dies with its blocks published: prefill must not wait for it forever.
    assert doomed.pid is not None
    _kill_tree(doomed.pid)
    tp, trace_id, parent = _traceparent()
    p = Call(pair.prefill.url, completion_body(prompt, 1, push_prefill_params(
        rid, doomed.engine_id, deadline_s=5, traceparent=tp)), rid)
    p.start()
    p.join(120)
    assert p.error is None  # the prefill leg itself completes
    push = _wait_records(stack["stats"]["prefill"], rid, "push", timeout_s=60)[0]
    assert not push["ok"] and push["outcome"] in ("error", "deadline")
    (span,) = _spans(stack["otlp"], trace_id, "kvpush.kv.push")
    assert span.parent_span_id == parent and span.status_code == STATUS_ERROR
    assert span.attributes["kvpush.outcome"] == push["outcome"]
    assert span.attributes["kvpush.dst_engine"] == doomed.engine_id
    assert _wait_kv_usage_zero(pair.prefill.url, timeout_s=60) == 0
    # Prefill still serves, pushes to the healthy decode included.
    _rid, text = disaggregated(pair, code_prompt("survivor", 5))
    assert text == complete(pair.prefill.url, completion_body(code_prompt("survivor", 5), 16))[
        "choices"][0]["text"]


def test_push_spans_join_the_request_trace_with_the_prompt_kv_bytes(stack) -> None:
    """kvpush.kv.push (with kvpush.kv.write children) on prefill and kvpush.kv.wait on
    decode carry the trace of the traceparent in kv_transfer_params, next to vLLM's own
    llm_request spans; their byte counts are the prompt's KV, every layer."""
    pair: EnginePair = stack["pair"]
    otlp: OTLPReceiver = stack["otlp"]
    tp, trace_id, parent = _traceparent()
    prompt = code_prompt("traced", 8)
    n_tokens = prompt_tokens(pair.decode.url, prompt)
    blocks, kv_bytes = _kv_bytes(stack, n_tokens)
    rid, text = disaggregated(pair, prompt, decode_first=True, traceparent=tp)
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]

    (push,) = _spans(otlp, trace_id, "kvpush.kv.push")
    writes = _spans(otlp, trace_id, "kvpush.kv.write")
    (wait,) = _spans(otlp, trace_id, "kvpush.kv.wait")
    assert push.parent_span_id == parent and wait.parent_span_id == parent
    assert all(w.parent_span_id == push.span_id for w in writes)
    assert push.service == wait.service == "kvpush-engine"
    assert push.status_code == wait.status_code == STATUS_UNSET
    pa, wa = push.attributes, wait.attributes
    assert pa["kvpush.bytes"] == wa["kvpush.bytes"] == kv_bytes
    assert sum(w.attributes["kvpush.bytes"] for w in writes) == kv_bytes
    assert pa["kvpush.blocks"] == wa["kvpush.blocks"] == blocks
    assert pa["kvpush.descriptors"] == blocks * LAYERS
    assert (pa["kvpush.src_engine"], pa["kvpush.dst_engine"]) == (
        pair.prefill.engine_id, pair.decode.engine_id)
    assert (wa["kvpush.src_engine"], wa["kvpush.dst_engine"]) == (
        pair.prefill.engine_id, pair.decode.engine_id)
    assert pa["kvpush.backend"] == "UCX" and pa["kvpush.outcome"] == wa["kvpush.outcome"] == "ok"
    # Target known before prefill ran: one layer-wise batch covering every layer.
    assert [(w.attributes["kvpush.layer_start"], w.attributes["kvpush.layer_end"])
            for w in writes] == [(0, LAYERS)]
    # Exposed transfer time: decode's KV complete minus prefill's last layer done.
    recv = _wait_records(stack["stats"]["decode"], rid, "recv")[0]
    assert recv["exposed_ms"] is not None
    assert wa["kvpush.exposed_transfer_ms"] == recv["exposed_ms"]
    push_rec = _wait_records(stack["stats"]["prefill"], rid, "push")[0]
    assert recv["last_layer_done_ms"] == push_rec["last_layer_done_ms"] > 0
    # vLLM's own request spans of both legs joined the same trace.
    llm = _spans(otlp, trace_id, "llm_request", n=2)
    assert {x.parent_span_id for x in llm} == {parent}


_OUTCOMES = ("ok", "error", "deadline", "cancelled", "corrupt")


def _by_outcome(path: Path, kinds: tuple[str, ...] = ("push", "recv")) -> dict[str, int]:
    """Transfers of ``path`` by outcome: an engine pushes and receives (a prefill receives
    history pushes, a decode makes them), and counts both in one series."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = dict.fromkeys(_OUTCOMES, 0)
    for r in rows:
        if r["kind"] in kinds:
            out[r["outcome"]] += 1
    return out


def _settle(read: Any, want: Any, timeout_s: float = 60) -> None:
    """Wait until ``read()`` equals ``want()`` (stats reach /metrics through vLLM's
    output loop a little after the stats file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got, expected = read(), want()
        if got == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"/metrics {got} != stats {expected}")
        time.sleep(0.2)


def test_engine_metrics_match_the_transfer_stats(stack) -> None:
    """kvpush_kv_* on each engine's /metrics agree with every transfer of its stats file."""
    pair: EnginePair = stack["pair"]
    prompt = code_prompt("metrics", 6)
    rid, _text = disaggregated(pair, prompt)
    _wait_records(stack["stats"]["decode"], rid, "recv")
    pre, dec = stack["stats"]["prefill"], stack["stats"]["decode"]

    def rows(path: Path, kind: str) -> list[dict[str, Any]]:
        return [r for line in path.read_text().splitlines() if line.strip()
                and (r := json.loads(line))["kind"] == kind]

    _settle(lambda: metric(pair.prefill.url, "kvpush_kv_bytes_pushed_total"),
            lambda: float(sum(r["bytes"] for r in rows(pre, "push") if r["ok"])))
    assert metric(pair.prefill.url, "kvpush_kv_bytes_pushed_total") > 0
    _settle(lambda: {o: metric(pair.prefill.url, "kvpush_kv_transfers_total", outcome=o)
                     for o in _OUTCOMES},
            lambda: {o: float(n) for o, n in _by_outcome(pre).items()})
    _settle(lambda: metric(pair.prefill.url, "kvpush_kv_transfer_seconds_count"),
            lambda: float(sum(1 for r in rows(pre, "push")
                              if r["ok"] and r["post_to_notify_s"] is not None)))
    _settle(lambda: {o: metric(pair.decode.url, "kvpush_kv_transfers_total", outcome=o)
                     for o in _OUTCOMES},
            lambda: {o: float(n) for o, n in _by_outcome(dec).items()})
    _settle(lambda: metric(pair.decode.url, "kvpush_kv_exposed_transfer_seconds_count"),
            lambda: float(sum(1 for r in rows(dec, "recv")
                              if r["ok"] and r["exposed_ms"] is not None)))
    assert metric(pair.decode.url, "kvpush_kv_exposed_transfer_seconds_count") > 0
    _settle(lambda: (metric(pair.decode.url, "kvpush_kv_verified_total"),
                     metric(pair.decode.url, "kvpush_kv_verify_failures_total")),
            lambda: (float(sum(1 for r in rows(dec, "recv") if r["verified"] is not None)),
                     float(sum(1 for r in rows(dec, "recv") if r["verified"] is False))))
    assert metric(pair.decode.url, "kvpush_kv_verified_total") > 0
    # Decode pushes only histories (test_e2e_history.py), prefill receives only those.
    _settle(lambda: metric(pair.decode.url, "kvpush_kv_bytes_pushed_total"),
            lambda: float(sum(r["bytes"] for r in rows(dec, "push") if r["ok"])))
    _settle(lambda: metric(pair.prefill.url, "kvpush_kv_bytes_received_total"),
            lambda: float(sum(r["bytes"] for r in rows(pre, "recv") if r["ok"])))




def test_malformed_kv_transfer_params_get_a_400_and_the_engines_live(stack) -> None:
    """Requests sent straight to an engine's port with malformed kvpush params: each gets
    a 400 naming ``kv_transfer_params`` at the engine's edge; no engine dies, no block
    stays allocated, and both still serve a pushed request correctly."""
    pair: EnginePair = stack["pair"]
    for engine in (pair.prefill, pair.decode):
        for why, params in HOSTILE_KV_PARAMS:
            body = {**completion_body(code_prompt("hostile", 2), 4), "kv_transfer_params": params}
            resp = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 400, (engine.engine_id, why, resp.text[:300])
            assert "kv_transfer_params" in resp.text, (why, resp.text[:300])
        assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
        assert engine.running()
    assert _wait_kv_usage_zero(pair.prefill.url) == 0
    assert _wait_kv_usage_zero(pair.decode.url) == 0
    prompt = code_prompt("after-hostile", 6)
    _rid, text = disaggregated(pair, prompt)
    assert text == complete(pair.prefill.url, completion_body(prompt, 16))["choices"][0]["text"]
