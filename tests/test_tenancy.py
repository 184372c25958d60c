"""Tenants and API keys on real Redis: hashed storage, auth errors, rotation, revocation, salts."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.common import tenancy
from kvpush.common.keys import RedisKeys
from kvpush.common.tenancy import (
    AuthCache,
    Quotas,
    RevokedApiKey,
    TenantExists,
    UnknownApiKey,
    UnknownTenant,
    authenticate,
    authenticate_sync,
    cache_salt,
    create_tenant,
)
from kvpush.services.local.local_redis import free_port


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _all_redis_bytes(r: redis.Redis) -> list[bytes]:
    """Every key name and every stored value, whatever the type."""
    out: list[bytes] = []
    for key in r.scan_iter(count=1000):
        out.append(key)
        kind = r.type(key)
        if kind == b"string":
            out.append(r.get(key))
        elif kind == b"hash":
            for f, v in r.hgetall(key).items():
                out += [f, v]
        elif kind == b"set":
            out += list(r.smembers(key))
        elif kind == b"zset":
            out += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        elif kind == b"list":
            out += r.lrange(key, 0, -1)
        else:
            pytest.fail(f"unexpected key type {kind!r} for {key!r}")
    return out


def test_no_plaintext_key_anywhere_in_redis(redis_client: redis.Redis) -> None:
    issued = []
    _, k = create_tenant(redis_client, "Acme Corp", quotas=Quotas(requests_per_second=5))
    issued.append(k)
    issued.append(tenancy.issue_api_key(redis_client, "acme-corp"))
    issued.append(tenancy.rotate_api_key(redis_client, "acme-corp", grace_s=60))
    _, k2 = create_tenant(redis_client, "other")
    issued.append(k2)
    tenancy.revoke_api_key(redis_client, k2)

    blobs = _all_redis_bytes(redis_client)
    assert blobs, "nothing was stored"
    for key in issued:
        secret = key.removeprefix("kvp_").encode()
        assert not any(secret in b for b in blobs), "an API key is stored in plaintext"
        # ...while its hash is what the index is keyed by.
        assert redis_client.exists(RedisKeys().api_key(tenancy.hash_api_key(key)))


def test_authenticate_maps_key_to_tenant(redis_client: redis.Redis) -> None:
    tenant, key = create_tenant(redis_client, "acme", weight=2.5,
                                quotas=Quotas(max_tokens=64, concurrent_requests=3))
    got = authenticate_sync(redis_client, f"Bearer {key}", cache=None)
    assert got == tenant
    assert got.weight == 2.5 and got.quotas.max_tokens == 64
    assert authenticate_sync(redis_client, key, cache=None) == tenant
    assert tenancy.get_tenant(redis_client, "acme") == tenant


@pytest.mark.parametrize(
    "token",
    [None, "", "Bearer", "Bearer kvp_short", "kvp_" + "x" * 43 + "!", "sk-abc",
     "kvp_" + "A" * 43],  # well-formed but never issued
)
def test_unknown_keys_raise_unknown_api_key(redis_client: redis.Redis, token: str | None) -> None:
    create_tenant(redis_client, "acme")
    with pytest.raises(UnknownApiKey):
        authenticate_sync(redis_client, token, cache=None)


def test_revoked_key_raises_revoked(redis_client: redis.Redis) -> None:
    _, key = create_tenant(redis_client, "acme")
    assert tenancy.revoke_api_key(redis_client, key) == "acme"
    with pytest.raises(RevokedApiKey):
        authenticate_sync(redis_client, key, cache=None)
    # The tombstone is kept for a while, then purged (then the key is merely unknown).
    ttl = redis_client.ttl(RedisKeys().api_key(tenancy.hash_api_key(key)))
    assert 0 < ttl <= tenancy.REVOKED_RETENTION_S


def test_revoke_whole_tenant(redis_client: redis.Redis) -> None:
    _, k1 = create_tenant(redis_client, "acme")
    k2 = tenancy.issue_api_key(redis_client, "acme")
    _, other = create_tenant(redis_client, "other")
    assert tenancy.revoke_tenant_keys(redis_client, "acme") == 2
    for k in (k1, k2):
        with pytest.raises(RevokedApiKey):
            authenticate_sync(redis_client, k, cache=None)
    assert authenticate_sync(redis_client, other, cache=None).id == "other"


def test_rotation_with_grace_then_expiry(redis_client: redis.Redis) -> None:
    _, old = create_tenant(redis_client, "acme")
    new = tenancy.rotate_api_key(redis_client, "acme", grace_s=3600)
    assert new != old
    # Both work during the grace period.
    assert authenticate_sync(redis_client, old, cache=None).id == "acme"
    assert authenticate_sync(redis_client, new, cache=None).id == "acme"
    recs = {r.key_hash: r for r in tenancy.list_api_keys(redis_client, "acme")}
    assert recs[tenancy.hash_api_key(old)].expires_ms > 0
    assert recs[tenancy.hash_api_key(new)].expires_ms == 0
    # Grace over (end it now rather than wait): the old key is refused as revoked.
    redis_client.hset(RedisKeys().api_key(tenancy.hash_api_key(old)), "expires_ms",
                      str(tenancy.now_ms() - 1))
    with pytest.raises(RevokedApiKey):
        authenticate_sync(redis_client, old, cache=None)
    assert authenticate_sync(redis_client, new, cache=None).id == "acme"


def test_rotation_revoke_old(redis_client: redis.Redis) -> None:
    _, old = create_tenant(redis_client, "acme")
    extra = tenancy.issue_api_key(redis_client, "acme")
    new = tenancy.rotate_api_key(redis_client, "acme", revoke_old=True)
    for k in (old, extra):
        with pytest.raises(RevokedApiKey):
            authenticate_sync(redis_client, k, cache=None)
    assert authenticate_sync(redis_client, new, cache=None).id == "acme"
    states = sorted(r.state for r in tenancy.list_api_keys(redis_client, "acme"))
    assert states == ["active", "revoked", "revoked"]


def test_cache_sees_revocation_within_ttl(redis_client: redis.Redis) -> None:
    """Another process revokes the key: this one refuses it once its cache entry ages out."""
    clock = FakeClock()
    cache = AuthCache(ttl_s=2.0, clock=clock)
    _, key = create_tenant(redis_client, "acme")
    assert authenticate_sync(redis_client, key, cache=cache).id == "acme"
    # Revoked elsewhere: this process's cache is not told.
    tenancy.revoke_api_key(redis_client, key, cache=None)
    clock.t += 1.9
    assert authenticate_sync(redis_client, key, cache=cache).id == "acme"  # within the bound
    clock.t += 0.2
    with pytest.raises(RevokedApiKey):
        authenticate_sync(redis_client, key, cache=cache)


def test_revocation_in_process_is_immediate(redis_client: redis.Redis) -> None:
    cache = AuthCache(ttl_s=3600.0)
    _, key = create_tenant(redis_client, "acme")
    authenticate_sync(redis_client, key, cache=cache)
    tenancy.revoke_api_key(redis_client, key, cache=cache)
    with pytest.raises(RevokedApiKey):
        authenticate_sync(redis_client, key, cache=cache)


def test_cache_never_outlives_grace_expiry(redis_client: redis.Redis) -> None:
    wall = [tenancy.now_ms()]
    cache = AuthCache(ttl_s=3600.0, wall_ms=lambda: wall[0])
    _, old = create_tenant(redis_client, "acme")
    tenancy.rotate_api_key(redis_client, "acme", grace_s=10)
    assert authenticate_sync(redis_client, old, cache=cache).id == "acme"
    wall[0] += 11_000
    assert cache.get("kvpush", tenancy.hash_api_key(old)) is None


def test_cache_hit_skips_redis(redis_client: redis.Redis) -> None:
    cache = AuthCache(ttl_s=60.0)
    _, key = create_tenant(redis_client, "acme")
    authenticate_sync(redis_client, key, cache=cache)
    redis_client.flushall()  # a hit must not need Redis
    assert authenticate_sync(redis_client, key, cache=cache).id == "acme"
    with pytest.raises(UnknownApiKey):
        authenticate_sync(redis_client, key, cache=None)


def test_async_authenticate(redis_url: str, redis_client: redis.Redis) -> None:
    tenant, key = create_tenant(redis_client, "acme")

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        try:
            cache = AuthCache()
            got = await asyncio.gather(*[authenticate(r, f"Bearer {key}", cache=cache)
                                         for _ in range(20)])
            assert all(t == tenant for t in got)
            with pytest.raises(UnknownApiKey):
                await authenticate(r, "Bearer kvp_" + "B" * 43, cache=cache)
            tenancy.revoke_api_key(redis_client, key, cache=cache)
            with pytest.raises(RevokedApiKey):
                await authenticate(r, key, cache=cache)
            assert await tenancy.get_tenant_async(r, "acme") == tenant
            with pytest.raises(UnknownTenant):
                await tenancy.get_tenant_async(r, "nope")
        finally:
            await r.aclose()

    asyncio.run(main())


def test_key_of_deleted_tenant_is_revoked(redis_client: redis.Redis) -> None:
    _, key = create_tenant(redis_client, "acme")
    redis_client.delete(RedisKeys().tenant("acme"))
    with pytest.raises(RevokedApiKey):
        authenticate_sync(redis_client, key, cache=None)


def test_cache_salts_differ_per_tenant_and_are_stable(redis_client: redis.Redis) -> None:
    a, ka = create_tenant(redis_client, "a")
    b, _ = create_tenant(redis_client, "b")
    salt_a = cache_salt(a)
    assert salt_a != cache_salt(b)
    # Stable across reloads and processes: derived from what Redis stores.
    assert cache_salt(authenticate_sync(redis_client, ka, cache=None)) == salt_a
    assert cache_salt(tenancy.get_tenant(redis_client, "a")) == salt_a
    # A client-sent salt is overwritten by the tenant's.
    body = tenancy.apply_cache_salt({"prompt": "x", "cache_salt": cache_salt(b)}, a)
    assert body["cache_salt"] == salt_a
    # The salt secret never shows in repr (logs, tracebacks).
    assert a.salt_secret not in repr(a) and a.salt_secret not in str(a)
    tenancy.rotate_cache_salt(redis_client, "a")
    assert cache_salt(tenancy.get_tenant(redis_client, "a")) != salt_a


def test_same_name_salt_differs_across_deployments(redis_url: str) -> None:
    # Two tenants with the same id in different prefixes get independent secrets.
    r = redis.Redis.from_url(redis_url)
    a, _ = create_tenant(r, "acme", keys=RedisKeys("one"))
    b, _ = create_tenant(r, "acme", keys=RedisKeys("two"))
    assert cache_salt(a) != cache_salt(b)
    r.close()


def test_duplicate_tenant_and_updates(redis_client: redis.Redis) -> None:
    create_tenant(redis_client, "acme")
    with pytest.raises(TenantExists):
        create_tenant(redis_client, "ACME")  # same slug
    t = tenancy.update_tenant(redis_client, "acme", weight=3, requests_per_second=7)
    assert t.weight == 3.0 and t.quotas.requests_per_second == 7
    assert tenancy.get_tenant(redis_client, "acme") == t
    with pytest.raises(ValueError):
        tenancy.update_tenant(redis_client, "acme", max_tokens=-1)
    with pytest.raises(ValueError):
        tenancy.update_tenant(redis_client, "acme", bogus=1)
    with pytest.raises(UnknownTenant):
        tenancy.update_tenant(redis_client, "nope", weight=1)
    assert [x.id for x in tenancy.list_tenants(redis_client)] == ["acme"]


def test_tenant_ids_are_key_safe() -> None:
    assert tenancy.slugify_tenant_id("Acme Corp!") == "acme-corp"
    with pytest.raises(ValueError):
        tenancy.slugify_tenant_id("!!!")


@pytest.fixture
def replica(redis_server, tmp_path):
    """A real replica of the test Redis, linked up."""
    port = free_port()
    # The master otherwise waits 5 s for more replicas before the first sync.
    redis.Redis(port=redis_server.port).config_set("repl-diskless-sync-delay", 0)
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path),
         "--save", "", "--appendonly", "no", "--replicaof", "127.0.0.1", str(redis_server.port),
         "--logfile", str(tmp_path / "replica.log")],
    )
    client = redis.Redis(port=port)
    try:
        for _ in range(200):
            try:
                if client.info("replication").get("master_link_status") == "up":
                    break
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail("replica did not link up")
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_revocation_is_on_the_replica_when_it_returns(redis_client: redis.Redis,
                                                      replica: redis.Redis) -> None:
    """A failover right after `revoke` cannot resurrect the key: the replica already has it."""
    _, key = create_tenant(redis_client, "acme")
    _, other = create_tenant(redis_client, "other")
    new = tenancy.rotate_api_key(redis_client, "other", grace_s=60)
    tenancy.revoke_api_key(redis_client, key, cache=None)
    # Read the replica at once, as a promoted replica would answer.
    with pytest.raises(RevokedApiKey):
        authenticate_sync(replica, key, cache=None)
    old_rec = replica.hgetall(RedisKeys().api_key(tenancy.hash_api_key(other)))
    assert int(old_rec[b"expires_ms"]) > 0
    assert authenticate_sync(replica, new, cache=None).id == "other"


@settings(max_examples=50)
@given(
    name=st.text(min_size=1, max_size=40),
    weight=st.floats(0.001, 1000, allow_nan=False),
    q=st.lists(st.integers(0, 10**9), min_size=5, max_size=5),
)
def test_tenant_hash_fields_roundtrip(name: str, weight: float, q: list[int]) -> None:
    t = tenancy.Tenant(id="acme", name=name, weight=weight,
                       quotas=Quotas(**dict(zip(tenancy.QUOTA_FIELDS, q, strict=True))),
                       salt_secret="ab" * 32, created_ms=123)
    raw = {k.encode(): v.encode() for k, v in tenancy._tenant_to_fields(t).items()}
    assert tenancy._tenant_from_fields("acme", raw) == t
