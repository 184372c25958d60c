"""KV-event relay: what an engine's prefix cache holds, from vLLM's KV events, mirrored into
Redis for placement.

vLLM publishes BlockStored, BlockRemoved and AllBlocksCleared over ZMQ
(``--kv-events-config``). :class:`HeldChunks` turns them into the prefix hashes of
``common/prefix_hashes.py`` (the same chain, from the same cache salt) that the engine holds
whole, and :class:`KvEventRelay` mirrors that set into ``kvpush:kv:{E}``, where the
schedulers read each request's overlap.

The view is exact or empty, never wrong: a gap in the publisher's sequence numbers, a
payload that does not decode, a block whose parent the relay never saw or more blocks than
the bound all reset it (an engine looks like it holds nothing until new blocks arrive).
After a Redis outage the whole set is written again; the key expires when the relay stops
refreshing it, so a dead engine's set vanishes with its status.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis
import zmq

from kvpush.common.keys import RedisKeys
from kvpush.common.prefix_hashes import CHUNK_TOKENS, MAX_HASHES, chain_next, chain_seed
from kvpush.common.redis_client import SyncRedis
from kvpush.common.wire import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKvEvent,
    VllmKvEventBatch,
)

logger = logging.getLogger(__name__)

TOPIC = b"kv"
_BATCH = msgspec.msgpack.Decoder(VllmKvEventBatch)
_EVENT = msgspec.msgpack.Decoder(VllmKvEvent)
_SADD_BATCH = 1000


class BadEvents(ValueError):
    """Events the relay cannot apply exactly: its view is reset."""


@dataclass(slots=True, frozen=True)
class _Block:
    chain: int  # hash of the last whole chunk at or before this block's end
    tail: bytes  # tokens after that chunk (array "q" bytes), fewer than a chunk
    chunks: int  # whole chunks up to this block's end
    emitted: tuple[int, ...]  # chunk hashes this block completed (held while it is)


class HeldChunks:
    """An engine's held prefix chunks, from its KV events (pure: no I/O).

    A chunk is held while the block that completes it is; :meth:`apply` returns the chunk
    hashes that became held and those that stopped being held.
    """

    def __init__(self, max_blocks: int = 131_072) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[int | bytes, _Block] = {}
        self._held: Counter[int] = Counter()
        self.group: int | None = None  # the first full-attention group: the one tracked

    @property
    def held(self) -> set[int]:
        """Every chunk hash held now."""
        return set(self._held)

    def __len__(self) -> int:
        return len(self._blocks)

    def reset(self) -> None:
        """Forget everything (the engine looks empty until new blocks arrive)."""
        self._blocks.clear()
        self._held.clear()

    def apply(self, event: VllmKvEvent) -> tuple[list[int], list[int]]:
        """Apply one event; raises :class:`BadEvents` when it cannot be applied exactly."""
        added: list[int] = []
        removed: list[int] = []
        if isinstance(event, VllmAllBlocksCleared):
            removed = list(self._held)
            self.reset()
        elif isinstance(event, VllmBlockRemoved):
            if self._tracks(event.group_idx, None):
                for h in event.block_hashes:
                    b = self._blocks.pop(h, None)
                    if b is not None:
                        removed += self._release(b.emitted)
        elif self._tracks(event.group_idx, event.kv_cache_spec_kind):
            added = self._store(event)
        return added, removed

    def _tracks(self, group: int | None, kind: str | None) -> bool:
        if group is None:
            return True
        if self.group is None and kind in (None, "full_attention"):
            self.group = group
        return group == self.group

    def _store(self, ev: VllmBlockStored) -> list[int]:
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * ev.block_size:
            raise BadEvents(f"{len(ev.token_ids)} token ids for {n} blocks of "
                            f"{ev.block_size}")
        if ev.lora_name is not None or ev.lora_id is not None:
            return []  # a LoRA's blocks: the gateway never hashes for one
        if ev.parent_block_hash is None:
            salt = _salt(ev.extra_keys)
            if salt is None:
                return []  # multimodal or embedded prompt: not a chain the gateway makes
            chain, tail, chunks = chain_seed(salt), b"", 0
        else:
            parent = self._blocks.get(ev.parent_block_hash)
            if parent is None:
                # Its parent was never seen (or was not a tracked chain): nothing below
                # it can be placed on, and nothing is claimed.
                return []
            chain, tail, chunks = parent.chain, parent.tail, parent.chunks
        if len(self._blocks) + n > self.max_blocks:
            raise BadEvents(f"more than {self.max_blocks} blocks")
        added: list[int] = []
        for i, h in enumerate(ev.block_hashes):
            try:
                tokens = array("q", tail)
                tokens.extend(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
            except OverflowError as exc:
                raise BadEvents(f"token id out of range: {exc}") from None
            emitted: list[int] = []
            while len(tokens) >= CHUNK_TOKENS:
                if chunks < MAX_HASHES:
                    chain = chain_next(chain, tokens[:CHUNK_TOKENS])
                    emitted.append(chain)
                chunks += 1
                del tokens[:CHUNK_TOKENS]
            tail = tokens.tobytes()
            old = self._blocks.get(h)
            if old is not None:
                self._release(old.emitted)  # stored again: the newest chain wins
            self._blocks[h] = _Block(chain, tail, chunks, tuple(emitted))
            for c in emitted:
                self._held[c] += 1
                if self._held[c] == 1:
                    added.append(c)
        return added

    def _release(self, chunks: tuple[int, ...]) -> list[int]:
        gone = []
        for c in chunks:
            self._held[c] -= 1
            if self._held[c] <= 0:
                del self._held[c]
                gone.append(c)
        return gone


def _salt(extra_keys: list[list[Any] | None] | None) -> str | None:
    """The first block's cache salt ("" for none); None when its hash took other keys."""
    first = extra_keys[0] if extra_keys else None
    if not first:
        return ""
    if len(first) == 1 and isinstance(first[0], str):
        return first[0]
    return None


