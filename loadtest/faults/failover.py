"""Redis failover under load: the fault stack on a Sentinel set or a Redis Cluster with
replicas, a master SIGKILLed mid-load, and what it cost (outcomes, duplicated requests,
repeated fencing tokens, leaks, recovery).

The stack is :class:`~kvpush.loadtest.faults.harness.FaultStack` (engines, schedulers,
gateway, load, leak checks) with Redis swapped for a topology from
:mod:`kvpush.services.local.redis_topologies`: every service is pointed at it through the
client factory's settings (``KVPUSH_REDIS_SENTINELS`` / ``KVPUSH_REDIS_CLUSTER``) and must
follow the failover without a restart. Engines run on loopback (Sentinels report loopback
addresses), the gateway requires API keys so that tenant quota units are held and checked.

What the harness cannot see from outcomes is counted here: every assignment is read off the
gateway's assignment stream as it is written (:class:`AssignmentTap`), so the fencing tokens
handed out per engine and the placements per request id survive the failover that may drop
them from Redis; the engines' logs say which requests were pushed or received twice.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from kvpush.common.redis_client import SyncRedis, lost_connection, sync_redis
from kvpush.common.settings import CommonSettings, GatewaySettings
from kvpush.common.tenancy import Quotas, create_tenant
from kvpush.common.wire import Assignment, WireError, decode
from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.outcomes import (
    FaultConfig,
    Load,
    Outcome,
    ScenarioResult,
    record_raise,
    send_request,
)
from kvpush.loadtest.faults.scenarios import _finish as finish  # the scenarios' own ending
from kvpush.loadtest.faults.tcp_proxy import TcpProxy
from kvpush.services.engine.launcher import EngineProcess, EngineSpec
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.redis_topologies import LocalCluster, LocalSentinels

logger = logging.getLogger(__name__)

GATEWAY_ID = "kvft-gw"
TENANT = "kvft"
TOPOLOGIES = ("sentinel", "cluster")
_TOPOLOGY_VARS = ("KVPUSH_REDIS_URL", "KVPUSH_REDIS_CLUSTER", "KVPUSH_REDIS_SENTINELS",
                  "KVPUSH_REDIS_SENTINEL_MASTER")


class UnknownTopology(ValueError):
    """A failover stack was asked for a topology other than ``sentinel`` or ``cluster``."""


def topology_env(settings: CommonSettings) -> dict[str, str]:
    """The ``KVPUSH_REDIS_*`` variables that point a service process at ``settings``'s Redis."""
    if settings.redis_sentinels:
        return {"KVPUSH_REDIS_SENTINELS": settings.redis_sentinels,
                "KVPUSH_REDIS_SENTINEL_MASTER": settings.redis_sentinel_master or ""}
    env = {"KVPUSH_REDIS_URL": settings.redis_url or ""}
    if settings.redis_cluster:
        env["KVPUSH_REDIS_CLUSTER"] = "true"
    return env


def _with_topology(env: dict[str, str], settings: CommonSettings) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in _TOPOLOGY_VARS}
    out.update(topology_env(settings))
    return out


@dataclass
class TopologyEngineSpec(EngineSpec):
    """An engine whose connector reaches Redis through ``redis_settings`` (any topology)."""

    redis_settings: CommonSettings | None = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = super().env(base)
        return _with_topology(env, self.redis_settings) if self.redis_settings else env


class TopologyEngine(EngineProcess):
    """An engine process whose heartbeat (in this process) uses the spec's topology."""

    def _redis_settings(self) -> CommonSettings | None:
        spec = self.spec
        if isinstance(spec, TopologyEngineSpec) and spec.redis_settings is not None:
            return spec.redis_settings
        return super()._redis_settings()


# ----------------------------------------------------------------------------- accounting


@dataclass
class FailoverResult(ScenarioResult):
    """A failover row: the harness's columns plus what a failover can break beyond them."""

    topology: str = ""
    duplicated: int = 0
    """Requests served twice: one request id with two different placements (reservation or
    fencing token), or pushed / received twice by the engines."""
    tokens: int = 0
    """Fencing tokens handed out during the run (assignments seen, all engines)."""
    token_repeats: int = 0
    """Fencing tokens handed out twice on one engine, to different reservations."""
    failover_s: float | None = None
    """Master SIGKILLed -> replica promoted and serving."""
    killed: str = ""

    def violations(self) -> list[str]:
        out = super().violations()
        if self.duplicated:
            out.append(f"{self.duplicated} request(s) served twice")
        return out


