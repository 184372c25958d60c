"""The one Redis client factory: single node, Redis Cluster or Sentinel, from ``CommonSettings``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel
from redis.exceptions import NoScriptError, RedisClusterException, SlotNotCoveredError

from kvpush.common.backoff import Backoff
from kvpush.common.runtime import sleep_unless_cancelled
from kvpush.common.settings import CommonSettings, parse_sentinels

T = TypeVar("T")
logger = logging.getLogger(__name__)

SyncRedis = redis.Redis | redis.cluster.RedisCluster
"""A blocking client of any topology; commands and non-transactional pipelines work alike."""

AsyncRedis = aioredis.Redis | aiocluster.RedisCluster
"""An asyncio client of any topology."""


class RedisNotConfigured(RuntimeError):
    """A service that needs Redis was started without ``KVPUSH_REDIS_URL`` or Sentinels."""


class RedisTopologyConflict(ValueError):
    """The settings ask for more than one topology, or for Sentinels without a master name."""


def redis_configured(settings: CommonSettings) -> bool:
    """Whether ``settings`` name a Redis at all (a URL or Sentinels)."""
    return bool(settings.redis_url or settings.redis_sentinels)


def topology(settings: CommonSettings) -> str:
    """``"sentinel"``, ``"cluster"`` or ``"single"``; raises on contradictory settings."""
    if settings.redis_sentinels:
        if settings.redis_cluster:
            raise RedisTopologyConflict(
                "KVPUSH_REDIS_CLUSTER and KVPUSH_REDIS_SENTINELS exclude each other"
            )
        if not settings.redis_sentinel_master:
            raise RedisTopologyConflict(
                "KVPUSH_REDIS_SENTINELS needs KVPUSH_REDIS_SENTINEL_MASTER (the master's name)"
            )
        return "sentinel"
    if not settings.redis_url:
        raise RedisNotConfigured("KVPUSH_REDIS_URL is not set")
    return "cluster" if settings.redis_cluster else "single"


def _url(settings: CommonSettings) -> str:
    """``redis_url`` without the credentials that ``redis_username``/``_password`` replace:
    redis-py lets the URL's win over keyword arguments, the settings promise the opposite."""
    url = settings.redis_url or ""
    parts = urlsplit(url)
    if not (settings.redis_username or settings.redis_password) or "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class ClusterUnsettled(redis.exceptions.ClusterError):
    """redis-py could not map the cluster's slots to live masters: a failover in progress.

    redis-py raises ``RedisClusterException`` for this, which is not a ``RedisError``, so
    callers that handle a lost Redis (a 503, a retry) would see a bug instead; the clients
    below raise this ``ClusterError`` in its place, which ``lost_connection`` accepts."""


def _settle(exc: RedisClusterException) -> ClusterUnsettled:
    return ClusterUnsettled(f"cluster topology unsettled: {exc}")


