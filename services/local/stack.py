"""``kvpush up``: a whole local P/D stack on one machine (Redis, prefill, decode, an HTTP front)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from kvpush.common.settings import CommonSettings, EngineSettings, GatewaySettings, StackSettings
from kvpush.services.engine.launcher import EngineProcess, EngineSpec
from kvpush.services.gateway.edge import server_config
from kvpush.services.local.autoscale import LocalAutoscaler
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.pd_proxy import Backend, PDProxy, create_app
from kvpush.services.local.ports import PortUnavailable, ensure_port_free, listening_socket
from kvpush.services.local.supervisor import EngineSupervisor
from kvpush.services.proc import stop_event_on_signals

logger = logging.getLogger(__name__)


class StackError(RuntimeError):
    """The local stack could not be brought up."""


class FrontUnavailable(StackError):
    """The requested front (e.g. the push gateway) is not importable yet."""


def local_redis_url(settings: StackSettings | None = None) -> str:
    """Where ``kvpush up`` runs its embedded Redis (when ``KVPUSH_REDIS_URL`` is unset)."""
    settings = settings or StackSettings()
    return f"redis://127.0.0.1:{settings.stack_redis_port}/0"


def stack_settings(**overrides: Any) -> StackSettings:
    """``StackSettings`` from the environment, with the non-None ``overrides`` applied."""
    base = StackSettings()
    changes = {f"stack_{k}": v for k, v in overrides.items() if v is not None}
    return base.model_copy(update=changes)


def engine_settings(**overrides: Any) -> EngineSettings:
    """``EngineSettings`` from the environment, with the non-None ``overrides`` applied
    (``max_model_len=4096`` sets ``engine_max_model_len``): what ``kvpush up`` gives every
    engine it starts."""
    base = EngineSettings()
    changes = {f"engine_{k}": v for k, v in overrides.items() if v is not None}
    return base.model_copy(update=changes)


@dataclass
class StackContext:
    """What a front needs to know about the running stack."""

    settings: StackSettings
    connector: str
    redis_url: str
    prefill: EngineProcess | None
    decode: EngineProcess
    model: str
    """Served model name (what clients put in ``model``)."""
    model_path: Path | None = None
    """Directory of the model the engines load (its tokenizer counts prompt tokens)."""
    max_model_len: int | None = None
    """The engines' maximum sequence length (the gateway's context limit)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """The token the stack's engines require; the front sends it on every engine call."""
    scheduler_overrides: dict[str, Any] = field(default_factory=dict)
    """Settings of the push front's in-process scheduler that differ from the environment's."""
    gateway_overrides: dict[str, Any] = field(default_factory=dict)
    """Settings of the push front's gateway that differ from the environment's."""
    tracer_provider: Any = None
    """A tracer provider of the front's own (a benchmark tracing one system), instead of the
    process's global one."""


# A front turns the running stack into an ASGI app.
FrontFactory = Callable[[StackContext], Any]


def _stock_front(ctx: StackContext) -> Any:
    prefill = None
    if ctx.prefill is not None:
        prefill = Backend(
            url=ctx.prefill.url,
            engine_id=ctx.prefill.engine_id,
            side_channel_host=ctx.prefill.spec.host,
            side_channel_port=ctx.prefill.spec.resolved_side_channel_port,
        )
    decode = Backend(url=ctx.decode.url, engine_id=ctx.decode.engine_id)
    return create_app(PDProxy(ctx.connector, prefill, decode,
                              engine_api_key=ctx.engine_api_key))


def _kvpush_front(ctx: StackContext) -> Any:
    # Imported here: the gateway and scheduler stack is heavy and only this front needs it.
    try:
        push_front = importlib.import_module("kvpush.services.local.push_front")
    except ImportError as exc:
        raise FrontUnavailable(f"the push front does not import: {exc}") from exc
    return push_front.create_stack_app(ctx)


FRONTS: dict[str, FrontFactory] = {
    "nixl-pull": _stock_front,
    "nixl-push": _stock_front,
    "none": _stock_front,
    "kvpush": _kvpush_front,
}


def kvpush_available() -> bool:
    """True when both halves of the push path import: the connector and the push front."""
    try:
        if importlib.util.find_spec("kvpush.connector.push_connector") is None:
            return False
        importlib.import_module("kvpush.services.local.push_front")
    except ImportError:
        return False
    return True


