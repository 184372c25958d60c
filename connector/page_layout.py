"""Where each byte of a paged KV cache sits, for every vLLM ``KVCacheLayout`` (pure,
unit-tested).

vLLM 0.32 views one layer's cache as ``[B, H, N, C]`` (block, KV head, token, content)
and places it in memory by a stride permutation of ``[L, B, H, N, C]``
(``vllm/v1/kv_cache_layout.py``): ``LBHNC`` head-major pages, ``LBNHC`` token-major
(FlashAttention's default), ``LHBNC`` heads outside blocks (ROCm), ``BLHNC``/``BLNHC``/
``BHLNC`` packed blocks holding every layer. How a backend reads the content ``C`` is its
own: FlashAttention and FlashInfer split each (head, token) cell into K then V
(:attr:`Content.FUSED`); vLLM's CPU attention reads one head's ``N x C`` bytes as every
token's K, then every token's V (:attr:`Content.SPLIT`); MLA has one latent per token
(:attr:`Content.LATENT`).

A page is therefore a strided box over four logical axes: head ``H``, part ``P`` (K, V),
token ``N`` and byte ``X`` within one part, each with a byte stride. Everything the push
addresses goes through it: NIXL descriptors (:func:`runs`, :func:`pair`), a head slice
under heterogeneous TP, a partial last block, and the bytes a checksum covers
(:func:`byte_index`, in a canonical order, so both sides of a push hash the same logical
bytes whatever their layouts).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# vLLM's KVCacheLayout members: logical axes [L, B, H, N, C] in physical order.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# The legacy names vLLM still accepts in VLLM_KV_CACHE_LAYOUT.
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

# A pairing whose every (layer, block) needs more descriptors than this is refused: the
# prepared descriptor lists grow with layers x blocks x runs.
MAX_RUNS_PER_BLOCK = 64

Runs = tuple[tuple[int, int], ...]  # (byte offset from the page origin, length)
Span = tuple[int, int]  # (first, count)


class Content(enum.StrEnum):
    """How a backend reads one head's content bytes."""

    FUSED = "fused"  # each (head, token) cell is [K | V] (FlashAttention, FlashInfer, ROCm)
    SPLIT = "split"  # each head is [K of every token][V of every token] (CPU attention)
    LATENT = "latent"  # one latent per token, no heads (MLA)


class UnsupportedPage(ValueError):
    """A cache view whose bytes cannot be addressed as a page of the declared layout."""


class UnmappableLayouts(ValueError):
    """Two pages whose bytes cannot be paired (the message names both layouts)."""


def layout_name(name: str) -> str:
    """vLLM's layout name for ``name`` (a member, or a legacy alias)."""
    name = ALIASES.get(name, name)
    if name not in LAYOUTS:
        raise UnsupportedPage(f"unknown KV cache layout {name!r} (known: "
                              f"{', '.join(LAYOUTS)})")
    return name


@dataclass(frozen=True)
class PageGeometry:
    """One block of one layer on one rank: a box of ``heads x parts x tokens x
    part_bytes`` bytes with byte strides, from the page origin (the layer's base address
    plus the block index times the block stride)."""

    layout: str
    content: Content
    heads: int
    parts: int  # 2: K and V addressable apart; 1: a latent, or a cell taken whole
    tokens: int
    part_bytes: int
    head_stride: int
    part_stride: int
    token_stride: int

    def axes(self) -> dict[str, tuple[int, int]]:
        """(size, byte stride) of each logical axis."""
        return {"H": (self.heads, self.head_stride), "P": (self.parts, self.part_stride),
                "N": (self.tokens, self.token_stride), "X": (self.part_bytes, 1)}

    @property
    def page_bytes(self) -> int:
        """Bytes of K and V (or latent) of every head and token of the page."""
        return self.heads * self.parts * self.tokens * self.part_bytes

    @property
    def physical_order(self) -> tuple[str, ...]:
        """Logical axes outermost first, as they lie in memory."""
        axes = self.axes()
        return (*sorted("HPN", key=lambda a: (-axes[a][1], "HPN".index(a))), "X")

    def describe(self) -> str:
        """The layout as operators know it, for messages."""
        return f"{self.layout}/{self.content.value}"


