"""Least-privilege Redis ACL users, one per service kind: their rules, ``ACL SETUSER`` lines.

Each kind (engine, scheduler, gateway, tenant) gets the keys and commands its code uses and
nothing else; the grants below name the code path each one serves. The rules use Redis 7
selectors, one per key family with only the commands used on that family, so a gateway that
may ``XADD`` to the request stream cannot ``XTRIM`` or ``DEL`` it, and an engine that may
``SET`` its agent metadata cannot ``SET`` over a push-target stream.

Lua scripts need care. ``EVAL``/``EVALSHA`` demand read *and* write access to every key a
script declares, even a key it only reads, and Redis checks every command a script runs
against the caller's rules as well. So ``EVALSHA`` sits in a selector of its own over the
declared keys, and the commands scripts run are granted only where they really read or
write: the scheduler's reserve script declares the engine's status hash, yet the scheduler
cannot write that hash, through a script of its own or otherwise.

Passwords go in as their SHA-256 (``#<hex>``), so the lines can be printed and kept in an ACL
file. The older tenant-scoped user that may run the quota script on its own counters
(:func:`tenant_acl_rules` without ``read_only``) is kept for tenant-dedicated components.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import SyncRedis, is_cluster

logger = logging.getLogger(__name__)

# An id that passes keys.py's checks and occurs in no key literal: it becomes "*".
_ANY = "ANY.ID"
_PREFIX_MARK = "\x00prefix\x00"
# A prefix goes unescaped into glob patterns and user names: no glob or space characters.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


class ServiceKind(enum.StrEnum):
    """Which service a Redis user is for."""

    ENGINE = "engine"
    SCHEDULER = "scheduler"
    GATEWAY = "gateway"
    TENANT = "tenant"


class AclError(ValueError):
    """A user that cannot be described (bad prefix or id, a tenant user without a tenant),
    a password source that lacks one, or a Redis that refused the rules."""


@dataclass(frozen=True)
class Grant:
    """One ACL selector: ``commands`` on keys matching ``rw`` (read and write) or ``ro``
    (read only); ``why`` names the code path it serves."""

    why: str
    commands: tuple[str, ...]
    rw: tuple[str, ...] = ()
    ro: tuple[str, ...] = ()

    def selector(self) -> str:
        """The selector as one ``ACL SETUSER`` argument: ``(~keys %R~keys +commands)``."""
        parts = ([f"~{p}" for p in self.rw] + [f"%R~{p}" for p in self.ro]
                 + [f"+{c}" for c in self.commands])
        return "(" + " ".join(parts) + ")"


# What every client sends without naming a key: handshake, health PINGs, a non-zero db.
# Not CLIENT SETINFO: Redis 7.0 does not know it (a rule naming it fails there), and
# redis-py carries on when a newer Redis refuses it.
_CONNECTION = ("ping", "hello", "auth", "client|setname", "select")
# What a Redis Cluster client needs to learn the slot map and key positions and follow
# redirects; none of them reveals a key.
_CLUSTER = ("cluster|slots", "cluster|shards", "command", "command|info", "command|getkeys",
            "asking")
# Loading scripts (after a restart or SCRIPT FLUSH) and the server clock the scripts read.
_SCRIPTS = ("script|load", "time")


@dataclass(frozen=True)
class AclUser:
    """A Redis user of one service kind: its name and what it may do."""

    name: str
    kind: ServiceKind
    grants: tuple[Grant, ...]
    keyless: tuple[str, ...]
    """Commands that name no key (the root of the user, outside every selector)."""

    def rules(self, password: str) -> list[str]:
        """``ACL SETUSER`` arguments after the name; the password appears only hashed."""
        return ["reset", "on", password_rule(password), "resetchannels", "-@all",
                *(f"+{c}" for c in self.keyless), *(g.selector() for g in self.grants)]


def password_rule(password: str) -> str:
    """The ``#<sha256>`` rule that sets ``password`` without spelling it."""
    if not password:
        raise AclError("an empty password would let anyone in")
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _check_prefix(keys: RedisKeys) -> str:
    if not _PREFIX_RE.match(keys.prefix):
        raise AclError(f"key prefix {keys.prefix!r} cannot go into ACL rules: use letters, "
                       "digits and _.:- only")
    return keys.prefix


