"""``kvpush tenants``: create tenants, issue, rotate and revoke API keys, set quotas, ACL users.

Talks to the Redis named by ``KVPUSH_REDIS_URL``. A new API key is printed once, alone on
stdout (so ``KEY=$(kvpush tenants add acme)`` works); everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# CLI flag -> Quotas field.
_QUOTA_FLAGS = {
    "rps": "requests_per_second",
    "concurrency": "concurrent_requests",
    "tpm": "tokens_per_minute",
    "max_prompt": "max_prompt_tokens",
    "max_tokens": "max_tokens",
}


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report admin mistakes (unknown tenant, bad value) as one line and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        from kvpush.common.tenancy import TenancyError

        try:
            return fn(args)
        except (TenancyError, ValueError) as exc:  # AclError is a ValueError
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    return run


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0 = unlimited)")
    return value


def _add_quota_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight", type=float, default=None, help="fair-share weight (default 1)")
    p.add_argument("--rps", type=_nonneg_int, default=None, help="requests per second")
    p.add_argument("--concurrency", type=_nonneg_int, default=None,
                   help="concurrent requests")
    p.add_argument("--tpm", type=_nonneg_int, default=None,
                   help="tokens per minute (prompt + max_tokens, unused part refunded)")
    p.add_argument("--max-prompt", type=_nonneg_int, default=None, help="max prompt tokens")
    p.add_argument("--max-tokens", type=_nonneg_int, default=None,
                   help="largest max_tokens a request may ask for")


def add_tenants_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``tenants`` and its subcommands to the ``kvpush`` parser."""
    p = subparsers.add_parser("tenants", help="administer tenants, API keys and quotas",
                              description=__doc__)
    sub = p.add_subparsers(dest="tenants_command", required=True)

    add = sub.add_parser("add", help="create a tenant; prints its API key once")
    add.add_argument("name")
    add.add_argument("--id", dest="tenant_id", default=None,
                     help="tenant id (default: derived from NAME)")
    _add_quota_flags(add)
    add.set_defaults(func=_guard(_cmd_add))

    ls = sub.add_parser("list", help="list tenants with quotas and current usage")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_guard(_cmd_list))

    keys = sub.add_parser("keys", help="list a tenant's API keys (hash prefixes only)")
    keys.add_argument("tenant")
    keys.set_defaults(func=_guard(_cmd_keys))

    addkey = sub.add_parser("add-key", help="issue one more API key; prints it once")
    addkey.add_argument("tenant")
    addkey.set_defaults(func=_guard(_cmd_add_key))

    rot = sub.add_parser("rotate-key", help="issue a new key and retire the old ones")
    rot.add_argument("tenant")
    grp = rot.add_mutually_exclusive_group()
    grp.add_argument("--grace", type=float, default=3600.0,
                     help="seconds the old keys stay valid (default 3600)")
    grp.add_argument("--revoke-old", action="store_true", help="revoke the old keys now")
    rot.set_defaults(func=_guard(_cmd_rotate))

    rev = sub.add_parser("revoke", help="revoke every key of TENANT, or one key with --key")
    target = rev.add_mutually_exclusive_group(required=True)
    target.add_argument("tenant", nargs="?")
    target.add_argument("--key", default=None, help="the API key to revoke")
    rev.set_defaults(func=_guard(_cmd_revoke))

    setq = sub.add_parser("set-quota", help="change a tenant's quotas or weight (0 = unlimited)")
    setq.add_argument("tenant")
    setq.add_argument("--name", default=None, help="new display name")
    _add_quota_flags(setq)
    setq.set_defaults(func=_guard(_cmd_set_quota))

    acl = sub.add_parser("acl", help="print (or --apply) the Redis ACL user of TENANT: reads "
                         "its record and quota usage, writes nothing (see `kvpush acl`)")
    acl.add_argument("tenant")
    acl.add_argument("--password", default=None,
                     help="default: generated and printed once (a password here shows in "
                          "the shell history and `ps`: prefer the generated one)")
    mode = acl.add_mutually_exclusive_group()
    mode.add_argument("--read-only", action="store_true", help="the default; kept for scripts")
    mode.add_argument("--quota-writer", action="store_true",
                      help="the older tenant-scoped gateway user: may also run the quota "
                           "script on TENANT's counters")
    acl.add_argument("--apply", action="store_true", help="run ACL SETUSER on the Redis")
    acl.set_defaults(func=_guard(_cmd_acl))


def _ctx() -> tuple[Any, Any]:
    from kvpush.common.keys import RedisKeys
    from kvpush.common.redis_client import sync_redis
    from kvpush.common.settings import CommonSettings

    settings = CommonSettings()
    return sync_redis(settings), RedisKeys(settings.key_prefix)


