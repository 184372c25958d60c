"""Page addressing for every vLLM KV cache layout (connector/page_layout.py): the byte runs
of a page, a head slice, a partial block and a pairing of two layouts, checked against
numpy's own strided indexing of vLLM's views, and the pairings that are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpush.connector import page_layout as pl

LAYERS, BLOCKS = 3, 5


def _view_strides(layout: str, heads: int, tokens: int, head_size: int, itemsize: int
                  ) -> tuple[list[int], int]:
    """Element strides of vLLM's per-layer [B, H, N, C] view of a fused (K | V) cache,
    and its layer stride in bytes, as vLLM 0.32 computes them."""
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[itemsize]
    spec = FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head_size,
                             dtype=dtype)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, KVCacheLayout[layout])
    # vLLM's content axis counts bytes: one element of the dtype view is itemsize of them.
    return [s // itemsize for s in strides[1:4]] + [1], strides[0]


def _logical_offsets(heads: int, tokens: int, cell: int, strides: list[int],
                     itemsize: int, kv: str) -> np.ndarray:
    """Byte offset of every (head, part, token, byte) of block 0, from the view's strides
    and the backend's reading of the cell: an independent oracle for page_layout."""
    h = np.arange(heads)[:, None, None, None]
    n = np.arange(tokens)[None, None, :, None]
    half = cell * itemsize // 2
    x = np.arange(half)[None, None, None, :]
    p = np.arange(2)[None, :, None, None]
    if kv == "split":  # one head's N x C bytes read as [K of every token][V of every token]
        off = h * strides[1] * itemsize + p * tokens * half + n * half + x
    else:
        off = h * strides[1] * itemsize + n * strides[2] * itemsize + p * half + x
    return off


def _bytes_of(runs: pl.Runs) -> np.ndarray:
    return np.concatenate([np.arange(o, o + n) for o, n in runs]) if runs else np.zeros(0)


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
@pytest.mark.parametrize("itemsize", [1, 2])
def test_runs_cover_exactly_the_page_and_a_head_slice_of_every_layout(
        layout: str, itemsize: int) -> None:
    heads, tokens, head_size = 4, 16, 8
    strides, _ = _view_strides(layout, heads, tokens, head_size, itemsize)
    g = pl.geometry(layout, "fused", (BLOCKS, heads, tokens, 2 * head_size), strides,
                    itemsize)
    oracle = _logical_offsets(heads, tokens, 2 * head_size, strides, itemsize, "fused")
    assert sorted(_bytes_of(pl.runs(g))) == sorted(oracle.reshape(-1))
    assert g.page_bytes == oracle.size
    # Heads 1..2: every byte of them, nothing of heads 0 and 3.
    assert sorted(_bytes_of(pl.runs(g, (1, 2)))) == sorted(oracle[1:3].reshape(-1))
    # The canonical order is head, K/V, token, byte, whatever the layout.
    assert list(pl.byte_index(g)) == list(oracle.reshape(-1))
    assert list(pl.byte_index(g, (2, 1), (0, 5))) == list(oracle[2:3, :, :5].reshape(-1))


