"""Worker side end to end without NIXL: a prefill rank pushes into a decode rank.

Both ``WorkerSide`` objects run in this process over the in-process fake transport, with
real torch KV tensors (CPU layout [blocks, heads, block_size, 2*head] per layer) and the
real Redis of conftest.py for the agent registry. Each test drives them with hand-built
``KVPushMetadata`` the way vLLM does: metadata, every layer's ``save_kv_layer``,
``wait_for_save``, then ``get_transfer_results``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvpush.common.keys import InvalidKeyPart, RedisKeys
from kvpush.common.wire import PushDone, PushTarget, encode, now_ms
from kvpush.connector import receiver, sender, targets
from kvpush.connector.config import ConnectorConfig, connector_redis
from kvpush.connector.fake_transport import FakeFabric, FakeTransport
from kvpush.connector.fence import Fence
from kvpush.connector.metadata import (
    FenceTo,
    KVPushMetadata,
    PrefillStep,
    RecvSpec,
    SendTarget,
)
from kvpush.connector.state import PushState, RecvState
from kvpush.connector.transport import Peer, XferState
from kvpush.connector.worker_side import WorkerSide
from tests.worker_util import age_quarantines, engine_step

BS = 4  # tokens per block
NUM_BLOCKS = 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = 10  # tokens: 3 blocks, the last one partial
SRC = [5, 6, 7]  # prefill's blocks of the request
DST = [1, 3, 4]  # decode's blocks of the request
RID = "cmpl-1"


def _caches(fill: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: fill(NUM_BLOCKS, 2, BS, 2 * 8, dtype=torch.float32) for n in LAYERS}


@dataclass
class Pair:
    prefill: WorkerSide
    decode: WorkerSide
    p_kv: dict[str, torch.Tensor]
    d_kv: dict[str, torch.Tensor]
    fabric: FakeFabric

    @property
    def p_transport(self) -> FakeTransport:
        assert isinstance(self.prefill.transport, FakeTransport)
        return self.prefill.transport


@pytest.fixture
def make_pair(redis_url: str) -> Iterator[Callable[..., Pair]]:
    sides: list[WorkerSide] = []

    def make(verify_kv: float | None = None, read_targets: bool = False) -> Pair:
        fabric = FakeFabric()
        factory = functools.partial(FakeTransport, fabric=fabric)

        def side(engine: str, generation: int) -> WorkerSide:
            cfg = ConnectorConfig(redis_url=redis_url, engine_id=engine, verify_kv=verify_kv)
            w = WorkerSide(cfg, tp_rank=0, tp_size=1, block_size=BS, num_blocks=NUM_BLOCKS,
                           generation=generation, transport_factory=factory,
                           read_targets=read_targets and engine == "P")
            sides.append(w)
            return w

        torch.manual_seed(0)
        pair = Pair(side("P", 1), side("D", 2), _caches(torch.randn), _caches(torch.zeros),
                    fabric)
        pair.prefill.register_kv_caches(pair.p_kv)
        pair.decode.register_kv_caches(pair.d_kv)
        return pair

    yield make
    for w in sides:
        w.shutdown()


_step = functools.partial(engine_step, layers=LAYERS)


def _answered(side: WorkerSide, meta: KVPushMetadata) -> tuple[set[str], set[str], set[str]]:
    """The step that computes a prompt, then the engine's next step: the first token is
    sampled between them, and PushDone leaves with the next step's metadata."""
    _step(side, meta)
    return _step(side)


def _deadline() -> int:
    return now_ms() + 30_000


def _target(block_ids: list[int] = DST, deadline_ms: int = 0) -> SendTarget:
    return SendTarget(RID, "D", 2, [list(block_ids)], skip_blocks=[0], num_tokens=PROMPT,
                      deadline_ms=deadline_ms or _deadline())


def _recv(deadline_ms: int = 0) -> KVPushMetadata:
    return KVPushMetadata(recvs={"d-1": RecvSpec(RID, "P", [list(DST)], [0],
                                                 deadline_ms or _deadline())})


