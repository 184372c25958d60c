"""The connector's settings: a pydantic model of vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Backends that move bytes between two hosts' memories. POSIX, GDS and OBJ are storage
# backends: loadable, but they cannot WRITE into a peer's KV cache.
TRANSFER_BACKENDS = frozenset({"UCX", "LIBFABRIC"})


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` is missing a field or holds an invalid value."""


class ConnectorConfig(BaseModel):
    """Everything the push connector reads from ``kv_connector_extra_config``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    redis_url: str
    """Redis holding agent metadata and the push-target streams."""

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

    late_write_grace_s: float = Field(2.0, ge=0)
    """Decode waits this long past the deadline before reusing blocks, so a write that
    prefill posted just before the deadline cannot land in a reallocated block."""

    failure_policy: Literal["fail", "recompute"] | None = None
    """What decode does with a failed push: ``fail`` the request or ``recompute`` the
    prompt locally. Unset: vLLM's ``kv_load_failure_policy`` decides."""

    layerwise: bool = True
    """Write each layer from ``save_kv_layer`` as soon as it is computed; off: one
    write per step after the forward pass."""

    heartbeat_s: float = Field(2.0, gt=0)
    """Interval between refreshes of this worker's agent metadata in Redis."""

    agent_ttl_s: float = Field(10.0, gt=0)
    """TTL of the agent metadata key; a dead engine's entry vanishes after it."""

    targets_maxlen: int = Field(10_000, gt=0)
    """Approximate cap on the length of a prefill engine's target stream."""

    stats_file: str | None = None
    """Append one JSON line per finished push (bytes, blocks, timings) to this file."""

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