class _ClusterClient(redis.cluster.RedisCluster):
    """redis-py's blocking cluster client, minus two failover traps.

    For a command whose keys move (XREAD, XREADGROUP) it asks its *default node* which keys
    the command names, and when that node is the master that died it never picks another,
    so the command fails forever even on slots the dead node never served. Here a lost
    default node is replaced (by a live master) before the error propagates, so the
    caller's retry goes through. And a topology it cannot map (see ``ClusterUnsettled``)
    is raised as a ``RedisError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except RedisClusterException as exc:
            raise _settle(exc) from exc
        # The blocking client rediscovers the topology from inside its error handlers,
        # through its NodesManager, whose class it does not let a subclass choose.
        discover = self.nodes_manager.initialize

        def initialize(*a: Any, **kw: Any) -> Any:
            try:
                return discover(*a, **kw)
            except RedisClusterException as exc:
                raise _settle(exc) from exc

        self.nodes_manager.initialize = initialize  # type: ignore[method-assign]

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except SlotNotCoveredError as exc:
            raise _settle(exc) from exc

    def _get_command_keys(self, *args: Any) -> Any:
        try:
            return super()._get_command_keys(*args)
        except (redis.ConnectionError, redis.TimeoutError):
            self.replace_default_node()
            raise


class _WriteNeedsSocket:
    """A connection that, asked to write after its socket was dropped, raises the lost
    connection it is rather than an ``AttributeError``: a failed command makes redis-py's
    asyncio cluster client drop a node's connections while another task may still be
    (re)connecting one of them, mid-failover."""

    _writer: Any

    async def _send_packed_command(self, command: Any) -> None:
        if self._writer is None:
            raise OSError("the connection was closed under the command")  # a ConnectionError
        await super()._send_packed_command(command)  # type: ignore[misc]


class _Connection(_WriteNeedsSocket, aioredis.Connection):
    pass


class _SSLConnection(_WriteNeedsSocket, aioredis.SSLConnection):
    pass


class _AsyncClusterClient(aiocluster.RedisCluster):
    """redis-py's asyncio cluster client, raising a topology it cannot map (see
    ``ClusterUnsettled``) and a connection it closed under a command (``_WriteNeedsSocket``)
    as ``RedisError``s, as it does every other lost connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The client picks the connection class itself; its nodes are made from these
        # keyword arguments (shared with its NodesManager), and none has connected yet.
        tls = issubclass(self.connection_kwargs["connection_class"], aioredis.SSLConnection)
        guarded = _SSLConnection if tls else _Connection
        self.connection_kwargs["connection_class"] = guarded
        for node in [*self.startup_nodes, *self.nodes_manager.startup_nodes.values()]:
            node.connection_class = guarded

    async def initialize(self) -> aiocluster.RedisCluster:
        try:
            return await super().initialize()
        except RedisClusterException as exc:
            raise _settle(exc) from exc

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except SlotNotCoveredError as exc:
            raise _settle(exc) from exc


def _kwargs(settings: CommonSettings) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "health_check_interval": 15,
        "socket_keepalive": True,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
    }
    parts = urlsplit(settings.redis_url or "")
    if settings.redis_username or settings.redis_password:
        # The URL's credentials are dropped (see _url); keep the half the settings lack.
        if parts.username and not settings.redis_username:
            kw["username"] = unquote(parts.username)
        if parts.password and not settings.redis_password:
            kw["password"] = unquote(parts.password)
    if settings.redis_username:
        kw["username"] = settings.redis_username
    if settings.redis_password:
        kw["password"] = settings.redis_password
    if settings.redis_url and settings.redis_url.startswith("rediss://"):
        if settings.redis_tls_ca:
            kw["ssl_ca_certs"] = str(settings.redis_tls_ca)
        if settings.redis_tls_cert:
            kw["ssl_certfile"] = str(settings.redis_tls_cert)
        if settings.redis_tls_key:
            kw["ssl_keyfile"] = str(settings.redis_tls_key)
    return kw


def _sentinel_args(settings: CommonSettings) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Sentinel addresses and the options of the connections to the Sentinels themselves."""
    kw: dict[str, Any] = {
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
    }
    if settings.redis_sentinel_username:
        kw["username"] = settings.redis_sentinel_username
    if settings.redis_sentinel_password:
        kw["password"] = settings.redis_sentinel_password
    return parse_sentinels(settings.redis_sentinels or ""), kw


def _master_kwargs(settings: CommonSettings) -> dict[str, Any]:
    # The master's address comes from the Sentinels, so the URL's TLS switch does not apply.
    return {k: v for k, v in _kwargs(settings).items() if not k.startswith("ssl_")}


def async_redis(settings: CommonSettings) -> AsyncRedis:
    """An asyncio client (binary responses) for the services, of the configured topology."""
    kind = topology(settings)
    if kind == "sentinel":
        addresses, sentinel_kw = _sentinel_args(settings)
        sentinel = aiosentinel.Sentinel(addresses, sentinel_kwargs=sentinel_kw,
                                        **_master_kwargs(settings))
        logger.debug("asyncio Redis via Sentinels %s", addresses)
        return sentinel.master_for(settings.redis_sentinel_master)
    url = _url(settings)
    if kind == "cluster":
        return _AsyncClusterClient.from_url(url, **_kwargs(settings))
    return aioredis.Redis.from_url(url, **_kwargs(settings))


def sync_redis(settings: CommonSettings) -> SyncRedis:
    """A blocking client (binary responses) for threads inside vLLM and the CLI."""
    kind = topology(settings)
    if kind == "sentinel":
        addresses, sentinel_kw = _sentinel_args(settings)
        sentinel = redis.sentinel.Sentinel(addresses, sentinel_kwargs=sentinel_kw,
                                           **_master_kwargs(settings))
        logger.debug("Redis via Sentinels %s", addresses)
        return sentinel.master_for(settings.redis_sentinel_master)
    url = _url(settings)
    if kind == "cluster":
        return _ClusterClient.from_url(url, **_kwargs(settings))
    return redis.Redis.from_url(url, **_kwargs(settings))


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (sync or asyncio)."""
    return isinstance(client, redis.cluster.RedisCluster | aiocluster.RedisCluster)


