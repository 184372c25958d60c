"""The ``kvpush`` command line: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpush.common.log import setup_logging

if TYPE_CHECKING:
    from kvpush.common.settings import EngineSettings, StackSettings

# Each entry adds one subcommand; heavy imports stay inside the handlers so that
# `kvpush --help` and `kvpush status` start fast.
Registrar = Callable[[argparse._SubParsersAction], None]  # type: ignore[type-arg]
REGISTRARS: list[Registrar] = []


def subcommand(fn: Registrar) -> Registrar:
    """Register a function that adds a subcommand parser (other modules may use it too)."""
    REGISTRARS.append(fn)
    return fn


@subcommand
def _models(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("models", help="build the local test models")
    msub = p.add_subparsers(dest="models_command", required=True)
    make = msub.add_parser("make", help="build models that are missing (deterministic)")
    make.add_argument("--name", default="all",
                      help="a model of `kvpush models list`, or all (default: all)")
    make.set_defaults(func=_cmd_models_make)
    ls = msub.add_parser("list", help="list the local models and whether they are built")
    ls.set_defaults(func=_cmd_models_list)


def _cmd_models_make(args: argparse.Namespace) -> int:
    from kvpush.services.local import models

    names = list(models.MODELS) if args.name == "all" else [args.name]
    for name, path in models.make_models(names, skip_unavailable=args.name == "all").items():
        spec = models.model_spec(name)
        print(f"{name}: {path} ({spec.attention} attention, {spec.kv_bytes_per_token} KV "
              f"bytes/token, {spec.dtype}; {spec.origin})")
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from kvpush.services.local import models

    for name, spec in models.MODELS.items():
        path = models.model_path(name)
        state = "built" if models.is_built(path) else "missing"
        print(f"{name:12s} {state:8s} {spec.attention:12s} {spec.kv_bytes_per_token:7d} "
              f"B/token  {path}  {spec.origin}")
    return 0


@subcommand
def _engine(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("engine", help="run one vLLM engine with a P/D connector")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument(
        "--connector", choices=["kvpush", "nixl-pull", "nixl-push", "none"], default="none"
    )
    p.add_argument("--model", default="tiny", help="local model name or model directory")
    p.add_argument("--port", type=int, default=None, help="HTTP port (KVPUSH_ENGINE_PORT)")
    p.add_argument("--cpus", default=None, help="CPU list to bind to, e.g. 0 or 2-3")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (KVPUSH_ENGINE_TP): a worker per rank, each "
                        "on its share of --cpus")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--side-channel-port", type=int, default=None)
    p.add_argument("--log", default=None, help="write the engine's output to this file")
    p.add_argument("--no-repin", action="store_true", help="leave vLLM's own thread pinning")
    p.set_defaults(func=_cmd_engine)


def _cmd_engine(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpush.common.settings import EngineSettings
    from kvpush.services.engine.foreground import run_engine
    from kvpush.services.engine.launcher import EngineSpec

    spec = EngineSpec.from_settings(
        EngineSettings(),
        role=args.role,
        connector=args.connector,
        model=args.model,
        port=args.port,
        cpus=args.cpus,
        tp=args.tp,
        engine_id=args.engine_id,
        side_channel_port=args.side_channel_port,
        log_path=Path(args.log) if args.log else None,
        repin=False if args.no_repin else None,
    )
    from kvpush.services.local import models
    from kvpush.services.local.ports import ensure_port_free

    # Before vLLM boots: it would fail to bind only after loading the model.
    ensure_port_free(spec.host, spec.port, "the engine's HTTP port", "KVPUSH_ENGINE_PORT")
    if spec.connector in ("nixl-pull", "nixl-push"):
        ensure_port_free(spec.host, spec.resolved_side_channel_port,
                         "the engine's NIXL side channel", "KVPUSH_ENGINE_SIDE_CHANNEL_PORT")
    return run_engine(spec, models.resolve)


@subcommand
def _up(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("up", help="run a whole local P/D stack until Ctrl-C")
    p.add_argument("--connector", default=None, help="kvpush, nixl-pull, nixl-push or none")
    p.add_argument("--model", default=None, metavar="NAME_OR_DIR",
                   help="local model name or a model directory of your own "
                        "(KVPUSH_STACK_MODEL, default smollm2-135m)")
    p.add_argument("--port", type=int, default=None, help="API port (KVPUSH_STACK_PORT)")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill engines (KVPUSH_STACK_PREFILL_ENGINES, default 1)")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="decode engines (KVPUSH_STACK_DECODE_ENGINES, default 1)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel size of each prefill engine "
                        "(KVPUSH_STACK_PREFILL_TP, default 1)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="M",
                   help="tensor-parallel size of each decode engine "
                        "(KVPUSH_STACK_DECODE_TP, default 1)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="maximum sequence length of every engine and the gateway "
                        "(KVPUSH_ENGINE_MAX_MODEL_LEN, default 2048)")
    p.add_argument("--kv-cache-gib", type=float, default=None, metavar="X",
                   help="KV cache of each engine in GiB (KVPUSH_ENGINE_KV_CACHE_GIB, default 1)")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV block of every engine (KVPUSH_ENGINE_BLOCK_SIZE, "
                        "default vLLM's: 128 on CPU)")
    p.add_argument("--autoscale", action="store_true", default=None,
                   help="size the fleet by the planner's counts: add engines under load, "
                        "drain and remove them after (KVPUSH_STACK_AUTOSCALE)")
    p.add_argument("--max-prefill", type=int, default=None, metavar="N",
                   help="most prefill engines under --autoscale (KVPUSH_STACK_MAX_PREFILL, "
                        "default one more than --prefill)")
    p.add_argument("--max-decode", type=int, default=None, metavar="M",
                   help="most decode engines under --autoscale (KVPUSH_STACK_MAX_DECODE, "
                        "default one more than --decode)")
    p.set_defaults(func=_cmd_up)


def up_settings(args: argparse.Namespace) -> tuple[StackSettings, EngineSettings]:
    """The stack and engine settings of ``kvpush up``: the environment's, with the flags
    given applied and validated; a :class:`CLIError` names the first invalid one."""
    from pydantic import ValidationError

    from kvpush.services.local.stack import engine_settings, stack_settings

    try:
        stack = stack_settings(connector=args.connector, model=args.model, port=args.port,
                               prefill_engines=args.prefill, decode_engines=args.decode,
                               prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                               autoscale=args.autoscale, max_prefill=args.max_prefill,
                               max_decode=args.max_decode)
        stack = type(stack).model_validate(stack.model_dump())
        engines = engine_settings(max_model_len=args.max_model_len,
                                  kv_cache_gib=args.kv_cache_gib, block_size=args.block_size)
        engines = type(engines).model_validate(engines.model_dump())
    except ValidationError as exc:
        raise CLIError(f"invalid stack settings: {exc.errors()[0]['msg']} "
                       f"({exc.errors()[0]['loc'][0]})") from None
    from pathlib import Path

    from kvpush.services.local.models import MODELS

    model = stack.stack_model
    if model not in MODELS and not (Path(model) / "config.json").is_file():
        raise CLIError(f"model {model!r} (--model, KVPUSH_STACK_MODEL) is neither a local "
                       f"model ({', '.join(MODELS)}) nor a model directory (no config.json)")
    return stack, engines


def _cmd_up(args: argparse.Namespace) -> int:
    from kvpush.services.local.stack import run_stack

    return run_stack(*up_settings(args))


@subcommand
def _status(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("status", help="list the engines registered in Redis")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from kvpush.services.local.stack import print_status

    return print_status(as_json=args.json)


@subcommand
def _demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="bring a local stack up, ask a few chat questions "
                                    "through P/D as they stream, tear down")
    p.add_argument("--connector", default=None, help="kvpush (default), nixl-pull, nixl-push, none")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=None,
                   help="API port of the demo's stack (KVPUSH_STACK_PORT, default 8000)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvpush.services.local.demo import run_demo
    from kvpush.services.local.stack import stack_settings

    return run_demo(requests=args.requests, max_tokens=args.max_tokens,
                    settings=stack_settings(connector=args.connector, port=args.port))


@subcommand
def _tenants(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.services.cli.tenants import (
        add_tenants_parser,  # argparse only; handlers import lazily
    )

    add_tenants_parser(sub)


@subcommand
def _acl(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.services.cli.acl import add_acl_parser  # argparse only

    add_acl_parser(sub)


@subcommand
def _drain(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.services.cli.drain import add_drain_parser  # argparse only

    add_drain_parser(sub)


@subcommand
def _scheduler(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("scheduler", help="run one push scheduler (KVPUSH_SCHEDULER_* settings)")
    p.add_argument("--id", default=None, help="consumer name (KVPUSH_SCHEDULER_ID)")
    p.add_argument("--placement", choices=["least_loaded", "best_fit"], default=None)
    p.set_defaults(func=_cmd_scheduler)


def _cmd_scheduler(args: argparse.Namespace) -> int:
    import contextlib

    from kvpush.common.runtime import freeze_startup_heap, run
    from kvpush.common.settings import SchedulerSettings
    from kvpush.services.scheduler import run_scheduler

    changes = {"scheduler_id": args.id, "scheduler_placement": args.placement}
    settings = SchedulerSettings().model_copy(
        update={k: v for k, v in changes.items() if v is not None})
    setup_logging(settings.log_level)
    freeze_startup_heap()  # the imports: its event loop does not pause to scan them
    with contextlib.suppress(KeyboardInterrupt):
        run(run_scheduler(settings))
    return 0


@subcommand
def _gateway(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gateway", help="serve the OpenAI API (KVPUSH_GATEWAY_* settings)")
    p.add_argument("--host", default=None, help="bind address (KVPUSH_GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=None, help="port (KVPUSH_GATEWAY_PORT)")
    p.add_argument("--id", default=None, help="gateway id (KVPUSH_GATEWAY_ID)")
    p.add_argument("--model", default=None, help="served model name (KVPUSH_GATEWAY_MODEL)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (KVPUSH_GATEWAY_TOKENIZER)")
    p.set_defaults(func=_cmd_gateway)


def _cmd_gateway(args: argparse.Namespace) -> int:
    import contextlib

    from kvpush.common.runtime import run
    from kvpush.common.settings import GatewaySettings
    from kvpush.services.gateway import serve_gateway

    changes = {"gateway_host": args.host, "gateway_port": args.port, "gateway_id": args.id,
               "gateway_model": args.model, "gateway_tokenizer": args.tokenizer}
    settings = GatewaySettings().model_copy(
        update={k: v for k, v in changes.items() if v is not None})
    from kvpush.services.local.ports import ensure_port_free

    # Before the gateway registers in Redis: uvicorn's own bind fails only after that.
    ensure_port_free(settings.gateway_host, settings.gateway_port, "the gateway's OpenAI API",
                     "KVPUSH_GATEWAY_PORT")
    if settings.gateway_metrics_port is not None:
        ensure_port_free(settings.gateway_host, settings.gateway_metrics_port,
                         "the gateway's /metrics", "KVPUSH_GATEWAY_METRICS_PORT")
    setup_logging(settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_gateway(settings))
    return 0


@subcommand
def _bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.loadtest.bench import add_arguments  # argparse only; the run imports lazily

    p = sub.add_parser("bench", help="benchmark every P/D system side by side (or "
                       "'transfer', 'placement')")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvpush.loadtest.bench import run_from_args

    return run_from_args(args)


@subcommand
def _eval(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.loadtest.evaluate import add_arguments  # argparse only

    p = sub.add_parser("eval", help="ask short questions with checkable answers of an "
                                    "OpenAI endpoint (and compare with a second one)")
    add_arguments(p)
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvpush.loadtest.evaluate import run_from_args

    return run_from_args(args)


@subcommand
def _reliability(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpush.loadtest.reliability import add_arguments  # argparse only; the run imports lazily

    p = sub.add_parser("reliability", help="run the fault-injection scenarios on a real "
                       "local stack and write RELIABILITY.md")
    add_arguments(p)
    p.set_defaults(func=_cmd_reliability)


def _cmd_reliability(args: argparse.Namespace) -> int:
    from kvpush.loadtest.reliability import run_from_args

    return run_from_args(args)


@subcommand
def _config(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("config", help="print every KVPUSH_* setting as Markdown tables "
                       "(the docs site's settings reference, docs/configure.md)")
    p.add_argument("--write", metavar="FILE", default=None,
                   help="write the tables into FILE between its settings markers instead "
                        "(a new FILE gets the whole page): kvpush config --write "
                        "docs/configure.md")
    p.set_defaults(func=_cmd_config)


SETTINGS_BEGIN, SETTINGS_END = "<!-- settings:begin -->", "<!-- settings:end -->"

_CONFIGURE_INTRO = """\
# Configure

