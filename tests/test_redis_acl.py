"""Real Redis ACL users per tenant: tenant A's user gets NOPERM on everything of tenant B's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import NoPermissionError

from kvpush.common.acl import (
    apply_tenant_acl,
    tenant_acl_command,
    tenant_acl_rules,
    tenant_acl_username,
)
from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import SyncQuotaLimiter
from kvpush.common.tenancy import Quotas, create_tenant, hash_api_key

K = RedisKeys()


@pytest.fixture
def acl_users(redis_client: redis.Redis) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for user in made:
        redis_client.acl_deluser(user)


def _connect(redis_url: str, user: str, password: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, username=user, password=password)


def test_tenant_user_confined_to_own_keys(
    redis_url: str, redis_client: redis.Redis, acl_users: list[str]
) -> None:
    quotas = Quotas(requests_per_second=100, concurrent_requests=5, tokens_per_minute=10_000)
    ta, key_a = create_tenant(redis_client, "a", quotas=quotas)
    tb, key_b = create_tenant(redis_client, "b", quotas=quotas)
    # B has live counters that A must not be able to read or reset.
    SyncQuotaLimiter(redis_client).admit(tb, 5, 5)

    acl_users.append(apply_tenant_acl(redis_client, "a", "pw-a"))
    ra = _connect(redis_url, tenant_acl_username("a"), "pw-a")
    try:
        assert ra.ping()

        # A's own keys work: its config and key hashes are readable, quotas run.
        assert ra.hget(K.tenant("a"), "name") == b"a"
        assert hash_api_key(key_a).encode() in ra.smembers(K.tenant_api_keys("a"))
        lim = SyncQuotaLimiter(ra)
        adm = lim.admit(ta, 10, 10)
        assert adm.renew()
        assert adm.release(15) == 5
        ra.set(K.tenant_quota("a", "scratch"), "1")
        assert ra.get(K.tenant_quota("a", "scratch")) == b"1"
        assert ra.delete(K.tenant_quota("a", "scratch")) == 1

        # ...but A cannot raise its own quotas.
        with pytest.raises(NoPermissionError):
            ra.hset(K.tenant("a"), "requests_per_second", "1000000")

        # Every read and write of B's keys is refused.
        with pytest.raises(NoPermissionError):
            ra.hgetall(K.tenant("b"))
        with pytest.raises(NoPermissionError):
            ra.hset(K.tenant("b"), "requests_per_second", "0")
        with pytest.raises(NoPermissionError):
            ra.smembers(K.tenant_api_keys("b"))
        with pytest.raises(NoPermissionError):
            ra.zcard(K.tenant_quota("b", "rate"))
        with pytest.raises(NoPermissionError):
            ra.delete(K.tenant_quota("b", "leases"))
        with pytest.raises(NoPermissionError):
            ra.set(K.tenant_quota("b", "tokens.sum"), "0")
        # Running the quota script on B's keys fails too (EVALSHA checks its declared keys).
        with pytest.raises(NoPermissionError):
            lim.admit(tb, 1, 1)

        # Shared keys: the key index, the tenant list, key enumeration, server-wide damage.
        with pytest.raises(NoPermissionError):
            ra.hgetall(K.api_key(hash_api_key(key_b)))
        with pytest.raises(NoPermissionError):
            ra.smembers(K.tenants())
        with pytest.raises(NoPermissionError):
            ra.keys("*")
        with pytest.raises(NoPermissionError):
            ra.scan()
        with pytest.raises(NoPermissionError):
            ra.flushall()
        with pytest.raises(NoPermissionError):
            ra.execute_command("FUNCTION", "FLUSH")
        with pytest.raises(NoPermissionError):
            ra.execute_command("SCRIPT", "FLUSH")
    finally:
        ra.close()

    # B's state is intact.
    assert redis_client.hget(K.tenant("b"), "requests_per_second") == b"100"
    assert redis_client.zcard(K.tenant_quota("b", "rate")) == 1


def test_read_only_tenant_user(
    redis_url: str, redis_client: redis.Redis, acl_users: list[str]
) -> None:
    ta, _ = create_tenant(redis_client, "a", quotas=Quotas(requests_per_second=10))
    create_tenant(redis_client, "b")
    SyncQuotaLimiter(redis_client).admit(ta, 1, 1)
    acl_users.append(apply_tenant_acl(redis_client, "a", "pw-ro", read_only=True))
    ra = _connect(redis_url, tenant_acl_username("a"), "pw-ro")
    try:
        assert ra.zcard(K.tenant_quota("a", "rate")) == 1
        assert ra.hget(K.tenant("a"), "name") == b"a"
        with pytest.raises(NoPermissionError):
            ra.delete(K.tenant_quota("a", "rate"))
        with pytest.raises(NoPermissionError):
            ra.hgetall(K.tenant("b"))
        with pytest.raises(NoPermissionError):
            SyncQuotaLimiter(ra).admit(ta, 1, 1)
    finally:
        ra.close()


def test_wrong_password_is_refused(
    redis_url: str, redis_client: redis.Redis, acl_users: list[str]
) -> None:
    create_tenant(redis_client, "a")
    acl_users.append(apply_tenant_acl(redis_client, "a", "right"))
    bad = _connect(redis_url, tenant_acl_username("a"), "wrong")
    with pytest.raises(redis.AuthenticationError):
        bad.ping()
    bad.close()


def test_emitted_rules_hold_no_plaintext_password() -> None:
    rules = tenant_acl_rules("acme", "s3cret-pw", extra_read_patterns=["kvpush:engines"])
    line = tenant_acl_command(tenant_acl_username("acme"), rules)
    assert "s3cret-pw" not in line
    assert line.startswith("ACL SETUSER kvpush-tenant-acme reset on #")
    assert f"%R~{K.tenant_pattern('acme')}" in rules
    assert f"~{K.tenant_quota_pattern('acme')}" in rules
    assert "%R~kvpush:engines" in rules
    ro = tenant_acl_rules("acme", "pw", read_only=True)
    assert not any(r.startswith("~") or r == "+@write" for r in ro)