def _glob(keys: RedisKeys, build: Callable[[RedisKeys], str]) -> str:
    """The key ``build`` spells through :class:`RedisKeys`, with ``*`` where it passed
    ``_ANY``: patterns follow keys.py's layout instead of spelling it again."""
    return build(RedisKeys(_PREFIX_MARK)).replace(_ANY, "*").replace(
        _PREFIX_MARK, _check_prefix(keys))


def _engine_grants(keys: RedisKeys, engine_id: str) -> tuple[Grant, ...]:
    def g(build: Callable[[RedisKeys], str]) -> str:
        return _glob(keys, build)

    e = engine_id
    status, resv, leases = (g(lambda k: k.engine(e)), g(lambda k: k.reservations(e)),
                            g(lambda k: k.reservation_leases(e)))
    grants = [
        Grant("scripts (declared keys need read+write): decode's reservation release, the "
              "snapshot a draining engine polls, the drain mark", ("evalsha", "eval"),
              rw=(status, resv, leases)),
        Grant("status hash: heartbeat (MULTI HSET PEXPIRE), withdrawal, drain mark and "
              "activity (services/engine/status.py, drain.py)",
              ("hset", "pexpire", "del", "hgetall", "hget", "exists"), rw=(status,)),
        Grant("own reservations: decode releases at request end; drain reads them",
              ("hget", "hdel", "hincrby", "zrem", "zrange", "zrangebyscore", "del",
               "pexpireat"), rw=(resv, leases)),
        Grant("engine index: heartbeat score, withdrawal", ("zadd", "zrem"),
              rw=(g(lambda k: k.engines()),)),
        Grant("held prefix chunks: the KV-event relay mirrors its engine's "
              "(services/engine/kv_events.py)",
              ("sadd", "srem", "del", "pexpire"), rw=(g(lambda k: k.kv_chunks(e)),)),
        Grant("NIXL agent metadata and KV layout: publish own (connector/registry.py)",
              ("set", "get", "del"), rw=(g(lambda k: k.agent_pattern(e)),)),
        Grant("push targets: decode publishes to the prefill engine's stream",
              ("xadd",), rw=(g(lambda k: k.targets(_ANY)),)),
        Grant("push targets: prefill reads its own stream (connector/scheduler_side.py)",
              ("xread", "xrevrange"), ro=(g(lambda k: k.targets(e)),)),
    ]
    if e != _ANY:
        grants.append(Grant("NIXL agent metadata of peers", ("get",),
                            ro=(g(lambda k: k.agent_pattern(_ANY)),)))
    return tuple(grants)


