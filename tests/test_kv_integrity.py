"""KV checksums and push-target checks: the pure logic under the end-to-end integrity mode."""

from __future__ import annotations

import pytest
import torch

from kvpush.common.wire import KVChecksums, KVLayout, PushDone, decode, encode
from kvpush.connector import integrity, page_layout
from kvpush.connector.metadata import SendTarget
from kvpush.connector.targets import TargetRejected, check_target

BLOCK, HEADS, CH, BLOCKS, LAYERS = 16, 2, 8, 12, 3


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BLOCK, CH, generator=g).to(torch.bfloat16)
            for _ in range(LAYERS)]


def _push(src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: list[int],
          dst_ids: list[int]) -> None:
    """What a NIXL WRITE of whole blocks does, every layer."""
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(src_ids, dst_ids, strict=True):
            d[b].copy_(s[a])


def _geometry(layer: torch.Tensor, kind: str = integrity.HEADS) -> page_layout.PageGeometry:
    """The page of vLLM's CPU attention (LBHNC, K and V split per head), or an MLA
    latent's."""
    content = "latent" if kind == integrity.LATENT else "split"
    return page_layout.geometry("LBHNC", content, tuple(layer.shape), layer.stride(),
                                layer.element_size())


def _sums(layers: list[torch.Tensor], ids: list[int], skip: int, n_tokens: int,
          kind: str = integrity.HEADS) -> KVChecksums:
    """Checksums of a one-group model's layers over ``ids``."""
    return integrity.checksums(layers, [0] * len(layers), [ids], [skip], n_tokens,
                               _geometry(layers[0], kind))


def _k(page: torch.Tensor, head: int, token: int) -> torch.Tensor:
    """K of ``token`` in one CPU attention page, as laid out in memory (per head: K of
    every slot, then V of every slot)."""
    return page.reshape(HEADS, 2, BLOCK, -1)[head, 0, token]


def _v(page: torch.Tensor, head: int, token: int) -> torch.Tensor:
    """V of ``token`` in one CPU attention page, as laid out in memory."""
    return page.reshape(HEADS, 2, BLOCK, -1)[head, 1, token]


def test_checksums_match_after_a_faithful_copy_and_survive_the_wire() -> None:
    src, dst = _caches(1), _caches(2)
    src_ids, dst_ids, n_tokens = [3, 7, 1], [10, 0, 5], 2 * BLOCK + 5
    _push(src, dst, src_ids, dst_ids)
    want = _sums(src, src_ids, 0, n_tokens)
    got = _sums(dst, dst_ids, 0, n_tokens)
    assert integrity.first_mismatch(want, got) is None
    # The CRCs travel inside PushDone.
    msg = decode(encode(PushDone(request_id="r", checksums=want)), PushDone)
    assert msg.checksums == want and len(want.crcs) == LAYERS and len(want.crcs[0]) == 3


def test_a_wrong_block_is_found_with_its_layer_and_index() -> None:
    src, dst = _caches(1), _caches(2)
    src_ids, dst_ids, n_tokens = [3, 7, 1], [10, 0, 5], 3 * BLOCK
    _push(src, dst, src_ids, dst_ids)
    dst[1][0][1, 4, 2] += 1  # one element of layer 1, request block 1 (decode block 0)
    want = _sums(src, src_ids, 0, n_tokens)
    got = _sums(dst, dst_ids, 0, n_tokens)
    assert integrity.first_mismatch(want, got) == (1, 1)


def test_blocks_written_elsewhere_are_caught_in_the_first_layer() -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [3, 7], [10, 11])  # the target said 10, 11; decode reserved 4, 5
    want = _sums(src, [3, 7], 0, 2 * BLOCK)
    got = _sums(dst, [4, 5], 0, 2 * BLOCK)
    assert integrity.first_mismatch(want, got) == (0, 0)


