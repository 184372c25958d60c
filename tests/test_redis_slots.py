"""Every multi-key Redis operation (MULTI, Lua script) stays inside one Cluster hash slot."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import _quota_keys
from kvpush.common.reservations import Reservations
from kvpush.common.tenancy import hash_api_key, new_api_key

ENGINES = ["decode-0", "E", "prefill-host.example-8100", "a_b"]
TENANTS = ["acme", "default", "t.1-x_y"]
PREFIXES = ["kvpush", "other-cluster"]
SHARDS = 8


def _slots(keys: list[str]) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


def multi_key_operations(k: RedisKeys) -> dict[str, list[str]]:
    """Name -> keys of each atomic multi-key operation kvpush issues, for sample ids."""
    ops: dict[str, list[str]] = {}
    resv = Reservations(None, k)  # type: ignore[arg-type] - only the key layout is used
    for e in ENGINES:
        ops[f"reservations.reserve({e})"] = resv.reserve_call(e, "cmpl-1", 4, 1000)[1]
        # release, renew, sweep (also the scheduler's pipelined sweep) share these keys.
        ops[f"reservations.release/renew/sweep({e})"] = resv._pair(e)
        ops[f"reservations.snapshot({e})"] = resv._snapshot_keys(e)
        ops[f"engine_status.publish_status script({e})"] = [k.engine(e)]
    for t in TENANTS:
        ops[f"quotas.lua({t})"] = _quota_keys(k, t)
    h = hash_api_key(new_api_key())
    ops["tenancy revoke / rotate MULTI"] = [k.api_key(h)]
    # On a Cluster the scheduler reads, claims, acks and trims each request shard on its
    # own (one XREADGROUP over all shards is for a single Redis only).
    for i, stream in enumerate(k.request_streams(SHARDS)):
        ops[f"scheduler XREADGROUP/XAUTOCLAIM/XACK/XTRIM on a Cluster (shard {i})"] = [stream]
    return ops


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_multi_key_operation_stays_in_one_slot(prefix: str) -> None:
    spread = {name: sorted(_slots(keys))
              for name, keys in multi_key_operations(RedisKeys(prefix)).items()
              if len(_slots(keys)) != 1}
    assert spread == {}, f"operations spanning several hash slots: {spread}"


@pytest.mark.parametrize("prefix", PREFIXES)
def test_each_request_shard_has_a_slot_of_its_own(prefix: str) -> None:
    k = RedisKeys(prefix)
    streams = k.request_streams(SHARDS)
    assert streams[0] == f"{prefix}:requests"  # unsharded name: one shard changes nothing
    assert streams[3] == f"{prefix}:requests:{{shard-3}}"
    assert len(_slots(streams)) == SHARDS


def test_the_check_notices_a_cross_slot_set() -> None:
    # The heartbeat once wrote these two in one MULTI; Redis Cluster refuses that.
    k = RedisKeys()
    assert len(_slots([k.engine("E"), k.engines()])) == 2
