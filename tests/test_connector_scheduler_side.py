"""Scheduler side against real Redis: targets published and read, holds, deadlines, cancels."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from vllm.v1.request import RequestStatus

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import PushTarget, decode, encode, history_digest, now_ms
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import FenceTo, KVPushMetadata, KVPushWorkerMeta
from kvpush.connector.scheduler_side import SchedulerSide
from kvpush.connector.state import DecodeState
from tests.polling import until

BS = 16


@dataclass
class Req:
    """The fields of vLLM's ``Request`` the scheduler side reads."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    blocks: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None


def _side(redis_url: str, engine: str, role: str, blocks: dict[str, list[int]] | None = None,
          **cfg: Any) -> SchedulerSide:
    config = ConnectorConfig(redis_url=redis_url, engine_id=engine, **cfg)
    table = blocks if blocks is not None else {}
    return SchedulerSide(config, block_size=BS, generation=42, kv_role=role,
                         block_ids_of=lambda rid: [table.get(rid, [])])


def _targets(client: redis.Redis, engine: str) -> list[PushTarget]:
    return [decode(f[b"m"], PushTarget) for _id, f in client.xrange(RedisKeys().targets(engine))]


def test_decode_publishes_its_blocks_and_counts_prompt_as_async(redis_url, redis_client) -> None:
    side = _side(redis_url, "D", "kv_consumer")
    params = {"kvpush": "decode", "request_id": "rid-1", "prefill_engine": "P",
              "deadline_ms": now_ms() + 30_000, "traceparent": "00-ab-cd-01"}
    req = Req("vllm-1", params, num_prompt_tokens=50)
    # 16 tokens already in the local prefix cache: the other 34 come by push.
    assert side.get_num_new_matched_tokens(req, 16) == (34, True)
    assert side.get_num_new_matched_tokens(req, 16) == (34, True)  # side-effect free
    side.update_state_after_alloc(req, [[7, 3, 9, 12, 40]], 34)
    meta = side.build_connector_meta([])
    assert meta.recvs["vllm-1"].block_ids == [[7, 3, 9, 12]]  # ceil(50/16) blocks
    t = until(lambda: _targets(redis_client, "P"), "a target", 5, step_s=0.02)[0]
    assert (t.request_id, t.decode_engine, t.decode_generation) == ("rid-1", "D", 42)
    assert t.block_ids == [[7, 3, 9, 12]] and t.skip_blocks == [1] and t.num_tokens == 50
    assert t.traceparent == "00-ab-cd-01" and not t.cancel
    # After the receive failed (recompute), re-admission computes locally.
    side.update_connector_output(None, {"vllm-1"}, {"vllm-1"})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    # Failure told prefill to stop.
    assert until(lambda: [x for x in _targets(redis_client, "P") if x.cancel], "a cancel",
                 5, step_s=0.02)
    req.status = RequestStatus.FINISHED_ERROR
    assert side.request_finished(req, [[7, 3, 9, 12]]) is False
    assert side.tracked() == {}
    side.shutdown()


def test_decode_abort_while_receiving_cancels_and_abandons(redis_url, redis_client) -> None:
    side = _side(redis_url, "D", "kv_consumer")
    params = {"kvpush": "decode", "request_id": "rid-2", "prefill_engine": "P"}
    req = Req("vllm-2", params, num_prompt_tokens=20)
    assert side.get_num_new_matched_tokens(req, 0) == (20, True)
    side.update_state_after_alloc(req, [[1, 2]], 20)
    side.build_connector_meta([])
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [[1, 2]]) is False
    meta = side.build_connector_meta([])
    assert meta.abandoned == {"vllm-2"}
    assert side.tracked() == {"vllm-2": DecodeState.ABANDONED}
    cancels = until(lambda: [x for x in _targets(redis_client, "P") if x.cancel], "a cancel",
                    5, step_s=0.02)
    assert cancels[0].request_id == "rid-2" and cancels[0].deadline_ms > 0
    side.update_connector_output(None, {"vllm-2"}, None)  # push stopped: blocks freed
    assert side.tracked() == {}
    side.shutdown()


def _prefill_req(rid: str, n: int = 40, deadline_s: float = 30) -> Req:
    return Req(f"v-{rid}", {"kvpush": "prefill", "request_id": rid, "decode_engine": "D",
                            "deadline_ms": now_ms() + int(deadline_s * 1000)}, n)


