"""Tenants and their API keys in Redis: storage, authentication, cache salts.

A tenant is a hash ``RedisKeys.tenant(T)`` (plain fields: name, weight, quotas, cache-salt
secret) listed in ``RedisKeys.tenants()``. An API key is ``kvp_`` + 256 random bits; Redis
only ever sees its SHA-256, under ``RedisKeys.api_key(hash)`` (the index the gateway looks
up) and in the tenant's ``RedisKeys.tenant_api_keys(T)`` set (for listing and rotation).

The gateway calls :func:`authenticate` (or :func:`authenticate_sync`) with the bearer token
and gets the :class:`Tenant`; the tenant always comes from the key, never from the request.
Admin operations (the ``kvpush tenants`` CLI) are synchronous.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import is_cluster
from kvpush.common.wire import now_ms

logger = logging.getLogger(__name__)

API_KEY_PREFIX = "kvp_"
_API_KEY_RE = re.compile(r"^kvp_[A-Za-z0-9_\-]{43}$")  # token_urlsafe(32) is 43 chars
DEFAULT_AUTH_CACHE_TTL_S = 2.0
"""Longest a gateway keeps using a cached key after it is revoked elsewhere."""
REVOKED_RETENTION_S = 30 * 24 * 3600
"""How long a revoked key's record stays so it is reported as revoked, not unknown."""
_SALT_CONTEXT = b"kvpush/cache-salt/v1|"
_SLUG_RE = re.compile(r"[^a-z0-9_.\-]+")


# -- errors --------------------------------------------------------------------------------


class TenancyError(Exception):
    """Base of every tenancy error."""


class UnknownApiKey(TenancyError):
    """The bearer token is malformed or no such key was ever issued (or it was purged)."""


class RevokedApiKey(TenancyError):
    """The key was issued but is revoked, or its rotation grace period is over."""


class UnknownTenant(TenancyError):
    """No tenant with that id."""


class TenantExists(TenancyError):
    """A tenant with that id already exists."""


# -- model ---------------------------------------------------------------------------------


class Quotas(msgspec.Struct, frozen=True, kw_only=True):
    """Per-tenant limits; 0 means unlimited. Field names double as ``QuotaExceeded`` names."""

    requests_per_second: int = 0
    concurrent_requests: int = 0
    tokens_per_minute: int = 0
    max_prompt_tokens: int = 0
    max_tokens: int = 0

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) < 0:
                raise ValueError(f"quota {name} must be >= 0")


QUOTA_FIELDS: tuple[str, ...] = Quotas.__struct_fields__


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant as stored in ``RedisKeys.tenant(id)`` (flattened into plain hash fields)."""

    id: str
    name: str
    weight: float = 1.0
    quotas: Quotas = Quotas()
    salt_secret: str = ""
    created_ms: int = 0

    def __repr__(self) -> str:
        # The salt secret must not end up in logs or tracebacks.
        return (
            f"Tenant(id={self.id!r}, name={self.name!r}, weight={self.weight!r}, "
            f"quotas={self.quotas!r})"
        )

    __str__ = __repr__


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One issued key, stored as plain fields of ``RedisKeys.api_key(key_hash)``."""

    key_hash: str
    tenant: str
    state: str = "active"  # "active" | "revoked"
    created_ms: int = 0
    expires_ms: int = 0  # 0: no expiry; else end of the rotation grace period (unix ms)
    revoked_ms: int = 0

    def valid_at(self, at_ms: int) -> bool:
        """Whether the key authenticates at wall-clock time ``at_ms``."""
        return self.state == "active" and (self.expires_ms == 0 or at_ms < self.expires_ms)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _tenant_to_fields(tenant: Tenant) -> dict[str, str]:
    out = {
        "name": tenant.name,
        "weight": repr(float(tenant.weight)),
        "salt_secret": tenant.salt_secret,
        "created_ms": str(tenant.created_ms),
    }
    out.update({k: str(v) for k, v in msgspec.structs.asdict(tenant.quotas).items()})
    return out