def _prefill(target: SendTarget) -> KVPushMetadata:
    """The step computing the whole prompt, in which decode's target is known."""
    return KVPushMetadata(steps={"p-1": PrefillStep(RID, [list(SRC)], 0, PROMPT, PROMPT)},
                          targets={"p-1": target})


def _records(side: WorkerSide) -> list[dict[str, Any]]:
    stats = side.take_stats()
    return list(stats.data["transfers"]) if stats is not None else []


def _landed(pair: Pair) -> bool:
    return all(torch.equal(pair.d_kv[n][d], pair.p_kv[n][s])
               for n in LAYERS for s, d in zip(SRC, DST, strict=True))


def _untouched(pair: Pair) -> bool:
    return all(not pair.d_kv[n].any() for n in LAYERS)


@pytest.mark.parametrize("polls", [0, 3])
def test_push_lands_byte_identical_and_decode_finishes(make_pair: Callable[..., Pair],
                                                       polls: int) -> None:
    pair = make_pair()
    pair.p_transport.polls_to_complete = polls
    assert _step(pair.decode, _recv()) == (set(), set(), set())
    _answered(pair.prefill, _prefill(_target()))
    for _ in range(polls + 1):
        if pair.prefill.sender.jobs["p-1"].notified:
            break
        _step(pair.prefill)
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert _landed(pair)
    others = [b for b in range(NUM_BLOCKS) if b not in DST]
    assert all(not pair.d_kv[n][others].any() for n in LAYERS)
    # vLLM keeps prefill's blocks until the worker reports the finished request sent.
    assert _step(pair.prefill, KVPushMetadata(held={"p-1": [list(SRC)]})) == ({"p-1"}, set(),
                                                                             set())
    assert not pair.prefill.has_inflight() and not pair.decode.has_inflight()
    (push,) = _records(pair.prefill)
    (recv,) = _records(pair.decode)
    assert push["ok"] and push["blocks"] == 3 and push["layers"] == len(LAYERS)
    assert push["bytes"] == 3 * len(LAYERS) * pair.p_kv[LAYERS[0]][0].nbytes
    assert recv["ok"] and recv["outcome"] == "ok" and recv["bytes"] == push["bytes"]


def test_checksums_match_when_every_push_is_verified(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(verify_kv=1.0)
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target()))
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    (push,) = _records(pair.prefill)
    (recv,) = _records(pair.decode)
    assert push["ok"] and push["verified"]
    assert recv["ok"] and recv["verified"] is True and recv["outcome"] == "ok"