def _publish(client: redis.Redis, rid: str, blocks: list[int], cancel: bool = False,
             deadline_ms: int | None = None, decode_engine: str = "D",
             push_key: str | None = None) -> None:
    client.xadd(RedisKeys().targets("P"), {"m": encode(PushTarget(
        request_id=rid, decode_engine=decode_engine, decode_generation=9, block_ids=[blocks],
        num_tokens=40, skip_blocks=[1], deadline_ms=deadline_ms or now_ms() + 30_000,
        cancel=cancel, push_key=push_key))})


def _meta_until(side: SchedulerSide, pred: Any, scheduled: list | None = None
                ) -> KVPushMetadata:
    return until(lambda: (m := side.build_connector_meta(scheduled or [])) and pred(m) and m,
                 "the connector metadata", 5, step_s=0.02)


def test_prefill_target_before_request_then_push_and_free(redis_url, redis_client) -> None:
    blocks = {"v-r1": [5, 6, 7]}
    side = _side(redis_url, "P", "kv_producer", blocks)
    time.sleep(0.2)  # the reader thread starts at the stream's end
    _publish(redis_client, "r1", [10, 11, 12])
    req = _prefill_req("r1")
    # Give the reader time to hand the target over before the request is scheduled.
    time.sleep(0.3)
    side.update_state_after_alloc(req, [], 0)
    meta = side.build_connector_meta([("v-r1", 40, False)])
    assert meta.targets["v-r1"].block_ids == [[10, 11, 12]]
    assert meta.targets["v-r1"].skip_blocks == [1]
    step = meta.steps["v-r1"]
    assert (step.block_ids, step.computed_before, step.computed_after) == ([[5, 6, 7]], 0, 40)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [[5, 6, 7]]) is True
    assert side.has_pending_push_work()
    meta = side.build_connector_meta([])
    assert meta.held == {"v-r1": [[5, 6, 7]]}
    side.update_connector_output({"v-r1"}, None, None)
    assert side.tracked() == {} and not side.has_pending_push_work()
    side.shutdown()


def test_an_early_prefill_takes_only_the_target_with_its_push_key(
        redis_url, redis_client) -> None:
    """A request sent to prefill at admission names no decode: targets and cancels forged
    by other engines (no key, a wrong one), before and after the request is known, are
    ignored; its decode's target, carrying the key, is taken."""
    side = _side(redis_url, "P", "kv_producer", {"v-r9": [5, 6, 7]})
    time.sleep(0.2)  # the reader thread starts at the stream's end
    _publish(redis_client, "r9", [66], decode_engine="X")
    _publish(redis_client, "r9", [], cancel=True, decode_engine="X", push_key="guess")
    time.sleep(0.3)
    side.build_connector_meta([])  # drains the inbox into pending
    req = Req("v-r9", {"kvpush": "prefill", "request_id": "r9", "push_key": "k-9",
                       "deadline_ms": now_ms() + 30_000}, 40)
    side.update_state_after_alloc(req, [], 0)
    meta = side.build_connector_meta([("v-r9", 40, False)])
    assert not meta.targets and not meta.cancel
    _publish(redis_client, "r9", [77], decode_engine="Y", push_key="k-8")
    _publish(redis_client, "r9", [10, 11, 12], push_key="k-9")
    meta = _meta_until(side, lambda m: m.targets)
    assert meta.targets["v-r9"].block_ids == [[10, 11, 12]]
    assert meta.targets["v-r9"].decode_engine == "D" and not meta.cancel
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [[5, 6, 7]]) is True
    side.shutdown()


def test_prefill_held_without_target_is_released_at_deadline(redis_url) -> None:
    side = _side(redis_url, "P", "kv_producer", {"v-r2": [1, 2, 3]})
    req = _prefill_req("r2", deadline_s=0.5)
    side.update_state_after_alloc(req, [], 0)
    side.build_connector_meta([("v-r2", 40, False)])
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [[1, 2, 3]]) is True
    assert side.build_connector_meta([]).held == {"v-r2": [[1, 2, 3]]}
    meta = _meta_until(side, lambda m: m.release)
    assert meta.release == {"v-r2"} and not meta.targets
    side.shutdown()