Every setting is an environment variable with the `KVPUSH_` prefix: `KVPUSH_REDIS_URL`
sets `redis_url`. Each service reads one pydantic-settings class of `common/settings.py`,
and every class includes `CommonSettings`, the settings all processes read. A command's
flag (`kvpush up --port`, `kvpush gateway --port`) wins over its variable; the flags name
their variable in `kvpush <command> --help`.

The tables below are generated from the classes' docstrings by
`kvpush config --write docs/configure.md`, and a test fails when they differ from the
code. Each setting is listed once, under the first class that has it.
"""


def settings_markdown() -> str:
    """Markdown tables of every setting, built from the settings classes' docstrings."""
    from pathlib import Path

    from kvpush.common import settings as s

    classes = [s.CommonSettings, s.EngineSettings, s.StackSettings, s.GatewaySettings,
               s.SchedulerSettings]
    seen: set[str] = set()
    out: list[str] = []
    for cls in classes:
        out += [f"## {cls.__name__}", "", " ".join((cls.__doc__ or "").split()), "",
                "| env var | default | meaning |", "|---|---|---|"]
        for name, field in cls.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            default = field.get_default(call_default_factory=True)
            if isinstance(default, Path):
                default = str(default).replace(str(Path.home()), "~")
            doc = " ".join((field.description or "").split()).replace("|", "\\|")
            out.append(f"| `KVPUSH_{name.upper()}` | `{default}` | {doc} |")
        out.append("")
    return "\n".join(out)


