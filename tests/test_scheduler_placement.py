"""Placement policies as pure functions (no Redis)."""

from __future__ import annotations

import pytest

from kvpush.common.engine_view import EngineView, view_from_hash
from kvpush.services.scheduler.placement import (
    Policy,
    UnknownPolicy,
    blocks_needed,
    can_ever_fit,
    decode_candidates,
    pick_prefill,
)
from tests.sched_util import engine_status


def dec(eid: str, total: int, reserved: int = 0, free: int | None = None,
        role: str = "decode") -> EngineView:
    return EngineView(eid, role, f"http://{eid}", total_blocks=total,
                      free_blocks=total if free is None else free, reserved_blocks=reserved)


def test_blocks_needed_rounds_up() -> None:
    assert blocks_needed(16, 0, 16) == 1
    assert blocks_needed(16, 1, 16) == 2
    assert blocks_needed(0, 0, 16) == 1


def test_least_loaded_prefers_most_headroom_share() -> None:
    engines = [dec("a", 100, reserved=50), dec("b", 10, reserved=1), dec("c", 100, reserved=90)]
    order = [e.engine_id for e, _ in decode_candidates(engines, 16, 0, Policy.LEAST_LOADED)]
    assert order == ["b", "a", "c"]


def test_best_fit_prefers_tightest_hole() -> None:
    engines = [dec("a", 100, reserved=50), dec("b", 10, reserved=7), dec("c", 100, reserved=98)]
    # Need 3 blocks: c has 2 (no fit), b has 3 (exact), a has 50.
    order = [e.engine_id for e, _ in decode_candidates(engines, 40, 0, Policy.BEST_FIT)]
    assert order == ["b", "a"]


def test_free_blocks_and_roles_limit_candidates() -> None:
    engines = [dec("a", 100, free=1), dec("p", 100, role="prefill"), dec("b", 100, role="both")]
    assert [e.engine_id for e, _ in decode_candidates(engines, 40, 0, Policy.LEAST_LOADED)] \
        == ["b"]
    assert can_ever_fit(engines, 1000, 0)
    assert not can_ever_fit(engines, 1700, 0)


def test_prefill_fewest_queued_tokens_then_pending() -> None:
    p1 = EngineView("p1", "prefill", "u", queued_prompt_tokens=100)
    p2 = EngineView("p2", "prefill", "u", queued_prompt_tokens=50)
    assert pick_prefill([p1, p2]).engine_id == "p2"
    p2.pending_prompt_tokens = 60
    assert pick_prefill([p1, p2]).engine_id == "p1"
    both = EngineView("b", "both", "u")
    assert pick_prefill([both], exclude={"b"}) is None
    assert pick_prefill([dec("d", 1)]) is None


def test_view_from_hash_reads_plain_fields_and_message() -> None:
    from kvpush.common.wire import encode

    st = engine_status("d1", total=7, free=5, queued=42)
    fields = {b"role": b"decode", b"url": b"http://x", b"block_size": b"32",
              b"total_blocks": b"7", b"free_blocks": b"5", b"m": encode(st)}
    v = view_from_hash("d1", fields)
    assert (v.block_size, v.total_blocks, v.free_blocks, v.queued_prompt_tokens) == (32, 7, 5, 42)
    assert view_from_hash("d1", {}) is None
    junk = {b"role": b"decode", b"url": b"http://x", b"m": b"junk"}
    assert view_from_hash("d1", junk).queued_prompt_tokens == 0
    measured = {**fields, b"prefill_tok_s": b"1800", b"history_wait_ms": b"95"}
    v = view_from_hash("d1", measured)
    assert (v.prefill_tok_s, v.history_wait_ms) == (1800, 95)
    assert (view_from_hash("d1", fields).prefill_tok_s,
            view_from_hash("d1", fields).history_wait_ms) == (0, 0)  # an older engine
    # The cost model's inputs are bounded like every other field: garbage is no engine.
    for bad in (b"-5", b"fast", b"1" * 30):
        assert view_from_hash("d1", {**fields, b"prefill_tok_s": bad}) is None
        assert view_from_hash("d1", {**fields, b"history_wait_ms": bad}) is None


def test_unknown_policy() -> None:
    with pytest.raises(UnknownPolicy):
        Policy.parse("random")
