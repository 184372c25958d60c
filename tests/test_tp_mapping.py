"""Rank arithmetic of heterogeneous-TP pushes: every decode head written exactly once."""

from __future__ import annotations

import itertools

import pytest

from kvpush.connector import tp_mapping as tpm

SIZES = (1, 2, 4, 8)


def _valid(p: int, d: int, h: int) -> bool:
    try:
        tpm.check_pairing(p, d, h)
    except tpm.UnsupportedTP:
        return False
    return True


@pytest.mark.parametrize(("p", "d", "h"), [c for c in itertools.product(SIZES, SIZES, SIZES)
                                           if _valid(*c)])
def test_every_decode_head_has_exactly_one_writer_with_matching_slices(p, d, h) -> None:
    got: dict[tuple[int, int], list[int]] = {}
    for prank in range(p):
        mine = tpm.rank_heads(prank, p, h)
        for w in tpm.writes_of(prank, p, d, h):
            theirs = tpm.rank_heads(w.decode_rank, d, h)
            assert w.local.first >= 0 and w.local.first + w.local.count <= len(mine)
            assert w.remote.first >= 0 and w.remote.first + w.remote.count <= len(theirs)
            for i in range(w.local.count):
                head = mine[w.local.first + i]
                assert head == theirs[w.remote.first + i]  # the same head on both sides
                got.setdefault((w.decode_rank, head), []).append(prank)
    want = {(dr, head) for dr in range(d) for head in tpm.rank_heads(dr, d, h)}
    assert set(got) == want
    assert all(len(writers) == 1 for writers in got.values())
    for dr in range(d):
        assert tpm.writers_of(dr, p, d, h) == sorted({w for (r, _h), ws in got.items()
                                                      if r == dr for w in ws})


def test_the_shapes_operators_run() -> None:
    # Prefill TP2 -> decode TP1, 2 KV heads: each prefill rank fills its half of the page.
    assert tpm.writes_of(0, 2, 1, 2) == [tpm.RankWrite(0, tpm.HeadSlice(0, 1),
                                                       tpm.HeadSlice(0, 1))]
    assert tpm.writes_of(1, 2, 1, 2) == [tpm.RankWrite(0, tpm.HeadSlice(0, 1),
                                                       tpm.HeadSlice(1, 1))]
    assert tpm.writers_of(0, 2, 1, 2) == [0, 1]
    # Prefill TP1 -> decode TP2: the one prefill rank splits its page in two.
    assert tpm.writes_of(0, 1, 2, 2) == [
        tpm.RankWrite(0, tpm.HeadSlice(0, 1), tpm.HeadSlice(0, 1)),
        tpm.RankWrite(1, tpm.HeadSlice(1, 1), tpm.HeadSlice(0, 1))]
    # Decode TP4 over 2 KV heads: each head is replicated on two decode ranks.
    assert [w.decode_rank for w in tpm.writes_of(0, 1, 4, 2)] == [0, 1, 2, 3]
    assert [w.local.first for w in tpm.writes_of(0, 1, 4, 2)] == [0, 0, 1, 1]
    # Prefill TP4 over 2 heads into decode TP1: one writer per head, no duplicate write.
    assert [p for p in range(4) if tpm.writes_of(p, 4, 1, 2)] == [0, 2]


def test_mla_gives_each_decode_rank_exactly_one_writer() -> None:
    for p, d in itertools.product(SIZES, SIZES):
        if max(p, d) % min(p, d):
            continue
        writers = [tpm.writers_of(dr, p, d, 1, mla=True) for dr in range(d)]
        assert all(len(w) == 1 for w in writers)
        assert all(w.local == w.remote == tpm.HeadSlice(0, 1)
                   for pr in range(p) for w in tpm.writes_of(pr, p, d, 1, mla=True))


@pytest.mark.parametrize(("p", "d", "h"), [(2, 3, 6), (3, 1, 2), (1, 3, 2), (4, 1, 6)])
def test_pairings_that_do_not_divide_are_refused(p, d, h) -> None:
    with pytest.raises(tpm.UnsupportedTP):
        tpm.writes_of(0, p, d, h)