def _tenant_from_fields(tenant_id: str, raw: dict[Any, Any]) -> Tenant:
    f = _fields(raw)
    quotas = msgspec.convert({k: f[k] for k in QUOTA_FIELDS if k in f}, Quotas, strict=False)
    rest = {k: f[k] for k in ("name", "weight", "salt_secret", "created_ms") if k in f}
    return msgspec.convert({"id": tenant_id, "quotas": quotas, **rest}, Tenant, strict=False)


def _record_from_fields(key_hash: str, raw: dict[Any, Any]) -> ApiKeyRecord:
    return msgspec.convert({"key_hash": key_hash, **_fields(raw)}, ApiKeyRecord, strict=False)


# -- keys, hashes, salts -------------------------------------------------------------------


def hash_api_key(api_key: str) -> str:
    """Hex SHA-256 of an API key: the only form of the key Redis ever sees.

    A plain (unsalted, fast) hash is enough because the key is 256 random bits: there is no
    dictionary to precompute and no brute force to slow down, unlike with passwords; and it
    needs no server-side secret, so every gateway can look keys up with Redis alone.
    """
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    """A fresh API key (``kvp_`` + 43 URL-safe characters = 256 bits from ``secrets``)."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def parse_bearer(authorization: str | None) -> str:
    """The key in an ``Authorization`` header value (``Bearer <key>``) or a bare key."""
    if not authorization:
        raise UnknownApiKey("no API key")
    token = authorization.strip()
    if token[:7].lower() == "bearer ":
        token = token[7:].strip()
    if not _API_KEY_RE.match(token):
        # Cheap rejection of garbage before any Redis round trip.
        raise UnknownApiKey("malformed API key")
    return token


def cache_salt(tenant: Tenant) -> str:
    """vLLM ``cache_salt`` for ``tenant``: HMAC of its id under its secret, stable per tenant.

    Engines only share prefix-cache blocks between requests with equal salts, so one salt per
    tenant isolates tenants' prefix caches (no cross-tenant timing probe) while a tenant's own
    requests still share prefixes. Keyed by a secret so nobody can compute another tenant's
    salt from its id.
    """
    if not tenant.salt_secret:
        raise ValueError(f"tenant {tenant.id!r} has no cache-salt secret")
    return _hmac_salt(tenant.salt_secret, tenant.id)


@functools.lru_cache(maxsize=4096)
def _hmac_salt(secret_hex: str, tenant_id: str) -> str:
    # Keyed by the secret too: a rotated secret is a new salt at once.
    mac = hmac.new(bytes.fromhex(secret_hex), _SALT_CONTEXT + tenant_id.encode(), hashlib.sha256)
    return mac.hexdigest()


def apply_cache_salt(body: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    """Set ``body["cache_salt"]`` to the tenant's salt, overwriting any client-sent value."""
    body["cache_salt"] = cache_salt(tenant)
    return body


def slugify_tenant_id(name: str) -> str:
    """A tenant id usable in Redis keys derived from a display name."""
    slug = _SLUG_RE.sub("-", name.strip().lower()).strip("-.")[:64]
    if not slug:
        raise ValueError(f"cannot derive a tenant id from {name!r}; pass one explicitly")
    return slug


# -- authentication ------------------------------------------------------------------------


class AuthCache:
    """Tiny in-process cache of successful key lookups, keyed by key hash.

    Only successes are cached: caching failures would let a flood of random keys evict real
    entries, and a newly issued key would be refused until the entry expired. An entry lives
    ``ttl_s`` (monotonic clock) and never past its key's own grace expiry (wall clock), so a
    key revoked by another process stops working within ``ttl_s`` at most.
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_AUTH_CACHE_TTL_S,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._wall_ms = wall_ms
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], tuple[float, int, Tenant]] = OrderedDict()

    def get(self, prefix: str, key_hash: str) -> Tenant | None:
        """The cached tenant for a key hash, if the entry is still fresh."""
        if self.ttl_s <= 0:
            return None
        k = (prefix, key_hash)
        with self._lock:
            entry = self._entries.get(k)
            if entry is None:
                return None
            until, expires_ms, tenant = entry
            if self._clock() >= until or (expires_ms and self._wall_ms() >= expires_ms):
                del self._entries[k]
                return None
            self._entries.move_to_end(k)
            return tenant

    def put(self, prefix: str, key_hash: str, tenant: Tenant, expires_ms: int = 0) -> None:
        """Remember a successful lookup."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            self._entries[(prefix, key_hash)] = (self._clock() + self.ttl_s, expires_ms, tenant)
            self._entries.move_to_end((prefix, key_hash))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def invalidate(self, key_hash: str | None = None, tenant_id: str | None = None) -> None:
        """Drop one key, every key of a tenant, or everything (no argument)."""
        with self._lock:
            if key_hash is None and tenant_id is None:
                self._entries.clear()
                return
            for k, (_, _, t) in list(self._entries.items()):
                if k[1] == key_hash or t.id == tenant_id:
                    del self._entries[k]