@pytest.mark.parametrize("n_last", [1, 5, BLOCK // 2, BLOCK // 2 + 1, BLOCK - 1])
def test_only_the_prompt_slots_of_a_partial_last_block_count(n_last: int) -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [3, 7], [10, 0])
    n_tokens = BLOCK + n_last
    # Decode writes its first generated token's K and V into the slot after the prompt.
    for layer in dst:
        for head in range(HEADS):
            _k(layer[0], head, n_last).fill_(9)
            _v(layer[0], head, n_last).fill_(9)
    want = _sums(src, [3, 7], 0, n_tokens)
    assert integrity.first_mismatch(want, _sums(dst, [10, 0], 0, n_tokens)) is None
    # One byte of V of the last prompt token counts, in the last head too (a last block
    # holding half a block of prompt or less had none of its V checked before).
    _v(dst[0][0], HEADS - 1, n_last - 1).view(torch.uint8)[0] ^= 1
    assert integrity.first_mismatch(want, _sums(dst, [10, 0], 0, n_tokens)) == (0, 1)
    _push(src, dst, [7], [0])
    _k(dst[2][0], 0, 0).view(torch.uint8)[1] ^= 0x10  # and K of its first token
    assert integrity.first_mismatch(want, _sums(dst, [10, 0], 0, n_tokens)) == (2, 1)


def test_an_mla_latent_page_counts_exactly_its_prompt_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(BLOCKS, 1, BLOCK, 576, generator=g).to(torch.bfloat16)]
    dst = [torch.randn(BLOCKS, 1, BLOCK, 576, generator=g).to(torch.bfloat16)]
    _push(src, dst, [2, 4], [6, 8])
    n_tokens = BLOCK + 3
    dst[0][8][0, 3:] = 7  # past the prompt: not compared (pages are [1, tokens, 576])
    want = _sums(src, [2, 4], 0, n_tokens, integrity.LATENT)
    assert integrity.first_mismatch(want, _sums(dst, [6, 8], 0, n_tokens,
                                                 integrity.LATENT)) is None
    dst[0][8][0, 2, 574:].view(torch.uint8)[-1] ^= 1  # the last latent byte of the prompt
    assert integrity.first_mismatch(want, _sums(dst, [6, 8], 0, n_tokens,
                                                integrity.LATENT)) == (0, 1)


def test_hybrid_groups_are_checked_over_their_own_blocks_from_their_own_skip() -> None:
    """Layers 0 and 2 are a sliding group that pushes only its last block; layer 1 is
    full attention. The groups share one tensor per layer pair, with distinct ids."""
    src, dst = _caches(1), _caches(2)
    groups = [1, 0, 1]
    src_ids, dst_ids, skips = [[1, 2], [0, 3]], [[4, 5], [0, 6]], [0, 1]
    for layer, grp in zip(range(LAYERS), groups, strict=True):
        first = skips[grp]
        _push([src[layer]], [dst[layer]], src_ids[grp][first:], dst_ids[grp][first:])
    n_tokens = BLOCK + 4
    geom = _geometry(src[0])
    want = integrity.checksums(src, groups, src_ids, skips, n_tokens, geom)
    got = integrity.checksums(dst, groups, dst_ids, skips, n_tokens, geom)
    assert integrity.first_mismatch(want, got) is None
    assert want.first_blocks == [1, 0, 1] and [len(r) for r in want.crcs] == [1, 2, 1]
    _v(dst[2][6], 0, 3).view(torch.uint8)[0] ^= 1
    got = integrity.checksums(dst, groups, dst_ids, skips, n_tokens, geom)
    assert integrity.first_mismatch(want, got) == (2, 1)


def test_blocks_decode_already_held_are_skipped() -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [7], [0])  # block 0 of the request was a prefix hit on decode
    want = _sums(src, [3, 7], 1, 2 * BLOCK)
    got = _sums(dst, [9, 0], 1, 2 * BLOCK)
    assert integrity.first_mismatch(want, got) is None and want.first_blocks == [1] * LAYERS


