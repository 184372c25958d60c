"""Fault harness: a real local push stack, bounded open-loop load, outcome accounting, leak
checks and recovery timing. Scenarios (``loadtest/faults/scenarios.py``) drive it.

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
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import live_reservations
from kvpush.loadtest.faults.netns import NetTopology
from kvpush.loadtest.faults.tcp_proxy import TcpProxy
from kvpush.services.engine import EngineProcess, EngineSpec
from kvpush.services.engine_status import MetricsUnavailable, metric_sum, scrape
from kvpush.services.local.local_redis import LocalRedis, free_port
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.stack import UvicornThread
from kvpush.services.proc import child_preexec

logger = logging.getLogger(__name__)

MODEL = "tiny"
ENGINE_IDS = {"prefill": "kvft-prefill", "decode": "kvft-decode"}

# Request outcomes.
OK = "ok"  # 200 and a complete answer
FAILED_CLEAN = "failed_clean"  # an HTTP error status (or an SSE error event) with a message
CANCELLED = "cancelled"  # the client itself went away (disconnect scenarios)
UNCLEAR = "unclear"  # an answer that is neither: 200 with finish_reason "error", empty text,
# a stream cut without an error event or [DONE]
LOST = "lost"  # no answer within deadline + margin, or a connection error with no status


@dataclass
class FaultConfig:
    """Deadlines and sizes of the fault stack (short, so that faults resolve quickly)."""

    request_timeout_s: float = 12.0
    """Gateway deadline of one request (also the push deadline the engines get)."""
    lease_s: float = 8.0
    claim_idle_ms: int = 2000
    queue_timeout_s: float = 4.0
    sweep_s: float = 1.0
    engine_status_ttl_s: float = 4.0
    block_size: int = 32
    kv_cache_gib: float = 0.25
    max_tokens: int = 6
    late_grace_s: float = 3.0
    """An answer later than deadline + this grace (scheduling slack on a busy CPU) counts
    as late: the request outlived its deadline."""
    client_margin_s: float = 20.0
    """A request still unanswered at deadline + this margin counts as lost."""
    settle_s: float = 45.0
    """Longest the leak checks wait for reservations, blocks and flights to drain; the
    configured bound is lease + push deadline + grace, far below it."""
    recovery_bound_s: float = 90.0
    netns: bool = True

    @property
    def client_timeout_s(self) -> float:
        return self.request_timeout_s + self.client_margin_s


# ----------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """What one client request ended as."""

    idx: int
    kind: str
    stream: bool
    status: int | None
    message: str
    started: float  # monotonic
    ended: float
    tokens: int = 0

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error") or {}
        return str(err.get("message") or "")[:200]
    except (ValueError, AttributeError):
        return ""


def prompt(tag: str, n: int = 8) -> str:
    """A short prompt (a few KV blocks of 32 tokens) unique to ``tag``."""
    return f"# {tag}\n" + " ".join(
        f"def f_{tag}_{i}(x):\n    return x * {i} + 1\n" for i in range(n))


def send_request(url: str, idx: int, stream: bool, cfg: FaultConfig, tag: str = "load",
                 n_lines: int = 8, max_tokens: int | None = None,
                 abandon_after_s: float | None = None, disconnect_at_token: bool = False,
                 headers: dict[str, str] | None = None) -> Outcome:
    """One completion through the gateway, classified (never raises).

    ``abandon_after_s``: the client closes the connection if no answer (status line) came
    by then (the gateway holds the status line back until the first token). With
    ``disconnect_at_token`` a stream is closed right after its first token.
    """
    body = {"model": MODEL, "prompt": prompt(f"{tag}{idx}", n_lines),
            "max_tokens": max_tokens or cfg.max_tokens, "temperature": 0.0, "stream": stream}
    started = time.monotonic()

    def done(kind: str, status: int | None, msg: str, tokens: int = 0) -> Outcome:
        return Outcome(idx, kind, stream, status, msg, started, time.monotonic(), tokens)

    timeout = httpx.Timeout(abandon_after_s or cfg.client_timeout_s, connect=10.0)
    try:
        with httpx.Client(timeout=timeout) as client, client.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raw = resp.read()
                msg = _error_message(raw)
                kind = FAILED_CLEAN if msg else UNCLEAR
                return done(kind, resp.status_code, msg or raw[:200].decode(errors="replace"))
            if not stream:
                data = json.loads(resp.read())
                choice = (data.get("choices") or [{}])[0]
                if choice.get("finish_reason") == "error":
                    return done(UNCLEAR, 200, "200 with finish_reason=error")
                text = choice.get("text") or ""
                tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
                if not text and tokens == 0:
                    return done(UNCLEAR, 200, f"200 with an empty answer: {data!r:.300}")
                return done(OK, 200, "", tokens)
            tokens, finished = 0, False
            buf = head = b""
            for chunk in resp.iter_raw():
                buf += chunk
                head = (head + chunk)[:400]
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if not ev.startswith(b"data:"):
                        continue
                    payload = ev[5:].strip()
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    try:
                        msg = json.loads(payload)
                    except ValueError:
                        return done(UNCLEAR, 200, f"bad SSE event {payload[:80]!r}", tokens)
                    if "error" in msg:
                        err = msg["error"] or {}
                        return done(FAILED_CLEAN, int(err.get("code") or 200),
                                    "SSE error: " + str(err.get("message"))[:180], tokens)
                    choice = (msg.get("choices") or [{}])[0]
                    if choice.get("finish_reason") == "error":
                        return done(UNCLEAR, 200, "stream finish_reason=error", tokens)
                    if choice.get("text"):
                        tokens += 1
                        if tokens == 1 and disconnect_at_token:
                            return done(CANCELLED, 200, "client disconnected mid-stream",
                                        tokens)
            if finished and tokens:
                return done(OK, 200, "", tokens)
            # The head of the stream goes in the message: an unclear answer must be diagnosable.
            if finished:
                return done(UNCLEAR, 200, f"stream ended with [DONE] but no text token: "
                            f"{head!r}", tokens)
            return done(UNCLEAR, 200, f"stream ended without [DONE] ({tokens} tokens): "
                        f"{head!r}", tokens)
    except httpx.TimeoutException as exc:
        if abandon_after_s is not None:
            return done(CANCELLED, None, f"client gave up after {abandon_after_s}s")
        return done(LOST, None, f"no answer within deadline + margin ({type(exc).__name__})")
    except httpx.HTTPError as exc:
        return done(LOST, None, f"connection error: {type(exc).__name__}: {exc}"[:200])


class Load:
    """Open-loop load: ``count`` requests at ``rate`` per second, each on its own thread,
    alternating streaming and non-streaming; every outcome is recorded."""

    def __init__(self, url: str, cfg: FaultConfig, count: int = 8, rate: float = 2.0,
                 tag: str = "load", stream: bool | None = None, **kw: Any) -> None:
        self.stream = stream
        self.url, self.cfg, self.count, self.rate, self.tag, self.kw = (
            url, cfg, count, rate, f"{tag}{uuid.uuid4().hex[:4]}", kw)
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._driver = threading.Thread(target=self._drive, daemon=True, name="fault-load")
        self.started_at = 0.0

    def start(self) -> Load:
        self.started_at = time.monotonic()
        self._driver.start()
        return self

    def _drive(self) -> None:
        for i in range(self.count):
            at = self.started_at + i / self.rate
            time.sleep(max(0.0, at - time.monotonic()))
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            with self._lock:
                self.sent += 1
                self._threads.append(t)
            t.start()

    def _one(self, i: int) -> None:
        stream = i % 2 == 0 if self.stream is None else self.stream
        out = send_request(self.url, i, stream=stream, cfg=self.cfg, tag=self.tag,
                           **self.kw)
        with self._lock:
            self.outcomes.append(out)

    def join(self) -> list[Outcome]:
        """Wait for every request (each is bounded by the client timeout)."""
        self._driver.join()
        for t in list(self._threads):
            t.join(self.cfg.client_timeout_s + 15)
        return sorted(self.outcomes, key=lambda o: o.idx)


# ----------------------------------------------------------------------------- results


@dataclass
class ScenarioResult:
    """One fault's row in the report."""

    name: str
    fault: str
    sent: int = 0
    ok: int = 0
    failed_clean: int = 0
    cancelled: int = 0
    unclear: int = 0
    lost: int = 0
    late: int = 0
    """Answered (any outcome but lost) after deadline + grace."""
    max_latency_s: float = 0.0
    leaks: dict[str, Any] = field(default_factory=dict)
    drain_s: float | None = None
    recovery_s: float | None = None
    recovery_from: str = "fault healed"
    errors: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: str | None = None

    def add(self, outcomes: list[Outcome], late_after_s: float = float("inf")) -> None:
        """Count ``outcomes`` into the row; answers slower than ``late_after_s`` are late."""
        for o in outcomes:
            self.max_latency_s = max(self.max_latency_s, o.latency_s)
            if o.kind not in (LOST, CANCELLED) and o.latency_s > late_after_s:
                self.late += 1
                key = f"late ({o.latency_s:.0f} s) {o.kind} {o.status}: {_generic(o.message)}"
                self.errors[key] = self.errors.get(key, 0) + 1
        c = Counter(o.kind for o in outcomes)
        self.sent += len(outcomes)
        self.ok += c[OK]
        self.failed_clean += c[FAILED_CLEAN]
        self.cancelled += c[CANCELLED]
        self.unclear += c[UNCLEAR]
        self.lost += c[LOST]
        for o in outcomes:
            if o.kind in (FAILED_CLEAN, UNCLEAR, LOST):
                key = f"{o.kind} {o.status}: {_generic(o.message)}"
                self.errors[key] = self.errors.get(key, 0) + 1

    @property
    def accounted(self) -> int:
        return self.ok + self.failed_clean + self.cancelled + self.unclear + self.lost

    def violations(self) -> list[str]:
        """Every broken invariant (empty: the fault was survived cleanly)."""
        if self.skipped:
            return []
        out = []
        if self.accounted != self.sent:
            out.append(f"{self.sent} sent but {self.accounted} accounted for")
        if self.lost:
            out.append(f"{self.lost} request(s) lost (no answer within deadline + margin)")
        if self.unclear:
            out.append(f"{self.unclear} request(s) ended without a clear status")
        if self.late:
            out.append(f"{self.late} request(s) answered only after their deadline + grace")
        for what, left in self.leaks.items():
            if left:
                out.append(f"leak: {what}: {left}")
        if self.recovery_s is None:
            out.append("no recovery: requests did not succeed again within the bound")
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["violations"] = self.violations()
        return d