def _quota_changes(args: argparse.Namespace) -> dict[str, int]:
    return {field: getattr(args, flag) for flag, field in _QUOTA_FLAGS.items()
            if getattr(args, flag) is not None}


def _cmd_add(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import Quotas, create_tenant

    r, keys = _ctx()
    tenant, api_key = create_tenant(
        r, args.name, tenant_id=args.tenant_id,
        weight=1.0 if args.weight is None else args.weight,
        quotas=Quotas(**_quota_changes(args)), keys=keys,
    )
    print(f"created tenant {tenant.id!r}; its API key follows and is not shown again",
          file=sys.stderr)
    print(api_key)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    import msgspec

    from kvpush.common.quotas import usage
    from kvpush.common.tenancy import list_api_keys, list_tenants

    r, keys = _ctx()
    rows = []
    for t in list_tenants(r, keys=keys):
        active = sum(rec.state == "active" for rec in list_api_keys(r, t.id, keys=keys))
        rows.append({"id": t.id, "name": t.name, "weight": t.weight,
                     "quotas": msgspec.structs.asdict(t.quotas), "active_keys": active,
                     "usage": usage(r, t.id, keys=keys)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'id':20s} {'weight':>6s} {'rps':>6s} {'conc':>5s} {'tpm':>9s} {'prompt':>7s} "
          f"{'maxtok':>7s} {'keys':>4s}  name")
    for row in rows:
        q = row["quotas"]
        print(f"{row['id']:20s} {row['weight']:6g} {q['requests_per_second']:6d} "
              f"{q['concurrent_requests']:5d} {q['tokens_per_minute']:9d} "
              f"{q['max_prompt_tokens']:7d} {q['max_tokens']:7d} {row['active_keys']:4d}  "
              f"{row['name']}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import get_tenant, list_api_keys

    r, keys = _ctx()
    get_tenant(r, args.tenant, keys=keys)
    for rec in list_api_keys(r, args.tenant, keys=keys):
        expires = f" expires_ms={rec.expires_ms}" if rec.expires_ms else ""
        print(f"{rec.key_hash[:12]} {rec.state:8s} created_ms={rec.created_ms}{expires}")
    return 0


def _cmd_add_key(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import issue_api_key

    r, keys = _ctx()
    print(issue_api_key(r, args.tenant, keys=keys))
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import rotate_api_key

    r, keys = _ctx()
    new_key = rotate_api_key(r, args.tenant, grace_s=args.grace, revoke_old=args.revoke_old,
                             keys=keys)
    when = "now" if args.revoke_old or args.grace <= 0 else f"in {args.grace:g}s"
    print(f"new API key for {args.tenant!r}; old keys stop working {when}", file=sys.stderr)
    print(new_key)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import revoke_api_key, revoke_tenant_keys

    r, keys = _ctx()
    if args.key:
        tid = revoke_api_key(r, args.key, keys=keys)
        print(f"revoked one key of {tid!r}", file=sys.stderr)
    else:
        n = revoke_tenant_keys(r, args.tenant, keys=keys)
        print(f"revoked {n} keys of {args.tenant!r}", file=sys.stderr)
    return 0


def _cmd_set_quota(args: argparse.Namespace) -> int:
    from kvpush.common.tenancy import update_tenant

    r, keys = _ctx()
    t = update_tenant(r, args.tenant, name=args.name, weight=args.weight, keys=keys,
                      **_quota_changes(args))
    print(f"{t.id}: weight={t.weight:g} {t.quotas}", file=sys.stderr)
    return 0


def _cmd_acl(args: argparse.Namespace) -> int:
    import secrets

    from kvpush.common.acl import (
        apply_tenant_acl,
        tenant_acl_command,
        tenant_acl_rules,
        tenant_acl_username,
    )
    from kvpush.common.tenancy import get_tenant

    r, keys = _ctx()
    get_tenant(r, args.tenant, keys=keys)
    password = args.password or secrets.token_urlsafe(32)
    read_only = not args.quota_writer
    username = tenant_acl_username(args.tenant, keys=keys)
    rules = tenant_acl_rules(args.tenant, password, read_only=read_only, keys=keys)
    print(tenant_acl_command(username, rules))
    if args.apply:
        apply_tenant_acl(r, args.tenant, password, read_only=read_only, keys=keys)
        print(f"applied ACL user {username}", file=sys.stderr)
    if not args.password:
        print(f"password of {username} (not shown again): {password}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``tenants`` on its own (``python -m services.cli.tenants ...``)."""
    parser = argparse.ArgumentParser(prog="kvpush")
    add_tenants_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main(["tenants", *sys.argv[1:]]))
