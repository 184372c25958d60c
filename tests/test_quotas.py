"""Quotas on a real Redis under concurrent hammering: exact rate, concurrency and token limits."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import (
    QuotaExceeded,
    QuotaLimiter,
    RequestTooLarge,
    SyncQuotaLimiter,
    usage,
)
from kvpush.common.tenancy import Quotas, Tenant

THREADS = 16


def tenant(tid: str = "acme", **quotas: int) -> Tenant:
    return Tenant(id=tid, name=tid, quotas=Quotas(**quotas), salt_secret="00" * 32)


def hammer(fn, attempts: int) -> list:
    """Run ``fn`` ``attempts`` times from THREADS threads released together."""
    start = threading.Barrier(THREADS)

    def worker(n: int) -> list:
        start.wait()
        out = []
        for _ in range(n):
            try:
                out.append(fn())
            except QuotaExceeded as exc:
                out.append(exc)
        return out

    per = [attempts // THREADS + (i < attempts % THREADS) for i in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        return [x for chunk in pool.map(worker, per) for x in chunk]


def split(results: list) -> tuple[list, list[QuotaExceeded]]:
    errors = [x for x in results if isinstance(x, BaseException)
              and not isinstance(x, QuotaExceeded)]
    assert not errors, errors[:3]
    ok = [x for x in results if not isinstance(x, QuotaExceeded)]
    return ok, [x for x in results if isinstance(x, QuotaExceeded)]


def test_rate_limit_exact_under_thread_hammering(redis_client: redis.Redis) -> None:
    # A long window makes "one window" independent of how slow this machine is.
    lim = SyncQuotaLimiter(redis_client, rate_window_s=60.0)
    t = tenant(requests_per_second=20)
    ok, rejected = split(hammer(lambda: lim.admit(t, 10, 10), 400))
    assert len(ok) == 20
    assert len(rejected) == 380
    assert {e.limit_name for e in rejected} == {"requests_per_second"}
    assert all(0 < e.retry_after_s <= 60.0 for e in rejected)
    assert usage(redis_client, "acme")["requests_in_window"] == 20


def test_rate_limit_exact_under_asyncio_hammering(redis_url: str) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        try:
            lim = QuotaLimiter(r, rate_window_s=60.0)
            t = tenant(requests_per_second=37)
            res = await asyncio.gather(*[lim.admit(t, 1, 1) for _ in range(300)],
                                       return_exceptions=True)
            ok, rejected = split(res)
            assert len(ok) == 37
            assert all(isinstance(e, QuotaExceeded) for e in rejected)
            assert len(rejected) == 263
        finally:
            await r.aclose()

    asyncio.run(main())


def test_rate_window_slides_and_retry_after_is_honest(redis_client: redis.Redis) -> None:
    # Windows and leases in these tests are seconds long so a stalled, shared CPU cannot
    # make them lapse between two calls that are meant to fall in one window.
    lim = SyncQuotaLimiter(redis_client, rate_window_s=2.0)
    t = tenant(requests_per_second=3)
    for _ in range(3):
        lim.admit(t, 1, 1)
    with pytest.raises(QuotaExceeded) as info:
        lim.admit(t, 1, 1)
    assert info.value.limit_name == "requests_per_second"
    assert 0 < info.value.retry_after_s <= 2.0
    time.sleep(info.value.retry_after_s + 0.02)  # waiting as told is enough
    lim.admit(t, 1, 1)


def test_concurrency_limit_exact_without_release(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client)
    t = tenant(concurrent_requests=5)
    ok, rejected = split(hammer(lambda: lim.admit(t, 1, 1), 200))
    assert len(ok) == 5
    assert {e.limit_name for e in rejected} == {"concurrent_requests"}
    assert all(0 < e.retry_after_s <= 1.0 for e in rejected)
    ok[0].release(2)
    ok[0].release(2)  # idempotent: frees one slot, not two
    lim.admit(t, 1, 1)
    with pytest.raises(QuotaExceeded):
        lim.admit(t, 1, 1)


def test_concurrency_never_exceeds_limit_while_churning(redis_client: redis.Redis) -> None:
    limit = 4
    lim = SyncQuotaLimiter(redis_client)
    t = tenant(concurrent_requests=limit)
    lock = threading.Lock()
    in_flight = 0
    peak = 0
    redis_peak = 0

    def one() -> bool:
        nonlocal in_flight, peak, redis_peak
        adm = lim.admit(t, 1, 1)
        # Counted after admit and uncounted before release: never above what Redis holds.
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        redis_peak = max(redis_peak, usage(redis_client, "acme")["concurrent_leases"])
        with lock:
            in_flight -= 1
        adm.release(2)
        return True

    ok, _ = split(hammer(one, 600))
    assert ok
    assert peak <= limit
    assert redis_peak <= limit
    assert usage(redis_client, "acme")["concurrent_leases"] == 0


def test_lease_expiry_frees_leaked_slot(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client, lease_s=2.0)
    t = tenant(concurrent_requests=1)
    leaked = lim.admit(t, 1, 1)  # its gateway "crashes": never released
    with pytest.raises(QuotaExceeded) as info:
        lim.admit(t, 1, 1)
    assert info.value.limit_name == "concurrent_requests"
    time.sleep(2.05)
    survivor = lim.admit(t, 1, 1)
    # The lapsed lease cannot be renewed back into a slot someone else now holds.
    assert leaked.renew() is False
    assert survivor.renew() is True
    with pytest.raises(QuotaExceeded):
        lim.admit(t, 1, 1)
    survivor.release()


def test_renew_keeps_slot_past_original_lease(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client, lease_s=2.0)
    t = tenant(concurrent_requests=1)
    adm = lim.admit(t, 1, 1)
    first = adm.lease_expiry_ms
    for _ in range(3):
        time.sleep(0.8)
        assert adm.renew()
    assert adm.lease_expiry_ms > first
    with pytest.raises(QuotaExceeded):  # past the original lease, still held
        lim.admit(t, 1, 1)
    adm.release()
    lim.admit(t, 1, 1)


def test_tokens_per_minute_exact_with_refunds(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client)
    t = tenant(tokens_per_minute=1000)
    ok, rejected = split(hammer(lambda: lim.admit(t, 20, 10), 100))
    assert len(ok) == 33  # 33 * 30 = 990 <= 1000 < 34 * 30
    assert {e.limit_name for e in rejected} == {"tokens_per_minute"}
    assert all(0 < e.retry_after_s <= 60.0 for e in rejected)
    assert usage(redis_client, "acme")["tokens_in_window"] == 990

    # Each used 25 of 30: 5 refunded apiece, once, however often release is called.
    assert sum(a.release(25) for a in ok) == 33 * 5
    assert sum(a.release(25) for a in ok) == 0
    # A retried release that reaches Redis again (e.g. after a client timeout) refunds nothing.
    ok[0].released = False
    assert ok[0].release(0) == 0
    assert usage(redis_client, "acme")["tokens_in_window"] == 825

    ok2, _ = split(hammer(lambda: lim.admit(t, 20, 10), 50))
    assert len(ok2) == 5  # 825 + 5 * 30 = 975 <= 1000 < 1005
    assert usage(redis_client, "acme")["tokens_in_window"] == 975


def test_token_window_slides(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client, token_window_s=2.0)
    t = tenant(tokens_per_minute=100)
    lim.admit(t, 50, 10)
    time.sleep(1.0)  # so the second admission is still in the window after the first left
    lim.admit(t, 20, 0)
    with pytest.raises(QuotaExceeded) as info:
        lim.admit(t, 30, 10)  # needs the first admission (60) to leave the window
    assert info.value.retry_after_s <= 1.0
    time.sleep(info.value.retry_after_s + 0.02)
    lim.admit(t, 30, 10)
    assert usage(redis_client, "acme")["tokens_in_window"] == 60


def test_caps_are_checked_before_redis(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client)
    t = tenant(max_prompt_tokens=100, max_tokens=50, tokens_per_minute=120)
    cases = [((101, 1), "max_prompt_tokens"), ((10, 51), "max_tokens"),
             ((100, 50), "tokens_per_minute")]
    for (prompt, max_tokens), name in cases:
        with pytest.raises(RequestTooLarge) as info:
            lim.admit(t, prompt, max_tokens)
        assert info.value.limit_name == name
        assert info.value.retry_after_s is None  # retrying cannot help
        assert isinstance(info.value, QuotaExceeded)
    assert redis_client.dbsize() == 0
    with pytest.raises(ValueError):
        lim.admit(t, -1, 1)


def test_rejection_records_nothing(redis_client: redis.Redis) -> None:
    """A request refused by one limit uses up none of the others."""
    lim = SyncQuotaLimiter(redis_client, rate_window_s=60.0)
    t = tenant(requests_per_second=10, concurrent_requests=2, tokens_per_minute=1000)
    a = lim.admit(t, 5, 5)
    lim.admit(t, 5, 5)
    for _ in range(5):
        with pytest.raises(QuotaExceeded) as info:
            lim.admit(t, 5, 5)
        assert info.value.limit_name == "concurrent_requests"
    assert usage(redis_client, "acme") == {
        "requests_in_window": 2, "concurrent_leases": 2, "tokens_in_window": 20,
    }
    a.release(10)
    lim.admit(t, 5, 5)


def test_worst_limit_is_reported(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client, rate_window_s=60.0)
    t = tenant(requests_per_second=1, concurrent_requests=1)
    lim.admit(t, 1, 1)
    with pytest.raises(QuotaExceeded) as info:
        lim.admit(t, 1, 1)
    # Both are full; the rate window (about 60 s) outlasts the concurrency hint (1 s).
    assert info.value.limit_name == "requests_per_second"
    assert info.value.retry_after_s > 1.0


def test_tenants_do_not_share_quotas(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client, rate_window_s=60.0)
    a, b = tenant("a", requests_per_second=2), tenant("b", requests_per_second=2)
    for _ in range(2):
        lim.admit(a, 1, 1)
    with pytest.raises(QuotaExceeded):
        lim.admit(a, 1, 1)
    lim.admit(b, 1, 1)
    lim.admit(b, 1, 1)


def test_unlimited_tenant_records_nothing(redis_client: redis.Redis) -> None:
    lim = SyncQuotaLimiter(redis_client)
    t = tenant()
    adms = [lim.admit(t, 1000, 1000) for _ in range(50)]
    for adm in adms:
        adm.release(5)
    assert redis_client.dbsize() == 0


def test_counters_live_in_tenant_slot_and_expire(redis_client: redis.Redis) -> None:
    keys = RedisKeys()
    lim = SyncQuotaLimiter(redis_client)
    t = tenant(requests_per_second=5, concurrent_requests=5, tokens_per_minute=500)
    adm = lim.admit(t, 3, 3)
    adm.release(4)
    names = [k.decode() for k in redis_client.scan_iter()]
    assert names
    slot = key_slot(keys.tenant("acme").encode())
    for name in names:
        assert name.startswith(keys.tenant_quota_pattern("acme")[:-1])
        assert key_slot(name.encode()) == slot
        assert redis_client.pttl(name) > 0  # idle tenants cost no memory forever


def test_async_admission_context_manager(redis_url: str) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        try:
            lim = QuotaLimiter(r)
            t = tenant(concurrent_requests=1, tokens_per_minute=100)
            async with await lim.admit(t, 10, 10) as adm:
                assert adm.charged_tokens == 20
                with pytest.raises(QuotaExceeded):
                    await lim.admit(t, 1, 1)
                assert await adm.renew()
            adm2 = await lim.admit(t, 10, 10)
            assert await adm2.release(12) == 8
        finally:
            await r.aclose()

    asyncio.run(main())


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    limit=st.integers(1, 500),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("admit"), st.integers(0, 120), st.integers(0, 120)),
            st.tuples(st.just("release"), st.integers(0, 30), st.integers(0, 300)),
        ),
        max_size=40,
    ),
)
def test_token_accounting_matches_a_model(redis_client: redis.Redis, limit: int,
                                          ops: list[tuple[str, int, int]]) -> None:
    """Any sequence of admits and (repeated) releases keeps Redis equal to a simple model."""
    tid = f"t-{uuid.uuid4().hex[:12]}"
    lim = SyncQuotaLimiter(redis_client, token_window_s=3600.0)
    t = tenant(tid, tokens_per_minute=limit)
    held: list = []
    kept: dict[str, int] = {}  # admission id -> tokens it still holds
    released: set[str] = set()
    for op, a, b in ops:
        if op == "admit":
            cost = a + b
            if cost > limit:
                with pytest.raises(RequestTooLarge):
                    lim.admit(t, a, b)
                continue
            fits = sum(kept.values()) + cost <= limit
            try:
                adm = lim.admit(t, a, b)
            except QuotaExceeded as exc:
                assert not fits
                assert exc.limit_name == "tokens_per_minute"
                continue
            assert fits
            held.append(adm)
            kept[adm.id] = cost
        elif held:
            adm = held[a % len(held)]
            refund = adm.release(b)
            if adm.id in released:
                assert refund == 0
            else:
                assert refund == max(0, kept[adm.id] - b)
                kept[adm.id] -= refund
                released.add(adm.id)
        assert usage(redis_client, tid)["tokens_in_window"] == sum(kept.values())