def resolve_connector(requested: str) -> str:
    """The connector to run: ``kvpush`` falls back to stock pull when the push path does
    not import."""
    if requested == "kvpush" and not kvpush_available():
        logger.warning(
            "the kvpush push path is not available (connector.push_connector or "
            "services.local.push_front does not import); using stock nixl-pull"
        )
        return "nixl-pull"
    if requested not in FRONTS:
        raise StackError(f"unknown connector {requested!r}; one of {sorted(FRONTS)}")
    return requested


class UvicornThread:
    """An ASGI app served by uvicorn on a background thread, stoppable."""

    def __init__(self, app: Any, host: str, port: int, log_level: str = "warning",
                 bounds: GatewaySettings | None = None,
                 sock: socket.socket | None = None) -> None:
        # With ``bounds`` the server has the gateway's connection, keep-alive and header
        # limits, as ``kvpush gateway`` serves it. The port is bound here (or was, when
        # ``sock`` is given), so a taken port fails the constructor, not the thread.
        config = (server_config(app, bounds, port, host) if bounds is not None else
                  uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 lifespan="on"))
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.sock = sock if sock is not None else listening_socket(host, port)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvpush-front", daemon=True)
        self.url = f"http://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> UvicornThread:
        """Start serving and wait until the socket is bound."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise StackError(f"front on {self.url} failed to start")
            if time.monotonic() > deadline:
                raise StackError(f"front on {self.url} did not start in {timeout_s}s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for it."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.sock.close()


def _split_cpus() -> tuple[str | None, str | None]:
    """Prefill and decode CPU lists: one half of the allowed cores each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def spread_cpus(cpus: str | None, count: int) -> list[str | None]:
    """``count`` CPU lists out of ``cpus``: a chunk of its own for each engine when there
    are enough cores, otherwise every engine shares the whole list."""
    if cpus is None or count <= 1:
        return [cpus] * count
    ids = cpus.split(",")
    per = len(ids) // count
    if per < 1:
        return [cpus] * count
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(count)]


