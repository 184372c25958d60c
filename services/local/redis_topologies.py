"""Real local Redis topologies (tests, fault harness): a three-master Cluster, optionally with
replicas, and a Sentinel-watched primary and replica; each can lose its master to a SIGKILL."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvpush.common.settings import CommonSettings
from kvpush.services.local.local_redis import LocalRedis, RedisUnavailable
from kvpush.services.local.ports import NoFreePort, free_port

logger = logging.getLogger(__name__)

SENTINEL_MASTER = "kvpush-test"
_BUS_OFFSET = 10000  # Redis Cluster's bus port is the client port + 10000


class TopologyNotReady(RuntimeError):
    """A Cluster or Sentinel set did not reach a usable state in time."""


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free as well."""
    for _ in range(200):
        port = free_port()
        if port + _BUS_OFFSET < 65536 and _free(port + _BUS_OFFSET):
            return port
    raise NoFreePort("no free port with a free cluster bus port")


def _wait(pred: Callable[[], Any], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise TopologyNotReady(f"timed out waiting for {what}")


@dataclass
class LocalCluster:
    """Three ``redis-server --cluster-enabled yes`` masters, slots split by ``redis-cli``, each
    with ``replicas`` replicas (which take over their master's slots when it dies)."""

    workdir: Path
    replicas: int = 0
    nodes: list[LocalRedis] = field(default_factory=list)

    MASTERS = 3

    @property
    def url(self) -> str:
        """URL of one live node: enough for a cluster client to find the rest."""
        return next((n for n in self.nodes if n.proc is not None), self.nodes[0]).url

    def settings(self) -> CommonSettings:
        """Settings that make the client factory talk to this cluster."""
        return CommonSettings(redis_url=self.url, redis_cluster=True)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start the nodes, create the cluster and wait until every node says ``ok`` and
        every replica is in sync with its master."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailable("redis-cli is not on PATH")
        try:
            for i in range(self.MASTERS * (1 + self.replicas)):
                node = LocalRedis(
                    self.workdir / f"node{i}", port=free_cluster_port(),
                    extra_args=["--cluster-enabled", "yes",
                                "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", "2000",
                                "--repl-diskless-sync-delay", "0"],
                )
                self.nodes.append(node.start())
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout_s,
            )
            for n in self.nodes:
                client = redis.Redis(port=n.port, decode_responses=True)
                _wait(lambda c=client: c.cluster("INFO").get("cluster_state") == "ok"
                      and int(c.cluster("INFO").get("cluster_known_nodes", 0))
                      == len(self.nodes),
                      f"cluster state ok on port {n.port}", timeout_s)
                client.close()
            _wait(lambda: all(len(reps) == self.replicas and all(
                _in_sync(p) for p in reps) for _, reps in self.shards().values()),
                "every replica in sync", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def node(self, port: int) -> LocalRedis:
        """The node listening on ``port``."""
        return next(n for n in self.nodes if n.port == port)

    def shards(self) -> dict[tuple[int, int], tuple[int, list[int]]]:
        """Slot range -> (master port, replica ports), as a live node reports it now."""
        for n in self.nodes:
            if n.proc is None:
                continue
            client = redis.Redis(port=n.port, socket_timeout=2)
            try:
                rows = client.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            finally:
                client.close()
            return {(int(r[0]), int(r[1])): (int(r[2][1]), [int(x[1]) for x in r[3:]])
                    for r in rows}
        raise TopologyNotReady("no cluster node answers")

    def shard_of(self, key: str) -> tuple[int, list[int]]:
        """(master port, replica ports) of the shard that serves ``key``'s slot now."""
        slot = _key_slot(key)
        for (lo, hi), shard in self.shards().items():
            if lo <= slot <= hi:
                return shard
        raise TopologyNotReady(f"slot {slot} of {key!r} is not served")

    def master_of(self, key: str) -> int:
        """Port of the master that serves ``key``'s slot now."""
        return self.shard_of(key)[0]

    def kill_master(self, key: str) -> int:
        """SIGKILL the master serving ``key`` (it must have a replica); returns its port.
        The cluster promotes the replica by itself: see :meth:`wait_promoted`."""
        old, reps = self.shard_of(key)
        if not reps:
            raise TopologyNotReady(f"master {old} has no replica to promote")
        self.node(old).kill()
        return old

    def wait_promoted(self, key: str, old: int, timeout_s: float = 30.0) -> int:
        """Wait until another node (the promoted replica) serves ``key``'s slot instead of
        the dead master ``old`` and every live node says ``ok``; returns its port."""
        _wait(lambda: self.master_of(key) != old, f"a replica of {old} to take its slots",
              timeout_s)
        for n in self.nodes:
            if n.proc is not None:
                client = redis.Redis(port=n.port, socket_timeout=2, decode_responses=True)
                _wait(lambda c=client: c.cluster("INFO").get("cluster_state") == "ok",
                      f"cluster state ok on port {n.port} after the failover", timeout_s)
                client.close()
        return self.master_of(key)

    def node_clients(self) -> list[redis.Redis]:
        """A plain client of each live master (per-node commands: INFO, CONFIG, FLUSHALL)."""
        out = []
        for n in self.nodes:
            if n.proc is None:
                continue
            c = redis.Redis(port=n.port)
            try:
                if c.info("replication").get("role") == "master":
                    out.append(c)
                    continue
            except redis.RedisError:
                pass
            c.close()
        return out

    def flushall(self) -> None:
        """Empty every master."""
        for c in self.node_clients():
            c.flushall()
            c.close()

    def stop(self) -> None:
        """Stop every node."""
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until(pred: Callable[[], Any], what: str, timeout_s: float) -> None:
    """Poll ``pred`` (Redis errors count as not yet) until true; raises past ``timeout_s``."""
    _wait(pred, what, timeout_s)


def _key_slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def _in_sync(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    try:
        return client.info("replication").get("master_link_status") == "up"
    finally:
        client.close()


@dataclass
class LocalSentinels:
    """A primary, one replica and three Sentinels watching them as ``SENTINEL_MASTER``."""

    workdir: Path
    relay: Callable[[int], int] | None = None
    """Maps the primary's port to the port the replica replicates from (a fault proxy in
    front of the primary, to give replication a lag); None: straight to the primary. The
    Sentinels point a replica that follows another address back at the master after
    ``failover_timeout_ms``: lengthen that with a relay."""
    failover_timeout_ms: int = 5000
    primary: LocalRedis | None = None
    replica: LocalRedis | None = None
    sentinels: list[LocalRedis] = field(default_factory=list)

    @property
    def addresses(self) -> str:
        """``KVPUSH_REDIS_SENTINELS`` value of this set."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def settings(self) -> CommonSettings:
        """Settings that make the client factory follow this set's master."""
        return CommonSettings(redis_sentinels=self.addresses,
                              redis_sentinel_master=SENTINEL_MASTER)

    def sentinel_client(self, i: int = 0) -> redis.Redis:
        """A plain client of Sentinel ``i`` (for SENTINEL commands)."""
        return redis.Redis(port=self.sentinels[i].port, decode_responses=True)

    def master_port(self) -> int:
        """The master's port as Sentinel 0 reports it now."""
        _, port = self.sentinel_client().sentinel_get_master_addr_by_name(SENTINEL_MASTER)
        return int(port)

    def start(self, timeout_s: float = 30.0) -> LocalSentinels:
        """Start primary, replica (in sync) and Sentinels (aware of the replica)."""
        sync = ["--repl-diskless-sync-delay", "0"]
        try:
            self.primary = LocalRedis(self.workdir / "primary", extra_args=sync).start()
            upstream = self.relay(self.primary.port) if self.relay else self.primary.port
            self.replica = LocalRedis(
                self.workdir / "replica",
                extra_args=[*sync, "--replicaof", "127.0.0.1", str(upstream)],
            ).start()
            rep = redis.Redis(port=self.replica.port, decode_responses=True)
            _wait(lambda: rep.info("replication").get("master_link_status") == "up",
                  "replica in sync", timeout_s)
            for i in range(3):
                wd = self.workdir / f"sentinel{i}"
                wd.mkdir(parents=True, exist_ok=True)
                conf = wd / "sentinel.conf"
                conf.write_text(
                    f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {self.primary.port} 2\n"
                    f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                    f"sentinel failover-timeout {SENTINEL_MASTER} {self.failover_timeout_ms}\n"
                )
                node = LocalRedis(wd, config_file=conf, extra_args=["--sentinel"])
                self.sentinels.append(node.start())
            for i in range(3):
                s = self.sentinel_client(i)
                _wait(lambda s=s: len(s.sentinel_slaves(SENTINEL_MASTER)) == 1
                      and len(s.sentinel_sentinels(SENTINEL_MASTER)) == 2,
                      f"sentinel {i} sees the replica and its peers", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def failover(self, timeout_s: float = 30.0) -> int:
        """Force a failover (``SENTINEL FAILOVER``); returns the new master's port."""
        old = self.master_port()
        s = self.sentinel_client()
        _wait(lambda: s.execute_command("SENTINEL FAILOVER", SENTINEL_MASTER),
              "Sentinel to accept the failover", timeout_s)
        _wait(lambda: self.master_port() != old, "the new master", timeout_s)
        new = self.master_port()
        promoted = redis.Redis(port=new, decode_responses=True)
        demoted = redis.Redis(port=old, decode_responses=True)
        _wait(lambda: promoted.info("replication")["role"] == "master",
              "the replica to take the master role", timeout_s)
        # Until the Sentinels turn the old master into a replica it still takes writes.
        _wait(lambda: demoted.info("replication")["role"] == "slave",
              "the old master to become a replica", timeout_s)
        return new

    def node(self, port: int) -> LocalRedis:
        """The data node (primary or replica) listening on ``port``."""
        return next(n for n in (self.primary, self.replica) if n is not None and n.port == port)

    def kill_master(self) -> int:
        """SIGKILL the current master (no ``SENTINEL FAILOVER``: the Sentinels must notice
        it is down and promote the replica themselves); returns its port."""
        old = self.master_port()
        self.node(old).kill()
        return old

    def wait_promoted(self, old: int, timeout_s: float = 30.0) -> int:
        """Wait until the Sentinels name a master other than the dead ``old`` and it has
        taken the master role; returns its port."""
        _wait(lambda: self.master_port() != old, "the Sentinels to promote the replica",
              timeout_s)
        new = self.master_port()
        promoted = redis.Redis(port=new, decode_responses=True)
        _wait(lambda: promoted.info("replication")["role"] == "master",
              "the replica to take the master role", timeout_s)
        promoted.close()
        return new

    def stop(self) -> None:
        """Stop Sentinels first, so they do not react to the data nodes going away."""
        for s in self.sentinels:
            s.stop()
        for n in (self.replica, self.primary):
            if n is not None:
                n.stop()
