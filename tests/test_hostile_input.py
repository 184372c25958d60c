"""Hostile input at all three edges, on real engines, real schedulers and a real Redis.

``loadtest/faults/hostile.py`` holds the probes (also reported by ``kvpush reliability``):
malformed and unauthenticated client requests and slow-loris connections at a gateway with
tenant auth; requests sent straight to the engines without the internal token or with
malformed ``kv_transfer_params``; garbage in the request stream, the engine statuses, a
prefill engine's target stream and a gateway's assignment stream. Each must get its clear
4xx or be dropped with a log line; afterwards every engine and scheduler is the same
process and serves, and no reservation, quota unit, KV block or stream entry is held.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.hostile import CLIENT, CONTROL, ENGINE, HostileReport, run_hostile
from kvpush.loadtest.faults.outcomes import FaultConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    netns = os.environ.get("KVPUSH_FAULTS_NETNS", "1") != "0"
    st = FaultStack(tmp_path_factory.mktemp("hostile"), FaultConfig(netns=netns)).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def report(stack: FaultStack) -> HostileReport:
    return run_hostile(stack)


@pytest.mark.parametrize(("edge", "at_least"), [(CLIENT, 30), (ENGINE, 20), (CONTROL, 10)])
def test_every_probe_gets_its_answer(report: HostileReport, edge: str, at_least: int) -> None:
    probes = [p for p in report.probes if p.edge == edge]
    assert len(probes) >= at_least, [p.name for p in probes]
    failed = [(p.name, p.expect, p.got) for p in probes if not p.ok]
    assert failed == []


def test_the_stack_is_unharmed_and_holds_nothing(report: HostileReport) -> None:
    assert [p for p in report.probes if p.edge == "harness"] == []
    assert report.violations() == [], report.after


def test_zz_stack_stops_without_leftover_processes(stack: FaultStack,
                                                   report: HostileReport) -> None:
    stack.stop()
    assert stack.leaked_processes() == []