def decode_batch(frames: list[bytes]) -> tuple[int, list[VllmKvEvent]]:
    """The sequence number and events of one publisher message; raises :class:`BadEvents`."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise BadEvents(f"expected (topic, seq, payload), got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big")
    try:
        batch = _BATCH.decode(frames[2])
        return seq, [_EVENT.decode(raw) for raw in batch.events]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadEvents(f"malformed event batch: {exc}") from None


class KvEventRelay:
    """Background thread: subscribes to one engine's KV events and mirrors the chunks it
    holds into ``kvpush:kv:{E}``."""

    def __init__(self, client: SyncRedis, *, engine_id: str, ttl_s: float = 5.0,
                 key_prefix: str = "kvpush", max_blocks: int = 131_072) -> None:
        self.client = client
        self.key = RedisKeys(key_prefix).kv_chunks(engine_id)
        self.engine_id = engine_id
        # IPC rather than TCP: vLLM's publisher binds only wildcard TCP addresses (it
        # connects to any other), and a socket in a directory only this user can enter
        # reaches no one else.
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvpush-kv-{engine_id[:40]}-"))
        self.endpoint = f"ipc://{self._dir / 'events'}"
        """Where the engine publishes (its ``--kv-events-config`` endpoint)."""
        self.ttl_ms = int(ttl_s * 1000)
        self.view = HeldChunks(max_blocks)
        self.resets = 0
        self.applied = 0
        self._seq: int | None = None
        self._dirty = True  # Redis may not match the view: write it whole
        self._written = 0.0  # monotonic time of the last write that set the TTL
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context.instance()

    def start(self) -> KvEventRelay:
        """Subscribe (before the engine publishes: nothing is missed) and start the thread."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(self.endpoint)
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True,
                                        name=f"kvpush-kv-events-{self.engine_id}")
        self._thread.start()
        return self

    def stop(self, remove: bool = True) -> None:
        """Stop the thread and, on a clean stop, delete the mirrored set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)
        if remove:
            try:
                self.client.delete(self.key)
            except redis.RedisError as exc:
                logger.warning("could not remove the KV view of %s: %s", self.engine_id, exc)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one publisher message to the view and to Redis (never raises for bad input)."""
        try:
            seq, events = decode_batch(frames)
            if self._seq is not None and seq != self._seq + 1:
                raise BadEvents(f"sequence {seq} after {self._seq}: events were lost")
            self._seq = seq
            added: list[int] = []
            removed: list[int] = []
            for ev in events:
                a, r = self.view.apply(ev)
                added += a
                removed += r
                self.applied += 1
        except BadEvents as exc:
            self._reset(str(exc))
            return
        if self._dirty:
            self.sync()
        elif added or removed:
            self._write(added, removed)

    def _reset(self, why: str) -> None:
        self.resets += 1
        if self.resets == 1 or self.resets % 100 == 0:
            logger.warning("KV events of %s: %s; its view is reset (%d resets)",
                           self.engine_id, why, self.resets)
        self.view.reset()
        self._seq = None
        self._dirty = True
        self.sync()

    def _write(self, added: list[int], removed: list[int], replace: bool = False) -> None:
        """Add and remove chunks in one pipeline; ``replace`` first empties the set. Not a
        transaction (a Cluster pipeline may not take one): a reader between the DEL and the
        SADDs sees less than is held, which costs a hit, never a wrong one."""
        try:
            pipe = self.client.pipeline(transaction=False)
            if replace:
                pipe.delete(self.key)
            if removed:
                pipe.srem(self.key, *removed)
            for i in range(0, len(added), _SADD_BATCH):
                pipe.sadd(self.key, *added[i:i + _SADD_BATCH])
            pipe.pexpire(self.key, self.ttl_ms)
            pipe.execute()
            self._written = time.monotonic()
            self._dirty = False
        except redis.RedisError as exc:
            self._lost(exc)

    def sync(self) -> None:
        """Write the whole view (after a reset or an outage), replacing the set."""
        self._write(list(self.view.held), [], replace=True)

    def _lost(self, exc: Exception) -> None:
        if not self._dirty:
            logger.warning("KV view of %s not written (%s); rewritten when Redis is back",
                           self.engine_id, exc)
        self._dirty = True

    def _refresh(self, every_s: float) -> None:
        if self._dirty:
            self.sync()
        elif time.monotonic() - self._written >= every_s:
            try:
                self.client.pexpire(self.key, self.ttl_ms)
                self._written = time.monotonic()
            except redis.RedisError as exc:
                self._lost(exc)

    def _run(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        refresh_s = max(0.2, self.ttl_ms / 5000)
        try:
            while not self._stop.is_set():
                if poller.poll(refresh_s * 1000):
                    self.handle(sock.recv_multipart())
                    while sock.poll(0):
                        self.handle(sock.recv_multipart())
                self._refresh(refresh_s)
        except zmq.ZMQError as exc:
            logger.error("KV events of %s stopped: %s", self.engine_id, exc)
        finally:
            sock.close(linger=0)