def _scheduler_grants(keys: RedisKeys) -> tuple[Grant, ...]:
    def g(build: Callable[[RedisKeys], str]) -> str:
        return _glob(keys, build)

    status, resv, leases, fence = (g(lambda k: k.engine(_ANY)),
                                   g(lambda k: k.reservations(_ANY)),
                                   g(lambda k: k.reservation_leases(_ANY)),
                                   g(lambda k: k.fence(_ANY)))
    return (
        Grant("request stream: consumer group, reads, reclaims, acks, trim "
              "(services/scheduler/streams.py)",
              ("xgroup|create", "xreadgroup", "xclaim", "xautoclaim", "xpending", "xack",
               "xinfo|groups", "xtrim"),
              rw=(g(lambda k: k.requests()), g(lambda k: k.request_shards_pattern()))),
        Grant("engine index: live engines; forgets engines with nothing left",
              ("zrangebyscore", "zrange", "zrem"), rw=(g(lambda k: k.engines()),)),
        Grant("engine status: read only (refresh, sweep, the reserve script's HMGET)",
              ("hgetall", "hmget", "exists"), ro=(status,)),
        Grant("scripts (declared keys need read+write): reserve, sweep, release",
              ("evalsha",), rw=(status, resv, leases, fence)),
        Grant("reservations, written by the scripts; reservation levels",
              ("hget", "hset", "hdel", "hincrby", "exists", "zadd", "zrem", "zscore", "zcard",
               "zrange", "zrangebyscore", "zremrangebyscore", "del", "pexpireat"),
              rw=(resv, leases)),
        Grant("fencing tokens: max(last + 1, server clock) (the reserve script)",
              ("get", "set"), rw=(fence,)),
        Grant("at-most-once markers of request ids", ("get", "set"),
              rw=(g(lambda k: k.request_once(_ANY)),)),
        Grant("assignments to each gateway's stream", ("xadd", "pexpire"),
              rw=(g(lambda k: k.assignments(_ANY)),)),
        Grant("dead letters", ("xadd",), rw=(g(lambda k: k.dead_letters()),)),
        Grant("prefix affinity: where prompt prefixes went (services/scheduler/prefix_affinity.py)",
              ("hmget", "hset", "pexpire"), rw=(g(lambda k: k.prefix_affinity_pattern()),)),
        Grant("held prefix chunks of each engine, from its KV events "
              "(services/scheduler/affinity.py)", ("smismember",),
              ro=(g(lambda k: k.kv_chunks(_ANY)),)),
        Grant("tenant records: fair-share weights", ("hgetall",),
              ro=(g(lambda k: k.tenant(_ANY)),)),
        Grant("fleet planner: the gateways' latency reports (read, forget the long gone), "
              "its lease, its plan (services/scheduler/planner_task.py)",
              ("hgetall", "hdel", "set", "get", "pexpire"),
              rw=(g(lambda k: k.slo_reports()), g(lambda k: k.planner_lead()),
                  g(lambda k: k.fleet_plan()))),
    )


_QUOTA_SCRIPT_COMMANDS = ("get", "set", "decrby", "hget", "hset", "hdel", "pexpire", "pttl",
                          "zadd", "zcard", "zrange", "zrangebyscore", "zrem",
                          "zremrangebyscore", "zscore")


def _gateway_grants(keys: RedisKeys, gateway_id: str) -> tuple[Grant, ...]:
    def g(build: Callable[[RedisKeys], str]) -> str:
        return _glob(keys, build)

    status, resv, leases, quotas, stored = (g(lambda k: k.engine(_ANY)),
                                            g(lambda k: k.reservations(_ANY)),
                                            g(lambda k: k.reservation_leases(_ANY)),
                                            g(lambda k: k.tenant_quota_pattern(_ANY)),
                                            g(lambda k: k.tenant_responses_pattern(_ANY)))
    return (
        Grant("request stream: enqueue (services/gateway/assignment.py)", ("xadd",),
              rw=(g(lambda k: k.requests()), g(lambda k: k.request_shards_pattern()))),
        Grant("own assignment stream: read, trim what was read",
              ("xread", "xrevrange", "xtrim"), rw=(g(lambda k: k.assignments(gateway_id)),)),
        Grant("API key index and tenant records: authentication", ("hgetall",),
              ro=(g(lambda k: k.api_key(_ANY)), g(lambda k: k.tenant(_ANY)))),
        Grant("scripts (declared keys need read+write): quotas, reservation renew and "
              "release, the engine breaker, stored responses", ("evalsha",),
              rw=(quotas, status, resv, leases, stored)),
        Grant("quota counters (common/quotas.lua)", _QUOTA_SCRIPT_COMMANDS, rw=(quotas,)),
        Grant("reservations: renew while streaming, release at the end or when orphaned",
              ("hget", "hdel", "hincrby", "zadd", "zrem", "zrange", "zrangebyscore",
               "zremrangebyscore", "del", "pexpireat"), rw=(resv, leases)),
        Grant("engine status: served models; suspect marks (services/engine/health.py); "
              "the prefill engines for early prefill", ("hget", "hgetall", "hset", "exists"),
              rw=(status,)),
        Grant("engine index: served models, live engines", ("zrange",),
              ro=(g(lambda k: k.engines()),)),
        Grant("push targets: cancel an early prefill the placement did not keep "
              "(services/gateway/early_prefill.py)", ("xadd",),
              rw=(g(lambda k: k.targets(_ANY)),)),
        Grant("own latency report for the fleet planner (services/gateway/slo_report.py)",
              ("hset",), rw=(g(lambda k: k.slo_reports()),)),
        Grant("stored /v1/responses answers: read, and the store and delete scripts "
              "(services/gateway/response_store.py)",
              ("hget", "hset", "hdel", "hstrlen", "zscore", "zadd", "zrem", "zcard", "zrange",
               "zrangebyscore", "get", "incrby", "decrby", "pexpire"), rw=(stored,)),
    )