def test_prefill_cancel_before_request_means_no_push(redis_url, redis_client) -> None:
    side = _side(redis_url, "P", "kv_producer", {"v-r3": [1, 2, 3]})
    time.sleep(0.2)
    _publish(redis_client, "r3", [10, 11, 12])
    _publish(redis_client, "r3", [], cancel=True)
    time.sleep(0.3)
    side.build_connector_meta([])  # drains the inbox into pending
    req = _prefill_req("r3")
    side.update_state_after_alloc(req, [], 0)
    meta = side.build_connector_meta([("v-r3", 40, False)])
    assert not meta.targets
    # The workers learn which decode gave up: a rank no target reached tells it so.
    assert meta.fence == {"v-r3": FenceTo("r3", "D", 9)}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [[1, 2, 3]]) is False  # nothing to push: free now
    meta = side.build_connector_meta([])
    assert meta.forget == {"v-r3"} and meta.fence == {"v-r3": FenceTo("r3", "D", None)}
    side.shutdown()


def test_prefill_abort_while_pushing_holds_until_workers_stop(redis_url, redis_client) -> None:
    side = _side(redis_url, "P", "kv_producer", {"v-r4": [1, 2, 3]})
    time.sleep(0.2)
    req = _prefill_req("r4")
    side.update_state_after_alloc(req, [], 0)
    _publish(redis_client, "r4", [10, 11, 12])
    _meta_until(side, lambda m: m.targets, [("v-r4", 20, False)])
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [[1, 2, 3]]) is True  # writes may be in flight
    meta = side.build_connector_meta([])
    assert meta.cancel == {"v-r4"} and meta.held == {"v-r4": [[1, 2, 3]]}
    side.shutdown()


def test_preempted_prefill_requests_reach_the_workers(redis_url) -> None:
    side = _side(redis_url, "P", "kv_producer", {"v-r5": [1, 2, 3]})
    req = _prefill_req("r5")
    side.update_state_after_alloc(req, [], 0)
    side.build_connector_meta([("v-r5", 20, False)])
    # Only requests the connector tracks are named (others' preemptions are not its business).
    meta = side.build_connector_meta([], preempted={"v-r5", "v-other"})
    assert meta.preempted == {"v-r5"} and not meta.is_empty()
    # Rescheduled: the step says the blocks were reallocated.
    meta = side.build_connector_meta([("v-r5", 40, True)])
    assert meta.steps["v-r5"].restarted and not meta.preempted
    side.shutdown()


def test_targets_for_unknown_requests_are_held_boundedly(redis_url, redis_client) -> None:
    """Forged targets (a year-3000 deadline, a flood) cost bounded time and memory."""
    from kvpush.connector import scheduler_side as ss

    side = _side(redis_url, "P", "kv_producer", max_push_deadline_s=2.0)
    time.sleep(0.2)
    far = now_ms() + 10 * 365 * 86_400_000
    _publish(redis_client, "forged-far", [1], deadline_ms=far)
    until(lambda: side.build_connector_meta([]) is not None and bool(side._pending),
          "a pending request", 5, step_s=0.02)
    (_target, expiry), = side._pending.values()
    assert expiry <= now_ms() + 2000 + ss._PENDING_SLACK_MS
    side._pending.clear()
    for i in range(ss._MAX_PENDING + 50):
        side._inbox.append(PushTarget(request_id=f"flood-{i}", decode_engine="D",
                                      decode_generation=1, block_ids=[[1]], num_tokens=1,
                                      deadline_ms=now_ms() + 1000))
    side.build_connector_meta([])
    assert len(side._pending) == ss._MAX_PENDING
    side.shutdown()


def test_redis_writes_that_meet_a_lost_connection_are_retried_until_their_deadline() -> None:
    """A push target written during a Redis failover lands once Redis is back (it used to
    be dropped, and its request waited for KV until the deadline); other errors, and a
    write past its deadline, are given up at once."""
    from kvpush.connector.scheduler_side import _Publisher

    calls: dict[str, int] = {"flaky": 0, "gone": 0, "bad": 0}

    def flaky() -> None:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise redis.ConnectionError("Error 111 connecting: Connection refused")

    def gone() -> None:
        calls["gone"] += 1
        raise redis.ConnectionError("Error 111 connecting: Connection refused")

    def bad() -> None:
        calls["bad"] += 1
        raise redis.ResponseError("WRONGTYPE Operation against a key")

    pub = _Publisher()
    pub.put(flaky, until_ms=now_ms() + 10_000)
    pub.put(gone, until_ms=now_ms() + 300)
    pub.put(bad, until_ms=now_ms() + 10_000)
    pub.close()
    assert calls["flaky"] == 3
    assert 1 < calls["gone"] < 10
    assert calls["bad"] == 1