def stream_read(client: Any, streams: Mapping[str, Any], *, group: str | None = None,
                consumer: str | None = None, count: int | None = None,
                block: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    """``execute_command`` arguments of ``XREADGROUP`` (with ``group`` and ``consumer``) or
    ``XREAD`` over ``streams`` (key -> id), for a client or a pipeline of ``client``.

    On a Cluster the read goes straight to the master of the keys' slot (they must share
    one): redis-py otherwise asks a node for the keys of these commands, whose key positions
    move (``COMMAND GETKEYS``), before every read: a round trip more each time. A MOVED
    reply still finds the new master; the reply is parsed as ``xreadgroup()``'s is.
    """
    args: list[Any] = ["XREADGROUP", "GROUP", group, consumer] if group else ["XREAD"]
    if count is not None:
        args += ["COUNT", count]
    if block is not None:
        args += ["BLOCK", block]
    args += ["STREAMS", *streams.keys(), *streams.values()]
    kw: dict[str, Any] = {}
    if is_cluster(client):
        # No slot map yet (nothing sent so far): redis-py routes this one itself.
        with contextlib.suppress(redis.exceptions.RedisClusterException):
            kw["target_nodes"] = client.get_node_from_key(next(iter(streams)))
    return args, kw


# What a Redis call raises when it fails: redis-py's errors, and uvloop's RuntimeError when a
# reset closed the transport under a connection being (re)established (``lost_connection``
# tells the lost connections among them apart).
REDIS_CALL_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RuntimeError)


def lost_connection(exc: BaseException) -> bool:
    """True when ``exc`` means the connection to Redis went away (reset, restart, partition,
    a failover in progress).

    Such errors are retried by every long-running loop rather than ending it.
    """
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError):
        return True
    # A cluster mid-failover answers CLUSTERDOWN / TRYAGAIN, and redis-py gives up with
    # ClusterError once its own retries run out; all pass once the cluster settles.
    # A demoted master answers READONLY until the client rediscovers the new one.
    if isinstance(exc, redis.exceptions.ClusterError | redis.exceptions.TryAgainError
                  | redis.exceptions.ReadOnlyError):
        return True
    # uvloop raises this when redis-py reuses a pooled connection whose transport a reset
    # closed under it: a lost connection, not a bug.
    return isinstance(exc, RuntimeError) and "closed=True" in str(exc)


