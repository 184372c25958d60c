"""Shared fixtures: a real Redis server per test session, flushed before each test, and real
Cluster and Sentinel topologies for the tests that need them; and the order and grouping
that let ``make test TEST_WORKERS=2`` run the suite on two pytest-xdist workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_topologies import LocalCluster, LocalSentinels

# Packages whose modules share one package-scoped engine stack: one unit of work for xdist.
SHARED_STACK_PACKAGES = ("e2e_tiny",)


def work_unit(path: Path) -> str:
    """The xdist group of a test file: the file itself (its module-scoped stacks boot once
    on one worker), or its package where the package shares a stack."""
    here = Path(__file__).parent
    rel = path.relative_to(here) if path.is_relative_to(here) else path
    if rel.parts[0] in SHARED_STACK_PACKAGES:
        return rel.parts[0]
    return rel.as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n N``: group each test with its file (``--dist loadgroup``) and run the
    units that boot engines first, in file order, so the long units start at once and the
    many short ones fill the workers' tails. Tests inside a unit keep their order. A run in
    one process keeps pytest's order."""
    if not getattr(config.option, "numprocesses", None):
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(work_unit(item.path), []).append(item)
    ordered = sorted(units.items(),
                     key=lambda kv: not any(i.get_closest_marker("slow") for i in kv[1]))
    items[:] = [i for _, unit in ordered for i in unit]
    for name, unit in ordered:
        for item in unit:
            item.add_marker(pytest.mark.xdist_group(name))


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
