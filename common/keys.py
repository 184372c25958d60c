"""Redis key names: the only place a kvpush key is spelled.

Keys that one Lua script touches share a hash tag (``{...}``) so they live in one Redis
Cluster slot. Tenant-scoped keys sit under ``<prefix>:t:{<tenant>}:`` so a per-tenant Redis
ACL user can be limited to ``~<prefix>:t:{<tenant>}:*``.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class InvalidKeyPart(ValueError):
    """An id used in a Redis key contains characters that could break the key layout."""


def valid_id(value: str) -> bool:
    """Whether ``value`` may name an engine, request or tenant in a key."""
    return bool(_SAFE.fullmatch(value))


def _part(value: str) -> str:
    if not _SAFE.fullmatch(value):
        raise InvalidKeyPart(f"invalid id for a Redis key: {value!r}")
    return value


def request_shard(request_id: str, shards: int) -> int:
    """The shard of ``request_id`` among ``shards``: CRC-32 of the id, the same in every
    process (unlike ``hash()``), so a retried or duplicated id lands where its first copy
    did, and random ids spread evenly. Every scheduler reads every shard, so which shard a
    request takes changes nothing about its tenant's fair share."""
    if shards <= 1:
        return 0
    return zlib.crc32(request_id.encode()) % shards


@dataclass(frozen=True)
class RedisKeys:
    """Key names under one prefix."""

    prefix: str = "kvpush"

    # -- engines (infrastructure, not tenant-scoped) ------------------------------------
    def engines(self) -> str:
        """Sorted set of engine ids scored by last heartbeat (unix ms)."""
        return f"{self.prefix}:engines"

    def engine(self, engine_id: str) -> str:
        """Hash of one engine's status; shares its slot with the engine's reservations."""
        return f"{self.prefix}:engine:{{{_part(engine_id)}}}"

    def reservations(self, engine_id: str) -> str:
        """Hash of reservations on decode engine ``engine_id`` (Lua-managed)."""
        return f"{self.prefix}:resv:{{{_part(engine_id)}}}"

    def reservation_leases(self, engine_id: str) -> str:
        """Sorted set of reservation ids on ``engine_id`` scored by lease expiry (unix ms)."""
        return f"{self.prefix}:resvexp:{{{_part(engine_id)}}}"

    def reservations_pattern(self) -> str:
        """SCAN pattern matching every engine's reservation hash (sweeps, leak checks)."""
        return f"{self.prefix}:resv:*"

    def fence(self, engine_id: str) -> str:
        """Counter handing out fencing tokens for reservations on ``engine_id``."""
        return f"{self.prefix}:fence:{{{_part(engine_id)}}}"

    def agent(self, engine_id: str, rank: int) -> str:
        """NIXL agent metadata and KV layout of one worker rank."""
        return f"{self.prefix}:agent:{{{_part(engine_id)}}}:{int(rank)}"

    def agent_pattern(self, engine_id: str) -> str:
        """ACL key pattern covering the agent keys of every worker rank of ``engine_id``."""
        return f"{self.prefix}:agent:{{{_part(engine_id)}}}:*"

    def targets(self, prefill_engine_id: str) -> str:
        """Stream of push targets published by decode connectors for one prefill engine."""
        return f"{self.prefix}:targets:{{{_part(prefill_engine_id)}}}"

    # -- request flow -------------------------------------------------------------------
    def requests(self, shard: int = 0) -> str:
        """Stream (shard ``shard``) of the requests the gateways enqueue for the schedulers.

        Shard 0 keeps the name the stream had before it was sharded, so the default of one
        shard reads and writes the same stream as ever (a rolling upgrade keeps its consumer
        group and pending entries). Shard ``i > 0`` has the hash tag ``{shard-i}``: each
        shard is one key in its own Cluster slot, spread over the masters like any key.
        """
        if shard == 0:
            return f"{self.prefix}:requests"
        if shard < 0:
            raise InvalidKeyPart(f"invalid request shard {shard!r}")
        return f"{self.prefix}:requests:{{shard-{int(shard)}}}"

    def request_streams(self, shards: int) -> list[str]:
        """Every request stream of ``shards`` shards, by shard index."""
        return [self.requests(i) for i in range(max(1, shards))]

    def request_shards_pattern(self) -> str:
        """ACL pattern covering every request-stream shard but shard 0 (:meth:`requests`)."""
        return f"{self.prefix}:requests:{{shard-*}}"

    def requests_for(self, request_id: str, shards: int) -> str:
        """The request stream ``request_id`` goes to (see :func:`request_shard`)."""
        return self.requests(request_shard(request_id, shards))

    def assignments(self, gateway_id: str) -> str:
        """Stream of assignments the schedulers answer to one gateway."""
        return f"{self.prefix}:assign:{{{_part(gateway_id)}}}"

    def request_once(self, request_id: str) -> str:
        """Marker that makes a duplicate request id reserve only once."""
        return f"{self.prefix}:once:{{{_part(request_id)}}}"

    def kv_chunks(self, engine_id: str) -> str:
        """Set of the prefix hashes (common/prefix_hashes.py) whose blocks ``engine_id``
        holds, mirrored from its KV events (services/engine/kv_events.py)."""
        return f"{self.prefix}:kv:{{{_part(engine_id)}}}"

    def prefix_affinity(self, window: int) -> str:
        """Hash of prefix hash -> "<decode>|<prefill>" placed in one time window."""
        return f"{self.prefix}:affinity:{{w{int(window)}}}"

    def prefix_affinity_pattern(self) -> str:
        """ACL pattern covering every window of :meth:`prefix_affinity`."""
        return f"{self.prefix}:affinity:*"

    def slo_reports(self) -> str:
        """Hash of gateway id -> its :class:`~kvpush.common.wire.GatewaySlo`."""
        return f"{self.prefix}:slo"

    def planner_lead(self) -> str:
        """Lease naming the scheduler whose planner decides (one per fleet)."""
        return f"{self.prefix}:planner:lead"

    def fleet_plan(self) -> str:
        """The leading planner's :class:`~kvpush.common.wire.FleetPlan`."""
        return f"{self.prefix}:planner:plan"

    def dead_letters(self) -> str:
        """Stream of poison entries moved aside after too many deliveries."""
        return f"{self.prefix}:dead"

    # -- tenants ------------------------------------------------------------------------
    def tenants(self) -> str:
        """Set of tenant ids."""
        return f"{self.prefix}:tenants"

    def api_key(self, key_hash: str) -> str:
        """Maps a hashed API key to its tenant id."""
        return f"{self.prefix}:apikey:{_part(key_hash)}"

    def tenant(self, tenant_id: str) -> str:
        """Hash of one tenant: name, quotas, weight, cache salt secret."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:config"

    def tenant_scoped(self, tenant_id: str, name: str) -> str:
        """Any further per-tenant key (quota counters, usage); all share the tenant's slot."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:{_part(name)}"

    def tenant_api_keys(self, tenant_id: str) -> str:
        """Set of the hashes of one tenant's API keys (active, in grace or revoked)."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:apikeys"

    def tenant_quota(self, tenant_id: str, name: str) -> str:
        """One quota counter of a tenant (Lua-managed, in the tenant's slot)."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:q:{_part(name)}"

    def tenant_quota_pattern(self, tenant_id: str) -> str:
        """ACL key pattern covering a tenant's quota counters and nothing else of it."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:q:*"

    def tenant_responses(self, tenant_id: str) -> str:
        """Hash of a tenant's stored responses: response id -> its compressed
        :class:`~kvpush.common.wire.StoredResponse` (services/gateway/response_store.py)."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:resp:items"

    def tenant_response_expiry(self, tenant_id: str) -> str:
        """Sorted set of a tenant's stored response ids scored by expiry (unix ms)."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:resp:expiry"

    def tenant_response_bytes(self, tenant_id: str) -> str:
        """Counter of the bytes a tenant's stored responses take (bounded per tenant)."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:resp:bytes"

    def tenant_responses_pattern(self, tenant_id: str) -> str:
        """ACL key pattern covering a tenant's stored-response keys and nothing else of it."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:resp:*"

    def tenant_pattern(self, tenant_id: str) -> str:
        """ACL key pattern that covers exactly one tenant's keys."""
        return f"{self.prefix}:t:{{{_part(tenant_id)}}}:*"
