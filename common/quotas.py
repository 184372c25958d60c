"""Exact per-tenant quotas: request rate, concurrency and tokens, enforced by one Lua script.

Every admission runs ``common/quotas.lua`` once, on keys that all sit in the tenant's Cluster
slot (``RedisKeys.tenant_quota``). The script checks every limit and records the admission
only if all pass, so under any number of concurrent gateways exactly ``limit`` requests get
in per window and the concurrency limit is never exceeded.

- Requests per second and tokens per minute are sliding windows (a log of admissions in a
  sorted set, scored by the Redis server's clock): at most ``limit`` in *any* window, with no
  double burst at window edges, and an exact ``retry_after_s``.
- Concurrency is a set of leases: :meth:`Admission.release` frees the slot; a gateway that
  dies holding one loses it when the lease ends (``lease_s``), so a crash never leaks a slot
  for longer than that. Long requests call :meth:`Admission.renew`.
- Tokens are charged ``prompt_tokens + max_tokens`` at admission; the unused part is refunded
  at release, while the admission is still inside the token window.
- Prompt-length and ``max_tokens`` caps (and a request larger than the whole token budget)
  are refused before Redis with :class:`RequestTooLarge`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import AsyncLuaScript, LuaScript
from kvpush.common.tenancy import Tenant

logger = logging.getLogger(__name__)

_SCRIPT = (Path(__file__).with_name("quotas.lua")).read_text()
_LIMIT_NAMES = {1: "requests_per_second", 2: "concurrent_requests", 3: "tokens_per_minute"}
DEFAULT_LEASE_S = 180.0
"""Concurrency lease: above the gateway's request timeout, so only a crash lets one lapse."""


class QuotaExceeded(Exception):
    """The tenant is over ``limit_name``; retrying after ``retry_after_s`` may succeed.

    ``retry_after_s`` is None when retrying the same request can never succeed.
    """

    def __init__(self, retry_after_s: float | None, limit_name: str, detail: str = "") -> None:
        self.retry_after_s = retry_after_s
        self.limit_name = limit_name
        msg = f"quota exceeded: {limit_name}"
        if retry_after_s is not None:
            msg += f" (retry after {retry_after_s:.3f}s)"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class RequestTooLarge(QuotaExceeded):
    """The request alone breaks a cap (prompt length, ``max_tokens``, tokens per minute)."""

    def __init__(self, limit_name: str, limit: int, requested: int) -> None:
        self.limit = limit
        self.requested = requested
        super().__init__(None, limit_name, f"requested {requested}, limit {limit}")


def _quota_keys(keys: RedisKeys, tenant_id: str) -> list[str]:
    # Order is the KEYS order of quotas.lua.
    return [
        keys.tenant_quota(tenant_id, "rate"),
        keys.tenant_quota(tenant_id, "leases"),
        keys.tenant_quota(tenant_id, "tokens"),
        keys.tenant_quota(tenant_id, "tokens.amt"),
        keys.tenant_quota(tenant_id, "tokens.sum"),
    ]