def test_decode_target_is_in_redis_when_allocation_returns(redis_url, redis_client) -> None:
    """Decode's target is written from the engine loop itself, not handed to a thread
    that waits for the GIL while vLLM's loop spins (5 ms per switch)."""
    side = _side(redis_url, "D", "kv_consumer")
    params = {"kvpush": "decode", "request_id": "rid-now", "prefill_engine": "P-now",
              "deadline_ms": now_ms() + 30_000}
    req = Req("vllm-now", params, num_prompt_tokens=20)
    assert side.get_num_new_matched_tokens(req, 0) == (20, True)
    side.update_state_after_alloc(req, [[4, 5]], 20)
    (t,) = _targets(redis_client, "P-now")  # no waiting
    assert t.request_id == "rid-now" and t.block_ids == [[4, 5]]
    side.shutdown()


def test_inline_write_that_fails_goes_to_the_publisher_in_order() -> None:
    """An inline write meeting a dead Redis is retried in the background; while anything
    is queued, later writes queue behind it instead of overtaking it inline."""
    from kvpush.connector.scheduler_side import _Publisher

    dead = redis.Redis(port=1, socket_connect_timeout=0.1, socket_timeout=0.1,
                       retry=Retry(NoBackoff(), 0))
    done: list[str] = []
    tries = {"first": 0}

    def first(client: Any) -> None:
        tries["first"] += 1
        if client is not None or tries["first"] < 3:
            (client or dead).ping()  # refused: inline, then the first background try
        done.append("first")

    pub = _Publisher(inline_client=dead)
    pub.put_now(first, until_ms=now_ms() + 10_000)
    pub.put_now(lambda client: done.append("second" if client is None else "inline"),
                until_ms=now_ms() + 10_000)
    pub.close()
    assert done == ["first", "second"]
    assert tries["first"] == 3


def test_decode_goes_on_from_prefill_first_token_in_vllms_own_request(
        redis_url, redis_client) -> None:
    """The receive's first token joins the prompt of vLLM's own ``Request``: the worker
    gets it with the prompt's token ids, vLLM's -1 rule no longer applies (the prompt is
    not all computed), and its block hashes are a prompt's that held the token."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    side = _side(redis_url, "D", "kv_consumer")
    params = {"kvpush": "decode", "request_id": "rid-9", "prefill_engine": "P",
              "continues": True}
    prompt = list(range(100, 100 + 2 * BS - 1))  # one token short of two blocks
    req = Request("vllm-9", list(prompt), SamplingParams(max_tokens=4), None,
                  block_hasher=hasher)
    req.kv_transfer_params = params
    assert req.num_prompt_tokens == 2 * BS - 1 and len(req.block_hashes) == 1
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BS - 1, True)
    side.update_state_after_alloc(req, [[3, 4]], 2 * BS - 1)
    assert side.build_connector_meta([]).recvs["vllm-9"].first_token
    t = until(lambda: _targets(redis_client, "P"), "a target", 5, step_s=0.02)[0]
    assert t.first_token
    # One rank reported the token a step before vLLM saw the request received.
    side.update_connector_output(None, None, None, KVPushWorkerMeta({"vllm-9": 77}))
    assert req.num_prompt_tokens == 2 * BS - 1
    side.update_connector_output(None, {"vllm-9"}, None)
    assert req.prompt_token_ids == [*prompt, 77] and req.num_prompt_tokens == 2 * BS
    assert list(req.all_token_ids) == [*prompt, 77] and req.num_output_tokens == 0
    whole = Request("whole", [*prompt, 77], SamplingParams(max_tokens=4), None,
                    block_hasher=hasher)
    assert req.block_hashes == whole.block_hashes and len(req.block_hashes) == 2
    assert side.tracked() == {"vllm-9": DecodeState.RECEIVED}
    side.shutdown()


def test_an_engine_that_recomputes_failed_pushes_does_not_go_on(redis_url, redis_client
                                                                ) -> None:
    """A recomputed prompt samples its own first token: an engine whose failed pushes are
    recomputed asks for none and recomputes the prompt's last token, as without it."""
    config = ConnectorConfig(redis_url=redis_url, engine_id="D2")
    side = SchedulerSide(config, block_size=BS, generation=1, kv_role="kv_consumer",
                         block_ids_of=lambda rid: [[]], continues=False)
    params = {"kvpush": "decode", "request_id": "rid-10", "prefill_engine": "P2",
              "continues": True}
    req = Req("vllm-10", params, num_prompt_tokens=20)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, [[1, 2]], 20)
    assert not side.build_connector_meta([]).recvs["vllm-10"].first_token
    t = until(lambda: _targets(redis_client, "P2"), "a target", 5, step_s=0.02)[0]
    assert not t.first_token
    side.shutdown()


