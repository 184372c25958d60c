"""Block reuse on prefill and decode: WRITEs reading a preempted request's blocks finish
before the blocks are reused, nothing more is read from them until the request is
rescheduled, and no WRITE is posted into decode's blocks once the push deadline passed.

The worker side runs against real Redis (agent registry) and a scripted stand-in for the
NIXL transport that keeps WRITEs in flight until told otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, KVLayout, encode, now_ms
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, PrefillStep, SendTarget
from kvpush.connector.page_layout import Runs
from kvpush.connector.state import PushState
from kvpush.connector.transport import (
    WHOLE,
    Peer,
    TransferTimeout,
    Xfer,
    XferState,
)
from kvpush.connector.worker_side import WorkerSide

BS = 16
LAYERS = ["l0", "l1"]


class ScriptedTransport:
    """Records WRITEs; they stay in flight until ``complete`` (or ``wait``) ends them."""

    backends = ["UCX"]

    def __init__(self, freeze: bool = False) -> None:
        self.writes: list[tuple[list[int], list[int], list[int]]] = []
        self.xfers: list[Xfer] = []
        self.freeze = freeze  # wait() times out, as with a frozen peer
        self.waited: list[list[Xfer]] = []

    def peer(self, info: AgentInfo, local: Runs = WHOLE, remote: Runs = WHOLE) -> Peer:
        return Peer(info.engine_id, info.rank, info.generation, info.agent_name, info.layout,
                    dlist=None, local=local, remote=remote)

    def write(self, peer: Peer, regions: list[int], local: list[int], remote: list[int]
              ) -> Xfer:
        self.writes.append((list(regions), list(local), list(remote)))
        n = len(regions) * len(local)
        xfer = Xfer(handle=None, peer=peer, nbytes=n * 100, descriptors=n,
                    posted_ns=time.monotonic_ns())
        self.xfers.append(xfer)
        return xfer

    def _done(self, xfer: Xfer) -> None:
        if xfer.state is XferState.IN_PROGRESS:
            xfer.state, xfer.done_ns = XferState.DONE, time.monotonic_ns()

    def poll(self, xfer: Xfer) -> XferState:
        return xfer.state

    def wait(self, xfers: list[Xfer], deadline_ns: int) -> None:
        self.waited.append(list(xfers))
        if self.freeze:
            raise TransferTimeout("still in progress at the deadline")
        for x in xfers:
            self._done(x)

    def abandon(self, xfer: Xfer) -> None:
        if xfer.state is XferState.IN_PROGRESS:
            xfer.state, xfer.error = XferState.FAILED, "abandoned"

    def complete_all(self) -> None:
        for x in self.xfers:
            self._done(x)

    def notify(self, peer: Peer, msg: bytes) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def drop_peer(self, peer: Peer) -> None:
        pass

    def close(self) -> None:
        pass


def _layout() -> KVLayout:
    return KVLayout(layer_names=LAYERS, base_addrs=[4096, 8192], region_len=6400,
                    block_len=100, num_blocks=64, block_size=BS, dtype="float32",
                    kv_splits=1, tp_rank=0, tp_size=1, memory="DRAM")


@pytest.fixture
def worker(redis_url: str, redis_client: redis.Redis) -> Any:
    redis_client.set(RedisKeys().agent("D", 0), encode(AgentInfo(
        engine_id="D", rank=0, agent_name="d-r0", agent_metadata=b"", backends=["UCX"],
        generation=9, layout=_layout())))

    def make(freeze: bool = False) -> tuple[WorkerSide, ScriptedTransport]:
        side = WorkerSide(ConnectorConfig(redis_url=redis_url, engine_id="P"), tp_rank=0,
                          tp_size=1, block_size=BS, num_blocks=64, generation=1)
        fake = ScriptedTransport(freeze)
        side.bind(fake, _layout(), [])  # type: ignore[arg-type]
        return side, fake

    return make


def _target(rid: str = "r1") -> SendTarget:
    return SendTarget(rid, "D", 9, [[30, 31, 32]], skip_blocks=[0], num_tokens=40,
                      deadline_ms=now_ms() + 60_000)


def _step(side: WorkerSide, meta: KVPushMetadata) -> None:
    """One engine step as vLLM drives it: preemptions, metadata, layers, after the pass."""
    side.handle_preemptions(meta.preempted)
    side.on_metadata(meta)
    for name in LAYERS:
        side.save_kv_layer(name)
    side.wait_for_save()


def test_preempted_request_drains_in_flight_writes_then_rewrites_from_new_blocks(worker
                                                                               ) -> None:
    side, fake = worker()
    # Chunk 1 computes 20 of 40 tokens: block 0 is final and written, layer by layer.
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[10, 11]], 0, 20, 40)},
                               targets={"v1": _target()}))
    assert fake.writes == [([0], [10], [30]), ([1], [10], [30])]
    in_flight = list(fake.xfers)
    assert all(x.state is XferState.IN_PROGRESS for x in in_flight)

    # vLLM preempts the request and frees blocks 10, 11 for others in this very step:
    # the WRITEs reading block 10 must be complete before the forward pass runs.
    _step(side, KVPushMetadata(preempted={"v1"}))
    assert fake.waited == [in_flight]
    assert all(x.state is XferState.DONE for x in in_flight)
    assert len(fake.writes) == 2  # nothing read from the freed blocks

    # Rescheduled with new blocks, recomputed from scratch: the written block 0 stays
    # valid on decode, blocks 1 and 2 come from the new blocks.
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[20, 21, 22]], 0, 40, 40,
                                                        restarted=True)}))
    assert fake.writes[2:] == [([0], [21, 22], [31, 32]), ([1], [21, 22], [31, 32])]
    fake.complete_all()
    _step(side, KVPushMetadata(held={"v1": [[20, 21, 22]]}))
    sending, _recving, _failed = side.get_transfer_results()
    assert sending == {"v1"}
    (rec,) = side.take_stats().data["transfers"]  # type: ignore[union-attr]
    assert rec["ok"] and rec["blocks"] == 3 and rec["bytes"] == 3 * len(LAYERS) * 100


def test_target_arriving_for_a_preempted_request_reads_nothing_until_rescheduled(worker
                                                                               ) -> None:
    side, fake = worker()
    # Prefill computed block 0 before decode published its target...
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[10, 11]], 0, 20, 40)}))
    # ...then was preempted in the step the target arrived: no catch-up from block 10.
    _step(side, KVPushMetadata(preempted={"v1"}, targets={"v1": _target()}))
    assert fake.writes == []
    assert side.sender.jobs["v1"].state is PushState.PUSHING
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[40, 41]], 0, 20, 40, True)}))
    assert fake.writes == [([0], [40], [30]), ([1], [40], [30])]


def test_frozen_peer_during_preemption_fails_the_push_instead_of_stalling(worker) -> None:
    side, fake = worker(freeze=True)
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[10, 11]], 0, 20, 40)},
                               targets={"v1": _target()}))
    _step(side, KVPushMetadata(preempted={"v1"}))
    job = side.sender.jobs["v1"]
    assert job.state is PushState.FAILED and "preempted" in (job.error or "")
    # Not released: a WRITE handed to the transport may still land; the fence polls it.
    assert job.xfers == [] and not job.fenced and side.sender.fence.lingering == 1
    assert all(x.state is XferState.IN_PROGRESS for x in fake.xfers)
    # Finished later: the failure is sealed and the blocks are released at once.
    _step(side, KVPushMetadata(held={"v1": []}))
    sending, _r, _f = side.get_transfer_results()
    assert sending == {"v1"}
    (rec,) = side.take_stats().data["transfers"]  # type: ignore[union-attr]
    assert not rec["ok"] and rec["outcome"] == "error"


def test_no_write_is_posted_once_the_push_deadline_passed(worker) -> None:
    """Decode reuses its blocks a grace period after the deadline: prefill must not post
    a WRITE after it, even for blocks its forward pass computes now."""
    side, fake = worker()
    target = _target()
    target.deadline_ms = now_ms() - 1
    _step(side, KVPushMetadata(steps={"v1": PrefillStep("r1", [[10, 11]], 0, 20, 40)},
                               targets={"v1": target}))
    assert fake.writes == []
    job = side.sender.jobs["v1"]
    assert job.state is PushState.ABORTED and job.outcome == "deadline"
