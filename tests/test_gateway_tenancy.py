"""Gateway tenancy over real HTTP and real Redis: API keys, quotas, cache salts, revocation.

Same stand-in engines as tests/test_gateway.py (they only record what the gateway sends);
prefix-cache isolation on real engines is in tests/test_e2e_gateway.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import usage
from kvpush.common.runtime import run
from kvpush.common.tenancy import Quotas, cache_salt, create_tenant, get_tenant, revoke_api_key
from kvpush.common.wire import ScheduleRequest, decode
from tests.sched_util import assert_no_reservations, engine_status, publish
from tests.test_gateway import PROMPT, pd, stack, tokenizer_dir  # noqa: F401 (fixture)

K = RedisKeys()
GW_AUTH = {"gateway_auth": True}


@pytest.fixture(autouse=True)
def no_leaks(redis_client: redis.Redis) -> Iterator[None]:
    yield
    assert_no_reservations(redis_client)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _no_leases(r: redis.Redis, *tenants: str) -> bool:
    return all(usage(r, t)["concurrent_leases"] == 0 for t in tenants)


async def _until(pred, what: str, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_requests_without_a_valid_key_are_401(redis_url: str, redis_client: redis.Redis,
                                              tokenizer_dir: Path) -> None:  # noqa: F811
    p, d = pd()
    _, key = create_tenant(redis_client, "acme", tenant_id="acme")
    revoke_api_key(redis_client, key, cache=None)

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=GW_AUTH) as s:
            for headers in ({}, {"Authorization": "Bearer nope"},
                            _bearer("kvp_" + "A" * 43), _bearer(key)):
                r = await s.client.post("/v1/completions", json={"prompt": PROMPT},
                                        headers=headers)
                assert r.status_code == 401, (headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and err["code"] == 401
            assert p.calls == [] and d.calls == []
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_errors_total{kind="unauthorized",tenant="-"} 4.0' in m

    run(main())


def test_tenant_comes_from_the_key_and_salts_both_legs(redis_url: str,
                                                       redis_client: redis.Redis,
                                                       tokenizer_dir: Path) -> None:  # noqa: F811
    p, d = pd()
    _, key = create_tenant(redis_client, "acme", tenant_id="acme")
    salt = cache_salt(get_tenant(redis_client, "acme"))

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=GW_AUTH) as s:
            # Client fields cannot pick the tenant or the salt.
            r = await s.client.post("/v1/completions", headers=_bearer(key), json={
                "prompt": PROMPT, "max_tokens": 3, "cache_salt": "other", "user": "x",
                "tenant": "someone-else"})
            assert r.status_code == 200, r.text
            (pc,), (dc,) = p.calls, d.calls
            assert pc.body["cache_salt"] == dc.body["cache_salt"] == salt
            (_, fields), = redis_client.xrange(K.requests())
            assert decode(fields[b"m"], ScheduleRequest).tenant == "acme"
            await _until(lambda: _no_leases(redis_client, "acme"), "lease released")
            m = (await s.client.get("/metrics")).text
            assert ('kvpush_gateway_requests_total{endpoint="completions",status="200",'
                    'tenant="acme"} 1.0') in m
            assert 'kvpush_ttft_seconds_count{tenant="acme"} 1.0' in m

    run(main())


def test_auth_off_is_tenant_default_without_salt(redis_url: str, redis_client: redis.Redis,
                                                 tokenizer_dir: Path) -> None:  # noqa: F811
    p, d = pd()

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT},
                                    headers=_bearer("kvp_" + "A" * 43))
            assert r.status_code == 200
            assert "cache_salt" not in d.calls[0].body
            (_, fields), = redis_client.xrange(K.requests())
            assert decode(fields[b"m"], ScheduleRequest).tenant == "default"

    run(main())


def test_quotas_429_with_retry_after_and_400_for_caps(redis_url: str,
                                                      redis_client: redis.Redis,
                                                      tokenizer_dir: Path) -> None:  # noqa: F811
    p, d = pd()
    _, key = create_tenant(redis_client, "acme", tenant_id="acme",
                           quotas=Quotas(requests_per_second=1, max_tokens=8))

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=GW_AUTH) as s:
            # A minute-long window, so a stalled shared CPU cannot let the second in.
            s.gateway.limiter.rate_window_s = 60.0
            r = await s.client.post("/v1/completions", headers=_bearer(key),
                                    json={"prompt": PROMPT, "max_tokens": 9})
            assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
            r = await s.client.post("/v1/completions", headers=_bearer(key),
                                    json={"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200
            r = await s.client.post("/v1/completions", headers=_bearer(key),
                                    json={"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 60
            assert len(d.calls) == 1
            m = (await s.client.get("/metrics")).text
            assert 'kvpush_gateway_errors_total{kind="quota_requests_per_second",' \
                   'tenant="acme"} 1.0' in m

    run(main())


def test_admission_released_with_actual_tokens_on_every_exit(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    """Charged prompt + max_tokens at admission; refunded to what was used at the end:
    served (prompt + generated), engine failure (prompt), rejected before dispatch (0),
    client gone mid-stream (prompt + what was generated)."""
    p, d = pd()
    d.tokens = 3
    _, key = create_tenant(redis_client, "acme", tenant_id="acme",
                           quotas=Quotas(concurrent_requests=8, tokens_per_minute=100_000))

    def tokens() -> int:
        return usage(redis_client, "acme")["tokens_in_window"]

    async def main() -> None:
        no_reroute = {**GW_AUTH, "gateway_dispatch_retries": 0,
                      "gateway_suspect_cooldown_s": 0}
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=no_reroute) as s:
            h = _bearer(key)
            r = await s.client.post("/v1/completions", headers=h,
                                    json={"prompt": PROMPT, "max_tokens": 50})
            assert r.status_code == 200
            await _until(lambda: _no_leases(redis_client, "acme"), "lease released")
            assert tokens() == 10 + 3  # prompt + generated, not prompt + 50

            r = await s.client.post("/v1/completions", headers=h, json={
                "prompt": PROMPT, "max_tokens": 50, "stream": True})
            assert r.status_code == 200 and r.text.count("data: {") == 3
            await _until(lambda: tokens() == 2 * 13, "stream refund")

            p.mode, d.mode = "fail", "hang"  # decode would wait for KV that never comes
            r = await s.client.post("/v1/completions", headers=h,
                                    json={"prompt": PROMPT, "max_tokens": 50})
            assert r.status_code == 502
            await _until(lambda: tokens() == 2 * 13 + 10, "failure refund")
            p.mode, d.mode = "ok", "ok"

            # Rejected by the scheduler (fits no engine): nothing ran, nothing is charged.
            r = await s.client.post("/v1/completions", headers=h,
                                    json={"prompt": PROMPT, "max_tokens": 30_000})
            assert r.status_code == 400
            await _until(lambda: tokens() == 2 * 13 + 10, "rejection refund")

            d.mode, d.tokens = "hang_after", 50
            async with s.client.stream("POST", "/v1/completions", headers=h, json={
                    "prompt": PROMPT, "max_tokens": 50, "stream": True}) as rs:
                assert rs.status_code == 200
                await anext(rs.aiter_lines())
            await _until(lambda: _no_leases(redis_client, "acme"), "lease after disconnect")
            await _until(lambda: tokens() == 2 * 13 + 10 + 10 + 2, "disconnect refund")

    run(main())


def test_revoked_key_mid_stream(redis_url: str, redis_client: redis.Redis,
                                tokenizer_dir: Path) -> None:  # noqa: F811
    """The running stream finishes; new requests get 401 within the auth cache bound."""
    p, d = pd()
    d.mode, d.tokens, d.hang_after = "pause_after", 6, 2
    _, key = create_tenant(redis_client, "acme", tenant_id="acme")
    _, key2 = create_tenant(redis_client, "beta", tenant_id="beta")
    bound_s = 0.5

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d,
                         gw={**GW_AUTH, "gateway_auth_cache_s": bound_s}) as s:
            async with s.client.stream("POST", "/v1/completions", headers=_bearer(key),
                                       json={"prompt": PROMPT, "max_tokens": 6,
                                             "stream": True}) as rs:
                assert rs.status_code == 200
                lines = rs.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
                # Revoked by another process (the CLI): this gateway's cache is not told.
                revoke_api_key(redis_client, key, cache=None)
                await asyncio.sleep(bound_s * 1.2)
                r = await s.client.post("/v1/completions", headers=_bearer(key),
                                        json={"prompt": PROMPT, "max_tokens": 2})
                assert r.status_code == 401
                d.resume.set()
                rest = [ln async for ln in lines if ln.startswith("data: ")]
            texts = [json.loads(x[6:])["choices"][0]["text"] for x in rest[:-1]]
            assert rest[-1] == "data: [DONE]" and len(texts) == 5  # the stream finished
            # Revoking through this gateway's own cache takes effect at once.
            revoke_api_key(redis_client, key2, cache=s.gateway.auth_cache)
            r = await s.client.post("/v1/completions", headers=_bearer(key2),
                                    json={"prompt": PROMPT})
            assert r.status_code == 401

    run(main())


def test_scheduler_receives_the_tenant_for_fair_share(redis_url: str,
                                                      redis_client: redis.Redis,
                                                      tokenizer_dir: Path) -> None:  # noqa: F811
    """Two tenants through one gateway: each ScheduleRequest names its own tenant."""
    publish(redis_client, engine_status("d0"))  # a second decode engine does not matter
    p, d = pd()
    _, ka = create_tenant(redis_client, "a", tenant_id="a")
    _, kb = create_tenant(redis_client, "b", tenant_id="b")

    async def main() -> None:
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=GW_AUTH) as s:
            for k in (ka, kb, ka):
                r = await s.client.post("/v1/completions", headers=_bearer(k),
                                        json={"prompt": PROMPT, "max_tokens": 2})
                # d0 answers nothing: a request placed there is placed again on d1.
                assert r.status_code == 200, r.text
            reqs = [decode(f[b"m"], ScheduleRequest) for _, f in redis_client.xrange(K.requests())]
            first = {r.request_id: r.tenant for r in reqs if "-r" not in r.request_id}
            assert list(first.values()) == ["a", "b", "a"]
            for r in reqs:
                if "-r" in r.request_id:  # a re-route keeps its tenant and avoids d0
                    assert r.tenant == first[r.request_id.rsplit("-r", 1)[0]]
                    assert r.exclude_engines == ["d0"]

    run(main())


def test_releases_that_meet_a_lost_redis_are_retried(
        redis_url: str, redis_client: redis.Redis, tokenizer_dir: Path) -> None:  # noqa: F811
    """A request that ends while Redis is unreachable (a failover, a restart) frees its
    quota slot and its reservation once Redis is back, not when their leases run out
    (the quota lease is minutes: a 2 s failover used to hold the slot that long)."""
    from kvpush.loadtest.faults.tcp_proxy import TcpProxy

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(("127.0.0.1", 0), ("127.0.0.1", port)).start()
    p, d = pd()
    d.mode, d.tokens = "hang_after", 50
    _, key = create_tenant(redis_client, "acme", tenant_id="acme",
                           quotas=Quotas(concurrent_requests=8))

    async def main() -> None:
        # Only the gateway goes through the proxy; the scheduler talks to Redis directly.
        async with stack(redis_url, redis_client, tokenizer_dir, p, d, gw=GW_AUTH,
                         gw_redis_url=proxy.url()) as s:
            async with s.client.stream("POST", "/v1/completions", headers=_bearer(key),
                                       json={"prompt": PROMPT, "max_tokens": 50,
                                             "stream": True}) as rs:
                assert rs.status_code == 200
                await anext(rs.aiter_lines())
                proxy.down()  # the request ends (client gone) while Redis is away
            await asyncio.sleep(1.5)
            assert not _no_leases(redis_client, "acme")  # the release could not land
            proxy.heal()
            await _until(lambda: _no_leases(redis_client, "acme"), "lease released",
                         timeout_s=20)
            await _until(lambda: not redis_client.keys("kvpush:resv:*"),
                         "reservation released", timeout_s=20)

    try:
        run(main())
    finally:
        proxy.stop()