@dataclass
class LocalStack:
    """Redis (embedded unless configured), one prefill and one decode engine, and a front."""

    settings: StackSettings
    host: str = "127.0.0.1"
    prefill_cpus: str | None = None
    decode_cpus: str | None = None
    kv_cache_gib: float | None = None
    """KV cache of each engine in GiB; None: ``engine_settings.engine_kv_cache_gib``."""
    engine_settings: EngineSettings = field(default_factory=EngineSettings)
    """Engine settings every engine of the stack gets: KV cache size, maximum sequence
    length and block size (``KVPUSH_ENGINE_*``, ``kvpush up --kv-cache-gib`` etc.)."""
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    """:class:`EngineSpec` fields that win over everything above (benchmarks, tests)."""
    role_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The same for every engine of one role (``prefill``, ``decode``), over those."""
    gateway_overrides: dict[str, Any] = field(default_factory=dict)
    """kvpush only: gateway settings that differ from the environment's (see
    :class:`StackContext`)."""
    connector: str = ""
    redis: LocalRedis | None = None
    redis_url: str = ""
    prefills: list[EngineProcess] = field(default_factory=list)
    decodes: list[EngineProcess] = field(default_factory=list)
    front: UvicornThread | None = None
    _front_sock: socket.socket | None = field(default=None, repr=False)
    engine_api_key: str | None = field(default=None, repr=False)
    """The engines' internal token: ``KVPUSH_ENGINE_API_KEY``, or a fresh one per start, so
    only this stack's front can submit requests to its engines."""
    tracer_provider: Any = None
    """Handed to the front (see :class:`StackContext`)."""
    scheduler_overrides: dict[str, Any] = field(default_factory=dict)
    """kvpush only: in-process scheduler settings that differ from the environment's (the
    planner's bounds under ``--autoscale``)."""
    data_parallel: int = 0
    """kvpush only: this many colocated engines (each prefills and decodes its own
    requests, no transfer) behind the gateway instead of prefill and decode engines; the
    data-parallel baseline a P/D fleet is compared against."""

    @property
    def prefill(self) -> EngineProcess | None:
        """The first prefill engine (None for a colocated stack)."""
        return self.prefills[0] if self.prefills else None

    @property
    def decode(self) -> EngineProcess | None:
        """The first decode (or colocated) engine."""
        return self.decodes[0] if self.decodes else None

    @property
    def engines(self) -> list[EngineProcess]:
        """Every engine of the stack."""
        return [*self.prefills, *self.decodes]

    @property
    def url(self) -> str:
        """Base URL of the stack's OpenAI API."""
        return f"http://{self.host}:{self.settings.stack_port}"

    @property
    def log_dir(self) -> Path:
        """Where the engines and Redis write their logs."""
        return Path(self.settings.run_dir) / "logs"

    def _spec(self, role: str, port: int, cpus: str | None) -> EngineSpec:
        es = self.engine_settings
        kv_cache_gib = self.kv_cache_gib if self.kv_cache_gib is not None \
            else es.engine_kv_cache_gib
        spec: dict[str, Any] = {
            "role": role,
            "connector": self.connector,
            "model": self.settings.stack_model,
            "host": self.host,
            "port": port,
            "cpus": cpus,
            "engine_id": f"{role}-{port}",
            "kv_cache_gib": kv_cache_gib,
            "max_model_len": es.engine_max_model_len,
            "block_size": es.engine_block_size,
            "kv_events": es.engine_kv_events,
            "tp": (self.settings.stack_prefill_tp if role == "prefill"
                   else self.settings.stack_decode_tp),
            "redis_url": self.redis_url,
            "key_prefix": self.settings.key_prefix,
            "quarantine_max_s": es.engine_quarantine_max_s,
            "log_path": self.log_dir / f"{role}-{port}.log",
            "api_key": self.engine_api_key,
            # The engines' spans (vLLM's llm_request, the connector's) join the front's traces.
            "otlp_endpoint": self.settings.otlp_endpoint,
        }
        return EngineSpec(**{**spec, **self.engine_overrides,
                             **self.role_overrides.get(role, {})})

    def start(self) -> LocalStack:
        """Bring everything up; on any failure, tear down what was started and re-raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.connector = resolve_connector(self.settings.stack_connector)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Bound before anything boots: the front serves it only once the engines are ready.
        try:
            self._front_sock = listening_socket(self.host, self.settings.stack_port)
        except OSError as exc:
            raise PortUnavailable.of(exc, self.host, self.settings.stack_port,
                                     "the stack's OpenAI API", "KVPUSH_STACK_PORT") from None
        if self.engine_api_key is None:
            key = self.settings.engine_api_key
            self.engine_api_key = key.get_secret_value() if key else secrets.token_urlsafe(24)
        if self.settings.redis_url:
            self.redis_url = self.settings.redis_url
        else:
            # Another server on the port would answer the new one's PING while it fails.
            ensure_port_free("127.0.0.1", self.settings.stack_redis_port,
                             "the stack's embedded Redis", "KVPUSH_STACK_REDIS_PORT "
                             "(or use a Redis of your own with KVPUSH_REDIS_URL)")
            self.redis = LocalRedis(
                Path(self.settings.run_dir) / "redis", port=self.settings.stack_redis_port
            ).start()
            self.redis_url = self.redis.url
        self.plan_engines()
        self.check_engine_ports()
        # Every engine is forked from this (long-lived) thread so that its parent-death
        # signal stays armed; they then boot in parallel.
        for engine in self.engines:
            engine.start()
        for engine in self.engines:
            engine.wait_ready()
        ctx = self.context()
        app = FRONTS[self.connector](ctx)
        self.front = UvicornThread(app, self.host, self.settings.stack_port,
                                   bounds=GatewaySettings(), sock=self._front_sock).start()
        logger.info("stack up: %s (connector %s)", self.url, self.connector)

    def plan_engines(self) -> list[EngineProcess]:
        """The stack's engines for its resolved connector, made but not started: every
        spec carries the stack's model and engine settings."""
        if not self.connector:
            self.connector = resolve_connector(self.settings.stack_connector)
        if self.prefill_cpus is None and self.decode_cpus is None:
            self.prefill_cpus, self.decode_cpus = _split_cpus()
        s = self.settings
        if self.connector == "none":
            # One colocated engine: the baseline every P/D path is compared against.
            self.prefills = []
            self.decodes = [EngineProcess(
                self._spec("both", s.stack_decode_port, self.decode_cpus), resolve=local_model)]
        elif self.data_parallel and self.connector == "kvpush":
            cpus = ",".join(c for c in (self.prefill_cpus, self.decode_cpus) if c) or None
            self.prefills = []
            self.decodes = [
                EngineProcess(self._spec("both", s.stack_decode_port + 2 * i, part),
                              resolve=local_model)
                for i, part in enumerate(spread_cpus(cpus, self.data_parallel))]
        else:
            n_pre = s.stack_prefill_engines
            n_dec = 1 if self.connector != "kvpush" else s.stack_decode_engines
            if self.connector != "kvpush":
                n_pre = 1  # the stock proxy pairs one prefill with one decode
            self.prefills = [
                EngineProcess(self._spec("prefill", s.stack_prefill_port + 2 * i, cpus),
                              resolve=local_model)
                for i, cpus in enumerate(spread_cpus(self.prefill_cpus, n_pre))]
            self.decodes = [
                EngineProcess(self._spec("decode", s.stack_decode_port + 2 * i, cpus),
                              resolve=local_model)
                for i, cpus in enumerate(spread_cpus(self.decode_cpus, n_dec))]
        return self.engines

    def check_engine_ports(self) -> None:
        """Raise :class:`PortUnavailable` for the first planned engine port that is taken:
        before any engine boots (a minute on CPU), and before a server already on the port
        answers the new engine's health check in its place."""
        for engine in self.engines:
            spec = engine.spec
            setting = ("KVPUSH_STACK_PREFILL_PORT" if spec.role == "prefill"
                       else "KVPUSH_STACK_DECODE_PORT")
            ensure_port_free(spec.host, spec.port, f"engine {engine.engine_id}'s HTTP port",
                             setting)
            if spec.connector in ("nixl-pull", "nixl-push"):
                ensure_port_free(spec.host, spec.resolved_side_channel_port,
                                 f"engine {engine.engine_id}'s NIXL side channel", setting)

    def context(self) -> StackContext:
        """What the front is told about the stack's (started) engines."""
        assert self.decode is not None
        return StackContext(
            settings=self.settings,
            connector=self.connector,
            redis_url=self.redis_url,
            prefill=self.prefill,
            decode=self.decode,
            model=self.decode.spec.served_model_name,
            model_path=self.decode.model_path,
            max_model_len=self.decode.spec.max_model_len,
            engine_api_key=self.engine_api_key,
            # Colocated engines serve each request whole: the scheduler never splits one.
            scheduler_overrides={**self.scheduler_overrides,
                                 **({"scheduler_min_disagg_tokens": 2**31 - 1}
                                    if self.data_parallel else {})},
            gateway_overrides=self.gateway_overrides,
            tracer_provider=self.tracer_provider,
        )

    def healthy(self) -> bool:
        """True while every engine process is alive."""
        return all(e.running() for e in self.engines)

    def stop(self) -> None:
        """Stop the front, the engines, then Redis (each step tolerates a failed start)."""
        if self.front is not None:
            self.front.stop()
            self.front = None
        if self._front_sock is not None:
            self._front_sock.close()
            self._front_sock = None
        for engine in reversed(self.engines):
            try:
                engine.stop()
            except Exception:
                logger.exception("stopping engine %s failed", engine.engine_id)
        self.prefills, self.decodes = [], []
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_stack(settings: StackSettings, engines: EngineSettings | None = None) -> int:
    """Foreground ``kvpush up``: serve until SIGINT/SIGTERM, then stop everything.

    ``engines``: what every engine gets (default: the ``KVPUSH_ENGINE_*`` environment)."""
    stop = stop_event_on_signals("the stack")
    stack = LocalStack(settings, engine_settings=engines or EngineSettings())
    limits = autoscale_limits(settings)
    if limits:
        # The planner asks for no more than the stack may start, so it never waits for
        # an engine that will not come.
        stack.scheduler_overrides.update(
            planner_min_prefill=1, planner_min_decode=1,
            planner_max_prefill=limits["prefill"], planner_max_decode=limits["decode"])
    supervisor: EngineSupervisor | None = None
    scaler: LocalAutoscaler | None = None
    try:
        stack.start()
        decode = stack.decode
        assert decode is not None
        print(
            f"kvpush stack ({stack.connector}, {len(stack.prefills)}P{len(stack.decodes)}D) "
            f"serving {stack.url}/v1 (model {decode.spec.served_model_name} from "
            f"{decode.model_path}, max model length {decode.spec.max_model_len}); logs in "
            f"{stack.log_dir}; Ctrl-C stops it",
            flush=True,
        )
        # One engine's death is not the stack's: the others keep serving while it restarts.
        supervisor = EngineSupervisor(stack.engines)
        if limits:
            scaler = LocalAutoscaler(stack, supervisor, limits)
            print(f"autoscaling: up to {limits['prefill']} prefill and {limits['decode']} "
                  "decode engines, down to one each", flush=True)
        while not stop.wait(1.0):
            supervisor.tick()
            if scaler is not None:
                scaler.tick()
        return 0
    finally:
        if scaler is not None:
            scaler.close()
        if supervisor is not None:
            supervisor.close()
        stack.stop()


