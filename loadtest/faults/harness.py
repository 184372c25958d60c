"""Fault harness: a real local push stack, leak checks and recovery timing; the requests, load
and outcome accounting are in ``outcomes.py``. Scenarios (``scenarios.py``) drive it.

The stack, composed here rather than by ``services.stack.LocalStack`` because faults need
handles that ``kvpush up`` does not expose (a proxy in front of Redis, schedulers as separate
processes that can be killed, engines in network namespaces):

* Redis: a real ``redis-server`` (restartable on the same port, AOF on or off) behind a
  :class:`~tests.faults.tcp_proxy.TcpProxy`; every service uses the proxy's URL, checks use
  Redis directly.
* Two schedulers, each a subprocess (``tests.faults.sched_proc``: the real scheduler plus an
  arm-able crash point between read and ack).
* The gateway (``services.gateway.create_app``) on a uvicorn thread in this process.
* A prefill and a decode vLLM engine with ``--connector kvpush``; with ``netns=True`` each in
  its own network namespace and NIXL/UCX over a veth link (``tests.faults.netns``).

Nothing here asserts a latency: recovery time is measured and reported; the only bounds
are the configured deadlines plus a margin, past which a request counts as lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import live_reservations
from kvpush.common.settings import GatewaySettings
from kvpush.loadtest.faults.netns import NetTopology
from kvpush.loadtest.faults.outcomes import MODEL, OK, FaultConfig, Load, Outcome, send_request
from kvpush.loadtest.faults.tcp_proxy import TcpProxy
from kvpush.services.engine.launcher import EngineProcess, EngineSpec
from kvpush.services.engine.status import MetricsUnavailable, metric_sum, scrape
from kvpush.services.local.local_redis import LocalRedis, free_port
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.stack import UvicornThread
from kvpush.services.proc import child_preexec

logger = logging.getLogger(__name__)

ENGINE_IDS = {"prefill": "kvft-prefill", "decode": "kvft-decode"}

# ----------------------------------------------------------------------------- the stack


class FaultStack:
    """The stack under test; see the module docstring."""

    # Engine name (the key of ``engines`` and ``specs``) -> role; faults/fleet.py runs more.
    roles: dict[str, str] = {"prefill": "prefill", "decode": "decode"}
    tcp_rto_max_ms: int | None = None  # in the namespaces (see netns.NetTopology)

    def __init__(self, workdir: Path, cfg: FaultConfig | None = None) -> None:
        self.workdir = Path(workdir)
        self.cfg = cfg or FaultConfig()
        self.logs = self.workdir / "logs"
        self.keys = RedisKeys()
        self.redis: LocalRedis | None = None
        self.redis_port = free_port()
        self.proxy: TcpProxy | None = None
        self.net: NetTopology | None = None
        self.engines: dict[str, EngineProcess] = {}
        self.specs: dict[str, EngineSpec] = {}
        self.schedulers: dict[str, subprocess.Popen[bytes]] = {}
        self.gateway: UvicornThread | None = None
        self.app: Any = None
        self.pids: set[int] = set()
        self.notes: list[str] = []
        # The engines accept requests only with this token, as in every kvpush deployment.
        self.engine_api_key = secrets.token_urlsafe(24)
        self.engine_ids = dict(ENGINE_IDS)  # per stack, so leftovers are told apart

    # -- urls -----------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        """What services use: the proxy."""
        assert self.proxy is not None
        return self.proxy.url()

    @property
    def direct_url(self) -> str:
        """What checks use: Redis itself."""
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def direct(self) -> redis.Redis:
        return redis.Redis.from_url(self.direct_url, socket_timeout=5)

    # -- start / stop ---------------------------------------------------------------------
    def start(self) -> FaultStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        host = "127.0.0.1"
        if self.cfg.netns:
            why = NetTopology.available()
            if why:
                self.notes.append(f"netns unavailable ({why}): engines on loopback")
                self.cfg = replace(self.cfg, netns=False)
            else:
                self.net = NetTopology(self.workdir / "netns", tuple(self.roles),
                                      self.tcp_rto_max_ms).up()
                host = self.net.host_ip
        self.start_redis(appendonly=False)
        self.proxy = TcpProxy((host, 0), ("127.0.0.1", self.redis_port)).start()
        for role in self.roles:
            self.specs[role] = self._spec(role)
            self.engines[role] = EngineProcess(self.specs[role], local_model).start()
        for name in ("sched-a", "sched-b"):
            self.start_scheduler(name)
        for role in self.roles:
            self.engines[role].wait_ready()
            self._track(self.engines[role].pid)
        self.start_gateway()
        self.wait_ok("stack warm-up")

    def _spec(self, name: str) -> EngineSpec:
        role = self.roles[name]
        cpus = sorted(os.sched_getaffinity(0))
        cpu = str(cpus[0] if role == "prefill" else cpus[-1]) if len(cpus) > 1 else None
        host, python = "127.0.0.1", sys.executable
        if self.net is not None:
            side = self.net.sides[name]
            host, python = side.ctl_ip, self.net.launcher(side)
        # A namespace has its own ports; on loopback the pair (HTTP, side channel) must be free.
        port = _free_port_on("127.0.0.1")
        return EngineSpec(
            role=role, connector="kvpush", model=MODEL, host=host, port=port, cpus=cpu,
            tp=self.cfg.prefill_tp if role == "prefill" else self.cfg.decode_tp,
            engine_id=self.engine_ids.setdefault(name, f"kvft-{name}"),
            kv_cache_gib=self.cfg.kv_cache_gib,
            block_size=self.cfg.block_size, redis_url=self.redis_url,
            status_ttl_s=self.cfg.engine_status_ttl_s, python=python,
            # A killed prefill never fences its WRITEs: decode cuts it off at the
            # quarantine's bound, which the leak checks' settle time must cover.
            extra_config={"late_write_grace_s": 1.5, "agent_ttl_s": 10.0},
            quarantine_max_s=20.0,
            log_path=self.logs / f"{name}.log", api_key=self.engine_api_key,
        )

    def start_redis(self, appendonly: bool) -> None:
        self.redis = LocalRedis(self.workdir / "redis", port=self.redis_port,
                                appendonly=appendonly).start()
        self._track(self.redis.proc.pid if self.redis.proc else None)

    def scheduler_env(self, name: str) -> dict[str, str]:
        c = self.cfg
        return dict(
            os.environ, KVPUSH_REDIS_URL=self.redis_url,
            KVPUSH_SCHEDULER_ID=name, KVPUSH_SCHEDULER_LEASE_S=str(c.lease_s),
            KVPUSH_SCHEDULER_CLAIM_IDLE_MS=str(c.claim_idle_ms),
            KVPUSH_SCHEDULER_QUEUE_TIMEOUT_S=str(c.queue_timeout_s),
            KVPUSH_SCHEDULER_SWEEP_S=str(c.sweep_s), KVPUSH_LOG_LEVEL="INFO",
            KVPUSH_FAULT_ARM_FILE=str(self.arm_file(name)),
        )

    def arm_file(self, name: str) -> Path:
        return self.workdir / f"{name}.crash"

    def start_scheduler(self, name: str) -> subprocess.Popen[bytes]:
        self.arm_file(name).unlink(missing_ok=True)
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpush.loadtest.faults.sched_proc"],
            env=self.scheduler_env(name), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=child_preexec)
        log.close()
        self.schedulers[name] = proc
        self._track(proc.pid)
        return proc

    def gateway_settings(self) -> GatewaySettings:
        """The in-process gateway's settings (a stack on another topology overrides them)."""
        return GatewaySettings(
            redis_url=self.redis_url, gateway_id="kvft-gw", gateway_model=MODEL,
            gateway_tokenizer=str(self.engines["decode"].model_path),
            gateway_request_timeout_s=self.cfg.request_timeout_s,
            # What a fault costs is measured here, not the interactive objective: a burst
            # that a slow machine serves in more than the default 2 s would be shed, with
            # or without a fault (test_e2e_shedding covers shedding). A request that would
            # wait past its deadline is still refused at once.
            gateway_shed_ttft_s=self.cfg.request_timeout_s,
            engine_api_key=self.engine_api_key)

    def start_gateway(self) -> None:
        from kvpush.services.gateway import create_app

        gs = self.gateway_settings()
        self.app = create_app(gs)
        self.gateway = UvicornThread(self.app, "127.0.0.1", free_port(), bounds=gs).start()

    def stop(self) -> None:
        """Stop everything; safe after a partial start."""
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                self.gateway.stop()
            self.gateway = None
        for name, proc in list(self.schedulers.items()):
            _stop_proc(proc)
            self.schedulers.pop(name)
        for role, eng in list(self.engines.items()):
            with contextlib.suppress(Exception):
                _cont_tree(eng.pid)
                eng.stop()
            self.engines.pop(role)
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.net is not None:
            self.net.down()
            self.net = None

    def __enter__(self) -> FaultStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- processes ------------------------------------------------------------------------
    def _track(self, pid: int | None) -> None:
        if pid is None:
            return
        self.pids.add(pid)
        with contextlib.suppress(psutil.Error):
            self.pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))

    def track_all(self) -> None:
        """Record every current process of the stack (call after restarts)."""
        for eng in self.engines.values():
            self._track(eng.pid)

    def leaked_processes(self) -> list[str]:
        """Processes this stack started that are still alive (call after :meth:`stop`)."""
        out = []
        for pid in sorted(self.pids):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {p.name()}")
        # Anything else that names this run (engine ids, the Redis dir) in its command line.
        tags = (str(self.workdir), *self.engine_ids.values())
        me = psutil.Process()
        mine = {me.pid, *(p.pid for p in me.parents())}  # whoever launched this run
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            if p.info["pid"] not in self.pids and p.info["pid"] not in mine \
                    and any(t in cmd for t in tags):
                out.append(f"{p.info['pid']} {cmd[:80]}")
        return out

    def engine_tree(self, role: str) -> list[psutil.Process]:
        eng = self.engines[role]
        try:
            root = psutil.Process(eng.pid)
            return [root, *root.children(recursive=True)]
        except (psutil.Error, TypeError):
            return []

    def signal_engine(self, role: str, sig: signal.Signals) -> None:
        """Send ``sig`` to every process of the engine (vLLM server, engine core, worker)."""
        for p in self.engine_tree(role):
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def restart_engine(self, role: str) -> float:
        """Stop what is left of the engine and start it again with the same id and port
        (a new generation); returns the seconds the restart took."""
        return self.restart_engines([role])

    def restart_engines(self, names: list[str]) -> float:
        """:meth:`restart_engine` for several engines at once: all stopped, all started
        (from this thread, whose exit the engines' parent-death signal follows), then
        waited for; returns the seconds until the last was ready."""
        t0 = time.monotonic()
        for name in names:
            old = self.engines[name]
            with contextlib.suppress(Exception):
                _cont_tree(old.pid)
                old.stop(timeout_s=5)
        started = {n: EngineProcess(self.specs[n], local_model).start() for n in names}
        for name, eng in started.items():
            self.engines[name] = eng.wait_ready()
            self._track(eng.pid)
        return time.monotonic() - t0

    def restart_redis(self, appendonly: bool, down_s: float = 1.0) -> None:
        """Crash Redis (SIGKILL), keep it down ``down_s``, start it on the same port."""
        assert self.redis is not None and self.redis.proc is not None
        self.redis.proc.kill()
        self.redis.proc.wait(10)
        self.redis.proc = None
        time.sleep(down_s)
        self.start_redis(appendonly=appendonly)

    # -- gateway internals (same process) -------------------------------------------------
    @property
    def gw(self) -> Any:
        return self.app.state.gateway

    # -- requests -------------------------------------------------------------------------
    def load(self, count: int = 8, rate: float = 2.0, **kw: Any) -> Load:
        return Load(self.url, self.cfg, count, rate, **kw).start()

    def probe(self, tag: str = "probe") -> Outcome:
        return send_request(self.url, 0, stream=True, cfg=self.cfg, tag=tag)

    def wait_ok(self, what: str, bound_s: float | None = None) -> float:
        """Send probes until one succeeds; seconds it took (raises past the bound)."""
        bound = bound_s or self.cfg.recovery_bound_s
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < bound:
            last = self.probe()
            if last.kind == OK:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise AssertionError(f"{what}: no successful request within {bound}s (last: {last})")

    def recover_from(self, since: float) -> Recovery:
        """Start probing now, in the background, for the first success after ``since``."""
        return Recovery(self, since).start()

    def recovery(self, since: float, bound_s: float | None = None) -> float | None:
        """Seconds from ``since`` (monotonic) to the first successful probe; None past the
        bound (no recovery without manual action)."""
        bound = bound_s or self.cfg.recovery_bound_s
        while time.monotonic() - since < bound:
            if self.probe().kind == OK:
                return time.monotonic() - since
            time.sleep(0.5)
        return None

    # -- leaks ----------------------------------------------------------------------------
    def leak_state(self) -> dict[str, Any]:
        """What is held right now that an idle stack must not hold."""
        state: dict[str, Any] = {}
        try:
            r = self.direct()
            state["reservations"] = [f"{x.engine_id}/{x.reservation_id}"
                                     for x in live_reservations(r)]
            pend = r.xpending(self.keys.requests(), "schedulers")
            state["pending_entries"] = int(pend["pending"]) if pend else 0
            r.close()
        except redis.RedisError as exc:
            state["redis"] = f"unreadable: {exc}"
        for role, eng in self.engines.items():
            try:
                s = scrape(eng.url, timeout_s=5)
                used = metric_sum(s, "vllm:kv_cache_usage_perc")
                running = metric_sum(s, "vllm:num_requests_running")
                waiting = metric_sum(s, "vllm:num_requests_waiting")
                state[f"{role}_kv_blocks"] = (
                    f"usage {used:.3f}, running {running:.0f}, waiting {waiting:.0f}"
                    if used or running or waiting else "")
            except MetricsUnavailable as exc:
                state[f"{role}_kv_blocks"] = f"unreadable: {exc}"
        state["gateway_flights"] = sorted(self.gw.active)
        return state

    def wait_drained(self, bound_s: float | None = None) -> tuple[dict[str, Any], float]:
        """Poll :meth:`leak_state` until nothing is held; (what is left, seconds waited)."""
        bound = bound_s or self.cfg.settle_s
        t0 = time.monotonic()
        while True:
            state = self.leak_state()
            if not any(state.values()) or time.monotonic() - t0 > bound:
                return {k: v for k, v in state.items() if v}, time.monotonic() - t0
            time.sleep(0.5)

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        r = self.direct()
        try:
            return [f for _, f in r.xrange(self.keys.dead_letters())]
        finally:
            r.close()


class Recovery(threading.Thread):
    """Probes (one at a time) from the heal until the first success, concurrently with the
    scenario's remaining load; ``seconds`` is heal -> first success, None past the bound."""

    def __init__(self, st: FaultStack, since: float) -> None:
        super().__init__(daemon=True, name="fault-recovery")
        self.st, self.since = st, since
        self.seconds: float | None = None

    def start(self) -> Recovery:  # type: ignore[override]
        super().start()
        return self

    def run(self) -> None:
        self.seconds = self.st.recovery(self.since)

    def result(self) -> float | None:
        self.join(self.st.cfg.recovery_bound_s + self.st.cfg.client_timeout_s + 10)
        return self.seconds


def _free_port_on(host: str) -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with socket.socket() as s2:
            try:
                s2.bind((host, port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port pair on {host}")


def _cont_tree(pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)


def _stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def timed() -> Iterator[dict[str, float]]:
    t: dict[str, float] = {"start": time.monotonic()}
    yield t
    t["elapsed"] = time.monotonic() - t["start"]