DEFAULT_AUTH_CACHE = AuthCache()


def _check_record(key_hash: str, raw: dict[Any, Any]) -> ApiKeyRecord:
    if not raw:
        raise UnknownApiKey("unknown API key")
    record = _record_from_fields(key_hash, raw)
    if not record.valid_at(now_ms()):
        raise RevokedApiKey("API key revoked" if record.state != "active" else "API key expired")
    return record


def _tenant_or_revoked(record: ApiKeyRecord, raw: dict[Any, Any]) -> Tenant:
    if not raw:
        # The key outlived its tenant: treat it as revoked rather than as a server error.
        raise RevokedApiKey("API key's tenant no longer exists")
    return _tenant_from_fields(record.tenant, raw)


async def authenticate(
    r: aioredis.Redis,
    bearer_token: str | None,
    *,
    keys: RedisKeys = RedisKeys(),
    cache: AuthCache | None = DEFAULT_AUTH_CACHE,
) -> Tenant:
    """The tenant owning ``bearer_token`` (``Bearer kvp_...`` or the bare key).

    Raises :class:`UnknownApiKey` or :class:`RevokedApiKey`. Two Redis reads on a cache
    miss; none on a hit. Revocation elsewhere is seen within ``cache.ttl_s``.
    """
    key_hash = hash_api_key(parse_bearer(bearer_token))
    if cache is not None and (hit := cache.get(keys.prefix, key_hash)) is not None:
        return hit
    record = _check_record(key_hash, await r.hgetall(keys.api_key(key_hash)))
    tenant = _tenant_or_revoked(record, await r.hgetall(keys.tenant(record.tenant)))
    if cache is not None:
        cache.put(keys.prefix, key_hash, tenant, record.expires_ms)
    return tenant


def authenticate_sync(
    r: redis.Redis,
    bearer_token: str | None,
    *,
    keys: RedisKeys = RedisKeys(),
    cache: AuthCache | None = DEFAULT_AUTH_CACHE,
) -> Tenant:
    """Blocking twin of :func:`authenticate`."""
    key_hash = hash_api_key(parse_bearer(bearer_token))
    if cache is not None and (hit := cache.get(keys.prefix, key_hash)) is not None:
        return hit
    record = _check_record(key_hash, r.hgetall(keys.api_key(key_hash)))
    tenant = _tenant_or_revoked(record, r.hgetall(keys.tenant(record.tenant)))
    if cache is not None:
        cache.put(keys.prefix, key_hash, tenant, record.expires_ms)
    return tenant


async def get_tenant_async(
    r: aioredis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()
) -> Tenant:
    """One tenant by id (for the scheduler's weights); raises :class:`UnknownTenant`."""
    raw = await r.hgetall(keys.tenant(tenant_id))
    if not raw:
        raise UnknownTenant(tenant_id)
    return _tenant_from_fields(tenant_id, raw)


# -- administration (sync: the CLI and tests) ----------------------------------------------


def get_tenant(r: redis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()) -> Tenant:
    """One tenant by id; raises :class:`UnknownTenant`."""
    raw = r.hgetall(keys.tenant(tenant_id))
    if not raw:
        raise UnknownTenant(tenant_id)
    return _tenant_from_fields(tenant_id, raw)


def list_tenants(r: redis.Redis, *, keys: RedisKeys = RedisKeys()) -> list[Tenant]:
    """Every tenant, sorted by id."""
    out = []
    for tid in sorted(_s(t) for t in r.smembers(keys.tenants())):
        try:
            out.append(get_tenant(r, tid, keys=keys))
        except UnknownTenant:
            logger.warning("tenant %s is listed but has no config hash", tid)
    return out