@dataclass
class Placements:
    """What the assignments handed out during a run say."""

    tokens: int = 0
    repeats: list[str] = field(default_factory=list)
    """``engine token N -> reservations a, b`` for every token given to two reservations."""
    duplicated: list[str] = field(default_factory=list)
    """Request ids placed twice (a second, different reservation or token)."""
    repeated_answers: int = 0
    """The same placement answered again (a redelivered entry): harmless, not a duplicate."""


def placements(assignments: Iterable[Assignment]) -> Placements:
    """Count fencing tokens, repeated tokens and duplicate placements in ``assignments``."""
    by_token: dict[tuple[str, int], set[str]] = defaultdict(set)
    by_request: dict[str, set[tuple[str, str, int]]] = defaultdict(set)
    answers = 0
    for a in assignments:
        if not a.ok or a.decode_engine is None:
            continue
        answers += 1
        by_token[(a.decode_engine, a.fencing_token)].add(a.reservation_id or "")
        by_request[a.request_id].add((a.decode_engine, a.reservation_id or "", a.fencing_token))
    out = Placements(tokens=len(by_token))
    out.repeats = [f"{e} token {t} -> reservations {', '.join(sorted(r))}"
                   for (e, t), r in sorted(by_token.items()) if len(r) > 1]
    out.duplicated = sorted(rid for rid, p in by_request.items() if len(p) > 1)
    out.repeated_answers = answers - sum(len(p) for p in by_request.values())
    return out


_LOG_RECORD = re.compile(rb"kvpush (push|recv) rid=(\S+) peer=\S+ rank=(\d+) ")


