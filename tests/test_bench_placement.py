"""Placement at scale: a decision costs the same Redis round trips with 2 engines as with 64.

The real scheduler runs against registered engine statuses (no engines) in real Redis, through
``loadtest.bench_placement`` on a client that counts every socket write. No timings are
asserted: only counts, which do not depend on the machine.
"""

from __future__ import annotations

import pytest

from kvpush.common.runtime import run
from kvpush.loadtest.bench_placement import PlacementRow, measure, render
from kvpush.services.cli.main import main as cli_main
from kvpush.services.local.local_redis import LocalRedis

# Background work (refresh, reclaim, sweep) off during the window: only decisions happen in
# it, so every count is exact. The one refresh measure() runs at the end is counted apart.
QUIET = {"scheduler_refresh_s": 3600.0, "scheduler_sweep_s": 3600.0,
         "scheduler_claim_idle_ms": 10_000_000}


@pytest.fixture(scope="module")
def rows(redis_server: LocalRedis) -> dict[int, PlacementRow]:
    return {n: run(measure(redis_server.url, n, 40, QUIET)) for n in (2, 64)}


def test_round_trips_per_decision_do_not_grow_with_the_fleet(
        rows: dict[int, PlacementRow]) -> None:
    small, big = rows[2], rows[64]
    assert small.decisions == big.decisions == 40
    # One read that brings the request (and carries the previous answer), one reserve
    # pipeline: two round trips and the same commands per decision at any fleet size.
    assert small.rt_per_decision == big.rt_per_decision == 2.0
    assert small.cmds_per_decision == big.cmds_per_decision
    assert small.rt_per_decision_all_in == big.rt_per_decision_all_in == 2.0


def test_a_refresh_reads_the_whole_fleet_in_the_same_round_trips(
        rows: dict[int, PlacementRow]) -> None:
    small, big = rows[2], rows[64]
    assert small.refreshes == big.refreshes == 1
    # The engine index, then one pipeline for every status and reservation level.
    assert small.refresh_rt == big.refresh_rt == 2
    # More engines are more commands in that one pipeline, not more round trips.
    assert big.refresh_cmds - small.refresh_cmds == 2 * (128 - 4)


def test_kvpush_bench_placement_prints_a_row_per_fleet_size(
        redis_server: LocalRedis, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "placement", "--engines", "2,4", "--decisions", "5",
                     "--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert [ln[0] for ln in lines] == ["2", "4"]
    assert all(ln[1] == "5" for ln in lines)
    assert render([]).startswith("engines:")