def _issue_key(r: redis.Redis, tenant_id: str, keys: RedisKeys) -> str:
    api_key = new_api_key()
    key_hash = hash_api_key(api_key)
    record = ApiKeyRecord(key_hash=key_hash, tenant=tenant_id, created_ms=now_ms())
    fields = {k: str(v) for k, v in msgspec.structs.asdict(record).items() if k != "key_hash"}
    # Index first, then the tenant's set: a crash between them leaves a working key that
    # `keys`/`rotate` don't list, never a listed key that fails to authenticate.
    r.hset(keys.api_key(key_hash), mapping=fields)
    r.sadd(keys.tenant_api_keys(tenant_id), key_hash)
    return api_key


def create_tenant(
    r: redis.Redis,
    name: str,
    *,
    tenant_id: str | None = None,
    weight: float = 1.0,
    quotas: Quotas = Quotas(),
    keys: RedisKeys = RedisKeys(),
) -> tuple[Tenant, str]:
    """Create a tenant and its first API key; returns both. The key is never shown again."""
    if weight <= 0:
        raise ValueError("weight must be > 0")
    tid = tenant_id or slugify_tenant_id(name)
    keys.tenant(tid)  # validates the id before anything is written
    tenant = Tenant(
        id=tid, name=name, weight=float(weight), quotas=quotas,
        salt_secret=secrets.token_hex(32), created_ms=now_ms(),
    )
    # SADD is the uniqueness guard; the set and the hash are in different Cluster slots, so
    # no MULTI spans both.
    if not r.sadd(keys.tenants(), tid):
        raise TenantExists(tid)
    r.hset(keys.tenant(tid), mapping=_tenant_to_fields(tenant))
    api_key = _issue_key(r, tid, keys)
    logger.info("created tenant %s", tid)
    return tenant, api_key


def update_tenant(
    r: redis.Redis,
    tenant_id: str,
    *,
    name: str | None = None,
    weight: float | None = None,
    keys: RedisKeys = RedisKeys(),
    **quota_changes: int,
) -> Tenant:
    """Change name, weight or any quota field; others stay. Gateways see it within the auth
    cache TTL."""
    current = get_tenant(r, tenant_id, keys=keys)
    unknown = set(quota_changes) - set(QUOTA_FIELDS)
    if unknown:
        raise ValueError(f"unknown quota fields: {sorted(unknown)}")
    if weight is not None and weight <= 0:
        raise ValueError("weight must be > 0")
    # Rebuilt rather than replace()d so __post_init__ validates the new values.
    quotas = Quotas(**{**msgspec.structs.asdict(current.quotas), **quota_changes})
    updated = msgspec.structs.replace(
        current,
        name=current.name if name is None else name,
        weight=current.weight if weight is None else float(weight),
        quotas=quotas,
    )
    r.hset(keys.tenant(tenant_id), mapping=_tenant_to_fields(updated))
    return updated


def rotate_cache_salt(r: redis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()) -> None:
    """New cache-salt secret: the tenant's cached prefixes stop matching (one cold start)."""
    get_tenant(r, tenant_id, keys=keys)
    r.hset(keys.tenant(tenant_id), "salt_secret", secrets.token_hex(32))


def list_api_keys(
    r: redis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()
) -> list[ApiKeyRecord]:
    """Records of a tenant's keys (hashes only), oldest first; purged ones are skipped."""
    out = []
    for h in (_s(x) for x in r.smembers(keys.tenant_api_keys(tenant_id))):
        raw = r.hgetall(keys.api_key(h))
        if raw:
            out.append(_record_from_fields(h, raw))
        else:
            r.srem(keys.tenant_api_keys(tenant_id), h)  # purged after retention
    return sorted(out, key=lambda rec: (rec.created_ms, rec.key_hash))