def served_twice(log: Path, offset: int) -> list[str]:
    """Request ids the engine log pushed or received in full more than once (per rank),
    reading from ``offset``."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return []
    seen = Counter(m.groups() for m in _LOG_RECORD.finditer(data))
    return sorted({f"{kind.decode()} {rid.decode()}" for (kind, rid, _), n in seen.items()
                   if n > 1})


class AssignmentTap(threading.Thread):
    """Reads the gateway's assignment stream beside the gateway through its own client of
    the topology, keeping every assignment as it is written: a failover may drop the
    newest entries from the stream, but not from here."""

    def __init__(self, settings: CommonSettings, key: str) -> None:
        super().__init__(daemon=True, name="assignment-tap")
        self.settings, self.key = settings, key
        self.seen: dict[str, Assignment] = {}
        self.errors = 0
        self.bad = 0
        self.ready = threading.Event()
        self._done = threading.Event()
        self._start_id = self._last_id = "0-0"

    def start(self) -> AssignmentTap:  # type: ignore[override]
        super().start()
        if not self.ready.wait(30):
            raise TimeoutError(f"no read of {self.key} within 30 s")
        return self

    def run(self) -> None:
        client = sync_redis(self.settings)
        try:
            last = client.xrevrange(self.key, "+", "-", count=1)
            self._start_id = self._last_id = last[0][0].decode() if last else "0-0"
            self.ready.set()
            while not self._done.is_set():
                try:
                    reply = client.xread({self.key: self._last_id}, count=512, block=200)
                except redis.RedisError as exc:
                    if not lost_connection(exc):
                        logger.warning("tap on %s: %s", self.key, exc)
                    self.errors += 1
                    time.sleep(0.1)
                    continue
                for _, entries in reply or []:
                    self._keep(entries)
                    self._last_id = entries[-1][0].decode()
        finally:
            client.close()

    def _keep(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for eid, f in entries:
            try:
                self.seen.setdefault(eid.decode(), decode(f.get(b"m", b""), Assignment))
            except WireError:
                self.bad += 1

    def finish(self) -> list[Assignment]:
        """Stop reading; add what the stream holds now that the tap missed; every
        assignment seen since the tap started, in stream order."""
        self._done.set()
        self.join(10)
        client = sync_redis(self.settings)
        try:
            self._keep([e for e in client.xrange(self.key, "-", "+")
                        if _entry_key(e[0].decode()) > _entry_key(self._start_id)])
        except (redis.RedisError, RedisClusterException) as exc:
            logger.warning("final read of %s failed: %s", self.key, exc)
        finally:
            client.close()
        return [self.seen[k] for k in sorted(self.seen, key=_entry_key)]


def _entry_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


# ----------------------------------------------------------------------------- the stack


class FailoverStack(FaultStack):
    """The fault stack on a Redis topology that can lose its master (see the module doc)."""

    def __init__(self, workdir: Path, topology: str, cfg: FaultConfig | None = None,
                 replication_lag_s: float = 0.0) -> None:
        if topology not in TOPOLOGIES:
            raise UnknownTopology(f"topology must be one of {TOPOLOGIES}, not {topology!r}")
        if replication_lag_s and topology != "sentinel":
            raise UnknownTopology("a replication lag is only built for the Sentinel set")
        super().__init__(workdir, replace(cfg or FaultConfig(), netns=False))
        self.topology = topology
        self.replication_lag_s = replication_lag_s
        self.link: TcpProxy | None = None
        """The replica's link to the primary when it lags: a delaying proxy that dies with
        the primary (what it carried is lost, as with a crashed host)."""
        self.topo: LocalSentinels | LocalCluster | None = None
        self.service_settings = CommonSettings()
        self.headers: dict[str, str] = {}
        self.tenant_id = TENANT
        self._victim_key = ""
        self.notes_for_row: list[str] = []
        run = uuid.uuid4().hex[:6]  # the machine may run other fault stacks (kvft-*)
        self.engine_ids = {role: f"kvfo-{run}-{role}" for role in ("prefill", "decode")}

    # -- Redis ----------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return self.service_settings.redis_url or ""

    def check_settings(self) -> CommonSettings:
        """Settings of a fresh client for checks (names a node that is alive now)."""
        assert self.topo is not None
        return self.topo.settings()

    def direct(self) -> SyncRedis:  # type: ignore[override]
        return sync_redis(self.check_settings())

    def hot_keys(self) -> dict[str, str]:
        """What each key the request path writes is, by key name."""
        k = self.keys
        return {
            k.fence(self.engine_ids["decode"]): "decode reservations and fencing counter",
            k.requests(): "request stream",
            k.assignments(GATEWAY_ID): "assignment stream",
            k.targets(self.engine_ids["prefill"]): "push targets",
            k.tenant_quota(self.tenant_id, "leases"): "tenant quotas",
            k.engines(): "engine index",
        }

    def kill_master(self) -> tuple[int, str]:
        """SIGKILL a master; (its port, what it held). On the cluster: the master holding
        most of the request path's keys (the decode reservations on a tie)."""
        assert self.topo is not None
        if isinstance(self.topo, LocalSentinels):
            if self.link is not None:
                self.link.down()
            return self.topo.kill_master(), "every key"
        cluster = self.topo
        held: dict[int, list[str]] = defaultdict(list)
        for key, what in self.hot_keys().items():
            held[cluster.master_of(key)].append(what)
        victim = max(held, key=lambda port: len(held[port]))
        key = next(k for k in self.hot_keys() if cluster.master_of(k) == victim)
        self._victim_key = key
        return cluster.kill_master(key), ", ".join(held[victim])

    def wait_promoted(self, killed: int) -> int:
        """Port of the replica that took over from ``killed``."""
        assert self.topo is not None
        if isinstance(self.topo, LocalSentinels):
            return self.topo.wait_promoted(killed)
        return self.topo.wait_promoted(self._victim_key, killed)

    # -- start / stop ---------------------------------------------------------------------
    def _start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        wd = self.workdir / "redis"
        if self.topology == "cluster":
            self.topo = LocalCluster(wd, replicas=1).start()
        elif self.replication_lag_s:
            # A long failover timeout: else the Sentinels point the replica past the link.
            self.topo = LocalSentinels(wd, relay=self._lagging_link,
                                       failover_timeout_ms=600_000).start()
        else:
            self.topo = LocalSentinels(wd).start()
        for node in _nodes(self.topo):
            self._track(node.proc.pid if node.proc else None)
        self.service_settings = self.topo.settings()
        if isinstance(self.topo, LocalCluster):
            # Seeded with a replica: masters are what gets killed, and a service restarted
            # later must still find the cluster through its seed.
            seed = next(reps[0] for _, reps in self.topo.shards().values())
            self.service_settings = CommonSettings(redis_url=self.topo.node(seed).url,
                                                   redis_cluster=True)
        r = self.direct()
        try:
            _, api_key = create_tenant(r, TENANT, tenant_id=TENANT, keys=self.keys,
                                       quotas=Quotas(concurrent_requests=64))
            if isinstance(self.topo, LocalSentinels):
                r.execute_command("WAIT", 1, 5000)  # the tenant must survive the failover
        finally:
            r.close()
        self.headers = {"Authorization": f"Bearer {api_key}"}
        for role in ("prefill", "decode"):
            self.specs[role] = self._spec(role)
            self.engines[role] = TopologyEngine(self.specs[role], local_model).start()
        for name in ("sched-a", "sched-b"):
            self.start_scheduler(name)
        for role in ("prefill", "decode"):
            self.engines[role].wait_ready()
            self._track(self.engines[role].pid)
        self.start_gateway()
        self.wait_ok("stack warm-up")

    def _lagging_link(self, primary_port: int) -> int:
        self.link = TcpProxy(("127.0.0.1", 0), ("127.0.0.1", primary_port)).start()
        self.link.delay(self.replication_lag_s)
        return self.link.port

    def _spec(self, role: str) -> EngineSpec:
        spec = super()._spec(role)
        values = {f.name: getattr(spec, f.name) for f in fields(spec)}
        values.update(redis_url=self.service_settings.redis_url,
                      redis_settings=self.service_settings)
        return TopologyEngineSpec(**values)

    def scheduler_env(self, name: str) -> dict[str, str]:
        return _with_topology(super().scheduler_env(name), self.service_settings)

    def gateway_settings(self) -> GatewaySettings:
        """The harness's gateway on this topology, with API keys (the tenant's quota)."""
        s = self.service_settings
        return super().gateway_settings().model_copy(update={
            "redis_url": s.redis_url, "redis_cluster": s.redis_cluster,
            "redis_sentinels": s.redis_sentinels,
            "redis_sentinel_master": s.redis_sentinel_master,
            "gateway_id": GATEWAY_ID, "gateway_auth": True})

    def stop(self) -> None:
        super().stop()
        if self.topo is not None:
            self.topo.stop()
            self.topo = None
        if self.link is not None:
            self.link.stop()
            self.link = None

    # -- requests (with the tenant's key) -------------------------------------------------
    def load(self, count: int = 8, rate: float = 2.0, **kw: Any) -> Load:
        return Load(self.url, self.cfg, count, rate, headers=self.headers, **kw).start()

    def probe(self, tag: str = "probe") -> Outcome:
        return send_request(self.url, 0, stream=True, cfg=self.cfg, tag=tag,
                            headers=self.headers)

    # -- leaks ----------------------------------------------------------------------------
    def leak_state(self) -> dict[str, Any]:
        state = super().leak_state()
        try:
            r = self.direct()
            try:
                secs, micros = r.time()
                now = int(secs) * 1000 + int(micros) // 1000
                state["quota_units"] = int(r.zcount(
                    self.keys.tenant_quota(self.tenant_id, "leases"), f"({now}", "+inf"))
            finally:
                r.close()
        except redis.RedisError as exc:
            state["quota_units"] = f"unreadable: {exc}"
        return state

    def wait_drained(self, bound_s: float | None = None) -> tuple[dict[str, Any], float]:
        """As the harness, and then quota units whose release the failover lost: those are
        held until their lease ends (the gateway's quota lease, minutes, not the settle
        bound), so wait for that bound too, and note it."""
        left, waited = super().wait_drained(bound_s)
        units = left.get("quota_units")
        if set(left) != {"quota_units"} or not isinstance(units, int):
            return left, waited
        bound = self.gw.limiter.lease_s + 10
        left, more = super().wait_drained(bound)
        self.notes_for_row.append(
            f"{units} tenant quota unit(s) held {waited + more:.0f} s after the load, until "
            "their lease ran out: a release the failover lost")
        return left, waited + more

    def log_marks(self) -> dict[str, int]:
        """Current size of each engine log (what a scenario reads from)."""
        return {role: _size(self.logs / f"{role}.log") for role in self.engine_ids}


