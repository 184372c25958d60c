"""The KV-event relay: vLLM's own event types and ZMQ publisher in, the prefix chunks an engine
holds out, in a real Redis; lost, malformed and hostile event streams reset the view rather
than leave it wrong, and a Redis outage ends with the whole view written again."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
import pytest
import redis
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvpush.common.keys import RedisKeys
from kvpush.common.prefix_hashes import CHUNK_TOKENS, MAX_HASHES, prefix_hashes
from kvpush.services.engine.kv_events import BadEvents, HeldChunks, KvEventRelay, decode_batch
from kvpush.services.local.local_redis import LocalRedis
from tests.polling import until

K = RedisKeys()
BS = 32  # tokens per block, as the tiny model's engines run


def stored(hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None,
           group: int = 0, extra: list | None = None) -> BlockStored:
    if extra is None:
        extra = [(salt,) if salt and i == 0 and parent is None else None
                 for i in range(len(hashes))]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=extra, group_idx=group,
                       kv_cache_spec_kind="full_attention")


def frames(seq: int, *events: object) -> list[bytes]:
    payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))
    return [b"kv", seq.to_bytes(8, "big"), payload]


def apply(view: HeldChunks, *events: object) -> tuple[list[int], list[int]]:
    added: list[int] = []
    removed: list[int] = []
    for ev in decode_batch(frames(0, *events))[1]:
        a, r = view.apply(ev)
        added += a
        removed += r
    return added, removed


def test_held_chunks_are_the_gateways_prefix_hashes() -> None:
    """Blocks stored in two steps (a prompt, then its continuation chained to its last
    block) hold exactly the chunks the gateway hashes for the whole prompt with the same
    salt; a removed block takes the chunk it completed with it."""
    prompt = list(range(1000, 1000 + 8 * BS))  # 256 tokens: 4 chunks, 8 blocks
    want = prefix_hashes(prompt, "salty")
    view = HeldChunks()
    added, _ = apply(view, stored([11, 12, 13], None, prompt[:3 * BS], salt="salty"))
    assert added == want[:1]  # 96 tokens: one whole chunk
    added, _ = apply(view, stored([14, 15, 16, 17, 18], 13, prompt[3 * BS:]))
    assert added == want[1:] and view.held == set(want)
    _, removed = apply(view, BlockRemoved(block_hashes=[18, 999], medium="GPU"))
    assert removed == [want[3]] and view.held == set(want[:3])
    # Unsalted, another salt, or another model group: not these chunks.
    other = HeldChunks()
    apply(other, stored([21, 22], None, prompt[:2 * BS]))
    assert other.held == set(prefix_hashes(prompt[:64], ""))
    apply(other, stored([31, 32], None, prompt[:2 * BS], salt="x"))
    assert set(want).isdisjoint(other.held)
    apply(other, stored([41, 42], None, prompt[:2 * BS], salt="salty", group=1))
    assert set(want).isdisjoint(other.held)
    _, removed = apply(other, AllBlocksCleared())
    assert len(removed) == 2 and not other.held and len(other) == 0


def test_what_the_gateway_never_hashes_is_not_held() -> None:
    """A block whose parent was never seen, a LoRA's blocks, a multimodal first block and
    chunks past the gateway's limit claim nothing."""
    view = HeldChunks()
    toks = list(range(2 * BS))
    assert apply(view, stored([1, 2], 77, toks)) == ([], [])
    assert apply(view, BlockStored(block_hashes=[3, 4], parent_block_hash=None,
                                   token_ids=toks, block_size=BS, lora_id=1, medium=None,
                                   lora_name="l", extra_keys=None)) == ([], [])
    assert apply(view, stored([5, 6], None, toks, extra=[("img", 0), None])) == ([], [])
    long = list(range((MAX_HASHES + 2) * CHUNK_TOKENS))
    n = len(long) // BS
    added, _ = apply(view, stored(list(range(100, 100 + n)), None, long))
    assert added == prefix_hashes(long, "") and len(added) == MAX_HASHES