def autoscale_limits(settings: StackSettings) -> dict[str, int]:
    """Most engines per role under ``--autoscale`` (empty without it)."""
    if not settings.stack_autoscale:
        return {}
    return {"prefill": settings.stack_max_prefill or settings.stack_prefill_engines + 1,
            "decode": settings.stack_max_decode or settings.stack_decode_engines + 1}


def engine_rows(
    redis_url: str, key_prefix: str = "kvpush", settings: CommonSettings | None = None
) -> list[dict[str, Any]]:
    """Every engine in ``kvpush:engines`` with its decoded status and state (``ok``,
    ``draining`` or ``suspect``); stale index entries and unreadable statuses are skipped.

    ``settings`` supply the topology and credentials (default: the environment's)."""
    import redis as redis_lib

    from kvpush.common.keys import InvalidKeyPart, RedisKeys
    from kvpush.common.redis_client import sync_redis
    from kvpush.common.wire import EngineStatus, WireError, decode, now_ms
    from kvpush.services.engine.drain import is_draining

    keys = RedisKeys(key_prefix)
    base = settings if settings is not None else CommonSettings()
    client = sync_redis(base.model_copy(update={"redis_url": redis_url}))
    rows = []
    try:
        for raw_id in client.zrange(keys.engines(), 0, -1):
            engine_id = raw_id.decode(errors="replace")
            try:
                fields = client.hgetall(keys.engine(engine_id))
                st = decode(fields[b"m"], EngineStatus)
            except (InvalidKeyPart, KeyError, WireError, redis_lib.ResponseError):
                continue
            try:
                suspect = int(fields.get(b"suspect_until", b"0")) > now_ms()
            except ValueError:
                suspect = False
            state = "draining" if is_draining(fields) else "suspect" if suspect else "ok"
            rows.append(
                {
                    "engine_id": st.engine_id,
                    "role": st.role,
                    "url": st.url,
                    "connector": st.connector,
                    "model": st.model,
                    "free_blocks": st.free_blocks,
                    "total_blocks": st.total_blocks,
                    "block_size": st.block_size,
                    "running": st.running,
                    "waiting": st.waiting,
                    "generation": st.generation,
                    "state": state,
                    "age_s": round((now_ms() - st.updated_ms) / 1000, 1),
                }
            )
    finally:
        client.close()
    return rows


def print_status(as_json: bool = False, settings: StackSettings | None = None) -> int:
    """``kvpush status``: the engines registered in Redis."""
    settings = settings or StackSettings()
    url = settings.redis_url or local_redis_url(settings)
    try:
        rows = engine_rows(url, settings.key_prefix, settings)
    except Exception as exc:  # any connection problem is reported the same way
        print(f"cannot read engines from {url}: {exc}")
        return 1
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no engines registered in {url}")
        return 0
    print(
        f"{'ENGINE':16s} {'ROLE':8s} {'URL':24s} {'CONNECTOR':10s} {'FREE/TOTAL':>12s} "
        f"{'RUN':>4s} {'WAIT':>4s} {'GENERATION':>14s} {'AGE':>6s} STATE"
    )
    for r in rows:
        blocks = f"{r['free_blocks']}/{r['total_blocks']}"
        print(
            f"{r['engine_id']:16s} {r['role']:8s} {r['url']:24s} {r['connector']:10s} "
            f"{blocks:>12s} {r['running']:>4d} {r['waiting']:>4d} {r['generation']:>14d} "
            f"{r['age_s']:>5.1f}s {r['state']}"
        )
    return 0
