"""Heterogeneous TP without NIXL: every prefill rank pushes its heads into the matching
head slice of every decode rank that holds them.

Each rank is a real ``WorkerSide`` over the in-process fake transport, with real torch KV
tensors (CPU layout ``[blocks, heads, block_size, 2*head]``, or MLA latents) and the real
Redis of conftest.py for the agent registry; the tests drive them with hand-built
``KVPushMetadata`` the way vLLM does. Every push is checksummed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvpush.connector import receiver, tp_mapping
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.fake_transport import FakeFabric, FakeTransport
from kvpush.connector.metadata import KVPushMetadata, PrefillStep, RecvSpec, SendTarget
from kvpush.connector.worker_side import WorkerSide
from tests.test_connector_worker import LAYERS, _answered, _deadline, _step
from tests.worker_util import age_quarantines

BS, NUM_BLOCKS, HEAD = 4, 8, 8
PROMPT = 10  # 3 blocks, the last one partial
SRC, DST = [5, 6, 7], [1, 3, 4]
RID = "cmpl-tp"


@dataclass
class Fleet:
    prefill: list[WorkerSide]
    decode: list[WorkerSide]
    model_kv: dict[str, torch.Tensor]  # every head of prefill's KV, [blocks, H, BS, 2*HEAD]
    d_kv: list[dict[str, torch.Tensor]]
    heads: int
    mla: bool


@pytest.fixture
def make_fleet(redis_url: str) -> Iterator[Callable[..., Fleet]]:
    sides: list[WorkerSide] = []

    def make(p: int, d: int, heads: int, mla: bool = False) -> Fleet:
        fabric = FakeFabric()
        factory = functools.partial(FakeTransport, fabric=fabric)
        torch.manual_seed(0)
        width = 576 if mla else 2 * HEAD
        model = {n: torch.randn(NUM_BLOCKS, 1 if mla else heads, BS, width) for n in LAYERS}

        def ranks(engine: str, tp: int, generation: int, fill: bool
                  ) -> tuple[list[WorkerSide], list[dict[str, torch.Tensor]]]:
            out, caches = [], []
            for rank in range(tp):
                cfg = ConnectorConfig(redis_url=redis_url, engine_id=engine, verify_kv=1.0)
                w = WorkerSide(cfg, tp_rank=rank, tp_size=tp, block_size=BS,
                               num_blocks=NUM_BLOCKS, generation=generation,
                               transport_factory=factory, mla=mla, total_kv_heads=heads)
                held = range(1) if mla else tp_mapping.rank_heads(rank, tp, heads)
                kv = {n: (model[n][:, held.start:held.stop].clone() if fill
                          else torch.zeros(NUM_BLOCKS, len(held), BS, width))
                      for n in LAYERS}
                w.register_kv_caches(kv)
                sides.append(w)
                out.append(w)
                caches.append(kv)
            return out, caches

        prefill, _ = ranks("P", p, 1, fill=True)
        decode, d_kv = ranks("D", d, 2, fill=False)
        return Fleet(prefill, decode, model, d_kv, heads, mla)

    yield make
    for w in sides:
        w.shutdown()


def _recv(deadline_ms: int = 0) -> KVPushMetadata:
    return KVPushMetadata(recvs={"d-1": RecvSpec(RID, "P", [list(DST)], [0],
                                                 deadline_ms or _deadline())})


def _prefill() -> KVPushMetadata:
    target = SendTarget(RID, "D", 2, [list(DST)], [0], PROMPT, _deadline())
    return KVPushMetadata(steps={"p-1": PrefillStep(RID, [list(SRC)], 0, PROMPT, PROMPT)},
                          targets={"p-1": target})


def _landed(fleet: Fleet, rank: int, tp: int) -> bool:
    held = range(1) if fleet.mla else tp_mapping.rank_heads(rank, tp, fleet.heads)
    return all(torch.equal(fleet.d_kv[rank][n][d],
                           fleet.model_kv[n][s, held.start:held.stop])
               for n in LAYERS for s, d in zip(SRC, DST, strict=True))


@pytest.mark.parametrize(("p", "d", "heads", "mla"), [
    (2, 1, 2, False),  # prefill TP2 -> decode TP1: two writers fill one page
    (1, 2, 2, False),  # prefill TP1 -> decode TP2: one page split over two ranks
    (1, 4, 2, False),  # decode TP above the KV heads: each head replicated twice
    (4, 1, 2, False),  # prefill heads replicated: one writer per head, none twice
    (2, 4, 4, False),
    (1, 2, 1, True),  # MLA: the same latent on every rank, one writer per decode rank
    (2, 1, 1, True),
])
def test_every_decode_rank_gets_its_heads_verified_from_every_writer(
        make_fleet: Callable[..., Fleet], p: int, d: int, heads: int, mla: bool) -> None:
    fleet = make_fleet(p, d, heads, mla)
    for rank in fleet.decode:
        _step(rank, _recv())
    for rank in fleet.prefill:
        _answered(rank, _prefill())
    for r, rank in enumerate(fleet.decode):
        assert _step(rank) == (set(), {"d-1"}, set())
        assert _landed(fleet, r, d)
        (recv,) = rank.take_stats().data["transfers"]  # type: ignore[union-attr]
        assert recv["ok"] and recv["verified"] is True
        writers = tp_mapping.writers_of(r, p, d, 1 if mla else heads, mla)
        page = fleet.d_kv[r][LAYERS[0]][0].nbytes
        assert recv["bytes"] == len(SRC) * len(LAYERS) * page  # whole pages, nothing twice
        assert len(writers) == (1 if mla else max(1, min(p, heads) // min(d, heads)))
    # Prefill ranks that wrote nothing (replicated heads) still release their blocks.
    for rank in fleet.prefill:
        assert _step(rank, KVPushMetadata(held={"p-1": [list(SRC)]}))[0] == {"p-1"}


def test_a_missing_part_fails_the_request_once_every_writer_fenced_or_was_cut_off(
        make_fleet: Callable[..., Fleet], monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rank 1 never pushes nor answers: past the deadline decode gives the push up
    but keeps the blocks (rank 1 might still write) until the quarantine's bound."""
    fleet = make_fleet(2, 1, 2)
    deadline = _deadline()
    _step(fleet.decode[0], _recv(deadline))
    _step(fleet.prefill[0], _prefill())  # prefill rank 1 never pushes
    assert _step(fleet.decode[0]) == (set(), set(), set())  # waits for rank 1's half
    monkeypatch.setattr(receiver, "now_ms", lambda: deadline + 60_000)
    assert _step(fleet.decode[0]) == (set(), set(), set())  # quarantined
    age_quarantines(fleet.decode[0], fleet.decode[0].cfg.quarantine_max_s + 1)
    assert _step(fleet.decode[0]) == (set(), {"d-1"}, {"d-1"})
    records = fleet.decode[0].take_stats().data["transfers"]  # type: ignore[union-attr]
    entered, recv, cut = records
    assert (entered["kind"], entered["outcome"], entered["held_blocks"]) == (
        "quarantine", "entered", recv["blocks"])
    assert not recv["ok"] and recv["outcome"] == "deadline"
    assert (cut["outcome"], cut["held_blocks"]) == ("cut_off", 0) and not cut["ok"]


