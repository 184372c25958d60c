"""Shared fixtures: a real Redis server per test session, flushed before each test, and real
Cluster and Sentinel topologies for the tests that need them; one directory of warm engine
zygotes for every launcher the session starts; and the order and grouping that let
``make test TEST_WORKERS=2`` run the suite on two pytest-xdist workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvpush.services.engine.zygote_pool import stop_zygotes
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.redis_topologies import LocalCluster, LocalSentinels

# The suite's stacks serve the 4-layer random-weight model unless a test names another: it
# boots and answers in a fraction of the real default's time, and what most tests check
# (placement, faults, checksums) does not depend on the weights. Subprocesses inherit it.
os.environ.setdefault("KVPUSH_STACK_MODEL", "tiny")
# Every prompt goes through P/D unless a test asks for decode alone: many tests send a
# prompt the decode may already hold, and check its push; whether decode's KV events of it
# are in Redis by then is a race, which must not pick the path. The tests of decode alone
# set the threshold themselves.
os.environ.setdefault("KVPUSH_SCHEDULER_DECODE_ALONE_TOKENS", "0")

# Packages whose modules share one package-scoped engine stack: one unit of work for xdist.
SHARED_STACK_PACKAGES = ("e2e_tiny",)


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to, from its node id: its file (a module-scoped
    stack boots once, on one worker), or its package where the package shares a stack."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in SHARED_STACK_PACKAGES:
            return "/".join(parts[:i + 1])
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadscope`` (``make test TEST_WORKERS=N``): hand out whole units of
    work (:func:`work_unit`), in collection order. xdist's own ``loadgroup`` cannot carry
    the grouping on pytest >= 9.2 (a node id no longer takes the group suffix it writes),
    and ``loadfile`` would split a package's shared stack across workers. Any other mode
    asked for on the command line is left to xdist."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: run the units that boot engines first, in file order, so the
    long units start at once and the many short ones fill the workers' tails. Tests inside
    a unit keep their order. A run in one process keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(work_unit(item.nodeid), []).append(item)
    ordered = sorted(units.items(),
                     key=lambda kv: not any(i.get_closest_marker("slow") for i in kv[1]))
    items[:] = [i for _, unit in ordered for i in unit]


@pytest.fixture(scope="session", autouse=True)
def engine_zygotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Engines started anywhere in the session (in this process, or by the ``kvpush``
    commands it runs) fork from zygotes in one directory: vLLM is imported once per
    environment, not once per engine. ``KVPUSH_ENGINE_ZYGOTE_DIR`` set beforehand is kept."""
    directory = os.environ.get("KVPUSH_ENGINE_ZYGOTE_DIR")
    if directory:
        yield directory
        return
    # A short path: a Unix socket's path has a limit of about 100 bytes.
    directory = str(tmp_path_factory.mktemp("zyg"))
    os.environ["KVPUSH_ENGINE_ZYGOTE_DIR"] = directory
    try:
        yield directory
    finally:
        del os.environ["KVPUSH_ENGINE_ZYGOTE_DIR"]
        stop_zygotes(directory)


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