_TENANT_READS = ("hget", "hgetall", "hmget", "exists", "type", "pttl", "ttl", "zcard",
                 "zrange", "zrangebyscore", "zscore", "get")


def _tenant_grants(keys: RedisKeys, tenant_id: str,
                   extra_read_patterns: Iterable[str] = ()) -> tuple[Grant, ...]:
    grants = [Grant("own tenant record and quota usage, read only", _TENANT_READS,
                    ro=(_glob(keys, lambda k: k.tenant(tenant_id)),
                        _glob(keys, lambda k: k.tenant_quota_pattern(tenant_id))))]
    extra = tuple(extra_read_patterns)
    if extra:
        grants.append(Grant("further shared keys, read only", _TENANT_READS, ro=extra))
    return tuple(grants)


def service_user(
    kind: ServiceKind | str,
    *,
    keys: RedisKeys = RedisKeys(),
    tenant_id: str | None = None,
    engine_id: str | None = None,
    gateway_id: str | None = None,
) -> AclUser:
    """The user of ``kind``: ``<prefix>-<kind>`` for every engine, scheduler or gateway,
    ``<prefix>-tenant-<T>`` for tenant ``T`` (required for that kind).

    ``engine_id`` narrows an engine user to one engine (``<prefix>-engine-<E>``): it writes
    only that engine's status, reservations and agent keys and reads only its own target
    stream. ``gateway_id`` narrows a gateway user to its own assignment stream.
    """
    kind = ServiceKind(kind)
    prefix = _check_prefix(keys)
    if kind is ServiceKind.TENANT:
        if not tenant_id:
            raise AclError("a tenant user needs the tenant's id")
        return AclUser(tenant_acl_username(tenant_id, keys=keys), kind,
                       _tenant_grants(keys, tenant_id), _CONNECTION + _CLUSTER)
    if kind is ServiceKind.ENGINE:
        keys.engine(engine_id or _ANY)  # validates the id
        name = f"{prefix}-engine" + (f"-{engine_id}" if engine_id else "")
        return AclUser(name, kind, _engine_grants(keys, engine_id or _ANY),
                       _CONNECTION + _CLUSTER + _SCRIPTS + ("multi", "exec", "discard"))
    if kind is ServiceKind.SCHEDULER:
        return AclUser(f"{prefix}-scheduler", kind, _scheduler_grants(keys),
                       _CONNECTION + _CLUSTER + _SCRIPTS)
    keys.assignments(gateway_id or _ANY)
    name = f"{prefix}-gateway" + (f"-{gateway_id}" if gateway_id else "")
    return AclUser(name, kind, _gateway_grants(keys, gateway_id or _ANY),
                   _CONNECTION + _CLUSTER + _SCRIPTS)


def setuser_line(username: str, rules: Sequence[str]) -> str:
    """The ``ACL SETUSER`` line for ``redis-cli``."""
    return " ".join(["ACL", "SETUSER", username, *rules])


def aclfile_line(username: str, rules: Sequence[str]) -> str:
    """The same user as a line of a Redis ACL file (``aclfile``)."""
    return " ".join(["user", username, *rules])


def apply_user(r: SyncRedis, username: str, rules: Sequence[str]) -> None:
    """Create or replace ``username`` on ``r`` (an admin connection): on every node of a
    Cluster, each of which keeps its own users. Raises :class:`AclError` when refused."""
    target = {"target_nodes": "all"} if is_cluster(r) else {}
    try:
        r.execute_command("ACL", "SETUSER", username, *rules, **target)
    except redis.ResponseError as exc:
        raise AclError(f"Redis refused the rules of {username} (selectors need Redis 7): "
                       f"{exc}") from exc
    logger.info("applied ACL user %s", username)