def test_target_outside_decode_blocks_fails_push_and_receive_ends_at_deadline(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    pair = make_pair()
    deadline = _deadline()
    _step(pair.decode, _recv(deadline))
    # A forged target: its last block id is past decode's registered cache.
    _answered(pair.prefill, _prefill(_target([1, 3, NUM_BLOCKS + 5], deadline)))
    job = pair.prefill.sender.jobs["p-1"]
    assert job.state is PushState.FAILED and "outside" in (job.error or "")
    assert pair.p_transport.writes == []
    (push,) = _records(pair.prefill)
    assert not push["ok"] and push["outcome"] == "error"
    # Prefill never reached decode's agent, so it never said anything: decode gives up at
    # deadline + grace, keeps the blocks quarantined, and cuts prefill off at the bound.
    assert _step(pair.decode) == (set(), set(), set())
    grace_ms = int(pair.decode.cfg.late_write_grace_s * 1000)
    monkeypatch.setattr(receiver, "now_ms", lambda: deadline + grace_ms + 1)
    assert _step(pair.decode) == (set(), set(), set())
    assert pair.decode.receiver.take_closing() == {"d-1"}  # prefill is told to stop
    age_quarantines(pair.decode, pair.decode.cfg.quarantine_max_s + 1)
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    entered, recv, cut = _records(pair.decode)
    assert (entered["outcome"], recv["outcome"], cut["outcome"]) == (
        "entered", "deadline", "cut_off")
    assert not recv["ok"] and not cut["ok"] and cut["wait_ms"] >= 60_000
    assert _untouched(pair)


def test_write_refused_by_the_transport_fails_the_receive_through_push_done(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the target check, the transport itself refuses a block outside the peer's
    cache; decode then learns it from PushDone(ok=False), not from its deadline."""
    pair = make_pair()
    monkeypatch.setattr(targets, "check_target", lambda *a: None)
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target([1, 3, NUM_BLOCKS + 5])))
    assert pair.prefill.sender.jobs["p-1"].state is PushState.FAILED
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    (recv,) = _records(pair.decode)
    assert not recv["ok"] and "WRITE post failed" in recv["error"]


def test_a_late_write_lands_only_in_blocks_decode_still_holds(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen link: prefill's WRITEs stay in flight past the deadline. Prefill fails the
    push but keeps polling them; decode keeps the blocks from vLLM until prefill says they
    ended. When the link comes back the late bytes land in blocks no other request has."""
    pair = make_pair()
    pair.p_transport.frozen = True
    deadline = _deadline()
    _step(pair.decode, _recv(deadline))
    _answered(pair.prefill, _prefill(_target(deadline_ms=deadline)))
    xfers = list(pair.p_transport.writes)
    assert xfers and all(x.state is XferState.IN_PROGRESS for x in xfers)
    # Before deadline + grace the push just waits.
    monkeypatch.setattr(sender, "now_ms", lambda: deadline + 500)
    _step(pair.prefill)
    assert all(x.state is XferState.IN_PROGRESS for x in xfers)
    monkeypatch.setattr(sender, "now_ms", lambda: deadline + sender._XFER_GRACE_MS + 1)
    _step(pair.prefill)
    job = pair.prefill.sender.jobs["p-1"]
    assert job.state is PushState.FAILED and job.notified and job.xfers == []
    assert all(x.state is XferState.IN_PROGRESS for x in xfers)  # not released
    assert pair.prefill.sender.fence.take_lingering() == 1
    (push,) = _records(pair.prefill)
    assert not push["ok"] and push["outcome"] == "error"
    # PushDone(ok=False) arrived without the fence: the request fails, the blocks stay.
    assert _step(pair.decode) == (set(), set(), set())
    assert pair.decode.receiver.jobs["d-1"].state is RecvState.QUARANTINED
    # Any clock past the deadline: nothing changes until prefill fences.
    monkeypatch.setattr(receiver, "now_ms", lambda: deadline + 3_600_000)
    assert _step(pair.decode) == (set(), set(), set())
    # The link heals: the late WRITEs complete into the quarantined blocks...
    pair.p_transport.frozen = False
    _step(pair.prefill)
    assert all(x.state is XferState.DONE for x in xfers) and _landed(pair)
    assert pair.prefill.sender.fence.take_lingering() == 0
    # ...and only then does decode give them back to vLLM.
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    entered, recv, fenced = _records(pair.decode)
    assert (entered["outcome"], fenced["outcome"]) == ("entered", "fenced")
    assert not recv["ok"] and fenced["ok"] and fenced["held_blocks"] == 0
    # Closed on prefill: the same target again is never written.
    pair.p_transport.writes.clear()
    _step(pair.prefill, KVPushMetadata(targets={"p-2": _target()}))
    assert pair.p_transport.writes == [] and "p-2" not in pair.prefill.sender.jobs


def test_decode_clock_ahead_of_prefill_by_more_than_the_grace_changes_nothing_for_others(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's clock runs 10 s ahead (a fault clock, not the system's): it gives the push
    up while prefill, by its own clock, is still inside the deadline and writing. The blocks
    stay quarantined until prefill's PushDone says its WRITEs ended; no clock frees them."""
    pair = make_pair()
    monkeypatch.setattr(receiver, "now_ms", lambda: now_ms() + 10_000)
    pair.p_transport.frozen = True
    deadline = now_ms() + 5_000
    _step(pair.decode, _recv(deadline))
    _answered(pair.prefill, _prefill(_target(deadline_ms=deadline)))
    assert _step(pair.decode) == (set(), set(), set())
    assert pair.decode.receiver.jobs["d-1"].state is RecvState.QUARANTINED
    assert pair.decode.receiver.take_closing() == {"d-1"}
    # Prefill, on time by its clock, finishes the push: its PushDone is the fence.
    pair.p_transport.frozen = False
    _step(pair.prefill, KVPushMetadata(held={"p-1": [list(SRC)]}))
    assert _landed(pair)
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    entered, recv, fenced = _records(pair.decode)
    assert (entered["outcome"], recv["outcome"], fenced["outcome"]) == (
        "entered", "deadline", "fenced")


def test_a_failure_reported_after_every_write_ended_frees_the_blocks_at_once(
        make_pair: Callable[..., Pair]) -> None:
    """The common failure: prefill's WRITEs all ended (here: failed) before it said so, so
    its PushDone carries the fence and nothing is quarantined."""
    pair = make_pair()
    pair.p_transport.fail_writes = True
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target()))
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    assert [r["kind"] for r in _records(pair.decode)] == ["recv"]