def test_a_verified_receive_holds_its_blocks_at_the_end_until_its_ranks_checked_them(
        redis_url) -> None:
    side = _side(redis_url, "D3", "kv_consumer")
    reqs = {}
    for n in ("a", "b"):
        params = {"kvpush": "decode", "request_id": f"rid-{n}", "prefill_engine": "P3"}
        reqs[n] = Req(f"vllm-{n}", params, num_prompt_tokens=20)
        side.get_num_new_matched_tokens(reqs[n], 0)
        side.update_state_after_alloc(reqs[n], [[1, 2]], 20)
    side.build_connector_meta([])
    side.update_connector_output(None, {"vllm-a", "vllm-b"}, None,
                                 KVPushWorkerMeta(kept={"vllm-a", "vllm-b"}))
    # b is preempted: recomputed into other blocks, nothing of it to check again.
    assert side.build_connector_meta([], preempted=["vllm-b"]).unkeep == {"vllm-b"}
    for n in ("a", "b"):
        reqs[n].status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(reqs["a"], [[1, 2]]) is True
    assert side.request_finished(reqs["b"], [[3, 4]]) is False
    assert side.build_connector_meta([]).recheck == {"vllm-a"}
    assert side.has_pending_push_work()
    side.update_connector_output({"vllm-a"}, None, None)
    assert not side.has_pending_push_work()
    side.shutdown()


def test_a_quarantined_receive_tells_prefill_to_stop_once(redis_url, redis_client) -> None:
    """The workers gave the receive up and hold its blocks until prefill fenced its WRITEs:
    prefill hears the cancel then, not when the receive is finally reported failed."""
    side = _side(redis_url, "D4", "kv_consumer")
    params = {"kvpush": "decode", "request_id": "rid-q", "prefill_engine": "P4"}
    req = Req("vllm-q", params, num_prompt_tokens=20)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, [[1, 2]], 20)
    side.build_connector_meta([])
    side.update_connector_output(None, None, None, KVPushWorkerMeta(closing={"vllm-q"}))
    cancels = until(lambda: [x for x in _targets(redis_client, "P4") if x.cancel],
                    "a cancel", 5, step_s=0.02)
    assert [c.request_id for c in cancels] == ["rid-q"]
    assert side.tracked() == {"vllm-q": DecodeState.RECEIVING}
    # Fenced later: reported failed; the cancel is not sent again.
    side.update_connector_output(None, {"vllm-q"}, {"vllm-q"})
    assert side.tracked() == {"vllm-q": DecodeState.FAILED}
    time.sleep(0.2)
    assert len([x for x in _targets(redis_client, "P4") if x.cancel]) == 1
    side.shutdown()


def test_writes_left_in_flight_keep_the_prefill_engine_stepping(redis_url) -> None:
    """The fence polls WRITEs only when the engine steps: while any rank has some left,
    the connector says it has work."""
    side = _side(redis_url, "P5", "kv_producer")
    assert not side.has_pending_push_work()
    side.update_connector_output(None, None, None, KVPushWorkerMeta(lingering={0: 1, 1: 0}))
    assert side.has_pending_push_work()
    side.update_connector_output(None, None, None, KVPushWorkerMeta(lingering={1: 2}))
    side.update_connector_output(None, None, None, KVPushWorkerMeta(lingering={0: 0}))
    assert side.has_pending_push_work()  # rank 1 still has some
    side.update_connector_output(None, None, None, KVPushWorkerMeta(lingering={1: 0}))
    assert not side.has_pending_push_work()
    side.shutdown()


