"""Fault injection on the real local push stack (Redis, schedulers, gateway, two vLLM engines
with the kvpush connector): one fault per test, under a small steady load.

For every fault: each request ends in success or a clear error within its deadline, every
request is accounted for, nothing stays held (reservations, KV blocks, gateway flights,
pending stream entries), and requests succeed again without manual action. Recovery time is
measured (``kvpush reliability`` writes it to RELIABILITY.md), never asserted against a
number: only the configured deadlines bound it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.outcomes import FaultConfig
from kvpush.loadtest.faults.scenarios import SCENARIOS, Scenario, run_scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    netns = os.environ.get("KVPUSH_FAULTS_NETNS", "1") != "0"
    st = FaultStack(tmp_path_factory.mktemp("faults"), FaultConfig(netns=netns)).start()
    yield st
    st.stop()


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_fault(stack: FaultStack, sc: Scenario) -> None:
    res = run_scenario(stack, sc)
    if res.skipped:
        pytest.skip(res.skipped)
    detail = json.dumps(res.to_json(), indent=1, default=str)
    assert res.violations() == [], detail
    assert res.sent > 0 and res.accounted == res.sent, detail


def test_zz_stack_stops_without_leftover_processes(stack: FaultStack) -> None:
    stack.stop()
    assert stack.leaked_processes() == []
    assert not Path(f"/var/run/netns/{'kvft-p'}").exists()