def describe_markdown(keys: RedisKeys = RedisKeys()) -> str:
    """A Markdown table of every kind's grants (the "Redis users" table of docs/tenancy.md,
    generated from the rules)."""
    rows = ["| user | keys (RW read+write, R read only) | commands | for |",
            "|---|---|---|---|"]
    users = [service_user(k, keys=keys, tenant_id="T" if k is ServiceKind.TENANT else None)
             for k in ServiceKind]
    for user in users:
        for grant in user.grants:
            where = " ".join([f"RW `{p}`" for p in grant.rw] + [f"R `{p}`" for p in grant.ro])
            cmds = " ".join(c.upper().replace("|", " ") for c in grant.commands)
            rows.append(f"| `{user.name}` | {where} | {cmds} | {grant.why} |")
    return "\n".join(rows)


# -- the tenant-scoped users of `kvpush tenants acl` ---------------------------------------


def tenant_acl_username(tenant_id: str, *, keys: RedisKeys = RedisKeys()) -> str:
    """ACL user name of a tenant-scoped user."""
    keys.tenant(tenant_id)  # validates the id
    return f"{_check_prefix(keys)}-tenant-{tenant_id}"


def tenant_acl_rules(
    tenant_id: str,
    password: str,
    *,
    read_only: bool = False,
    extra_read_patterns: Iterable[str] = (),
    keys: RedisKeys = RedisKeys(),
) -> list[str]:
    """``ACL SETUSER`` rules confining a user to one tenant's keys.

    ``read_only``: the tenant kind's user (its record and usage, nothing written). Otherwise
    the older tenant-scoped *gateway* user: read access to ``tenant_pattern(T)`` and write
    access to the quota counters ``tenant_quota_pattern(T)``, so it can run the quota script
    for T but can neither touch another tenant nor raise its own quotas.
    """
    if read_only:
        grants = _tenant_grants(keys, tenant_id, extra_read_patterns)
        user = AclUser(tenant_acl_username(tenant_id, keys=keys), ServiceKind.TENANT, grants,
                       _CONNECTION + _CLUSTER)
        return user.rules(password)
    rules = [
        "reset",
        "on",
        password_rule(password),
        "resetchannels",
        f"%R~{keys.tenant_pattern(tenant_id)}",
        f"~{keys.tenant_quota_pattern(tenant_id)}",
    ]
    rules += [f"%R~{p}" for p in extra_read_patterns]
    # Rules apply left to right: categories first, then removals, then single commands.
    rules += [
        "-@all", "+@read", "+@connection", "+@write",
        # Key-pattern rules do not filter key enumeration, so listing commands would reveal
        # other tenants' ids; DBSIZE, OBJECT, etc. go with @keyspace.
        "-@keyspace",
        "-@dangerous",
        # @write pulls in server-wide script functions; only EVAL/EVALSHA are needed.
        "-function",
        "+exists", "+type", "+ttl", "+pttl",
        # The quota script reads the server clock so gateways' clocks don't matter.
        "+time",
        # A Cluster client learns the slot map with these (they reveal no keys).
        "+cluster|slots", "+cluster|shards",
        "+del", "+unlink", "+expire", "+pexpire",
        "+eval", "+evalsha", "+script|load", "+script|exists",
    ]
    return rules


def tenant_acl_command(username: str, rules: list[str]) -> str:
    """The ``ACL SETUSER`` line for ``redis-cli`` or an ACL file."""
    return setuser_line(username, rules)


def apply_tenant_acl(
    r: SyncRedis,
    tenant_id: str,
    password: str,
    *,
    read_only: bool = False,
    extra_read_patterns: Iterable[str] = (),
    keys: RedisKeys = RedisKeys(),
) -> str:
    """Create or replace the tenant's ACL user on ``r`` (needs an admin connection)."""
    username = tenant_acl_username(tenant_id, keys=keys)
    apply_user(r, username, tenant_acl_rules(tenant_id, password, read_only=read_only,
                                             extra_read_patterns=extra_read_patterns,
                                             keys=keys))
    return username
