"""Engine launcher: a vLLM OpenAI server with a P/D connector, pinned, supervised, heartbeating."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from kvpush.common.settings import CommonSettings, EngineSettings
from kvpush.services.engine.cpus import omp_bind, parse_cpus, repin_tree
from kvpush.services.engine.zygote_pool import (
    ForkedEngine,
    is_interpreter,
    zygote_pool,
)
from kvpush.services.proc import child_preexec

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
ENGINE_MAIN = "kvpush.services.engine.vllm_main"
"""The engine process's main module (vLLM's API server; see that module for why)."""
CONNECTORS = ("kvpush", "nixl-pull", "nixl-push", "none")
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class EngineError(RuntimeError):
    """The engine could not be configured or started."""


class EngineStartTimeout(EngineError):
    """The engine did not answer /health before its deadline."""


class EngineExited(EngineError):
    """The engine process exited while we waited for it."""


@dataclass
class EngineSpec:
    """Everything needed to start one engine; the defaults suit the local CPU stack."""

    role: str = "both"
    connector: str = "none"
    model: str = "tiny"
    """A model directory, or a name the launcher's ``resolve`` knows (the local stack's
    test models)."""
    port: int = 8100
    host: str = "127.0.0.1"
    cpus: str | None = None
    engine_id: str | None = None
    side_channel_port: int | None = None
    """NIXL side-channel port of the stock connectors; defaults to ``port + 1``."""
    kv_cache_gib: float = 1.0
    max_model_len: int = 2048
    block_size: int | None = None
    """Tokens per KV block; None keeps vLLM's platform default (128 on CPU)."""
    tp: int = 1
    """Tensor-parallel size: one vLLM worker process per rank, each bound to its share of
    ``cpus`` (vLLM's per-rank ``VLLM_CPU_OMP_THREADS_BIND`` lists)."""
    worker_in_core: bool = True
    """With ``tp`` 1, run the model in vLLM's engine-core process (``EngineSettings``)."""
    kv_events: bool = True
    """Relay the engine's KV events to Redis for placement (with the heartbeat)."""
    kv_events_endpoint: str | None = None
    """Where vLLM publishes KV events; set by :class:`EngineProcess` at each start."""
    dtype: str | None = None
    """Model dtype; None takes the local model's own dtype."""
    redis_url: str | None = None
    key_prefix: str = "kvpush"
    extra_config: dict[str, Any] = field(default_factory=dict)
    """Merged into ``kv_connector_extra_config``."""
    quarantine_max_s: float | None = None
    """kvpush decode: longest a failed push's blocks wait for prefill's fence (the
    connector's ``quarantine_max_s``; None: its default)."""
    connector_class: str = "kvpush.connector.push_connector.KVPushConnector"
    """The kvpush connector vLLM loads (module path and class); a fault harness names a
    subclass of it."""
    nixl_backends: list[str] = field(default_factory=lambda: ["UCX"])
    """NIXL backends of the kvpush connector, in preference order (``LIBFABRIC`` on EFA)."""
    otlp_endpoint: str | None = None
    """OTLP traces endpoint: the connector's spans and vLLM's ``llm_request`` span go there."""
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    repin: bool = True
    """Re-pin every engine thread onto ``cpus`` once up (the stock NIXL worker moves its
    compute thread to the machine's last core at init)."""
    heartbeat: bool = True
    """Publish the engine status to Redis while running (needs ``redis_url``)."""
    heartbeat_s: float = 1.0
    status_ttl_s: float = 5.0
    drain_timeout_s: float = 60.0
    """On a stop signal, how long ``kvpush engine`` waits for its work to drain."""
    ready_timeout_s: float = 300.0
    python: str = sys.executable
    zygote: bool = True
    """Fork the engine from a warm zygote (services/engine/zygote.py) instead of starting
    a fresh interpreter."""
    zygote_dir: Path | None = None
    """The shared zygotes' directory; None: ``KVPUSH_ENGINE_ZYGOTE_DIR``, else this
    launcher's own zygotes."""
    api_key: str | None = field(default=None, repr=False)
    """Token the engine requires on its OpenAI routes; reaches vLLM only through its
    environment (``VLLM_API_KEY``), never the command line."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EngineError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.connector not in CONNECTORS:
            raise EngineError(f"connector must be one of {CONNECTORS}, not {self.connector!r}")
        if self.connector == "none" and self.role != "both":
            raise EngineError("an engine without a connector can only have role 'both'")
        if self.cpus is not None:
            try:
                parse_cpus(self.cpus)
            except ValueError as exc:  # CPUListError, or a part that is no number
                raise EngineError(f"bad CPU list {self.cpus!r}: {exc}") from exc
        if self.tp < 1:
            raise EngineError(f"tp must be at least 1, not {self.tp}")
        if self.otlp_endpoint:
            vllm_otlp_endpoint(self.otlp_endpoint)  # refuse a bad endpoint before launch
        if self.connector == "kvpush":
            from kvpush.connector.config import TRANSFER_BACKENDS

            bad = [b for b in self.nixl_backends if b not in TRANSFER_BACKENDS]
            if bad or not self.nixl_backends:
                raise EngineError(
                    f"NIXL backends must be a non-empty list of {sorted(TRANSFER_BACKENDS)}, "
                    f"not {self.nixl_backends!r}"
                )

    @classmethod
    def from_settings(cls, settings: EngineSettings, **overrides: Any) -> EngineSpec:
        """A spec from ``KVPUSH_ENGINE_*`` settings; ``overrides`` win (None values ignored)."""
        base = cls(
            engine_id=settings.engine_id,
            host=settings.engine_host,
            port=settings.engine_port,
            cpus=settings.engine_cpus,
            kv_cache_gib=settings.engine_kv_cache_gib,
            max_model_len=settings.engine_max_model_len,
            block_size=settings.engine_block_size,
            tp=settings.engine_tp,
            worker_in_core=settings.engine_worker_in_core,
            kv_events=settings.engine_kv_events,
            # The settings default is one fixed port; two engines on a host need two, so
            # only an explicitly configured port is used and otherwise port + 1.
            side_channel_port=(
                settings.engine_side_channel_port
                if "engine_side_channel_port" in settings.model_fields_set
                else None
            ),
            ready_timeout_s=settings.engine_ready_timeout_s,
            zygote=settings.engine_zygote,
            zygote_dir=settings.engine_zygote_dir,
            heartbeat_s=settings.engine_heartbeat_s,
            status_ttl_s=settings.engine_status_ttl_s,
            drain_timeout_s=settings.engine_drain_timeout_s,
            redis_url=settings.redis_url,
            key_prefix=settings.key_prefix,
            nixl_backends=list(settings.engine_nixl_backends),
            quarantine_max_s=settings.engine_quarantine_max_s,
            otlp_endpoint=settings.otlp_endpoint,
            api_key=(settings.engine_api_key.get_secret_value()
                     if settings.engine_api_key else None),
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    # -- derived ----------------------------------------------------------------------
    @property
    def uniproc(self) -> bool:
        """The model runs in the engine-core process (vLLM's ``uni`` executor)."""
        return self.worker_in_core and self.tp == 1

    @property
    def url(self) -> str:
        """Base URL of the engine's OpenAI server."""
        return f"http://{self.host}:{self.port}"

    @property
    def resolved_engine_id(self) -> str:
        """The engine id published to Redis and given to the connector."""
        return self.engine_id or f"{self.role}-{socket.gethostname()}-{self.port}"

    @property
    def resolved_side_channel_port(self) -> int:
        """NIXL side-channel port (distinct per engine on one host)."""
        return self.side_channel_port or self.port + 1

    @property
    def served_model_name(self) -> str:
        """Model name clients put in their requests."""
        return Path(self.model).name if os.sep in self.model else self.model

    @property
    def continues_from_prefill(self) -> bool:
        """Whether, as decode, it goes on from prefill's first token: kvpush's connector
        where a failed push fails its request (vLLM's default policy), since a recomputed
        prompt would sample a first token of its own (``EngineStatus.continues``)."""
        return self.connector == "kvpush" and self.role in ("decode", "both") \
            and self.extra_config.get("failure_policy") != "recompute"

    def kv_transfer_config(self, generation: int = 0) -> dict[str, Any] | None:
        """vLLM ``--kv-transfer-config`` for this connector and role, or None."""
        if self.connector == "none":
            return None
        engine_id = self.resolved_engine_id
        if self.connector == "kvpush":
            extra = {
                "redis_url": self.redis_url,
                "key_prefix": self.key_prefix,
                "engine_id": engine_id,
                "role": self.role,
                "generation": generation,
                "backends": list(self.nixl_backends),
                **({"quarantine_max_s": self.quarantine_max_s}
                   if self.quarantine_max_s is not None else {}),
                # A prefill's only receive is a history push, which it computes itself
                # when the push fails: the request must never fail for it.
                **({"failure_policy": "recompute"} if self.role == "prefill" else {}),
                **self.extra_config,
            }
            module, _, name = self.connector_class.rpartition(".")
            return {
                "kv_connector": name,
                "kv_connector_module_path": module,
                "kv_role": _KV_ROLE[self.role],
                "engine_id": engine_id,
                "kv_connector_extra_config": extra,
            }
        # Both stock connectors pair engines by a fixed engine id, and on CPU they must
        # register host memory ("cpu" buffer device).
        cfg: dict[str, Any] = {
            "kv_connector": (
                "NixlConnector" if self.connector == "nixl-pull" else "NixlPushConnector"
            ),
            "kv_role": _KV_ROLE[self.role],
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
        }
        if self.extra_config:
            cfg["kv_connector_extra_config"] = dict(self.extra_config)
        return cfg

    def command(self, model_path: str | Path, generation: int = 0) -> list[str]:
        """The full command line of the vLLM OpenAI server."""
        cmd = [
            self.python, "-m", ENGINE_MAIN,
            "--model", str(model_path),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(int(self.kv_cache_gib * (1 << 30))),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        elif self.uniproc:
            cmd += ["--distributed-executor-backend", "uni"]
        kv = self.kv_transfer_config(generation)
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv, sort_keys=True)]
        if self.connector == "kvpush":
            # Malformed kvpush params get a 400 at the engine's edge, not a scheduler error.
            cmd += ["--middleware", "kvpush.connector.api_guard.KVParamsGuard"]
            # The gateway sizes a /v1/responses request by the engine's own render of it
            # (/v1/responses/render); the engine's API key guards those routes too.
            cmd += ["--enable-scale-out"]
        if self.kv_events_endpoint:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self.kv_events_endpoint, "topic": "kv"})]
        if self.otlp_endpoint:
            # vLLM's own llm_request span joins the request's trace (traceparent header).
            cmd += ["--otlp-traces-endpoint", vllm_otlp_endpoint(self.otlp_endpoint)]
        cmd += list(self.extra_args)
        if self.cpus is not None:
            # taskset pins the server and everything it forks from the first instruction;
            # the OMP bind list makes vLLM's compute threads agree with it.
            cmd = ["taskset", "-c", self.cpus, *cmd]
        return cmd

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment of the vLLM server."""
        env = dict(os.environ if base is None else base)
        # The legacy integer knob would silently override --kv-cache-memory-bytes.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.resolved_side_channel_port)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        # Only this spec decides whether the engine wants a token; an inherited one is
        # dropped (and KVPUSH_ENGINE_API_KEY stays the launcher's business).
        env.pop("VLLM_API_KEY", None)
        env.pop("KVPUSH_ENGINE_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env["PYTHONUNBUFFERED"] = "1"
        if self.uniproc:
            # vLLM's CPU platform turns ``uni`` into ``mp`` unless multiprocessing is off:
            # its multiprocess executor is where it sets the worker's OpenMP environment.
            # The engine core stays a process of its own (AsyncLLM always starts one); the
            # OpenMP environment vLLM would give the worker is set here, for the whole
            # engine, which taskset already confines to these cores.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            if self.cpus is not None:
                cores = parse_cpus(self.cpus)
                env["OMP_NUM_THREADS"] = str(len(cores))
                env["OMP_PLACES"] = "{" + ",".join(map(str, cores)) + "}"
                env["OMP_PROC_BIND"] = "true"
        elif self.cpus is not None or self.tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(self.cpus, self.tp)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        if self.otlp_endpoint:
            # The connector reads KVPUSH_OTLP_ENDPOINT in every engine process; vLLM's
            # exporter speaks gRPC unless told otherwise.
            env["KVPUSH_OTLP_ENDPOINT"] = self.otlp_endpoint
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = (
                "grpc" if self.otlp_endpoint.startswith("grpc://") else "http/protobuf"
            )
            # vLLM installs its tracer provider before the connector exists, so its
            # resource (from these variables) is the one the connector's spans carry.
            env.setdefault("OTEL_SERVICE_NAME", "kvpush-engine")
            attrs = f"kvpush.engine_id={self.resolved_engine_id},kvpush.role={self.role}"
            env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
                a for a in (env.get("OTEL_RESOURCE_ATTRIBUTES"), attrs) if a
            )
        return env


def vllm_otlp_endpoint(endpoint: str) -> str:
    """kvpush's OTLP endpoint as vLLM's ``--otlp-traces-endpoint`` takes it.

    kvpush names the protocol by scheme (``grpc://`` or ``http(s)://``, path optional);
    vLLM takes the protocol from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (see
    :meth:`EngineSpec.env`) and an HTTP endpoint as the full ``/v1/traces`` URL.
    """
    if endpoint.startswith("grpc://"):
        return "http://" + endpoint.removeprefix("grpc://")
    if endpoint.startswith(("http://", "https://")):
        if endpoint.rstrip("/").count("/") <= 2:
            return endpoint.rstrip("/") + "/v1/traces"
        return endpoint
    raise EngineError(
        f"OTLP endpoint must start with grpc://, http:// or https://: {endpoint!r}"
    )


ModelResolver = Callable[["EngineSpec"], tuple[Path, str]]


def resolve_model(spec: EngineSpec) -> tuple[Path, str]:
    """Model directory and dtype for ``spec``, whose model must be a model directory."""
    path = Path(spec.model)
    if not (path / "config.json").is_file():
        raise EngineError(f"{spec.model!r} is not a model directory (no config.json)")
    return path, spec.dtype or "auto"


class EngineProcess:
    """A running vLLM server: start it, wait for /health, heartbeat, stop the whole group.

    Start it from a long-lived thread (normally the main one): the kernel's parent-death
    signal fires when the *thread* that forked the child exits.
    """

    def __init__(self, spec: EngineSpec, resolve: ModelResolver = resolve_model) -> None:
        self.spec = spec
        self.resolve = resolve
        self.proc: subprocess.Popen[bytes] | ForkedEngine | None = None
        self.generation = 0
        self.model_path: Path | None = None
        self.publisher: Any = None
        self.kv_relay: Any = None
        self._log: IO[bytes] | None = None
        self._repin_stop = threading.Event()
        self._repin_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the engine."""
        return self.spec.url

    @property
    def engine_id(self) -> str:
        """The engine's id."""
        return self.spec.resolved_engine_id

    @property
    def pid(self) -> int | None:
        """Pid of the vLLM API server (the process group leader)."""
        return self.proc.pid if self.proc else None

    def start(self) -> EngineProcess:
        """Spawn the server; returns at once (see :meth:`wait_ready`)."""
        model_path, dtype = self.resolve(self.spec)
        self.model_path = model_path
        self.spec = replace(self.spec, dtype=dtype)
        # A new generation on every start lets peers tell a restarted engine apart.
        self.generation = time.time_ns() // 1_000_000
        self._repin_stop = threading.Event()
        if self.kv_relay is not None:
            self.kv_relay.stop(remove=True)
        self._start_kv_relay()
        cmd = self.spec.command(model_path, self.generation)
        out: IO[bytes] | int | None = None
        if self.spec.log_path is not None:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.spec.log_path, "ab")  # noqa: SIM115 - lives as long as the engine
            out = self._log
        logger.info("starting engine %s: %s", self.engine_id, " ".join(cmd))
        env = self.spec.env()

        def popen() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                stdin=subprocess.DEVNULL,
                preexec_fn=child_preexec,
                # Own process group, so stop() reaches vLLM's engine-core and worker children.
                start_new_session=True,
            )

        if self.spec.zygote and is_interpreter(self.spec.python):
            self.proc = self._fork(cmd, env, popen)
        else:
            self.proc = popen()
        return self

    def _fork(self, cmd: list[str], env: dict[str, str],
              fallback: Callable[[], subprocess.Popen[bytes]]) -> ForkedEngine:
        """The engine of ``cmd``, forked from a warm zygote (taskset's pinning applied by
        the child itself), or started by ``fallback`` if no zygote can."""
        if cmd[0] == "taskset":
            cmd = cmd[3:]
        directory = self.spec.zygote_dir or EngineSettings().engine_zygote_dir
        out = self._log.fileno() if self._log is not None else sys.stdout.fileno()
        err = self._log.fileno() if self._log is not None else sys.stderr.fileno()
        return zygote_pool(directory).fork(
            self.spec.python, cmd[cmd.index(ENGINE_MAIN) + 1:], env,
            cpus=parse_cpus(self.spec.cpus) if self.spec.cpus is not None else None,
            stdout=out, stderr=err, title=" ".join(cmd), fallback=fallback)

    def wait_ready(self, timeout_s: float | None = None) -> EngineProcess:
        """Block until /health answers 200; raises if the process exits or the deadline passes."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + (timeout_s or self.spec.ready_timeout_s)
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise EngineExited(
                        f"engine {self.engine_id} exited with {code} before it was ready"
                        + (f"; see {self.spec.log_path}" if self.spec.log_path else "")
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartTimeout(f"engine {self.engine_id} not ready at {self.url}")
                time.sleep(0.5)
        logger.info("engine %s ready at %s", self.engine_id, self.url)
        self.mark_ready()
        return self

    def mark_ready(self) -> None:
        """The engine answers /health: pin its threads and start its heartbeat (for
        callers that watch /health themselves instead of blocking in wait_ready)."""
        if self.spec.cpus is not None and self.spec.repin:
            cpus = parse_cpus(self.spec.cpus)
            moved = repin_tree(self.proc.pid, cpus)  # type: ignore[union-attr]
            logger.info("engine %s: re-pinned %d threads onto %s", self.engine_id, moved, cpus)
            # NIXL/UCX start threads lazily (first handshake); keep them on our cores too.
            self._repin_thread = threading.Thread(
                target=self._repin_loop, args=(cpus,), name="kvpush-repin", daemon=True
            )
            self._repin_thread.start()
        if self.spec.heartbeat and self._redis_settings() is not None:
            self._start_heartbeat()

    def _repin_loop(self, cpus: list[int]) -> None:
        while not self._repin_stop.wait(2.0):
            if self.proc is None or self.proc.poll() is not None:
                return
            moved = repin_tree(self.proc.pid, cpus)
            if moved:
                logger.debug("engine %s: re-pinned %d new threads", self.engine_id, moved)

    def _redis_settings(self) -> CommonSettings | None:
        """The heartbeat's Redis: the spec's URL (or the environment's Sentinels) with the
        environment's topology and credentials; None when neither names a Redis."""
        overrides = {"redis_url": self.spec.redis_url} if self.spec.redis_url else {}
        settings = CommonSettings(**overrides)
        return settings if self.spec.redis_url or settings.redis_sentinels else None

    def _start_heartbeat(self) -> None:
        from kvpush.common.redis_client import sync_redis
        from kvpush.services.engine.status import StatusPublisher

        settings = self._redis_settings()
        assert settings is not None
        client = sync_redis(settings)
        self.publisher = StatusPublisher(
            client,
            engine_id=self.engine_id,
            role=self.spec.role,
            url=self.url,
            model=self.spec.served_model_name,
            connector=self.spec.connector,
            generation=self.generation,
            kv_events=self.kv_relay is not None,
            continues=self.spec.continues_from_prefill,
            interval_s=self.spec.heartbeat_s,
            ttl_s=self.spec.status_ttl_s,
            key_prefix=self.spec.key_prefix,
        )
        self.publisher.publish_once()
        self.publisher.start()

    def _start_kv_relay(self) -> None:
        """Subscribe to the engine's KV events before it starts (an empty cache: nothing
        to miss); without a Redis for the heartbeat there is nowhere to relay them."""
        settings = self._redis_settings()
        if not (self.spec.kv_events and self.spec.heartbeat) or settings is None:
            self.spec = replace(self.spec, kv_events_endpoint=None)
            return
        from kvpush.common.redis_client import sync_redis
        from kvpush.services.engine.kv_events import KvEventRelay

        self.kv_relay = KvEventRelay(sync_redis(settings), engine_id=self.engine_id,
                                     ttl_s=self.spec.status_ttl_s,
                                     key_prefix=self.spec.key_prefix).start()
        self.spec = replace(self.spec, kv_events_endpoint=self.kv_relay.endpoint)

    def running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Withdraw the status, SIGTERM the process group, SIGKILL it after ``timeout_s``."""
        self._repin_stop.set()
        if self.publisher is not None:
            self.publisher.stop(remove=True)
            self.publisher = None
        if self.proc is not None and self.proc.pid is None:  # a fork that never started
            self.proc = None
        if self.proc is not None:
            pgid = self.proc.pid
            assert pgid is not None
            members = _group_members(pgid)
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine %s ignored SIGTERM; killing it", self.engine_id)
            # Children that outlive the leader (or a stuck leader) get SIGKILL.
            _signal_group(pgid, signal.SIGKILL)
            for m in members:
                with contextlib.suppress(psutil.Error):
                    m.wait(timeout=5)
            if self.proc.poll() is None:
                self.proc.wait(5)
            logger.info("engine %s stopped", self.engine_id)
            self.proc = None
        if self.kv_relay is not None:
            self.kv_relay.stop(remove=True)
            self.kv_relay = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineProcess:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