def test_one_ranks_failure_fails_the_request_at_once(
        make_fleet: Callable[..., Fleet]) -> None:
    fleet = make_fleet(2, 1, 2)
    _step(fleet.decode[0], _recv())
    transport = fleet.prefill[1].transport
    assert isinstance(transport, FakeTransport)
    transport.fail_writes = True
    for rank in fleet.prefill:
        _answered(rank, _prefill())
    assert _step(fleet.decode[0]) == (set(), {"d-1"}, {"d-1"})
    (recv,) = fleet.decode[0].take_stats().data["transfers"]  # type: ignore[union-attr]
    assert not recv["ok"] and "failed" in recv["error"]


def test_one_flipped_byte_in_one_ranks_head_slice_is_caught(
        make_fleet: Callable[..., Fleet]) -> None:
    """Decode TP1 gets one head from each of two prefill ranks; a byte of V of the last
    prompt token in the second rank's head is corrupted before decode checks it."""
    fleet = make_fleet(2, 1, 2)
    _step(fleet.decode[0], _recv())
    for rank in fleet.prefill:
        _answered(rank, _prefill())
    last = fleet.d_kv[0][LAYERS[1]][DST[-1]]  # request block 2 holds prompt tokens 8, 9
    v_of_token_9 = last.reshape(2, 2, BS, HEAD)[1, 1, PROMPT - 1 - 2 * BS]
    v_of_token_9.view(torch.uint8)[3] ^= 0x01
    assert _step(fleet.decode[0]) == (set(), {"d-1"}, {"d-1"})
    (recv,) = fleet.decode[0].take_stats().data["transfers"]  # type: ignore[union-attr]
    assert recv["outcome"] == "corrupt" and recv["verified"] is False
    assert (recv["bad_layer"], recv["bad_block"]) == (1, 2)
    assert "prefill rank 1" in recv["error"]