def _nodes(topo: LocalSentinels | LocalCluster) -> list[Any]:
    if isinstance(topo, LocalCluster):
        return list(topo.nodes)
    return [n for n in (topo.primary, topo.replica, *topo.sentinels) if n is not None]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ----------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class FailoverScenario:
    name: str
    fault: str
    topology: str
    replication_lag_s: float = 0.0
    """The replica receives the primary's writes this much later; the primary dies with
    them in flight. 0: a replica on loopback, a few microseconds behind."""


KILL_AFTER_S = 3.0
"""Load runs at least this long before the kill: requests are queued, prefilling, streaming."""


def kill_master_under_load(st: FailoverStack, res: FailoverResult) -> None:
    """SIGKILL the master mid-load, right after a reservation (its writes are the newest);
    the topology promotes the replica by itself."""
    tap = AssignmentTap(st.service_settings, st.keys.assignments(GATEWAY_ID)).start()
    marks = st.log_marks()
    load = st.load(count=16, rate=2.0, n_lines=12)
    time.sleep(KILL_AFTER_S)
    seen = len(tap.seen)
    if not _until(lambda: len(tap.seen) > seen, 10.0):
        res.notes.append("no assignment seen just before the kill")
    t_kill = time.monotonic()
    killed, held = st.kill_master()
    rec = st.recover_from(t_kill)
    promoted = st.wait_promoted(killed)
    res.failover_s = time.monotonic() - t_kill
    res.killed = f"127.0.0.1:{killed} ({held})"
    lag = (f", replicating {st.replication_lag_s * 1000:.0f} ms behind through a link that "
           "died with it" if st.replication_lag_s else "")
    res.notes.append(f"master 127.0.0.1:{killed} SIGKILLed {KILL_AFTER_S:.0f} s into the "
                     f"load, right after an assignment (it held: {held}{lag}); replica "
                     f"127.0.0.1:{promoted} promoted {res.failover_s:.1f} s later")
    finish(st, res, load.join(), rec, "master SIGKILLed")
    res.notes += st.notes_for_row
    _count_placements(st, res, tap.finish(), marks)
    res.notes.append(f"{tap.errors} tap reads failed during the failover")


