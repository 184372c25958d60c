"""Fencing tokens stay monotonic across a real Sentinel failover that lost the last writes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import lost_connection, sync_redis
from kvpush.common.reservations import ReleaseStatus, Reservations
from kvpush.services.engine.status import publish_status
from kvpush.services.local.redis_topologies import LocalSentinels
from tests import sched_util
from tests.polling import until

K = RedisKeys()
T = TypeVar("T")


def _retry(call: Callable[[], T], timeout_s: float = 30.0) -> T:
    """``call`` until it stops failing for a lost connection (the failover in progress)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except redis.RedisError as exc:
            if not lost_connection(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _tokens(res: Reservations, n: int, tag: str) -> list[int]:
    out = []
    for i in range(n):
        r = res.reserve("D1", f"{tag}-{i}", 1, 60_000).reservation
        assert r is not None
        out.append(r.fencing_token)
        assert res.release("D1", r.reservation_id, r.fencing_token) is ReleaseStatus.RELEASED
    return out


def test_tokens_after_a_lossy_failover_exceed_every_earlier_one(
        redis_sentinels: LocalSentinels) -> None:
    group = redis_sentinels
    assert group.primary is not None and group.replica is not None
    assert group.primary.proc is not None and group.replica.proc is not None
    client = sync_redis(group.settings())
    res = Reservations(client, K)
    publish_status(client, K, sched_util.engine_status("D1", total=100), ttl_s=600)
    primary = redis.Redis(port=group.primary.port)
    replica = redis.Redis(port=group.replica.port)

    replicated = _tokens(res, 3, "replicated")
    assert primary.wait(1, 10_000) == 1  # the replica has these

    # Make the next writes miss the replica, deterministically: freeze it, then cut its link
    # from the primary's side. Nothing written from now on is sent to it, and frozen it
    # cannot reconnect before the primary dies.
    os.kill(group.replica.proc.pid, signal.SIGSTOP)
    try:
        primary.client_kill_filter(_type="slave")
        until(lambda: primary.info("replication")["connected_slaves"] == 0,
              "the primary to drop its replica", 10, ignore=(redis.RedisError,))
        lost = _tokens(res, 3, "lost")
        group.primary.proc.kill()
        group.primary.proc.wait(10)
    finally:
        os.kill(group.replica.proc.pid, signal.SIGCONT)

    # The Sentinels see the primary down and promote the replica that missed `lost`.
    until(lambda: group.master_port() == group.replica.port, "the replica promoted", 60,
          ignore=(redis.RedisError,))
    until(lambda: replica.info("replication")["role"] == "master", "the master role", 30,
          ignore=(redis.RedisError,))
    left = int(replica.get(K.fence("D1")))
    assert left == replicated[-1] < lost[0], "the lost writes reached the replica after all"
    # A plain INCR would now hand out left + 1, a token an old holder may still carry.
    assert left + 1 <= max(lost)

    after = _retry(lambda: _tokens(res, 3, "after"))
    assert min(after) > max(replicated + lost)
    assert after == sorted(set(after))
    client.close()
    primary.close()
    replica.close()