def test_a_hostile_checksum_shape_is_a_mismatch_not_a_crash() -> None:
    src = _caches(1)
    want = _sums(src, [3, 7], 0, 2 * BLOCK)
    got = _sums(src, [3], 0, 2 * BLOCK)
    assert integrity.first_mismatch(want, got) == (0, 1)
    short = _sums(src[:1], [3, 7], 0, 2 * BLOCK)
    assert integrity.first_mismatch(want, short) is not None
    other_skip = _sums(src, [3, 7], 1, 2 * BLOCK)
    assert integrity.first_mismatch(want, other_skip) is not None


def test_sampling_is_a_pure_function_of_the_request_id() -> None:
    ids = [f"cmpl-{i}" for i in range(4000)]
    assert not any(integrity.sampled(r, 0.0) for r in ids)
    assert all(integrity.sampled(r, 1.0) for r in ids)
    share = sum(integrity.sampled(r, 0.25) for r in ids) / len(ids)
    assert 0.2 < share < 0.3
    assert [integrity.sampled(r, 0.25) for r in ids] == [integrity.sampled(r, 0.25)
                                                          for r in ids]


def _layout(num_blocks: int = 100, groups: list[int] | None = None) -> KVLayout:
    return KVLayout(layer_names=[f"l{i}" for i in range(len(groups or [0]))],
                    base_addrs=[0] * len(groups or [0]), region_len=0, block_len=1,
                    num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16", kv_splits=1,
                    tp_rank=0, tp_size=1, memory="DRAM", layer_groups=groups or [])


def _target(block_ids: list[int] | list[list[int]], num_tokens: int,
            skip: int | list[int] = 0) -> SendTarget:
    ids = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids]
    skips = skip if isinstance(skip, list) else [skip] * len(ids)
    return SendTarget("r", "d0", 7, ids, skips, num_tokens, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("target", "why"), [
    (_target([1, 2, 100], 3 * BLOCK), "outside"),
    (_target([1, -2, 3], 3 * BLOCK), "outside"),
    (_target([1, 2], 3 * BLOCK), "block ids in group 0"),
    (_target([1, 2, 3, 4], 3 * BLOCK), "block ids in group 0"),
    (_target([1, 1, 3], 3 * BLOCK), "repeated"),
    (_target([1, 2, 3], 3 * BLOCK, skip=4), "skip_blocks"),
    (_target([1, 2, 3], 3 * BLOCK, skip=-1), "skip_blocks"),
    (_target([0, 2, 3], 3 * BLOCK), "null block"),
    (_target([[1, 2], [3, 4]], 2 * BLOCK), "for 1 KV cache groups"),
    (SendTarget("r", "d0", 7, [[1, 2]], [], 2 * BLOCK, 0), "0 skips"),
])
def test_targets_that_would_write_outside_the_reservation_are_refused(
        target: SendTarget, why: str) -> None:
    with pytest.raises(TargetRejected, match=why):
        check_target(target, _layout(), BLOCK)


def test_a_fitting_target_passes() -> None:
    check_target(_target([99, 3, 5], 2 * BLOCK + 1, skip=1), _layout(), BLOCK)
    with pytest.raises(TargetRejected, match="block size"):
        check_target(_target([1], BLOCK), _layout(), BLOCK * 2)


def test_a_hybrid_target_skips_null_blocks_and_shares_no_block_across_groups() -> None:
    hybrid = _layout(groups=[1, 0, 1, 0])
    # The sliding group (1) lists vLLM's null block for the blocks it does not push.
    check_target(_target([[4, 5, 6], [0, 0, 7]], 3 * BLOCK, skip=[0, 2]), hybrid, BLOCK)
    with pytest.raises(TargetRejected, match="null block"):
        check_target(_target([[4, 5, 6], [0, 0, 7]], 3 * BLOCK, skip=[0, 1]), hybrid, BLOCK)
    with pytest.raises(TargetRejected, match="repeated"):
        check_target(_target([[4, 5, 6], [0, 0, 6]], 3 * BLOCK, skip=[0, 2]), hybrid, BLOCK)
    with pytest.raises(TargetRejected, match="group 1"):
        check_target(_target([[4, 5, 6], [7]], 3 * BLOCK, skip=[0, 0]), hybrid, BLOCK)
