"""A local three-master Redis Cluster (real ``redis-server`` children) for tests and benchmarks."""

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


def wait_until(pred: Callable[[], Any], what: str, timeout_s: float) -> None:
    """Poll ``pred`` (Redis errors count as not yet) until true; :class:`TopologyNotReady`
    after ``timeout_s``."""
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
    """Three ``redis-server --cluster-enabled yes`` masters, slots split by ``redis-cli``."""

    workdir: Path
    nodes: list[LocalRedis] = field(default_factory=list)

    @property
    def url(self) -> str:
        """URL of one node: enough for a cluster client to find the rest."""
        return self.nodes[0].url

    def settings(self) -> CommonSettings:
        """Settings that make the client factory talk to this cluster."""
        return CommonSettings(redis_url=self.url, redis_cluster=True)

    def node_clients(self) -> list[redis.Redis]:
        """A plain client of each master (per-node commands: INFO, CONFIG, FLUSHALL)."""
        return [redis.Redis(port=n.port) for n in self.nodes]

    def flushall(self) -> None:
        """Empty every master."""
        for c in self.node_clients():
            c.flushall()
            c.close()

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start the nodes, create the cluster and wait until every node says ``ok``."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailable("redis-cli is not on PATH")
        try:
            for i in range(3):
                node = LocalRedis(
                    self.workdir / f"node{i}", port=free_cluster_port(),
                    extra_args=["--cluster-enabled", "yes",
                                "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", "2000"],
                )
                self.nodes.append(node.start())
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout_s,
            )
            for n in self.nodes:
                client = redis.Redis(port=n.port)
                wait_until(lambda c=client: c.cluster("INFO").get("cluster_state") == "ok",
                           f"cluster state ok on port {n.port}", timeout_s)
                client.close()
        except BaseException:
            self.stop()
            raise
        logger.info("local Redis Cluster on ports %s", [n.port for n in self.nodes])
        return self

    def stop(self) -> None:
        """Stop every node."""
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
