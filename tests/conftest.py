"""Shared fixtures: a real Redis server per test session, flushed before each test, and real
Cluster and Sentinel topologies for the tests that need them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_topologies import LocalCluster, LocalSentinels


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    """URL of a real, empty Redis."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real three-master Redis Cluster on loopback, shared by the session."""
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def redis_sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinels]:
    """A real primary + replica watched by three Sentinels (per module: failovers move it)."""
    group = LocalSentinels(tmp_path_factory.mktemp("redis-sentinel")).start()
    yield group
    group.stop()
