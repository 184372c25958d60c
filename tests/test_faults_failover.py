"""Redis failover on the real stack (schedulers, gateway with API keys, prefill and decode vLLM
engines with the kvpush connector): the master of a Sentinel set, or of a Redis Cluster with
replicas, is SIGKILLed under load and the topology promotes its replica; every service must
follow without a restart.

For every failover: each request is answered (ok, or a clear error), none is lost or served
twice, nothing stays held (reservations, quota units, KV blocks, gateway flights, pending
stream entries) and requests succeed again without manual action. Fencing tokens handed out
twice are asserted absent where the replica is not behind; where it is (its last writes die
with the master) they are counted and reported: the counter is not yet monotonic across a
failover that loses its last increments (see RELIABILITY.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.loadtest.faults.failover import FAILOVER_SCENARIOS, FailoverScenario, run_failover

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sc", FAILOVER_SCENARIOS, ids=[s.name for s in FAILOVER_SCENARIOS])
def test_failover(tmp_path: Path, sc: FailoverScenario) -> None:
    res = run_failover(tmp_path, sc)
    detail = json.dumps(res.to_json(), indent=1, default=str)
    assert res.sent > 0 and res.accounted == res.sent, detail
    assert res.lost == 0, detail
    assert res.duplicated == 0, detail
    assert res.leaks == {}, detail
    assert res.recovery_s is not None, detail
    assert res.tokens > 0, detail  # the tap saw the assignments it counts tokens from
    # Every request that did not succeed failed clean (an HTTP error with a message).
    assert res.sent - res.ok == res.failed_clean, detail
    assert res.violations() == [], detail
    # Fencing tokens are max(last + 1, server clock): even a promoted replica that missed
    # the old master's last writes hands out only larger ones.
    assert res.token_repeats == 0, detail
