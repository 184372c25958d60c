"""``kvpush drain ENGINE``: keep new work off an engine; with ``--wait``, wait until it is idle."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_drain_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``drain`` subcommand (argparse only; the handler imports lazily)."""
    p = sub.add_parser("drain", help="stop new assignments to an engine; --wait until it "
                       "holds nothing (safe to stop)")
    p.add_argument("engine", help="engine id, as `kvpush status` lists it")
    p.add_argument("--wait", action="store_true",
                   help="wait until nothing runs or waits on it and it holds no reservation")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up waiting after S seconds (exit status 1; default 300)")
    p.add_argument("--settle", type=float, default=2.0, metavar="S",
                   help="how long it must stay idle before it counts as drained (default 2)")
    p.add_argument("--clear", action="store_true",
                   help="remove the mark instead: the engine takes new work again")
    p.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    """Mark (or unmark) the engine; with ``--wait``, poll until it is drained."""
    from kvpush.common.keys import RedisKeys
    from kvpush.common.redis_client import sync_redis
    from kvpush.common.settings import CommonSettings
    from kvpush.services.cli.main import CLIError
    from kvpush.services.engine.drain import (
        UnknownEngine,
        clear_draining,
        describe,
        mark_draining,
        wait_drained,
    )

    settings = CommonSettings()
    keys = RedisKeys(settings.key_prefix)
    client = sync_redis(settings)
    try:
        if args.clear:
            had = clear_draining(client, keys, args.engine)
            print(f"engine {args.engine} takes new work again"
                  + ("" if had else " (it was not draining)"))
            return 0
        gen = mark_draining(client, keys, args.engine)
        if not args.wait:
            print(f"engine {args.engine} draining (generation {gen}): no new assignments")
            return 0
        res = wait_drained(client, keys, args.engine, timeout_s=args.timeout,
                           settle_s=args.settle)
        print(describe(args.engine, res))
        return 0 if res.drained else 1
    except UnknownEngine as exc:
        raise CLIError(str(exc)) from None
    finally:
        client.close()
