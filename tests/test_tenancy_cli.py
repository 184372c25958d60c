"""``kvpush tenants`` end to end against a real Redis."""

from __future__ import annotations

import json

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.tenancy import (
    AuthCache,
    RevokedApiKey,
    authenticate_sync,
    get_tenant,
    list_api_keys,
)
from kvpush.services.cli.main import main as kvpush


@pytest.fixture
def cli(redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("KVPUSH_REDIS_URL", redis_url)

    def run(*argv: str) -> tuple[int, str, str]:
        rc = kvpush(["tenants", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def _auth(r: redis.Redis, key: str) -> str:
    return authenticate_sync(r, key, cache=AuthCache(ttl_s=0)).id


def test_add_list_set_quota(cli, redis_client: redis.Redis) -> None:
    rc, out, err = cli("add", "Acme Corp", "--weight", "2", "--rps", "5", "--concurrency", "3",
                       "--tpm", "9000", "--max-prompt", "512", "--max-tokens", "128")
    assert rc == 0
    key = out.strip()
    assert key.startswith("kvp_") and "\n" not in key  # the key alone on stdout
    assert key not in err
    t = get_tenant(redis_client, "acme-corp")
    assert t.name == "Acme Corp" and t.weight == 2.0
    assert (t.quotas.requests_per_second, t.quotas.concurrent_requests,
            t.quotas.tokens_per_minute, t.quotas.max_prompt_tokens,
            t.quotas.max_tokens) == (5, 3, 9000, 512, 128)
    assert _auth(redis_client, key) == "acme-corp"

    rc, _, _ = cli("set-quota", "acme-corp", "--rps", "0", "--weight", "0.5")
    assert rc == 0
    t = get_tenant(redis_client, "acme-corp")
    assert t.quotas.requests_per_second == 0 and t.weight == 0.5
    assert t.quotas.concurrent_requests == 3  # untouched

    rc, out, _ = cli("list", "--json")
    rows = json.loads(out)
    assert [r["id"] for r in rows] == ["acme-corp"]
    assert rows[0]["active_keys"] == 1 and rows[0]["quotas"]["tokens_per_minute"] == 9000
    rc, out, _ = cli("list")
    assert rc == 0 and "acme-corp" in out and key not in out


def test_rotate_revoke(cli, redis_client: redis.Redis) -> None:
    _, old, _ = cli("add", "acme")
    old = old.strip()
    rc, new, _ = cli("rotate-key", "acme", "--grace", "600")
    new = new.strip()
    assert rc == 0 and new != old
    assert _auth(redis_client, old) == _auth(redis_client, new) == "acme"

    rc, newer, _ = cli("rotate-key", "acme", "--revoke-old")
    newer = newer.strip()
    for k in (old, new):
        with pytest.raises(RevokedApiKey):
            _auth(redis_client, k)
    assert _auth(redis_client, newer) == "acme"

    rc, extra, _ = cli("add-key", "acme")
    extra = extra.strip()
    rc, _, _ = cli("revoke", "--key", extra)
    assert rc == 0
    with pytest.raises(RevokedApiKey):
        _auth(redis_client, extra)
    assert _auth(redis_client, newer) == "acme"

    rc, out, _ = cli("keys", "acme")
    assert rc == 0 and out.count("revoked") == 3 and out.count("active") == 1
    assert all(k not in out for k in (old, new, newer, extra))

    rc, _, err = cli("revoke", "acme")
    assert rc == 0 and "revoked 1 keys" in err
    assert all(rec.state == "revoked" for rec in list_api_keys(redis_client, "acme"))


def test_errors_are_one_line(cli) -> None:
    rc, _, err = cli("set-quota", "nope", "--rps", "1")
    assert rc == 1 and "UnknownTenant" in err
    cli("add", "acme")
    rc, _, err = cli("add", "acme")
    assert rc == 1 and "TenantExists" in err
    rc, _, err = cli("revoke", "--key", "not-a-key")
    assert rc == 1 and "UnknownApiKey" in err
    with pytest.raises(SystemExit):
        cli("add", "x", "--rps", "-1")


def test_acl_apply(cli, redis_url: str, redis_client: redis.Redis) -> None:
    cli("add", "acme")
    rc, out, err = cli("acl", "acme", "--apply")
    try:
        assert rc == 0 and out.startswith("ACL SETUSER kvpush-tenant-acme ")
        password = err.rsplit(": ", 1)[1].strip()
        assert password not in out
        ra = redis.Redis.from_url(redis_url, username="kvpush-tenant-acme", password=password)
        assert ra.hget(RedisKeys().tenant("acme"), "name") == b"acme"
        with pytest.raises(redis.exceptions.NoPermissionError):
            ra.smembers(RedisKeys().tenants())
        ra.close()
    finally:
        redis_client.acl_deluser("kvpush-tenant-acme")


def test_without_redis_url_the_local_stack_redis_is_used_or_one_line_says_what_to_set(
        redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys
    from urllib.parse import urlsplit

    from kvpush.services.local.ports import free_port

    # Empty, not deleted: monkeypatch then restores what the CLI sets for its children.
    monkeypatch.setenv("KVPUSH_REDIS_URL", "")
    # No local stack on this port: one line naming the setting, no traceback.
    monkeypatch.setenv("KVPUSH_STACK_REDIS_PORT", str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "kvpush.services.cli", "tenants", "list"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "KVPUSH_REDIS_URL" in proc.stderr and "Traceback" not in proc.stderr
    # A local stack's Redis on its port is found without any setting.
    monkeypatch.setenv("KVPUSH_STACK_REDIS_PORT", str(urlsplit(redis_url).port))
    assert kvpush(["tenants", "add", "Local Co", "--id", "local-co"]) == 0
    assert capsys.readouterr().out.startswith("kvp_")  # the new tenant's API key
    assert get_tenant(redis.Redis.from_url(redis_url), "local-co").name == "Local Co"
