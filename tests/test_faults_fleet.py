"""Faults with a surviving peer: a real 2-prefill + 2-decode push stack under a small load.

For every fault: nothing is lost, no request fails before its first token (it is placed again
on the surviving peer), every request is accounted for, nothing stays held (reservations,
KV blocks, gateway flights, pending stream entries), and requests succeed again. Streams cut
after their first token by the fault itself are counted, not failed. ``kvpush reliability``
reports the same rows. The row accounting and the report are checked without engines.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest

from kvpush.loadtest import reliability
from kvpush.loadtest.faults.fleet import (
    FLEET_SCENARIOS,
    FleetResult,
    FleetScenario,
    FleetStack,
    fleet_config,
    run_fleet_scenario,
)
from kvpush.loadtest.faults.outcomes import (
    FAILED_CLEAN,
    LOST,
    OK,
    FaultConfig,
    Outcome,
    ScenarioResult,
)


def _out(idx: int, kind: str, tokens: int = 0, stream: bool = True) -> Outcome:
    return Outcome(idx, kind, stream, 200 if kind == OK else 502, "", 0.0, 1.0, tokens)


def test_a_fleet_row_fails_on_a_failure_before_the_first_token_only() -> None:
    res = FleetResult("x", "a fault")
    res.add([_out(0, OK, 3), _out(1, FAILED_CLEAN, tokens=2), _out(2, OK, 1, stream=False)])
    res.recovery_s = 0.5
    assert (res.sent, res.ok, res.failed_clean) == (3, 2, 1)
    assert (res.failed_before_token, res.failed_after_token) == (0, 1)
    assert res.violations() == []  # a stream cut mid-answer by the fault itself
    res.add([_out(3, FAILED_CLEAN, stream=False), _out(4, LOST)])
    assert (res.failed_before_token, res.failed_after_token) == (2, 1)
    assert any("before their first token" in v for v in res.violations())


def test_reliability_report_has_a_fleet_table_and_notes() -> None:
    res = FleetResult("fleet_x", "2P2D: something died")
    res.add([_out(0, OK, 2), _out(1, FAILED_CLEAN, tokens=1)])
    res.recovery_s, res.drain_s = 0.2, 1.0
    res.notes.append("victim restarted")
    meta = {"when": "now", "host": "h", "cpus": 2, "total_s": 1.0, "netns": False,
            "leftover": [], "stack_notes": [], "verify": None}
    md = reliability.render([], FaultConfig(), meta, [res], fleet_config())
    row = next(ln for ln in md.splitlines() if ln.startswith("| 2P2D: something died"))
    assert row.split(" | ")[1:5] == ["2", "1", "0", "1"] and row.endswith("pass |")
    assert "### fleet_x: 2P2D: something died" in md and "- victim restarted" in md


def test_reliability_report_has_the_heterogeneous_tp_rows() -> None:
    """The TP rows get a table of their own naming the TP sizes."""
    main, tp_row = ScenarioResult("decode_sigkill", "decode died"), ScenarioResult(
        "decode_sigkill", "decode died")
    tp_row.add([_out(0, FAILED_CLEAN, stream=False), _out(1, OK, 2)])
    tp_row.recovery_s, tp_row.drain_s = 0.2, 1.0
    tp_cfg = FaultConfig(prefill_tp=2, decode_tp=1)
    meta = {"when": "now", "host": "h", "cpus": 2, "total_s": 1.0, "netns": False,
            "leftover": [], "stack_notes": [], "verify": None, "tp": ([tp_row], tp_cfg, [])}
    md = reliability.render([main], FaultConfig(), meta)
    section = md[md.index("## Prefill TP2 -> decode TP1"):md.index("## Per fault")]
    row = next(ln for ln in section.splitlines() if ln.startswith("| decode died"))
    assert row.split(" | ")[1:4] == ["2", "1", "1"] and row.endswith("pass |")
    assert "### decode_sigkill (prefill TP != decode TP): decode died" in md


def test_reliability_refuses_unknown_scenarios_before_starting_anything() -> None:
    args = argparse.Namespace(only="fleet_decode_sigkill,nope", out="-", json=None,
                              no_netns=True, no_tp=False, workdir=None)
    assert reliability.run_from_args(args) == 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    st = FleetStack(tmp_path_factory.mktemp("faults-fleet")).start()
    yield st
    st.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sc", FLEET_SCENARIOS, ids=[s.name for s in FLEET_SCENARIOS])
def test_fleet_fault(fleet: FleetStack, sc: FleetScenario) -> None:
    res = run_fleet_scenario(fleet, sc)
    detail = json.dumps(res.to_json(), indent=1, default=str)
    assert res.sent > 0 and res.accounted == res.sent, detail
    assert res.lost == 0, detail
    assert res.failed_before_token == 0, detail
    assert res.violations() == [], detail


@pytest.mark.slow
def test_zz_fleet_stops_without_leftover_processes(fleet: FleetStack) -> None:
    fleet.stop()
    assert fleet.leaked_processes() == []