def test_an_abandoned_receive_past_its_deadline_waits_for_the_fence(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's request ended while the push was frozen: vLLM keeps the blocks until the
    receive ends, which is when prefill fenced, and it ends quietly (not failed)."""
    pair = make_pair()
    pair.p_transport.frozen = True
    deadline = _deadline()
    _step(pair.decode, _recv(deadline))
    _answered(pair.prefill, _prefill(_target(deadline_ms=deadline)))
    _step(pair.decode, KVPushMetadata(abandoned={"d-1"}))
    monkeypatch.setattr(receiver, "now_ms", lambda: deadline + 10_000)
    assert _step(pair.decode) == (set(), set(), set())
    assert pair.decode.receiver.jobs["d-1"].state is RecvState.QUARANTINED
    # Prefill reads decode's cancel: it stops, and fences once its WRITEs ended.
    _step(pair.prefill, KVPushMetadata(cancel={"p-1"}))
    assert _step(pair.decode) == (set(), set(), set())
    pair.p_transport.frozen = False
    _step(pair.prefill)
    assert _step(pair.decode) == (set(), {"d-1"}, set())


def test_push_done_from_another_agent_is_ignored(make_pair: Callable[..., Pair],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    pair = make_pair()
    _step(pair.decode, _recv())
    rogue = FakeTransport("X-r0-1", fabric=pair.fabric)
    assert pair.decode.layout is not None
    decode_peer = Peer("D", 0, 2, "D-r0-2", pair.decode.layout, None)
    rogue.notify(decode_peer, encode(PushDone(request_id=RID, ok=True)))
    rogue.notify(decode_peer, encode(PushDone(request_id=RID, ok=False, error="forged")))
    assert _step(pair.decode) == (set(), set(), set())
    assert "ignoring PushDone" in caplog.text and pair.decode.has_inflight()
    # The assigned prefill's PushDone still ends the receive.
    _answered(pair.prefill, _prefill(_target()))
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert _landed(pair)


def test_corrupted_decode_block_fails_the_receive_as_corrupt(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(verify_kv=1.0)
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target()))
    assert _landed(pair)
    # Bytes changed after the WRITE, before decode reads PushDone.
    pair.d_kv[LAYERS[1]][DST[1], 0, 0, 0] += 1.0
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    (recv,) = _records(pair.decode)
    assert not recv["ok"] and recv["outcome"] == "corrupt" and recv["verified"] is False
    assert (recv["bad_layer"], recv["bad_block"]) == (1, 1)
    assert f"decode block {DST[1]}" in recv["error"]


def test_rank_that_pushes_and_receives_keeps_push_done_read_while_sealing(
        make_pair: Callable[..., Pair]) -> None:
    """Sealing a push reads the rank's notifications to flush PushDone out; on an engine
    that also decodes, a PushDone read then must still end its receive."""
    pair = make_pair()
    _step(pair.decode, _recv())
    _step(pair.prefill, _prefill(_target()))
    # Decode computes a request it pushes back to the first engine; nothing in its inbox.
    back = SendTarget("cmpl-2", "P", 1, [[3, 1, 2]], skip_blocks=[0], num_tokens=PROMPT,
                      deadline_ms=_deadline())
    assert _step(pair.decode, KVPushMetadata(
        steps={"d-2": PrefillStep("cmpl-2", [[5, 6, 7]], 0, PROMPT, PROMPT)},
        targets={"d-2": back})) == (set(), set(), set())
    # The first engine's next step sends PushDone for d-1 into decode's inbox.
    assert _step(pair.prefill, KVPushMetadata(
        recvs={"p-2": RecvSpec("cmpl-2", "D", [[3, 1, 2]], [0], _deadline())})) == (
            set(), set(), set())
    pair.decode.on_metadata(KVPushMetadata())  # decode's next step seals d-2, reading d-1
    assert pair.decode.sender.jobs["d-2"].notified
    assert pair.decode.get_transfer_results() == (set(), {"d-1"}, set())
    assert _landed(pair)
    assert _step(pair.prefill) == (set(), {"p-2"}, set())


def test_push_done_waits_for_the_answer_and_leaves_with_the_next_step(
        make_pair: Callable[..., Pair]) -> None:
    """The first token is sampled after wait_for_save: neither PushDone nor its checksums
    may delay it, however soon the last WRITE lands. PushDone leaves when the next step's
    metadata arrives, before that step's forward pass."""
    pair = make_pair(verify_kv=1.0)
    _step(pair.decode, _recv())
    assert _step(pair.prefill, _prefill(_target())) == (set(), set(), set())
    job = pair.prefill.sender.jobs["p-1"]
    assert job.state is PushState.DONE and job.xfers == [] and not job.notified
    assert _step(pair.decode) == (set(), set(), set())  # nothing in decode's inbox yet
    pair.prefill.on_metadata(KVPushMetadata(held={"p-1": [list(SRC)]}))
    assert job.notified
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    for name in LAYERS:
        pair.prefill.save_kv_layer(name)
    pair.prefill.wait_for_save()
    assert pair.prefill.get_transfer_results() == ({"p-1"}, set(), set())
    (push,) = _records(pair.prefill)
    assert push["ok"] and push["verified"]


# -- the fence: decode learns when no WRITE can land any more ------------------------------------
def test_a_prefill_that_never_got_the_target_fails_the_receive_at_once(
        make_pair: Callable[..., Pair]) -> None:
    """Decode's target never reached prefill (Redis cut, say): prefill computed the prompt,
    held it, and released it at its deadline. It tells the decode its assignment named
    that it pushed nothing: decode fails the receive now, and quarantines nothing."""
    pair = make_pair()
    _step(pair.decode, _recv())
    step = PrefillStep(RID, [list(SRC)], 0, PROMPT, PROMPT, decode_engine="D")
    _answered(pair.prefill, KVPushMetadata(steps={"p-1": step}))
    _step(pair.prefill, KVPushMetadata(held={"p-1": [list(SRC)]}))
    assert _step(pair.prefill, KVPushMetadata(release={"p-1"}))[0] == {"p-1"}
    assert pair.p_transport.writes == []
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    (recv,) = _records(pair.decode)
    assert not recv["ok"] and "unpushed" in recv["error"]
    # The request is closed on prefill: its target, arriving after all, is never written.
    _step(pair.prefill, KVPushMetadata(targets={"p-1": _target()}))
    assert pair.p_transport.writes == []


def test_a_request_prefill_never_scheduled_is_fenced_when_decode_cancels(
        make_pair: Callable[..., Pair]) -> None:
    """Decode gave up on a request still queued at prefill and cancelled it: the scheduler
    side hands the rank the cancel's decode, and the rank, which never had the request,
    fences it at once."""
    pair = make_pair()
    deadline = _deadline()
    _step(pair.decode, _recv(deadline))
    _step(pair.prefill, KVPushMetadata(fence={"p-1": FenceTo(RID, "D", 2)}))
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    assert [r["kind"] for r in _records(pair.decode)] == ["recv"]
    # Scheduled after all: the rank computes it but never takes a target for it.
    _answered(pair.prefill, _prefill(_target()))
    assert pair.p_transport.writes == []


def test_a_request_vllm_ended_mid_push_is_sealed_once_its_writes_ended(
        make_pair: Callable[..., Pair]) -> None:
    """vLLM aborted a prefill request the rank was pushing (a target it took itself) and
    freed its blocks without holding them: the rank stops, waits for its WRITEs, and only
    then tells decode (fenced); the request is never reported finished sending."""
    pair = make_pair()
    pair.p_transport.frozen = True
    _step(pair.decode, _recv())
    _step(pair.prefill, _prefill(_target()))
    assert pair.p_transport.writes
    assert _step(pair.prefill, KVPushMetadata(forget={"p-1"}))[0] == set()
    assert "p-1" in pair.prefill.sender.jobs
    assert _step(pair.decode) == (set(), set(), set())
    pair.p_transport.frozen = False
    assert _step(pair.prefill)[0] == set()
    assert "p-1" not in pair.prefill.sender.jobs
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    assert [r["kind"] for r in _records(pair.decode)] == ["recv"]


# -- targets the prefill rank reads from Redis itself ------------------------------------------
def _publish(pair: Pair, decode_engine: str = "D", cancel: bool = False,
             push_key: str | None = None) -> None:
    """XADD decode's target to P's target stream, as decode's scheduler side does, and wait
    until P's reader thread has it."""
    target = PushTarget(request_id=RID, decode_engine=decode_engine, decode_generation=2,
                        block_ids=[] if cancel else [list(DST)],
                        skip_blocks=[] if cancel else [0],
                        num_tokens=0 if cancel else PROMPT, deadline_ms=_deadline(),
                        cancel=cancel, push_key=push_key)
    cfg = pair.prefill.cfg
    inbox = pair.prefill.sender._rank_targets.inbox
    assert inbox is not None
    before = len(inbox)
    client = connector_redis(cfg)
    client.xadd(RedisKeys(cfg.key_prefix).targets("P"), {"m": encode(target)})
    give_up = time.monotonic() + 10
    while len(inbox) <= before and time.monotonic() < give_up:
        time.sleep(0.005)
    assert len(inbox) > before, "the reader thread never delivered the target"


def _computing(assigned: str | None = "D", push_key: str | None = None) -> KVPushMetadata:
    """The step computing the whole prompt, before decode's target is known."""
    return KVPushMetadata(steps={"p-1": PrefillStep(
        RID, [list(SRC)], 0, PROMPT, PROMPT, decode_engine=assigned, deadline_ms=_deadline(),
        push_key=push_key)})


def test_target_landing_mid_forward_writes_the_rest_layer_by_layer(
        make_pair: Callable[..., Pair]) -> None:
    """The scheduler side's copy of a target reaches the worker only with the next step;
    a prefill rank reads the stream itself, so a target landing between two layers is
    written at once for the layers already computed and layer by layer after that."""
    pair = make_pair(read_targets=True)
    _step(pair.decode, _recv())
    pair.prefill.on_metadata(_computing())
    pair.prefill.save_kv_layer(LAYERS[0])
    assert pair.p_transport.writes == []
    _publish(pair)
    pair.prefill.save_kv_layer(LAYERS[1])
    # Both WRITEs are out before the forward pass ends: layer 0 caught up, layer 1 posted
    # from its own hook.
    assert [x.descriptors for x in pair.p_transport.writes] == [len(SRC), len(SRC)]
    pair.prefill.wait_for_save()
    pair.prefill.get_transfer_results()
    # The scheduler side's copy, with the next step (which sends PushDone), writes
    # nothing again.
    _step(pair.prefill, KVPushMetadata(targets={"p-1": _target()}))
    assert pair.prefill.sender.jobs["p-1"].notified
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert _landed(pair)
    assert len(pair.p_transport.writes) == 2
    (push,) = _records(pair.prefill)
    assert push["ok"] and push["layerwise_xfers"] == 1 and push["xfers"] == 2


def test_target_read_before_the_first_step_is_written_layer_by_layer(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(read_targets=True)
    _step(pair.decode, _recv())
    _publish(pair)
    pair.prefill.get_transfer_results()  # a poll between steps: P has no job for it yet
    _answered(pair.prefill, _computing())
    assert [x.descriptors for x in pair.p_transport.writes] == [len(SRC), len(SRC)]
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert _landed(pair)
    (push,) = _records(pair.prefill)
    assert push["layerwise_xfers"] == len(LAYERS)


@pytest.mark.parametrize("forged", ["other-decode", "cancelled", "early-no-key",
                                    "early-wrong-key"])
def test_target_the_scheduler_side_would_refuse_is_not_taken(
        make_pair: Callable[..., Pair], forged: str) -> None:
    """Whoever can write the target stream must not steer a push the assignment did not
    name, nor revive one decode cancelled: the worker leaves both to the scheduler side.
    A request sent to prefill at admission names no decode: only its push key decides."""
    pair = make_pair(read_targets=True)
    early = forged.startswith("early")
    pair.prefill.on_metadata(_computing(None, "k-1") if early else _computing())
    pair.prefill.save_kv_layer(LAYERS[0])
    if forged == "other-decode":
        _publish(pair, decode_engine="X")
    elif early:
        _publish(pair, decode_engine="X", push_key=None if forged == "early-no-key" else "k-2")
    else:
        _publish(pair)
        _publish(pair, cancel=True)
    pair.prefill.save_kv_layer(LAYERS[1])
    pair.prefill.wait_for_save()
    assert pair.prefill.sender.jobs["p-1"].state is PushState.WAIT_TARGET
    assert pair.p_transport.writes == []
    assert _untouched(pair)


def test_an_early_request_takes_the_target_that_carries_its_key(
        make_pair: Callable[..., Pair]) -> None:
    """The counterpart of the forged cases: the same early step, its decode's target with
    the key the gateway gave both legs, is written layer by layer."""
    pair = make_pair(read_targets=True)
    _step(pair.decode, _recv())
    pair.prefill.on_metadata(_computing(None, "k-1"))
    pair.prefill.save_kv_layer(LAYERS[0])
    _publish(pair, push_key="k-1")
    pair.prefill.save_kv_layer(LAYERS[1])
    assert [x.descriptors for x in pair.p_transport.writes] == [len(SRC), len(SRC)]


# -- decode goes on from prefill's first token --------------------------------------------


def _recv_going_on() -> KVPushMetadata:
    return KVPushMetadata(recvs={"d-1": RecvSpec(RID, "P", [list(DST)], [0], _deadline(),
                                                 first_token=True)})


def test_push_done_carries_the_first_token_decode_goes_on_from(
        make_pair: Callable[..., Pair]) -> None:
    """A target that asks for prefill's first token is sealed only once the request
    ended with it (the next step's metadata says which), whatever the step that
    sampled it left in flight; decode's rank reports it to its scheduler."""
    pair = make_pair()
    _step(pair.decode, _recv_going_on())
    target = dataclasses.replace(_target(), first_token=True)
    _answered(pair.prefill, _prefill(target))
    job = pair.prefill.sender.jobs["p-1"]
    assert job.state is PushState.DONE and not job.notified  # no token yet: not sealed
    assert _step(pair.decode) == (set(), set(), set())
    _step(pair.prefill, KVPushMetadata(held={"p-1": [list(SRC)]}, first_tokens={"p-1": 42}))
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.decode.receiver.take_first_tokens() == {"d-1": 42}
    assert pair.decode.receiver.take_first_tokens() == {}
    assert _landed(pair)


def test_a_push_without_the_first_token_decode_asked_for_fails_the_receive(
        make_pair: Callable[..., Pair]) -> None:
    """Decode would otherwise sample a first token of its own after the client got
    prefill's: a prefill that ended with none (or does not know the field) fails it."""
    pair = make_pair()
    _step(pair.decode, _recv_going_on())
    _answered(pair.prefill, _prefill(dataclasses.replace(_target(), first_token=True)))
    _step(pair.prefill, KVPushMetadata(held={"p-1": [list(SRC)]}))  # ended without one
    assert _step(pair.decode) == (set(), {"d-1"}, {"d-1"})
    assert pair.decode.receiver.take_first_tokens() == {}
    (recv,) = _records(pair.decode)
    assert not recv["ok"] and "no first token" in recv["error"]


# -- a verified receive checked again when its request ends -----------------------------------


@pytest.mark.parametrize("changed", [False, True])
def test_a_verified_receive_is_checked_again_when_its_request_ends(
        make_pair: Callable[..., Pair], caplog: pytest.LogCaptureFixture, changed: bool
) -> None:
    """A block that changed while the request used it (a late WRITE into blocks decode
    gave it, say) passed the check at PushDone: it is caught when the request ends, before
    vLLM may free the blocks, and named with the request and the agent that wrote them."""
    pair = make_pair(verify_kv=1.0)
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target()))
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.decode.receiver.take_kept() == {"d-1"}
    (recv,) = _records(pair.decode)
    assert recv["verified"] is True
    # Decode writes the prompt's last block itself: that block is not checked again.
    pair.d_kv[LAYERS[1]][DST[-1], 0, 0, 0] += 1.0
    if changed:
        pair.d_kv[LAYERS[1]][DST[1], 0, 0, 0] += 1.0
    # The request ended: its ranks check again and then let vLLM free its blocks.
    assert _step(pair.decode, KVPushMetadata(recheck={"d-1"})) == ({"d-1"}, set(), set())
    (check,) = _records(pair.decode)
    assert check["kind"] == "recheck" and check["ok"] is not changed
    if changed:
        assert (check["bad_layer"], check["bad_block"]) == (1, 1)
        assert f"decode block {DST[1]}" in check["error"] and "P-r0-" in check["error"]
        assert "changed while the request used it" in caplog.text
    assert pair.decode.receiver._kept == {}


