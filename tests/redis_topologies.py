"""A real local Sentinel-watched pair for tests (the Cluster: services/local/redis_cluster.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvpush.common.settings import CommonSettings
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_cluster import wait_until

SENTINEL_MASTER = "kvpush-test"


@dataclass
class LocalSentinels:
    """A primary, one replica and three Sentinels watching them as ``SENTINEL_MASTER``."""

    workdir: Path
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
            self.replica = LocalRedis(
                self.workdir / "replica",
                extra_args=[*sync, "--replicaof", "127.0.0.1", str(self.primary.port)],
            ).start()
            rep = redis.Redis(port=self.replica.port, decode_responses=True)
            wait_until(lambda: rep.info("replication").get("master_link_status") == "up",
                  "replica in sync", timeout_s)
            for i in range(3):
                wd = self.workdir / f"sentinel{i}"
                wd.mkdir(parents=True, exist_ok=True)
                conf = wd / "sentinel.conf"
                conf.write_text(
                    f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {self.primary.port} 2\n"
                    f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                    f"sentinel failover-timeout {SENTINEL_MASTER} 5000\n"
                )
                node = LocalRedis(wd, config_file=conf, extra_args=["--sentinel"])
                self.sentinels.append(node.start())
            for i in range(3):
                s = self.sentinel_client(i)
                wait_until(lambda s=s: len(s.sentinel_slaves(SENTINEL_MASTER)) == 1
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
        wait_until(lambda: s.execute_command("SENTINEL FAILOVER", SENTINEL_MASTER),
              "Sentinel to accept the failover", timeout_s)
        wait_until(lambda: self.master_port() != old, "the new master", timeout_s)
        new = self.master_port()
        promoted = redis.Redis(port=new, decode_responses=True)
        demoted = redis.Redis(port=old, decode_responses=True)
        wait_until(lambda: promoted.info("replication")["role"] == "master",
              "the replica to take the master role", timeout_s)
        # Until the Sentinels turn the old master into a replica it still takes writes.
        wait_until(lambda: demoted.info("replication")["role"] == "slave",
              "the old master to become a replica", timeout_s)
        return new

    def stop(self) -> None:
        """Stop Sentinels first, so they do not react to the data nodes going away."""
        for s in self.sentinels:
            s.stop()
        for n in (self.replica, self.primary):
            if n is not None:
                n.stop()