async def ride_out(op: Callable[[], Awaitable[T]], budget_s: float, what: str) -> T:
    """Await ``op()``, calling it again while Redis is briefly gone (a restart, a Sentinel
    or Cluster failover) for up to ``budget_s``; then raise a ``redis.RedisError`` (a lost
    connection always as one), or any other error at once.

    Only for operations that are safe to repeat when a reply was lost: reads, and writes the
    readers de-duplicate (the request stream's entries carry a once marker).
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + max(0.0, budget_s)
    backoff = Backoff(first=0.05, cap=1.0, jitter=0.5)
    while True:
        try:
            return await op()
        except Exception as exc:
            if not lost_connection(exc):
                raise
            delay = backoff.next()
            if loop.time() + delay > give_up:
                if isinstance(exc, redis.RedisError):
                    raise
                # A socket error or uvloop's closed transport: callers handle Redis
                # errors (a 503, a retry), and this is one, whatever its class.
                raise redis.ConnectionError(f"{what}: {exc}") from exc
            logger.info("%s: Redis unreachable (%s); again in %.2f s", what, exc, delay)
            await sleep_unless_cancelled(delay)


# -- Lua scripts that survive a failover --------------------------------------------------
#
# A promoted replica (Sentinel or Cluster) has an empty script cache: Redis does not
# replicate SCRIPT LOAD. redis-py's own fallback (SCRIPT LOAD, then EVALSHA again) loads the
# script where its cluster client believes the masters are; the asyncio cluster client
# keeps a promoted replica typed as a replica (it follows MOVED for keys, but not for
# SCRIPT LOAD), so every call then fails with NOSCRIPT until a restart. Here loading goes to
# every node the client knows, replicas included, so a replica promoted later already holds
# the scripts; and a script still missing after that runs with EVAL, which is routed by its
# keys like EVALSHA and caches the script on the node that serves them.


def script_sha(text: str) -> str:
    """The SHA1 Redis names ``text`` by (what SCRIPT LOAD returns)."""
    return hashlib.sha1(text.encode()).hexdigest()


class LuaScript:
    """A Lua script on a blocking client of any topology, called like redis-py's ``Script``
    (``script(keys=..., args=...)``): see :func:`run_script`."""

    def __init__(self, client: SyncRedis, text: str) -> None:
        self.client, self.text, self.sha = client, text, script_sha(text)

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        return run_script(self.client, self.sha, self.text, keys, args)


class AsyncLuaScript:
    """:class:`LuaScript` on an asyncio client."""

    def __init__(self, client: AsyncRedis, text: str) -> None:
        self.client, self.text, self.sha = client, text, script_sha(text)

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        return await arun_script(self.client, self.sha, self.text, keys, args)


def run_script(client: SyncRedis, sha: str, text: str, keys: Sequence[Any],
               args: Sequence[Any]) -> Any:
    """EVALSHA; where the node lacks the script (restarted, flushed, a promoted replica),
    SCRIPT LOAD on every node and EVALSHA again, and EVAL where that still misses. Loading
    comes before EVAL because the services' ACL users may load scripts but not EVAL them
    (common/acl.py)."""
    try:
        return client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        load_script(client, text)
    try:
        return client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        return client.eval(text, len(keys), *keys, *args)


async def arun_script(client: AsyncRedis, sha: str, text: str, keys: Sequence[Any],
                      args: Sequence[Any]) -> Any:
    """:func:`run_script` on an asyncio client."""
    try:
        return await client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        await aload_script(client, text)
    try:
        return await client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(text, len(keys), *keys, *args)


def load_script(client: SyncRedis, text: str) -> str:
    """SCRIPT LOAD ``text`` on the master, or on every node of a cluster (replicas too;
    nodes that do not answer are skipped); returns its SHA."""
    if not is_cluster(client):
        client.script_load(text)
        return script_sha(text)
    for node in client.get_nodes():  # type: ignore[union-attr]
        with contextlib.suppress(redis.RedisError, OSError):
            client.execute_command("SCRIPT LOAD", text, target_nodes=node)
    return script_sha(text)


async def aload_script(client: AsyncRedis, text: str) -> str:
    """:func:`load_script` on an asyncio client."""
    if not is_cluster(client):
        await client.script_load(text)
        return script_sha(text)
    await client.initialize()  # type: ignore[union-attr]  # learn every node first
    for node in client.get_nodes():  # type: ignore[union-attr]
        with contextlib.suppress(redis.RedisError, OSError):
            await client.execute_command("SCRIPT LOAD", text, target_nodes=node)
    return script_sha(text)