def configure_page(current: str | None = None) -> str:
    """docs/configure.md with fresh tables: ``current`` with the text between its settings
    markers replaced, or (no page yet, or no markers) the whole page."""
    tables = f"{SETTINGS_BEGIN}\n{settings_markdown().strip()}\n{SETTINGS_END}"
    if current is not None and SETTINGS_BEGIN in current and SETTINGS_END in current:
        head, rest = current.split(SETTINGS_BEGIN, 1)
        return head + tables + rest.split(SETTINGS_END, 1)[1]
    return f"{_CONFIGURE_INTRO}\n{tables}\n"


def _cmd_config(args: argparse.Namespace) -> int:
    if args.write is None:
        print(settings_markdown())
        return 0
    from pathlib import Path

    path = Path(args.write)
    try:
        current = path.read_text() if path.exists() else None
        page = configure_page(current)
        if page != current:
            path.write_text(page)
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"{path}: {'unchanged' if page == current else 'written'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvpush`` argument parser."""
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    return parser


# Commands that talk to an existing Redis; `up`, `demo`, `bench` and `reliability` start
# their own when none is configured.
_NEEDS_REDIS = frozenset({"tenants", "scheduler", "gateway", "engine", "drain"})


class CLIError(RuntimeError):
    """A user's mistake or a missing prerequisite: printed as one line, exit status 2."""


