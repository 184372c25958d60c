"""Fault injection and hostile input on the real local push stack (Redis, schedulers, gateway,
two vLLM engines with the kvpush connector), in the order ``kvpush reliability`` runs them:
one fault per test under a small steady load, then the hostile probes on the stack the
faults left.

For every fault: each request ends in success or a clear error within its deadline, every
request is accounted for, nothing stays held (reservations, KV blocks, gateway flights,
pending stream entries), and requests succeed again without manual action. Recovery time is
measured (``kvpush reliability`` writes it to RELIABILITY.md), never asserted against a
number: only the configured deadlines bound it.

Hostile input at all three edges (``loadtest/faults/hostile.py`` holds the probes):
malformed and unauthenticated client requests and slow-loris connections at a gateway with
tenant auth; requests sent straight to the engines without the internal token or with
malformed ``kv_transfer_params``; garbage in the request stream, the engine statuses, a
prefill engine's target stream and a gateway's assignment stream. Each must get its clear
4xx or be dropped with a log line; afterwards every engine and scheduler is the same
process and serves, and no reservation, quota unit, KV block or stream entry is held.

One stack serves both: the faults prove it recovers by itself, and booting a second pair
of engines for the probes cost CI a minute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.hostile import CLIENT, CONTROL, ENGINE, HostileReport, run_hostile
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


@pytest.fixture(scope="module")
def hostile(stack: FaultStack) -> HostileReport:
    return run_hostile(stack)


@pytest.mark.parametrize(("edge", "at_least"), [(CLIENT, 30), (ENGINE, 20), (CONTROL, 10)])
def test_every_hostile_probe_gets_its_answer(hostile: HostileReport, edge: str,
                                             at_least: int) -> None:
    probes = [p for p in hostile.probes if p.edge == edge]
    assert len(probes) >= at_least, [p.name for p in probes]
    failed = [(p.name, p.expect, p.got) for p in probes if not p.ok]
    assert failed == []


def test_hostile_input_leaves_the_stack_unharmed_and_holding_nothing(
        hostile: HostileReport) -> None:
    assert [p for p in hostile.probes if p.edge == "harness"] == []
    assert hostile.violations() == [], hostile.after


def test_zz_stack_stops_without_leftover_processes(stack: FaultStack,
                                                   hostile: HostileReport) -> None:
    stack.stop()
    assert stack.leaked_processes() == []
    assert not Path(f"/var/run/netns/{'kvft-p'}").exists()