def test_malformed_events_are_refused() -> None:
    view = HeldChunks(max_blocks=4)
    with pytest.raises(BadEvents, match="token ids"):
        apply(view, stored([1, 2], None, list(range(BS))))
    with pytest.raises(BadEvents, match="more than 4 blocks"):
        apply(view, stored(list(range(5)), None, list(range(5 * BS))))
    for bad in ([b"kv", b"\x00" * 8], [b"kv", b"\x00" * 8, b"\xc1garbage"],
                [b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])],
                [b"kv", b"\x00" * 8, msgspec.msgpack.encode(
                    [1.0, [{"type": "BlockStored", "block_hashes": [1],
                            "parent_block_hash": None, "token_ids": [-1],
                            "block_size": 1}]])]):
        with pytest.raises(BadEvents):
            decode_batch(bad)


@pytest.fixture
def relay(redis_url: str) -> Iterator[KvEventRelay]:
    r = KvEventRelay(redis.Redis.from_url(redis_url), engine_id="d1", ttl_s=30).start()
    yield r
    r.stop()


def test_the_relay_mirrors_an_engines_events_into_redis(
        relay: KvEventRelay, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own publisher, bound where the launcher tells the engine to publish: the set
    follows stores and removals; a lost event (a sequence gap) empties the view until new
    blocks arrive, and the relay keeps going through garbage on its socket."""
    prompt = list(range(4 * BS))
    want = set(prefix_hashes(prompt, "s"))
    pub = ZmqEventPublisher(0, endpoint=relay.endpoint, topic="kv")
    key = K.kv_chunks("d1")
    try:
        held = lambda: {int(x) for x in redis_client.smembers(key)}  # noqa: E731
        # The SUB side joins asynchronously: publish until the first batch lands.
        until(lambda: (pub.publish(KVEventBatch(ts=time.time(), events=[
            stored([1, 2, 3, 4], None, prompt, salt="s")])), held() == want)[1],
            "the stored chunks in Redis", 10, step_s=0.05)
        assert 0 < redis_client.pttl(key) <= 30_000
        pub.publish(KVEventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=[4], medium="GPU")]))
        until(lambda: len(held()) == 1, "the removed chunk gone", 10, step_s=0.05)
    finally:
        pub.shutdown()
    resets = relay.resets
    with caplog.at_level(logging.WARNING):
        relay.handle(frames(relay._seq + 5, stored([9, 10], None, prompt[:64])))
        assert relay.resets == resets + 1 and held() == set()
        relay.handle([b"junk"])
        relay.handle(frames(0, stored([9, 10], None, prompt[:64], salt="s")))
    assert "events were lost" in caplog.text
    assert held() == set(prefix_hashes(prompt[:64], "s"))


def test_a_redis_outage_ends_with_the_whole_view_written_again(tmp_path) -> None:
    server = LocalRedis(tmp_path / "r").start()
    client = redis.Redis.from_url(server.url, socket_timeout=1)
    r = KvEventRelay(client, engine_id="d1", ttl_s=30)
    try:
        prompt = list(range(4 * BS))
        r.handle(frames(0, stored([1, 2], None, prompt[:64], salt="s")))
        assert {int(x) for x in client.smembers(K.kv_chunks("d1"))} == \
            set(prefix_hashes(prompt[:64], "s"))
        port = server.port
        server.stop()
        r.handle(frames(1, stored([3, 4], 2, prompt[64:])))  # lost on the way to Redis
        server = LocalRedis(tmp_path / "r", port=port).start()
        r.handle(frames(2, BlockRemoved(block_hashes=[999], medium=None)))
        assert {int(x) for x in client.smembers(K.kv_chunks("d1"))} == \
            set(prefix_hashes(prompt, "s"))
    finally:
        r.stop()
        server.stop()