# The flag of each command that moves a port, by the setting that does (PortUnavailable).
_PORT_FLAGS = {
    ("up", "KVPUSH_STACK_PORT"): "--port",
    ("demo", "KVPUSH_STACK_PORT"): "--port",
    ("gateway", "KVPUSH_GATEWAY_PORT"): "--port",
    ("engine", "KVPUSH_ENGINE_PORT"): "--port",
    ("engine", "KVPUSH_ENGINE_SIDE_CHANNEL_PORT"): "--side-channel-port",
}


def _startup_failures() -> tuple[type[BaseException], ...]:
    """Errors that say why a server did not come up (an engine that exited while booting,
    a redis-server that did not start, a front that failed): their message is the whole
    story, so they print as one line. Only the classes of modules imported so far: one not
    imported cannot have been raised."""
    names = (("kvpush.services.engine.launcher", "EngineError"),
             ("kvpush.services.local.stack", "StackError"),
             ("kvpush.services.local.local_redis", "RedisUnavailable"))
    return tuple(getattr(sys.modules[m], n) for m, n in names if m in sys.modules)


def find_redis() -> str:
    """``KVPUSH_REDIS_URL``, else the local stack's Redis when one answers; else a
    :class:`CLIError` saying what to set."""
    import redis

    from kvpush.common.settings import CommonSettings
    from kvpush.services.local.stack import local_redis_url

    configured = CommonSettings().redis_url
    if configured:
        return configured
    url = local_redis_url()
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) as client:
            client.ping()
    except redis.RedisError:
        raise CLIError("no Redis: set KVPUSH_REDIS_URL, or start the local stack with "
                       "`kvpush up` (its Redis is used when KVPUSH_REDIS_URL is unset)") from None
    return url


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpush`` console script."""
    import redis

    from kvpush.common.redis_client import RedisNotConfigured
    from kvpush.services.local.ports import PortUnavailable

    setup_logging()
    # One INFO line per heartbeat scrape would drown the engine's own messages.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        if args.command in _NEEDS_REDIS and not os.environ.get("KVPUSH_REDIS_URL"):
            # Child processes (engines) inherit it, so every part finds the same Redis.
            os.environ["KVPUSH_REDIS_URL"] = find_redis()
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # so that a closed pipe raises here, inside the handlers below
        return rc
    except (CLIError, RedisNotConfigured) as exc:
        print(f"kvpush {args.command}: {exc}", file=sys.stderr)
        return 2
    except PortUnavailable as exc:
        exc.flag = _PORT_FLAGS.get((args.command, exc.setting))
        print(f"kvpush {args.command}: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"kvpush {args.command}: Redis error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # A reader that stopped early (`kvpush models list | head -1`) is not our error;
        # stdout goes to /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # last: the clauses above come first
        if not isinstance(exc, _startup_failures()):
            raise
        print(f"kvpush {args.command}: {exc}", file=sys.stderr)
        return 1