def test_fewest_runs_per_layout() -> None:
    """Head-major compact pages are one run; token-major ones too, until a head slice
    splits them per token; heads outside blocks are one run per head."""
    def count(layout: str, heads: tuple[int, int] | None = None) -> int:
        strides, _ = _view_strides(layout, 4, 16, 8, 2)
        g = pl.geometry(layout, "fused", (BLOCKS, 4, 16, 16), strides, 2)
        return len(pl.runs(g, heads))
    assert [count(x) for x in ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC")] == \
        [1, 1, 1, 1, 4, 4]
    assert count("LBHNC", (0, 2)) == 1 and count("LBNHC", (0, 2)) == 16


def test_the_cpu_page_splits_k_from_v_per_head() -> None:
    strides = [4 * 16 * 16, 16 * 16, 16, 1]
    g = pl.geometry("LBHNC", "split", (BLOCKS, 4, 16, 16), strides, 2)
    oracle = _logical_offsets(4, 16, 16, strides, 2, "split")
    assert list(pl.byte_index(g)) == list(oracle.reshape(-1))
    # A partial block's first 3 tokens: K and V of each head, two runs per head.
    assert len(pl.runs(g, None, (0, 3))) == 8
    assert sorted(_bytes_of(pl.runs(g, None, (0, 3)))) == \
        sorted(oracle[:, :, :3].reshape(-1))
    with pytest.raises(pl.UnsupportedPage, match="head-major"):
        pl.geometry("LBNHC", "split", (BLOCKS, 4, 16, 16),
                    _view_strides("LBNHC", 4, 16, 8, 2)[0], 2)


def test_an_mla_latent_has_one_head_and_one_part() -> None:
    g = pl.geometry("BLHNC", "latent", (BLOCKS, 16, 576), (LAYERS * 16 * 576, 576, 1), 2)
    assert (g.heads, g.parts, g.part_bytes, g.token_stride) == (1, 1, 1152, 1152)
    assert pl.runs(g) == ((0, 16 * 1152),)
    assert pl.runs(g, None, (0, 3)) == ((0, 3 * 1152),)
    with pytest.raises(pl.UnsupportedPage, match="heads"):
        pl.geometry("LBHNC", "latent", (BLOCKS, 2, 16, 576), (2 * 16 * 576, 16 * 576, 576, 1),
                    2)


@settings(max_examples=60, deadline=None)
@given(local=st.sampled_from([m.name for m in KVCacheLayout]),
       remote=st.sampled_from([m.name for m in KVCacheLayout]),
       ratio=st.sampled_from([1, 2, 4]), rank=st.integers(0, 3),
       tokens=st.integers(1, 16))
def test_a_pairing_carries_each_logical_byte_to_its_place(
        local: str, remote: str, ratio: int, rank: int, tokens: int) -> None:
    """Prefill holds ``4 / ratio`` of decode's 4 heads (TP ``ratio`` -> 1): every byte
    of its slice lands on the same logical (head, part, token, byte) of decode's page."""
    rank %= ratio
    heads = 4 // ratio
    ls, _ = _view_strides(local, heads, 16, 8, 2)
    rs, _ = _view_strides(remote, 4, 16, 8, 2)
    lg = pl.geometry(local, "fused", (BLOCKS, heads, 16, 16), ls, 2)
    rg = pl.geometry(remote, "fused", (BLOCKS, 4, 16, 16), rs, 2)
    try:
        a, b = pl.pair(lg, rg, (0, heads), (rank * heads, heads), (0, tokens),
                       max_runs=10_000)
    except pl.UnmappableLayouts:
        pytest.fail(f"{local} -> {remote} refused")
    assert [n for _o, n in a] == [n for _o, n in b]
    lo = _logical_offsets(heads, 16, 16, ls, 2, "fused")[:, :, :tokens]
    ro = _logical_offsets(4, 16, 16, rs, 2, "fused")[rank * heads:(rank + 1) * heads,
                                                      :, :tokens]
    where = dict(zip(lo.reshape(-1).tolist(), ro.reshape(-1).tolist(), strict=True))
    for (la, n), (rb, _n) in zip(a, b, strict=True):
        assert [where[la + i] for i in range(n)] == list(range(rb, rb + n))
    assert sum(n for _o, n in a) == lo.size


def test_same_layouts_pair_in_few_runs_and_odd_ones_are_refused_naming_both() -> None:
    ls, _ = _view_strides("LBNHC", 4, 16, 8, 2)
    rs, _ = _view_strides("LBHNC", 4, 16, 8, 2)
    g_nhd = pl.geometry("LBNHC", "fused", (BLOCKS, 4, 16, 16), ls, 2)
    g_hnd = pl.geometry("LBHNC", "fused", (BLOCKS, 4, 16, 16), rs, 2)
    a, b = pl.pair(g_hnd, g_hnd)
    assert len(a) == 1 and a == b
    # Token-major into head-major: one piece per (token, head) cell, refused past the
    # bound on descriptors per block.
    assert len(pl.pair(g_nhd, g_hnd)[0]) == 4 * 16
    with pytest.raises(pl.UnmappableLayouts, match="LBNHC/fused with LBHNC/fused"):
        pl.pair(g_nhd, g_hnd, max_runs=32)
    cpu = pl.geometry("LBHNC", "split", (BLOCKS, 4, 16, 16), [1024, 256, 16, 1], 2)
    latent = pl.geometry("LBNHC", "latent", (BLOCKS, 16, 576), (16 * 576, 576, 1), 2)
    with pytest.raises(pl.UnmappableLayouts, match="LBNHC/latent"):
        pl.pair(latent, cpu)
    other_block = pl.geometry("LBHNC", "fused", (BLOCKS, 4, 32, 16), [2048, 512, 16, 1], 2)
    with pytest.raises(pl.UnmappableLayouts, match="block size"):
        pl.pair(g_hnd, other_block)


def test_unknown_layouts_and_shapes_are_named() -> None:
    assert pl.layout_name("NHD") == "LBNHC" and pl.layout_name("HND") == "LBHNC"
    with pytest.raises(pl.UnsupportedPage, match="unknown KV cache layout 'XYZ'"):
        pl.layout_name("XYZ")
    with pytest.raises(pl.UnsupportedPage, match=r"not \[B, H, N, C\]"):
        pl.geometry("LBHNC", "fused", (4, 16), (16, 1), 2)
    with pytest.raises(pl.UnsupportedPage, match="not contiguous"):
        pl.geometry("LBHNC", "fused", (4, 2, 16, 8), (256, 128, 8, 2), 2)
