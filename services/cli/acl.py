"""``kvpush acl``: print (or ``--apply``) the least-privilege Redis user of each service kind.

The rules go to stdout, one user a line (``ACL SETUSER ...`` for ``redis-cli``, or ``user ...``
lines for an ACL file with ``--format aclfile``); they hold only hashed passwords. Passwords
come from ``--password-file`` (``-``: stdin), lines ``NAME=PASSWORD`` where NAME is a kind
(``engine``) or a user name (``kvpush-tenant-acme``); without one they are generated and
printed once, on stderr. ``--apply`` runs ``ACL SETUSER`` as the admin user the ``KVPUSH_REDIS_*``
settings name, on every node of a Cluster.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from kvpush.common.settings import CommonSettings

logger = logging.getLogger(__name__)

_DEFAULT_KINDS = ("engine", "scheduler", "gateway")


def add_acl_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``acl`` and its subcommands to the ``kvpush`` parser (argparse only)."""
    p = subparsers.add_parser("acl", help="least-privilege Redis users per service kind",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="acl_command", required=True)

    users = sub.add_parser("users", help="print (or --apply) the users of the service kinds")
    users.add_argument("--kind", action="append", default=None,
                       choices=["engine", "scheduler", "gateway", "tenant"],
                       help="only this kind (repeatable; default: engine, scheduler, gateway "
                            "and a tenant user per --tenant)")
    users.add_argument("--tenant", action="append", default=[], metavar="T",
                       help="also a read-only user of tenant T (repeatable)")
    users.add_argument("--engine-id", default=None, metavar="E",
                       help="narrow the engine user to engine E (user <prefix>-engine-E)")
    users.add_argument("--gateway-id", default=None, metavar="G",
                       help="narrow the gateway user to its own assignment stream "
                            "(user <prefix>-gateway-G; the gateway must run with "
                            "KVPUSH_GATEWAY_ID=G)")
    users.add_argument("--format", choices=["setuser", "aclfile"], default="setuser",
                       help="ACL SETUSER lines (default) or ACL file lines")
    users.add_argument("--password-file", default=None, metavar="FILE",
                       help="NAME=PASSWORD lines ('-': stdin); default: generate")
    users.add_argument("--apply", action="store_true",
                       help="create or replace the users on the Redis of KVPUSH_REDIS_URL")
    users.set_defaults(func=cmd_users)

    describe = sub.add_parser("describe", help="a Markdown table of every kind's grants")
    describe.set_defaults(func=cmd_describe)


def parse_passwords(stream: TextIO) -> dict[str, str]:
    """``NAME=PASSWORD`` lines (blank lines and ``#`` comments skipped) as a dict."""
    from kvpush.common.acl import AclError

    out: dict[str, str] = {}
    for n, line in enumerate(stream, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, password = line.partition("=")
        if not sep or not name.strip() or not password:
            # Never echo the line: it may hold a password.
            raise AclError(f"password file line {n} is not NAME=PASSWORD")
        out[name.strip()] = password
    return out


def _read_passwords(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    if path == "-":
        return parse_passwords(sys.stdin)
    with open(path, encoding="utf-8") as f:
        return parse_passwords(f)


def cmd_users(args: argparse.Namespace) -> int:
    """Print the users' rules; apply them with ``--apply``."""
    import secrets

    from kvpush.common.acl import (
        AclError,
        ServiceKind,
        aclfile_line,
        service_user,
        setuser_line,
    )
    from kvpush.common.keys import InvalidKeyPart, RedisKeys
    from kvpush.common.settings import CommonSettings

    settings = CommonSettings()
    keys = RedisKeys(settings.key_prefix)
    kinds = args.kind or [*_DEFAULT_KINDS, *(["tenant"] if args.tenant else [])]
    try:
        users = []
        for kind in dict.fromkeys(kinds):
            if kind == "tenant":
                if not args.tenant:
                    raise AclError("--kind tenant needs --tenant T")
                users += [service_user(kind, keys=keys, tenant_id=t) for t in args.tenant]
            else:
                users.append(service_user(kind, keys=keys, engine_id=args.engine_id,
                                          gateway_id=args.gateway_id))
        given = _read_passwords(args.password_file)
        generated: list[tuple[str, str]] = []
        lines = []
        for user in users:
            if given is None:
                password = secrets.token_urlsafe(32)
                generated.append((user.name, password))
            else:
                # Every tenant user needs its own line: one password for all would let
                # any tenant's holder in as every other.
                shared = "" if user.kind is ServiceKind.TENANT else given.get(user.kind.value)
                password = given.get(user.name) or shared or ""
                if not password:
                    raise AclError(f"the password file has no line for {user.name}")
            lines.append((user.name, user.rules(password)))
    except (AclError, InvalidKeyPart, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    line = aclfile_line if args.format == "aclfile" else setuser_line
    for name, rules in lines:
        print(line(name, rules))
    if args.apply:
        rc = _apply(settings, lines)
        if rc:
            return rc
    for name, password in generated:
        print(f"password of {name} (not shown again): {password}", file=sys.stderr)
    return 0


def _apply(settings: CommonSettings, lines: list[tuple[str, list[str]]]) -> int:
    from kvpush.common.acl import AclError, apply_user
    from kvpush.common.redis_client import redis_configured, sync_redis, topology
    from kvpush.services.cli.main import find_redis

    if not redis_configured(settings):
        settings = settings.model_copy(update={"redis_url": find_redis()})
    client = sync_redis(settings)
    try:
        for name, rules in lines:
            apply_user(client, name, rules)
            print(f"applied ACL user {name}", file=sys.stderr)
    except AclError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if topology(settings) == "sentinel":
        print("note: applied on the current master only; replicas keep their own users "
              "(load the same lines there, e.g. from an ACL file)", file=sys.stderr)
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    """Print the grants of every kind as the Markdown table of docs/tenancy.md."""
    from kvpush.common.acl import describe_markdown
    from kvpush.common.keys import RedisKeys
    from kvpush.common.settings import CommonSettings

    print(describe_markdown(RedisKeys(CommonSettings().key_prefix)))
    return 0