def geometry(layout: str, content: Content | str, shape: Sequence[int],
             strides: Sequence[int], itemsize: int, head_size: int = 0) -> PageGeometry:
    """The page of a vLLM per-layer cache view ``[B, H, N, C]`` (``[B, N, C]`` for an MLA
    latent) with element ``strides`` and ``itemsize`` bytes per element. ``head_size``
    is the K width of a fused cell (0: half the cell); a cell whose V width differs is
    taken whole."""
    layout = layout_name(layout)
    content = Content(content)
    if len(shape) == 3:
        shape = (shape[0], 1, shape[1], shape[2])
        strides = (strides[0], shape[2] * strides[1], strides[1], strides[2])
    if len(shape) != 4 or len(strides) != 4:
        raise UnsupportedPage(f"a KV cache view of shape {tuple(shape)} is not [B, H, N, C]")
    _blocks, heads, tokens, cell = (int(s) for s in shape)
    s_head, s_token, s_cell = (int(s) * itemsize for s in strides[1:])
    if s_cell != itemsize:
        raise UnsupportedPage(f"content of a {layout} page is not contiguous (stride "
                              f"{strides[3]} elements)")
    cell_bytes = cell * itemsize
    if content is Content.LATENT:
        if heads != 1:
            raise UnsupportedPage(f"an MLA latent page has {heads} heads, not one")
        return PageGeometry(layout, content, 1, 1, tokens, cell_bytes, s_head, cell_bytes,
                            s_token)
    if content is Content.SPLIT:
        # The CPU kernels re-view one head's N x C bytes as [2][N][C / 2].
        if cell % 2 or s_token != cell_bytes:
            raise UnsupportedPage(f"a split K/V page needs each head's tokens contiguous "
                                  f"({layout} is not head-major inside a block)")
        half = cell_bytes // 2
        return PageGeometry(layout, content, heads, 2, tokens, half, s_head, tokens * half,
                            half)
    k_bytes = (head_size or cell // 2) * itemsize
    if 2 * k_bytes == cell_bytes:
        return PageGeometry(layout, content, heads, 2, tokens, k_bytes, s_head, k_bytes,
                            s_token)
    return PageGeometry(layout, content, heads, 1, tokens, cell_bytes, s_head, cell_bytes,
                        s_token)


def _box(g: PageGeometry, heads: Span | None, tokens: Span | None
         ) -> dict[str, tuple[int, int, int]]:
    """(first, count, stride) of each axis of the part of ``g`` a request owns."""
    h0, hc = heads if heads is not None else (0, g.heads)
    t0, tc = tokens if tokens is not None else (0, g.tokens)
    if not (h0 >= 0 and hc >= 0 and h0 + hc <= g.heads):
        raise UnmappableLayouts(f"heads {h0}..{h0 + hc} outside {g.heads}")
    if not (t0 >= 0 and tc >= 0 and t0 + tc <= g.tokens):
        raise UnmappableLayouts(f"tokens {t0}..{t0 + tc} outside {g.tokens}")
    axes = g.axes()
    return {"H": (h0, hc, axes["H"][1]), "P": (0, g.parts, axes["P"][1]),
            "N": (t0, tc, axes["N"][1]), "X": (0, g.part_bytes, 1)}


def runs(g: PageGeometry, heads: Span | None = None, tokens: Span | None = None,
         order: Sequence[str] | None = None) -> Runs:
    """The contiguous byte runs holding ``heads`` x ``tokens`` of a page (all of them when
    not given), enumerated in logical ``order`` (outermost axis first; default: the page's
    physical order, which gives the fewest runs)."""
    box = _box(g, heads, tokens)
    order = tuple(order or g.physical_order)
    if sorted(order) != ["H", "N", "P", "X"] or order[-1] != "X":
        raise ValueError(f"order {order} must name H, P, N once each and end in X")
    if any(box[a][1] == 0 for a in order):
        return ()
    run = box["X"][1]
    outer = list(order[:-1])
    while outer:
        _first, count, stride = box[outer[-1]]
        if count != 1 and stride != run:
            break
        run *= count
        outer.pop()
    base = sum(box[a][0] * box[a][2] for a in "HPN")
    out = []
    for idx in itertools.product(*(range(box[a][1]) for a in outer)):
        out.append((base + sum(i * box[a][2] for i, a in zip(idx, outer, strict=True)), run))
    return tuple(out)


def _refine(a: Runs, b: Runs) -> tuple[Runs, Runs]:
    """Split two run lists over the same bytes in the same order into equal pieces."""
    out_a, out_b = [], []
    i = j = 0
    ia = ib = 0  # bytes of a[i] / b[j] already taken
    while i < len(a) and j < len(b):
        n = min(a[i][1] - ia, b[j][1] - ib)
        out_a.append((a[i][0] + ia, n))
        out_b.append((b[j][0] + ib, n))
        ia += n
        ib += n
        if ia == a[i][1]:
            i, ia = i + 1, 0
        if ib == b[j][1]:
            j, ib = j + 1, 0
    return tuple(out_a), tuple(out_b)


def check_pairable(local: PageGeometry, remote: PageGeometry) -> None:
    """Raise :class:`UnmappableLayouts` unless one head of ``local`` holds the same
    logical bytes as one head of ``remote`` (layouts may differ)."""
    problems = []
    if (local.content is Content.LATENT) != (remote.content is Content.LATENT):
        problems.append("an MLA latent cannot pair with per-head K/V")
    elif local.content is not remote.content and (local.parts, remote.parts) != (2, 2):
        problems.append("K/V content split differently with unequal K and V widths")
    if local.tokens != remote.tokens:
        problems.append(f"block size {local.tokens} != {remote.tokens}")
    if local.parts * local.part_bytes != remote.parts * remote.part_bytes:
        problems.append(f"bytes per head and token {local.parts * local.part_bytes} != "
                        f"{remote.parts * remote.part_bytes}")
    if problems:
        raise UnmappableLayouts(f"cannot pair {local.describe()} with {remote.describe()}: "
                                + ", ".join(problems))


def pair(local: PageGeometry, remote: PageGeometry, local_heads: Span | None = None,
         remote_heads: Span | None = None, tokens: Span | None = None,
         max_runs: int = MAX_RUNS_PER_BLOCK) -> tuple[Runs, Runs]:
    """Byte runs of a local page and of a remote page that carry the same logical bytes,
    piece for piece: heads ``local_heads`` of the local page into ``remote_heads`` of the
    remote one (whole pages when not given). Raises :class:`UnmappableLayouts` when the
    pages do not hold the same bytes or need more than ``max_runs`` pieces per block."""
    check_pairable(local, remote)
    lh = local_heads or (0, local.heads)
    rh = remote_heads or (0, remote.heads)
    if lh[1] != rh[1]:
        raise UnmappableLayouts(f"{lh[1]} local heads for {rh[1]} remote heads")
    if local.parts != remote.parts:
        # One side's cell taken whole can only pair token by token with [K | V] cells.
        a = runs(local, lh, tokens, ("H", "N", "P", "X"))
        b = runs(remote, rh, tokens, ("H", "N", "P", "X"))
    else:
        order = local.physical_order
        a, b = runs(local, lh, tokens, order), runs(remote, rh, tokens, order)
    la, lb = _refine(a, b)
    if sum(n for _o, n in la) != sum(n for _o, n in a) or len(la) != len(lb):
        raise UnmappableLayouts(f"cannot pair {local.describe()} with {remote.describe()}")
    if len(la) > max_runs:
        raise UnmappableLayouts(
            f"pairing {local.describe()} with {remote.describe()} takes {len(la)} "
            f"descriptors per block and layer (at most {max_runs}); run both engines with "
            "the same layout (VLLM_KV_CACHE_LAYOUT)")
    return la, lb


# The order every checksum reads a page in, whatever its layout.
CANONICAL = ("H", "P", "N", "X")


@lru_cache(maxsize=1024)
def byte_index(g: PageGeometry, heads: Span | None = None, tokens: Span | None = None
               ) -> np.ndarray:
    """Offsets (from the page origin) of every byte of ``heads`` x ``tokens`` in the
    canonical order (head, K/V, token, byte): two pages of different layouts holding the
    same KV give the same bytes in this order. A fused cell taken whole (K and V widths
    differ) is read as one part."""
    pieces = runs(g, heads, tokens, CANONICAL)
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    starts = np.fromiter((o for o, _n in pieces), dtype=np.int64, count=len(pieces))
    length = pieces[0][1]
    return (starts[:, None] + np.arange(length, dtype=np.int64)[None, :]).reshape(-1)


def block_origins(base: int, block_stride: int, blocks: Sequence[int]) -> np.ndarray:
    """Page origins of ``blocks`` of a layer whose block 0 starts at ``base``."""
    return base + np.asarray(blocks, dtype=np.int64) * block_stride