def check_caps(tenant: Tenant, prompt_tokens: int, max_tokens: int) -> int:
    """Refuse what no retry can fix; returns the tokens to charge (prompt + max_tokens)."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("token counts must be >= 0")
    q = tenant.quotas
    if q.max_prompt_tokens and prompt_tokens > q.max_prompt_tokens:
        raise RequestTooLarge("max_prompt_tokens", q.max_prompt_tokens, prompt_tokens)
    if q.max_tokens and max_tokens > q.max_tokens:
        raise RequestTooLarge("max_tokens", q.max_tokens, max_tokens)
    cost = prompt_tokens + max_tokens
    if q.tokens_per_minute and cost > q.tokens_per_minute:
        raise RequestTooLarge("tokens_per_minute", q.tokens_per_minute, cost)
    return cost


@dataclass
class _Limiter:
    keys: RedisKeys = field(default_factory=RedisKeys)
    lease_s: float = DEFAULT_LEASE_S
    rate_window_s: float = 1.0
    """Window of ``requests_per_second``; the limit is per this window (tests lengthen it)."""
    token_window_s: float = 60.0
    """Window of ``tokens_per_minute``; the limit is per this window."""

    def _admit_args(self, tenant: Tenant, admission_id: str, cost: int) -> list[Any]:
        q = tenant.quotas
        return [
            "admit", admission_id,
            q.requests_per_second, int(self.rate_window_s * 1000),
            q.concurrent_requests, int(self.lease_s * 1000),
            q.tokens_per_minute, int(self.token_window_s * 1000),
            cost,
        ]

    @staticmethod
    def _parse(tenant: Tenant, res: list[Any]) -> tuple[int, int]:
        if int(res[0]) != 1:
            limit_name = _LIMIT_NAMES[int(res[1])]
            logger.debug("tenant %s over %s", tenant.id, limit_name)
            raise QuotaExceeded(int(res[2]) / 1000.0, limit_name)
        return int(res[1]), int(res[2])


@dataclass
class Admission:
    """An admitted request: call :meth:`release` when it ends (idempotent)."""

    limiter: QuotaLimiter
    tenant_id: str
    id: str
    charged_tokens: int
    admitted_ms: int
    lease_expiry_ms: int
    released: bool = False

    async def release(self, actual_tokens: int | None = None) -> int:
        """Free the concurrency slot and refund ``charged - actual_tokens`` tokens
        (``actual_tokens`` = prompt + generated; None keeps the whole charge). Returns the
        refund."""
        if self.released:
            return 0
        lim = self.limiter
        # Marked only once it landed, so a release that met a lost connection can be
        # retried; the script refunds and frees once however often it runs.
        res = await lim._script(
            keys=_quota_keys(lim.keys, self.tenant_id),
            args=["release", self.id, -1 if actual_tokens is None else max(0, actual_tokens)],
        )
        self.released = True
        return int(res)

    async def renew(self) -> bool:
        """Extend the concurrency lease by ``lease_s``; False if it had already lapsed."""
        lim = self.limiter
        res = int(await lim._script(keys=_quota_keys(lim.keys, self.tenant_id),
                                    args=["renew", self.id, int(lim.lease_s * 1000)]))
        if res:
            self.lease_expiry_ms = res
        return bool(res)

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Without an earlier release(actual) the whole token charge stays: the safe side.
        await self.release()


class QuotaLimiter(_Limiter):
    """Admission control for the asyncio gateway."""

    def __init__(self, r: aioredis.Redis, **kw: Any) -> None:
        super().__init__(**kw)
        self._script = AsyncLuaScript(r, _SCRIPT)

    async def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Admission:
        """Admit one request of ``tenant`` or raise :class:`QuotaExceeded`
        (:class:`RequestTooLarge` for caps, checked without Redis)."""
        cost = check_caps(tenant, prompt_tokens, max_tokens)
        aid = uuid.uuid4().hex
        res = await self._script(keys=_quota_keys(self.keys, tenant.id),
                                 args=self._admit_args(tenant, aid, cost))
        admitted_ms, expiry = self._parse(tenant, res)
        return Admission(self, tenant.id, aid, cost, admitted_ms, expiry)


@dataclass
class SyncAdmission:
    """Blocking twin of :class:`Admission`."""

    limiter: SyncQuotaLimiter
    tenant_id: str
    id: str
    charged_tokens: int
    admitted_ms: int
    lease_expiry_ms: int
    released: bool = False

    def release(self, actual_tokens: int | None = None) -> int:
        """See :meth:`Admission.release`."""
        if self.released:
            return 0
        self.released = True
        lim = self.limiter
        return int(lim._script(
            keys=_quota_keys(lim.keys, self.tenant_id),
            args=["release", self.id, -1 if actual_tokens is None else max(0, actual_tokens)],
        ))

    def renew(self) -> bool:
        """See :meth:`Admission.renew`."""
        lim = self.limiter
        res = int(lim._script(keys=_quota_keys(lim.keys, self.tenant_id),
                              args=["renew", self.id, int(lim.lease_s * 1000)]))
        if res:
            self.lease_expiry_ms = res
        return bool(res)

    def __enter__(self) -> SyncAdmission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SyncQuotaLimiter(_Limiter):
    """Admission control for blocking callers (threads, the CLI, tests)."""

    def __init__(self, r: redis.Redis, **kw: Any) -> None:
        super().__init__(**kw)
        self._script = LuaScript(r, _SCRIPT)

    def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> SyncAdmission:
        """See :meth:`QuotaLimiter.admit`."""
        cost = check_caps(tenant, prompt_tokens, max_tokens)
        aid = uuid.uuid4().hex
        res = self._script(keys=_quota_keys(self.keys, tenant.id),
                           args=self._admit_args(tenant, aid, cost))
        admitted_ms, expiry = self._parse(tenant, res)
        return SyncAdmission(self, tenant.id, aid, cost, admitted_ms, expiry)


def usage(r: redis.Redis, tenant_id: str, *, keys: RedisKeys = RedisKeys()) -> dict[str, int]:
    """Current counters of a tenant, for ``kvpush tenants list`` and tests (not exact on
    expired-but-unswept entries: those leave at the next admission)."""
    k = _quota_keys(keys, tenant_id)
    pipe = r.pipeline(transaction=False)
    pipe.zcard(k[0])
    pipe.zcard(k[1])
    pipe.get(k[4])
    rate, leases, tokens = pipe.execute()
    return {
        "requests_in_window": int(rate),
        "concurrent_leases": int(leases),
        "tokens_in_window": int(tokens or 0),
    }