def test_a_cancel_for_a_request_never_seen_is_fenced_once_its_time_is_up(
        redis_url, redis_client) -> None:
    """Decode gave up on a request this prefill never had: once the request's deadline and
    the slack for a late arrival passed, the ranks close it and tell decode (FenceTo);
    before that the cancel is only held, so a forged one cannot close a request on its way."""
    side = _side(redis_url, "P", "kv_producer")
    time.sleep(0.2)  # the reader thread starts at the stream's end
    _publish(redis_client, "r7", [], cancel=True, deadline_ms=now_ms() - 11_000)
    _publish(redis_client, "r8", [], cancel=True)
    meta = _meta_until(side, lambda m: m.fence)
    assert meta.fence == {"r7": FenceTo("r7", "D", 9)}
    time.sleep(0.2)
    assert side.build_connector_meta([]).fence == {}  # r8 is held, not fenced
    side.shutdown()


PROMPT = list(range(1000, 1100))


def _history_leg(rid: str, tokens: int, digest_of: list[int] | None = None
                 ) -> dict[str, Any]:
    return {"kvpush": "prefill", "request_id": rid, "decode_engine": "D",
            "deadline_ms": now_ms() + 30_000, "history_engine": "H",
            "history_request_id": f"hist-{rid}", "history_tokens": tokens,
            "history_push_key": "k-hist",
            "history_digest": history_digest((digest_of or PROMPT)[:tokens])}


def _hreq(req_id: str, params: dict[str, Any], n: int) -> Req:
    return Req(req_id, params, num_prompt_tokens=n, prompt_token_ids=PROMPT[:n])


def test_a_history_leg_receives_whole_blocks_of_its_history_then_pushes_as_prefill(
        redis_url, redis_client) -> None:
    side = _side(redis_url, "P", "kv_producer", {"v-h1": [5, 6, 7, 8, 9, 10, 11]})
    req = _hreq("v-h1", _history_leg("h1", 70), 100)
    # 70 history tokens are 4 whole blocks; the first is in prefill's own cache.
    assert side.get_num_new_matched_tokens(req, 16) == (48, True)
    side.update_state_after_alloc(req, [[5, 6, 7, 8, 9, 10, 11]], 48)
    meta = side.build_connector_meta([])
    assert meta.recvs["v-h1"].block_ids == [[5, 6, 7, 8]]
    assert meta.recvs["v-h1"].rid == "hist-h1" and meta.recvs["v-h1"].prefill_engine == "H"
    t = until(lambda: _targets(redis_client, "H"), "a history target", 5, step_s=0.02)[0]
    assert (t.request_id, t.decode_engine, t.push_key) == ("hist-h1", "P", "k-hist")
    assert t.num_tokens == 64 and t.block_ids == [[5, 6, 7, 8]] and t.skip_blocks == [1]
    assert not t.first_token
    # Received: the rest is computed here and pushed to decode as any prefill leg is.
    side.update_connector_output(None, {"v-h1"}, None, KVPushWorkerMeta(kept={"v-h1"}))
    assert side.build_connector_meta([]).unkeep == {"v-h1"}  # no recheck of an input
    assert side.get_num_new_matched_tokens(req, 64) == (0, False)
    req.num_computed_tokens = 64
    step = side.build_connector_meta([("v-h1", 36, False)]).steps["v-h1"]
    assert (step.rid, step.decode_engine, step.computed_before) == ("h1", "D", 64)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    side.request_finished(req, [[5, 6, 7, 8, 9, 10, 11]])
    assert side.tracked() == {"v-h1": side.tracked()["v-h1"]}  # only the push is left
    assert "v-h1" not in side._decode
    side.shutdown()


def test_a_history_prefill_already_holds_cancels_the_holders_leg(redis_url, redis_client
                                                                 ) -> None:
    side = _side(redis_url, "P", "kv_producer")
    req = _hreq("v-h2", _history_leg("h2", 64), 80)
    assert side.get_num_new_matched_tokens(req, 64) == (0, False)
    side.update_state_after_alloc(req, [[1, 2, 3, 4, 5]], 0)
    assert not side.build_connector_meta([]).recvs
    t = until(lambda: _targets(redis_client, "H"), "a cancel", 5, step_s=0.02)[0]
    assert t.cancel and t.request_id == "hist-h2" and t.push_key == "k-hist"
    assert "v-h2" not in side._decode and "v-h2" in side._prefill
    side.shutdown()


