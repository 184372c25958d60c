"""The connector's settings: a pydantic model of vLLM's ``kv_connector_extra_config``.

Secrets never travel in the extra config (vLLM logs it at startup): Redis credentials and
TLS files come from the engine's ``KVPUSH_REDIS_*`` environment, like every other kvpush
process (see :func:`connector_redis`).
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpush.common.redis_client import (
    RedisNotConfigured,
    RedisTopologyConflict,
    SyncRedis,
    sync_redis,
)
from kvpush.common.settings import CommonSettings

# Backends that move bytes between two hosts' memories. POSIX, GDS and OBJ are storage
# backends: loadable, but they cannot WRITE into a peer's KV cache.
TRANSFER_BACKENDS = frozenset({"UCX", "LIBFABRIC"})


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` is missing a field or holds an invalid value."""


class RedisAccessError(RuntimeError):
    """The connector cannot use Redis: unreachable, refused credentials, or no permission."""


class ConnectorConfig(BaseModel):
    """Everything the push connector reads from ``kv_connector_extra_config``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    redis_url: str | None = None
    """Redis holding agent metadata and the push-target streams; unset: the engine's
    ``KVPUSH_REDIS_URL``. User name, password and TLS files always come from the
    environment (``KVPUSH_REDIS_USERNAME`` / ``_PASSWORD`` / ``_TLS_*``)."""

    engine_id: str
    """This engine's id, as the scheduler and the peers know it."""

    generation: int = 0
    """Engine generation set by the launcher (changes on every start); 0: derived from
    vLLM's instance id, which every rank of one engine shares."""

    key_prefix: str = "kvpush"
    """Prefix of every Redis key (see ``common.keys.RedisKeys``)."""

    backends: list[str] = Field(default_factory=lambda: ["UCX"])
    """NIXL backends, in preference order: ``UCX`` here, ``LIBFABRIC`` on AWS EFA."""

    push_deadline_s: float = Field(30.0, gt=0)
    """Deadline of a push when the request's ``kv_transfer_params`` carry none."""

    max_push_deadline_s: float = Field(300.0, gt=0)
    """Longest a request may hold decode blocks waiting for its push, whatever deadline
    its ``kv_transfer_params`` ask for (a request sent straight to an engine cannot pin
    blocks for longer)."""

    late_write_grace_s: float = Field(2.0, ge=1.5)
    """Decode waits this long past the deadline for a late PushDone before it gives the
    push up; the blocks then stay quarantined until prefill fenced its WRITEs (at most
    ``quarantine_max_s``). Prefill stops waiting for its WRITEs 1 s past the deadline,
    hence the 1.5 s floor."""

    quarantine_max_s: float = Field(60.0, gt=0)
    """Longest decode keeps a failed or abandoned receive's blocks from vLLM (quarantined)
    waiting for every prefill rank that writes them to say that none of its WRITEs can
    still land (``PushDone.fenced``). Past it the blocks go back anyway, counted as cut
    off (``kvpush_kv_quarantines_total{end="cut_off"}``) and logged with the prefill."""

    failure_policy: Literal["fail", "recompute"] | None = None
    """What decode does with a failed push: ``fail`` the request or ``recompute`` the
    prompt locally. Unset: vLLM's ``kv_load_failure_policy`` decides."""

    history_source: bool = True
    """A decode engine also reads its target stream, so it can push a prefix it holds (a
    conversation's earlier turns) into blocks a prefill reserved for it (the history
    push). Prefill engines always read theirs."""

    history_deadline_s: float = Field(10.0, gt=0)
    """Longest a prefill waits for a history push (a conversation's earlier turns, from
    the engine holding them) before it computes the history itself."""

    layerwise: bool = True
    """Write each layer from ``save_kv_layer`` as soon as it is computed; off: one
    write per step after the forward pass."""

    heartbeat_s: float = Field(2.0, gt=0)
    """Interval between refreshes of this worker's agent metadata in Redis."""

    agent_ttl_s: float = Field(10.0, gt=0)
    """TTL of the agent metadata key; a dead engine's entry vanishes after it."""

    targets_maxlen: int = Field(10_000, gt=0)
    """Approximate cap on the length of a prefill engine's target stream."""

    verify_kv: float | None = Field(None, ge=0.0, le=1.0)
    """Share of pushes checksummed end to end; unset: ``KVPUSH_VERIFY_KV`` (default 0).
    Prefill's rate decides; decode verifies every push that arrives with checksums."""

    stats_file: str | None = None
    """Append one JSON line per finished push (bytes, blocks, timings) to this file."""

    otlp_endpoint: str | None = None
    """OTLP traces endpoint for the connector's spans; unset: ``KVPUSH_OTLP_ENDPOINT``,
    and tracing is off when neither is set."""

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one NIXL backend is required")
        bad = [b for b in value if b not in TRANSFER_BACKENDS]
        if bad:
            raise ValueError(
                f"unsupported NIXL backend(s) {bad}: kvpush writes peer memory with "
                f"{sorted(TRANSFER_BACKENDS)}"
            )
        return value

    @classmethod
    def from_extra(
        cls, extra: dict[str, Any] | None, engine_id: str | None = None
    ) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; ``engine_id`` is the fallback engine id."""
        data = dict(extra or {})
        if not data.get("engine_id") and engine_id:
            data["engine_id"] = engine_id
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConnectorConfigError(f"invalid kv_connector_extra_config: {exc}") from exc


def _redacted(url: str) -> str:
    """``url`` without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def connector_redis(cfg: ConnectorConfig, *, check: bool = True,
                    timeout_s: float | None = None) -> SyncRedis:
    """A Redis client with the engine's ``KVPUSH_REDIS_*`` credentials and TLS applied.

    ``cfg.redis_url`` overrides ``KVPUSH_REDIS_URL``. With ``check`` the client PINGs once,
    so an engine with missing or wrong credentials refuses to start with a clear error
    instead of logging failed background writes for every request. ``timeout_s`` replaces
    both socket timeouts (connect and reply) and turns redis-py's own retries off.
    """
    overrides: dict[str, object] = {"redis_url": cfg.redis_url} if cfg.redis_url else {}
    if timeout_s is not None:
        overrides["redis_socket_timeout_s"] = timeout_s
        overrides["redis_connect_timeout_s"] = timeout_s
    settings = CommonSettings(**overrides)
    try:
        client = sync_redis(settings)
    except RedisNotConfigured as exc:
        raise RedisAccessError(
            "kvpush connector needs Redis: set redis_url in kv_connector_extra_config, "
            "KVPUSH_REDIS_URL or KVPUSH_REDIS_SENTINELS"
        ) from exc
    except RedisTopologyConflict as exc:
        raise RedisAccessError(f"kvpush connector: {exc}") from exc
    if timeout_s is not None and hasattr(client, "set_retry"):
        # redis-py retries a refused connection three times with backoff (seconds): the
        # caller of a short-timeout client has a fallback of its own.
        client.set_retry(Retry(NoBackoff(), 0))
    if check:
        check_redis(client, settings.redis_url or "", settings.redis_username)
    return client


def check_redis(client: SyncRedis, url: str, username: str | None = None) -> None:
    """PING ``client``; raise :class:`RedisAccessError` naming what to fix."""
    try:
        client.ping()
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
        user = username or urlsplit(url).username
        who = f"user {user!r}" if user else "the default user"
        raise RedisAccessError(
            f"Redis at {_redacted(url)} refused {who}: {exc}; set KVPUSH_REDIS_USERNAME and "
            "KVPUSH_REDIS_PASSWORD in the engine's environment"
        ) from exc
    except redis.RedisError as exc:
        raise RedisAccessError(f"cannot use Redis at {_redacted(url)}: {exc}") from exc
