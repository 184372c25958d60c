"""KV checksums and push-target checks: the pure logic under the end-to-end integrity mode."""

from __future__ import annotations

import pytest
import torch

from kvpush.common.wire import KVLayout, PushDone, decode, encode
from kvpush.connector import integrity
from kvpush.connector.metadata import SendTarget
from kvpush.connector.sender import TargetRejected, check_target

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


def test_checksums_match_after_a_faithful_copy_and_survive_the_wire() -> None:
    src, dst = _caches(1), _caches(2)
    src_ids, dst_ids, n_tokens = [3, 7, 1], [10, 0, 5], 2 * BLOCK + 5
    _push(src, dst, src_ids, dst_ids)
    want = integrity.checksums(src, src_ids, 0, n_tokens, BLOCK)
    got = integrity.checksums(dst, dst_ids, 0, n_tokens, BLOCK)
    assert integrity.first_mismatch(want, got) is None
    # The CRCs travel inside PushDone.
    msg = decode(encode(PushDone(request_id="r", checksums=want)), PushDone)
    assert msg.checksums == want and len(want.crcs) == LAYERS and len(want.crcs[0]) == 3


def test_a_wrong_block_is_found_with_its_layer_and_index() -> None:
    src, dst = _caches(1), _caches(2)
    src_ids, dst_ids, n_tokens = [3, 7, 1], [10, 0, 5], 3 * BLOCK
    _push(src, dst, src_ids, dst_ids)
    dst[1][0][1, 4, 2] += 1  # one element of layer 1, request block 1 (decode block 0)
    want = integrity.checksums(src, src_ids, 0, n_tokens, BLOCK)
    got = integrity.checksums(dst, dst_ids, 0, n_tokens, BLOCK)
    assert integrity.first_mismatch(want, got) == (1, 1)


def test_blocks_written_elsewhere_are_caught_in_the_first_layer() -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [3, 7], [10, 11])  # the target said 10, 11; decode reserved 4, 5
    want = integrity.checksums(src, [3, 7], 0, 2 * BLOCK, BLOCK)
    got = integrity.checksums(dst, [4, 5], 0, 2 * BLOCK, BLOCK)
    assert integrity.first_mismatch(want, got) == (0, 0)


def test_only_the_prompt_slots_of_a_partial_last_block_count() -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [3, 7], [10, 0])
    n_tokens = BLOCK + 5
    # Decode writes its first generated token into the slot after the prompt.
    for layer in dst:
        layer[0][:, 5, :] = 9
    want = integrity.checksums(src, [3, 7], 0, n_tokens, BLOCK)
    got = integrity.checksums(dst, [10, 0], 0, n_tokens, BLOCK)
    assert integrity.first_mismatch(want, got) is None
    dst[0][0][0, 4, 0] += 1  # the last prompt slot does count
    got = integrity.checksums(dst, [10, 0], 0, n_tokens, BLOCK)
    assert integrity.first_mismatch(want, got) == (0, 1)


def test_blocks_decode_already_held_are_skipped() -> None:
    src, dst = _caches(1), _caches(2)
    _push(src, dst, [7], [0])  # block 0 of the request was a prefix hit on decode
    want = integrity.checksums(src, [3, 7], 1, 2 * BLOCK, BLOCK)
    got = integrity.checksums(dst, [9, 0], 1, 2 * BLOCK, BLOCK)
    assert integrity.first_mismatch(want, got) is None and want.first_block == 1


def test_a_hostile_checksum_shape_is_a_mismatch_not_a_crash() -> None:
    src = _caches(1)
    want = integrity.checksums(src, [3, 7], 0, 2 * BLOCK, BLOCK)
    got = integrity.checksums(src, [3], 0, 2 * BLOCK, BLOCK)
    assert integrity.first_mismatch(want, got) == (0, 1)
    short = integrity.checksums(src[:1], [3, 7], 0, 2 * BLOCK, BLOCK)
    assert integrity.first_mismatch(want, short) is not None


def test_sampling_is_a_pure_function_of_the_request_id() -> None:
    ids = [f"cmpl-{i}" for i in range(4000)]
    assert not any(integrity.sampled(r, 0.0) for r in ids)
    assert all(integrity.sampled(r, 1.0) for r in ids)
    share = sum(integrity.sampled(r, 0.25) for r in ids) / len(ids)
    assert 0.2 < share < 0.3
    assert [integrity.sampled(r, 0.25) for r in ids] == [integrity.sampled(r, 0.25)
                                                          for r in ids]


def _layout(num_blocks: int = 100) -> KVLayout:
    return KVLayout(layer_names=["l0"], base_addrs=[0], region_len=0, block_len=1,
                    num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16", kv_splits=1,
                    tp_rank=0, tp_size=1, memory="DRAM")


def _target(block_ids: list[int], num_tokens: int, skip: int = 0) -> SendTarget:
    return SendTarget("r", "d0", 7, block_ids, skip, num_tokens, 0)


@pytest.mark.parametrize(("target", "why"), [
    (_target([1, 2, 100], 3 * BLOCK), "outside"),
    (_target([1, -2, 3], 3 * BLOCK), "outside"),
    (_target([1, 2], 3 * BLOCK), "block ids for"),
    (_target([1, 2, 3, 4], 3 * BLOCK), "block ids for"),
    (_target([1, 1, 3], 3 * BLOCK), "repeated"),
    (_target([1, 2, 3], 3 * BLOCK, skip=4), "skip_blocks"),
    (_target([1, 2, 3], 3 * BLOCK, skip=-1), "skip_blocks"),
])
def test_targets_that_would_write_outside_the_reservation_are_refused(
        target: SendTarget, why: str) -> None:
    with pytest.raises(TargetRejected, match=why):
        check_target(target, _layout(), BLOCK)


def test_a_fitting_target_passes() -> None:
    check_target(_target([99, 0, 5], 2 * BLOCK + 1, skip=1), _layout(), BLOCK)
    with pytest.raises(TargetRejected, match="block size"):
        check_target(_target([1], BLOCK), _layout(), BLOCK * 2)
