"""Redis connections built from :class:`~common.settings.CommonSettings` (URL, TLS, ACL)."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

from kvpush.common.settings import CommonSettings


class RedisNotConfigured(RuntimeError):
    """A service that needs Redis was started without ``KVPUSH_REDIS_URL``."""


def _kwargs(settings: CommonSettings) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "health_check_interval": 15,
        "socket_keepalive": True,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
    }
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


def _url(settings: CommonSettings) -> str:
    if not settings.redis_url:
        raise RedisNotConfigured("KVPUSH_REDIS_URL is not set")
    return settings.redis_url


def async_redis(settings: CommonSettings) -> aioredis.Redis:
    """An asyncio client (binary responses) for the services."""
    return aioredis.Redis.from_url(_url(settings), **_kwargs(settings))


def sync_redis(settings: CommonSettings) -> redis.Redis:
    """A blocking client (binary responses) for threads inside vLLM and the CLI."""
    return redis.Redis.from_url(_url(settings), **_kwargs(settings))


def lost_connection(exc: BaseException) -> bool:
    """True when ``exc`` means the connection to Redis went away (reset, restart, partition).

    Such errors are retried by every long-running loop rather than ending it.
    """
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError):
        return True
    # uvloop raises this when redis-py reuses a pooled connection whose transport a reset
    # closed under it: a lost connection, not a bug.
    return isinstance(exc, RuntimeError) and "closed=True" in str(exc)