def _count_placements(st: FailoverStack, res: FailoverResult, seen: list[Assignment],
                      marks: dict[str, int]) -> None:
    p = placements(seen)
    twice = [x for role in st.engine_ids
             for x in served_twice(st.logs / f"{role}.log", marks[role])]
    res.tokens, res.token_repeats = p.tokens, len(p.repeats)
    res.duplicated = len(set(p.duplicated) | {x.split()[1] for x in twice})
    res.notes.append(f"{len(seen)} assignments seen, {p.tokens} fencing tokens handed out, "
                     f"{len(p.repeats)} of them twice; {p.repeated_answers} repeated "
                     "answers of the same placement")
    res.notes += [f"fencing token repeated: {x}" for x in p.repeats[:5]]
    res.notes += [f"placed twice: {x}" for x in p.duplicated[:5]]
    res.notes += [f"engine log shows it twice: {x}" for x in twice[:5]]


def _until(pred: Callable[[], bool], bound_s: float) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


FAILOVER_SCENARIOS: list[FailoverScenario] = [
    FailoverScenario("sentinel_failover",
                     "Sentinel failover under load (primary SIGKILLed, replica promoted)",
                     "sentinel"),
    FailoverScenario("sentinel_failover_lagging",
                     "Sentinel failover, replica 250 ms behind (the primary's last writes "
                     "lost)", "sentinel", replication_lag_s=0.25),
    FailoverScenario("cluster_master_killed",
                     "Redis Cluster master killed under load (its replica promoted)",
                     "cluster"),
]

FAILOVER_BY_NAME = {s.name: s for s in FAILOVER_SCENARIOS}


def run_failover(workdir: Path, sc: FailoverScenario,
                 cfg: FaultConfig | None = None) -> FailoverResult:
    """Start a stack on ``sc``'s topology, run ``sc``, stop it; a failure anywhere becomes
    a note and a failed row, and so does a process left behind."""
    res = FailoverResult(sc.name, sc.fault, topology=sc.topology)
    t0 = time.monotonic()
    st = FailoverStack(Path(workdir) / sc.name, sc.topology, cfg, sc.replication_lag_s)
    try:
        st.start()
        kill_master_under_load(st, res)
    except Exception as exc:  # the row records it; the suite goes on
        logger.exception("failover scenario %s", sc.name)
        record_raise(res, exc)
    finally:
        with contextlib.suppress(Exception):
            st.stop()
    left = st.leaked_processes()
    if left:
        res.leaks["processes"] = left
    res.notes += st.notes
    res.duration_s = time.monotonic() - t0
    return res