def _generic(msg: str) -> str:
    """An error message with request ids and numbers blurred, for grouping."""
    import re

    msg = re.sub(r"cmpl-[0-9a-f]+", "cmpl-*", msg)
    msg = re.sub(r"\d+(\.\d+)?", "N", msg)
    return msg[:140]


# ----------------------------------------------------------------------------- the stack


class FaultStack:
    """The stack under test; see the module docstring."""

    # Engine name (the key of ``engines`` and ``specs``) -> role; faults/fleet.py runs more.
    roles: dict[str, str] = {"prefill": "prefill", "decode": "decode"}

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
                self.net = NetTopology(self.workdir / "netns").up()
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
            side = self.net.prefill if role == "prefill" else self.net.decode
            host, python = side.ctl_ip, self.net.launcher(side)
        # A namespace has its own ports; on loopback the pair (HTTP, side channel) must be free.
        port = _free_port_on("127.0.0.1")
        return EngineSpec(
            role=role, connector="kvpush", model=MODEL, host=host, port=port, cpus=cpu,
            engine_id=self.engine_ids.setdefault(name, f"kvft-{name}"),
            kv_cache_gib=self.cfg.kv_cache_gib,
            block_size=self.cfg.block_size, redis_url=self.redis_url,
            status_ttl_s=self.cfg.engine_status_ttl_s, python=python,
            extra_config={"late_write_grace_s": 1.5, "agent_ttl_s": 10.0},
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

    def start_gateway(self) -> None:
        from kvpush.common.settings import GatewaySettings
        from kvpush.services.gateway import create_app

        gs = GatewaySettings(
            redis_url=self.redis_url, gateway_id="kvft-gw", gateway_model=MODEL,
            gateway_tokenizer=str(self.engines["decode"].model_path),
            gateway_request_timeout_s=self.cfg.request_timeout_s,
            engine_api_key=self.engine_api_key)
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
        t0 = time.monotonic()
        old = self.engines[role]
        with contextlib.suppress(Exception):
            _cont_tree(old.pid)
            old.stop(timeout_s=5)
        eng = EngineProcess(self.specs[role], local_model).start().wait_ready()
        self.engines[role] = eng
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