def _wait_for_replicas(r: redis.Redis, timeout_ms: int = 1000) -> None:
    """Block until the replicas have the last write, so a failover cannot undo a revocation
    (replication is asynchronous: an unreplicated write vanishes with its master)."""
    if is_cluster(r):
        return  # WAIT counts the writes of its own connection, which a Cluster client can't pin
    try:
        n = int(r.info("replication").get("connected_slaves", 0))
    except redis.ResponseError:  # no INFO permission: best effort only
        return
    if n and (acked := int(r.wait(n, timeout_ms))) < n:
        logger.warning("only %s of %s replicas acknowledged the key change", acked, n)


def _revoke_hashes(
    r: redis.Redis, hashes: Iterable[str], keys: RedisKeys, cache: AuthCache | None
) -> int:
    n = 0
    at = now_ms()
    for h in hashes:
        k = keys.api_key(h)
        if not r.exists(k):
            continue
        pipe = r.pipeline(transaction=True)  # one key: fine under Cluster too
        pipe.hset(k, mapping={"state": "revoked", "revoked_ms": str(at)})
        pipe.expire(k, REVOKED_RETENTION_S)
        pipe.execute()
        if cache is not None:
            cache.invalidate(key_hash=h)
        n += 1
    if n:
        _wait_for_replicas(r)
    return n


def revoke_api_key(
    r: redis.Redis,
    api_key: str,
    *,
    keys: RedisKeys = RedisKeys(),
    cache: AuthCache | None = DEFAULT_AUTH_CACHE,
) -> str:
    """Revoke one key now; returns its tenant id. Raises :class:`UnknownApiKey`."""
    key_hash = hash_api_key(parse_bearer(api_key))
    raw = r.hgetall(keys.api_key(key_hash))
    if not raw:
        raise UnknownApiKey("unknown API key")
    record = _record_from_fields(key_hash, raw)
    _revoke_hashes(r, [key_hash], keys, cache)
    logger.info("revoked one API key of tenant %s", record.tenant)
    return record.tenant


def revoke_tenant_keys(
    r: redis.Redis,
    tenant_id: str,
    *,
    keys: RedisKeys = RedisKeys(),
    cache: AuthCache | None = DEFAULT_AUTH_CACHE,
) -> int:
    """Revoke every key of a tenant (the tenant and its config stay); returns how many."""
    get_tenant(r, tenant_id, keys=keys)
    live = [rec.key_hash for rec in list_api_keys(r, tenant_id, keys=keys)
            if rec.state == "active"]
    n = _revoke_hashes(r, live, keys, cache)
    if cache is not None:
        cache.invalidate(tenant_id=tenant_id)
    logger.info("revoked %s API keys of tenant %s", n, tenant_id)
    return n


def issue_api_key(r: redis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()) -> str:
    """An additional key for an existing tenant."""
    get_tenant(r, tenant_id, keys=keys)
    return _issue_key(r, tenant_id, keys)


def rotate_api_key(
    r: redis.Redis,
    tenant_id: str,
    *,
    grace_s: float = 3600.0,
    revoke_old: bool = False,
    keys: RedisKeys = RedisKeys(),
    cache: AuthCache | None = DEFAULT_AUTH_CACHE,
) -> str:
    """Issue a new key; the tenant's other active keys stop working after ``grace_s``
    seconds (or at once with ``revoke_old``). Returns the new key."""
    get_tenant(r, tenant_id, keys=keys)
    old = [rec for rec in list_api_keys(r, tenant_id, keys=keys) if rec.state == "active"]
    new_key = _issue_key(r, tenant_id, keys)
    if revoke_old or grace_s <= 0:
        _revoke_hashes(r, [rec.key_hash for rec in old], keys, cache)
    else:
        until = now_ms() + int(grace_s * 1000)
        for rec in old:
            # Keep an earlier deadline from a previous rotation.
            if rec.expires_ms == 0 or rec.expires_ms > until:
                pipe = r.pipeline(transaction=True)
                pipe.hset(keys.api_key(rec.key_hash), "expires_ms", str(until))
                # Past the grace the record stays long enough to say "revoked".
                pipe.pexpireat(keys.api_key(rec.key_hash), until + REVOKED_RETENTION_S * 1000)
                pipe.execute()
        _wait_for_replicas(r)
    logger.info("rotated API key of tenant %s (%s old keys)", tenant_id, len(old))
    return new_key