def test_a_preempted_receive_is_not_checked_again_but_still_released(
        make_pair: Callable[..., Pair]) -> None:
    """vLLM freed a preempted request's blocks and recomputes it elsewhere: what they hold
    then is another request's, so nothing is checked; its end still frees its blocks."""
    pair = make_pair(verify_kv=1.0)
    _step(pair.decode, _recv())
    _answered(pair.prefill, _prefill(_target()))
    _step(pair.decode)
    pair.d_kv[LAYERS[0]][DST[0], 0, 0, 0] += 1.0  # reused by another request
    _step(pair.decode, KVPushMetadata(unkeep={"d-1"}))
    assert _step(pair.decode, KVPushMetadata(recheck={"d-1"})) == ({"d-1"}, set(), set())
    assert [r for r in _records(pair.decode) if r["kind"] == "recheck"] == []


def test_a_fence_owed_to_a_name_no_engine_can_have_is_dropped_not_raised() -> None:
    """The names a fence goes to were read from Redis: one that cannot be an engine's (a
    gateway's cancel, or anyone's forgery) ends the owed fence with a log line, inside the
    forward pass, where an exception would kill the engine."""
    sent: list[Any] = []
    fence = Fence(5.0, lambda peer, done: sent.append(done))

    def peers() -> list[Any]:
        raise InvalidKeyPart("invalid id for a Redis key: 'gateway:gw-1'")

    fence.unpushed("r1", peers, 1)
    assert sent == [] and fence.closed("r1")