def test_a_history_is_never_the_whole_prompt_nor_a_partial_block(redis_url) -> None:
    side = _side(redis_url, "P", "kv_producer")
    # Prefill computes the prompt's last token to answer: 64 tokens leave 3 blocks.
    assert side.get_num_new_matched_tokens(
        _hreq("v-h3", _history_leg("h3", 64), 64), 0) == (48, True)
    # A history shorter than a block is computed here.
    assert side.get_num_new_matched_tokens(
        _hreq("v-h4", _history_leg("h4", 15), 64), 0) == (0, False)
    # So is one whose tokens are not the prompt's (the engine rendered it otherwise).
    other = [7, *PROMPT[1:]]
    assert side.get_num_new_matched_tokens(
        _hreq("v-h6", _history_leg("h6", 64, other), 80), 0) == (0, False)
    side.shutdown()


def test_an_aborted_history_leg_cancels_the_holder_and_abandons_the_receive(
        redis_url, redis_client) -> None:
    side = _side(redis_url, "P", "kv_producer")
    req = _hreq("v-h5", _history_leg("h5", 32), 50)
    assert side.get_num_new_matched_tokens(req, 0) == (32, True)
    side.update_state_after_alloc(req, [[1, 2, 3, 4]], 32)
    side.build_connector_meta([])
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [[1, 2, 3, 4]]) is False
    assert side.build_connector_meta([]).abandoned == {"v-h5"}
    assert until(lambda: [t for t in _targets(redis_client, "H") if t.cancel], "a cancel",
                 5, step_s=0.02)[0].request_id == "hist-h5"
    side.shutdown()


def test_a_history_leg_aborted_with_decodes_target_in_holds_nothing_for_its_push(
        redis_url, redis_client) -> None:
    """Decode's target arrived while the request still waited for its history, then the
    request was aborted (its turn placed again elsewhere): it never ran, so its push posted
    no WRITE and holds no block. vLLM frees the request once, when the history's receive
    is reported; a push holding the blocks too would have the request freed first by its
    send report, and the receive's report would then name a request vLLM no longer has
    (an assertion in vLLM's scheduler, which kills the engine)."""
    side = _side(redis_url, "P", "kv_producer")
    time.sleep(0.2)  # the reader thread starts at the stream's end
    req = _hreq("v-h7", _history_leg("h7", 32), 50)
    assert side.get_num_new_matched_tokens(req, 0) == (32, True)
    side.update_state_after_alloc(req, [[1, 2, 3, 4]], 32)
    _publish(redis_client, "h7", [10, 11, 12, 13])
    _meta_until(side, lambda m: "v-h7" in m.targets)
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, [[1, 2, 3, 4]]) is False
    meta = side.build_connector_meta([])
    assert "v-h7" not in meta.held and "v-h7" in meta.forget
    assert meta.abandoned == {"v-h7"}
    side.shutdown()


def test_a_gateways_cancel_names_no_decode_to_fence(redis_url, redis_client) -> None:
    """The gateway cancels an early prefill it gave up on the prefill's target stream, as
    ``gateway:<id>``: when the prefill never had that request, no decode waits for a fence,
    and the ranks are not sent to look up an engine by a name no engine can have (that
    lookup raised inside the forward pass and killed the engine)."""
    side = _side(redis_url, "P", "kv_producer")
    time.sleep(0.2)  # the reader thread starts at the stream's end
    _publish(redis_client, "r10", [], cancel=True, deadline_ms=now_ms() - 11_000,
             decode_engine="gateway:gw-1")
    _publish(redis_client, "r11", [], cancel=True, deadline_ms=now_ms() - 11_000)
    meta = _meta_until(side, lambda m: m.fence)
    assert meta.fence == {"r11": FenceTo("r11", "D", 9)}
    # An early prefill it has: the gateway's cancel, with the request's key, is taken, so
    # the answered prefill holds no block for a target that will never come.
    req = Req("v-r12", {"kvpush": "prefill", "request_id": "r12", "push_key": "k-12",
                        "deadline_ms": now_ms() + 30_000}, 40)
    side.update_state_after_alloc(req, [], 0)
    side.build_connector_meta([("v-r12", 40, False)])
    _publish(redis_client, "r12", [], cancel=True, decode_engine="gateway:gw-1",
             push_key="k-12")
    until(lambda: side.build_connector_meta([]) is not None
          and side._prefill["v-r12"].machine.cancelled, "the cancel taken", 5, step_s=0.02)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.request_finished(req, [[5, 6, 7]]) is False
    assert not side.build_connector_meta([]).fence
    side.shutdown()
