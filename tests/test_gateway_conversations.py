"""Stored responses on a real Redis (and a real Redis Cluster): per-tenant lookups, the
bounds in time, bytes and count, hostile blobs, and how a conversation patches, keeps and
expands the responses it relays. The real-engine path is in
``tests/e2e_tiny/test_e2e_conversations.py``."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis as AsyncRedis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import async_redis
from kvpush.common.wire import StoredResponse, encode, now_ms
from kvpush.services.gateway.conversations import Conversation, input_items
from kvpush.services.gateway.response_store import (
    ResponseStore,
    StoreResult,
    valid_response_id,
)
from kvpush.services.local.redis_topologies import LocalCluster

K = RedisKeys()


def _response(rid: str, text: str = "hello", status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": status, "store": False,
            "previous_response_id": None,
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text,
                                     "annotations": []}]}]}


def _stored(rid: str, history: list[Any] | None = None, pad: int = 0) -> StoredResponse:
    return StoredResponse(id=rid, created_ms=now_ms(),
                          history=history or [{"role": "user", "content": "x" * pad}],
                          response=_response(rid))


def _store(r: AsyncRedis, **kw: Any) -> ResponseStore:
    bounds = {"ttl_s": 60.0, "tenant_max_bytes": 1 << 20, "tenant_max_count": 100,
              "max_bytes": 1 << 20, **kw}
    return ResponseStore(r, K, **bounds)


def test_a_tenant_reads_and_deletes_only_its_own_responses(redis_url: str,
                                                           redis_client: redis.Redis) -> None:
    async def main() -> None:
        r = AsyncRedis.from_url(redis_url)
        store = _store(r)
        try:
            assert await store.put("acme", _stored("resp_a1")) is StoreResult.STORED
            got = await store.get("acme", "resp_a1")
            assert got is not None and got.response["id"] == "resp_a1"
            # Another tenant's id reads as one that never existed.
            assert await store.get("other", "resp_a1") is None
            assert await store.get("acme", "resp_never") is None
            assert not await store.delete("other", "resp_a1")
            assert await store.get("acme", "resp_a1") is not None
            assert await store.delete("acme", "resp_a1")
            assert not await store.delete("acme", "resp_a1")
            assert await store.get("acme", "resp_a1") is None
            assert int(redis_client.get(K.tenant_response_bytes("acme")) or 0) == 0
        finally:
            await r.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("rid", ["", "resp_", "x" * 300, "resp_a b", "resp_a\n", "resp_é",
                                 "../resp_a", "resp_" + "a" * 97, "msg_abc"])
def test_malformed_ids_are_never_looked_up(rid: str) -> None:
    assert not valid_response_id(rid)

    async def main() -> None:
        # A closed port: any Redis call would fail, so None means none was made.
        r = AsyncRedis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        store = ResponseStore(r, K, 60.0, 1 << 20, 100, 1 << 20)
        assert await store.get("acme", rid) is None
        assert not await store.delete("acme", rid)
        await r.aclose()

    asyncio.run(main())


def test_expired_responses_are_gone_and_their_bytes_given_back(
        redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        r = AsyncRedis.from_url(redis_url)
        store = _store(r, ttl_s=0.5)
        try:
            assert await store.put("acme", _stored("resp_old")) is StoreResult.STORED
            await asyncio.sleep(0.6)
            assert await store.get("acme", "resp_old") is None
            assert not await store.delete("acme", "resp_old")
            # Storing another sweeps the expired one's bytes out of the tenant's count.
            long = ResponseStore(r, K, 60.0, 1 << 20, 100, 1 << 20)
            assert await long.put("acme", _stored("resp_new")) is StoreResult.STORED
            items = redis_client.hgetall(K.tenant_responses("acme"))
            assert list(items) == [b"resp_new"]
            assert int(redis_client.get(K.tenant_response_bytes("acme"))) == \
                len(items[b"resp_new"])
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_tenant_past_its_bounds_drops_its_oldest(redis_url: str,
                                                   redis_client: redis.Redis) -> None:
    async def main() -> None:
        r = AsyncRedis.from_url(redis_url)
        store = _store(r, tenant_max_count=3)
        try:
            for i in range(5):
                assert await store.put("acme", _stored(f"resp_{i}")) is StoreResult.STORED
            assert [await store.get("acme", f"resp_{i}") is not None for i in range(5)] == \
                [False, False, True, True, True]
            assert redis_client.zcard(K.tenant_response_expiry("acme")) == 3
            # Bytes: incompressible padding, a bound that holds two of them.
            size = len(zlib.compress(encode(_noisy("resp_b0")), 1))
            by_bytes = _store(r, tenant_max_bytes=2 * size + size // 2)
            for i in range(4):
                assert await by_bytes.put("bytes", _noisy(f"resp_b{i}")) is \
                    StoreResult.STORED
            held = redis_client.hgetall(K.tenant_responses("bytes"))
            assert sorted(held) == [b"resp_b2", b"resp_b3"]
            assert int(redis_client.get(K.tenant_response_bytes("bytes"))) == \
                sum(len(v) for v in held.values())
            # One alone past the tenant's bound, or past one response's, is not kept.
            assert await _store(r, tenant_max_bytes=size // 2).put(
                "bytes", _noisy("resp_big")) is StoreResult.TOO_LARGE
            assert await _store(r, max_bytes=1000).put(
                "bytes", _stored("resp_big", pad=2000)) is StoreResult.TOO_LARGE
            assert sorted(redis_client.hgetall(K.tenant_responses("bytes"))) == \
                [b"resp_b2", b"resp_b3"]
            # Other tenants are untouched by one tenant's bound.
            assert await store.get("acme", "resp_4") is not None
        finally:
            await r.aclose()

    asyncio.run(main())


def _noisy(rid: str) -> StoredResponse:
    import os

    return _stored(rid, history=[{"role": "user", "content": os.urandom(6000).hex()}])


def test_hostile_blobs_read_as_gone(redis_url: str, redis_client: redis.Redis) -> None:
    """What Redis hands back is not trusted: garbage, a compression bomb, another schema."""
    bomb = zlib.compress(b"\0" * (8 << 20), 9)
    wrong = zlib.compress(json.dumps({"v": 3}).encode())
    old_schema = zlib.compress(encode(_stored("resp_s")).replace(b"\xa1v\x03", b"\xa1v\x63"))

    async def main() -> None:
        r = AsyncRedis.from_url(redis_url)
        store = _store(r)
        try:
            for rid, blob in [("resp_junk", b"not zlib"), ("resp_bomb", bomb),
                              ("resp_wrong", wrong), ("resp_s", old_schema)]:
                redis_client.hset(K.tenant_responses("acme"), rid, blob)
                redis_client.zadd(K.tenant_response_expiry("acme"), {rid: now_ms() + 60_000})
                assert await store.get("acme", rid) is None, rid
        finally:
            await r.aclose()

    asyncio.run(main())


def test_the_store_runs_on_a_redis_cluster(redis_cluster: LocalCluster) -> None:
    """Every key of the store's scripts sits in the tenant's slot."""
    async def main() -> None:
        r = async_redis(redis_cluster.settings())
        store = ResponseStore(r, RedisKeys(f"c{time.time_ns()}"), 60.0, 1 << 20, 2, 1 << 20)
        try:
            for i in range(3):
                assert await store.put("acme", _stored(f"resp_{i}")) is StoreResult.STORED
            assert await store.get("acme", "resp_0") is None
            assert await store.get("acme", "resp_2") is not None
            assert await store.delete("acme", "resp_2")
        finally:
            await r.aclose()

    asyncio.run(main())


def _event(kind: str, response: dict[str, Any]) -> bytes:
    return (f"event: {kind}\ndata: " + json.dumps({"type": kind, "response": response})
            ).encode() + b"\n\n"


def _data(event: bytes) -> dict[str, Any]:
    return json.loads(event.partition(b"\ndata: ")[2])["response"]


def test_a_stream_is_patched_and_kept_at_its_end(redis_url: str) -> None:
    outcomes = Counter("o", "o", ["outcome"], registry=CollectorRegistry())

    async def main() -> None:
        r = AsyncRedis.from_url(redis_url)
        store = _store(r)
        try:
            history = input_items("hi")
            conv = Conversation(store, "acme", "resp_prev", history, True, outcomes)
            created = _data(await conv.event(_event("response.created",
                                                    _response("resp_n", status="in_progress"))))
            assert (created["previous_response_id"], created["store"]) == ("resp_prev", True)
            delta = b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n'
            assert await conv.event(delta) == delta
            for odd in (b"event: response.created\ndata: {bad\n\n",
                        b'event: response.created\ndata: {"response": "x"}\n\n',
                        b'event: response.completed\ndata: [1]\n\n',
                        b"event: response.in_progress\n\n"):
                assert await conv.event(odd) == odd  # passed on as the engine sent it
            done = _data(await conv.event(_event("response.completed", _response("resp_n"))))
            assert done["store"] is True
            kept = await store.get("acme", "resp_n")
            assert kept is not None and kept.history == history
            assert kept.response["previous_response_id"] == "resp_prev"
            assert outcomes.labels("stored")._value.get() == 1

            # A failed answer is not kept, and says so.
            conv = Conversation(store, "acme", None, history, True, outcomes)
            failed = await conv.finish(_response("resp_f", status="failed"))
            assert failed["store"] is False and await store.get("acme", "resp_f") is None

            # Not asked to keep: nothing stored, the field says false.
            conv = Conversation(store, "acme", "resp_prev", history, False, outcomes)
            answer = await conv.finish(_response("resp_u"))
            assert (answer["store"], answer["previous_response_id"]) == (False, "resp_prev")
            assert await store.get("acme", "resp_u") is None
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_redis_outage_while_keeping_serves_the_answer_unstored() -> None:
    outcomes = Counter("o", "o", ["outcome"], registry=CollectorRegistry())

    async def main() -> None:
        r = AsyncRedis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        store = ResponseStore(r, K, 60.0, 1 << 20, 100, 1 << 20)
        conv = Conversation(store, "acme", None, input_items("hi"), True, outcomes)
        answer = await conv.finish(_response("resp_x"))
        assert answer["store"] is False
        assert outcomes.labels("failed")._value.get() == 1
        await r.aclose()

    asyncio.run(main())  # a Redis error escaping here would have failed the answer
