"""The scheduler's ordered engine index picks exactly what the linear placement scans pick."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.common.engine_view import EngineView
from kvpush.services.scheduler.placement import Policy, best_decode, pick_prefill
from kvpush.services.scheduler.placement_index import EngineIndex

engine = st.builds(
    lambda i, role, total, reserved, free_share, bs, running, queued: EngineView(
        f"e{i}", role, f"http://e{i}", block_size=bs, total_blocks=total,
        free_blocks=int(total * free_share), reserved_blocks=min(reserved, total),
        running=running, queued_prompt_tokens=queued),
    st.integers(0, 40), st.sampled_from(["decode", "prefill", "both"]),
    st.integers(0, 64), st.integers(0, 64), st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from([16, 32]), st.integers(0, 3), st.integers(0, 2000))


def _fleet(views: list[EngineView]) -> list[EngineView]:
    seen: dict[str, EngineView] = {}
    for v in views:
        seen.setdefault(v.engine_id, v)
    return list(seen.values())


@settings(max_examples=300, deadline=None)
@given(st.lists(engine, max_size=24), st.sampled_from(list(Policy)),
       st.lists(st.tuples(st.integers(0, 900), st.integers(0, 300)), min_size=1, max_size=12),
       st.integers(0, 2**32))
def test_index_agrees_with_the_scans_through_a_run_of_placements(
        views: list[EngineView], policy: Policy, requests: list[tuple[int, int]],
        seed: int) -> None:
    fleet = _fleet(views)
    index = EngineIndex(policy)
    index.rebuild(fleet, fleet)
    rng = random.Random(seed)
    for prompt, out in requests:
        skip = frozenset(rng.sample([e.engine_id for e in fleet], k=min(len(fleet), 2))
                         if rng.random() < 0.3 else [])
        want = best_decode(fleet, prompt, out, policy, skip)
        got = index.best_decode(prompt, out, skip)
        assert (got and (got[0].engine_id, got[1])) == (want and (want[0].engine_id, want[1]))
        want_p = pick_prefill(fleet, exclude=skip)
        got_p = index.pick_prefill(skip)
        assert (got_p and got_p.engine_id) == (want_p and want_p.engine_id)
        # What the scheduler does with a pick: book it locally, then re-sort.
        if got is not None:
            got[0].reserved_blocks += got[1]
            index.update(got[0])
        if got_p is not None:
            got_p.pending_prompt_tokens += prompt
            index.update(got_p)


def test_a_view_from_before_the_rebuild_does_not_move_the_new_one() -> None:
    old = EngineView("d", "decode", "http://d", total_blocks=10, free_blocks=10)
    new = EngineView("d", "decode", "http://d", total_blocks=10, free_blocks=10)
    index = EngineIndex(Policy.LEAST_LOADED)
    index.rebuild([old], [])
    index.rebuild([new], [])
    old.reserved_blocks = 10
    index.update(old)  # a plan made before the refresh: not indexed any more
    got = index.best_decode(16, 0)
    assert got is not None and got[0] is new
    assert index.pick_prefill() is None
