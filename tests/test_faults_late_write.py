"""A late WRITE never lands in blocks decode gave to another request (real engines, NIXL,
Redis; the rows of ``kvpush reliability``'s late-write section, ``loadtest/faults/late_write.py``).

Prefill A's push of a request R1 outlives decode's deadline: A stopped mid-push (SIGSTOP),
A's data link cut and healed (netns), or decode's clock ahead of A's. A victim pushed from
prefill B needs R1's blocks. With the quarantine, decode holds them until A says none of its
WRITEs can still land, so the victim waits, then answers exactly as it did alone, its blocks
unchanged when it ends. ``KVPUSH_MEASURE_UNGUARDED=1`` adds the rows with the quarantine at
10 ms (as good as off), which print what the late WRITEs did to the victim.

Each stack boots its own engines: A loads the fault connector and decode a 64-block pool
without a prefix cache, which no shared stack can have; the TP2 stack has A at TP 2.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpush.loadtest.faults.late_write import LateWriteStack, run_late_write_row

pytestmark = pytest.mark.slow

UNGUARDED = bool(os.environ.get("KVPUSH_MEASURE_UNGUARDED"))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2-1"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LateWriteStack]:
    """Prefill A at TP 1, then at TP 2 (one of its ranks stops, or both lose the link, and
    decode waits for both fences); one stack at a time, as they share the namespaces."""
    st = LateWriteStack(tmp_path_factory.mktemp(f"late-write-{request.param}"),
                        a_tp=request.param)
    with st:
        yield st
    assert not st.leaked_processes()


@pytest.mark.parametrize("kind", ["sigstop", "link_cut", "clock_skew"])
def test_late_writes_land_only_in_quarantined_blocks(stack: LateWriteStack, kind: str
                                                     ) -> None:
    res = run_late_write_row(stack, kind, seed=len(kind) + 10 * stack.a_tp)
    print(f"{res.stack} {res.name}: {'; '.join(res.notes)}")
    if res.skipped:
        pytest.skip(res.skipped)
    assert res.violations() == [], res.to_json()
    assert res.victim_equal and res.rechecked >= 1 and res.changed == 0
    # A's WRITEs ended after decode gave R1 up (by decode's clock), as a timer would not know.
    assert res.after_give_up_s is not None and res.after_give_up_s > 0, res.after_give_up_s
    if UNGUARDED:
        off = run_late_write_row(stack, kind, guarded=False, seed=len(kind) + 50)
        print(f"{off.stack} {off.name} (measured): victim "
              f"{'equal' if off.victim_equal else 'DIFFERENT'}; {'; '.join(off.notes)}")
