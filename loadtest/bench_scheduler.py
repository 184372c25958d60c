"""Control-plane benchmark: real push schedulers against many simulated engines in real Redis.

The schedulers run in processes of their own (as in production); this process plays the
gateways: it enqueues ``ScheduleRequest``\\s open-loop at a fixed rate, each on its request
shard, and reads the ``Assignment``\\s. "Added latency" is enqueue (just before the XADD) to
the assignment read back, i.e. all the control plane adds to a request; "scheduler latency"
is what the schedulers themselves measure, entry read to answer written. Redis work is read
from ``INFO commandstats`` deltas summed over every master (commands issued inside the Lua
scripts count too) and from the schedulers' own count of round trips. Prints a table (and
writes it with the raw figures under ``--out``); asserts nothing about timings.

    python -m kvpush.loadtest.bench_scheduler --rates 250,500,1000,2000 --seconds 5
    kvpush bench scheduler --redis-cluster --request-shards 4 --schedulers 2 --rates 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.redis_client import (
    SyncRedis,
    async_redis,
    is_cluster,
    stream_read,
    sync_redis,
)
from kvpush.common.settings import CommonSettings
from kvpush.common.wire import Assignment, EngineStatus, ScheduleRequest, decode, encode, now_ms

logger = logging.getLogger(__name__)
K = RedisKeys()
GATEWAY = "bench"
DEFAULT_RATES = "250,500,1000,2000"


class BenchFailed(RuntimeError):
    """A scheduler did not start, or a request was refused (the fleet never runs out)."""


@dataclass(frozen=True)
class Topology:
    """Where the benchmark runs: the Redis, its request shards, schedulers, gateway streams."""

    settings: CommonSettings
    request_shards: int = 1
    schedulers: int = 1
    gateways: int = 1

    @property
    def cluster(self) -> bool:
        """A Redis Cluster rather than one Redis."""
        return self.settings.redis_cluster


def publish_engines(client: SyncRedis, decodes: int, prefills: int) -> None:
    """Status hashes for the simulated fleet (huge KV caches: capacity never runs out)."""
    pipe = client.pipeline(transaction=False)
    for i in range(decodes + prefills):
        role = "decode" if i < decodes else "prefill"
        eid = f"{role}-{i}"
        st = EngineStatus(engine_id=eid, role=role, url=f"http://10.0.0.{i % 250}:8000",
                          model="tiny", block_size=16, total_blocks=10**9, free_blocks=10**9,
                          generation=1, updated_ms=now_ms())
        pipe.hset(K.engine(eid), mapping={
            "role": role, "url": st.url, "model": st.model, "block_size": 16,
            "total_blocks": st.total_blocks, "free_blocks": st.free_blocks, "generation": 1,
            "updated_ms": st.updated_ms, "m": encode(st)})
        pipe.zadd(K.engines(), {eid: st.updated_ms})
    pipe.execute()


def masters(client: SyncRedis) -> list[redis.Redis]:
    """A plain client of every master (one for a single Redis)."""
    if is_cluster(client):
        return [redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()]
    return [client]


def commandstats(nodes: list[redis.Redis]) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, summed over ``nodes``."""
    out: dict[str, int] = {}
    for node in nodes:
        for k, v in node.info("commandstats").items():
            name = k.removeprefix("cmdstat_")
            out[name] = out.get(name, 0) + int(v["calls"])
    return out


def shard_nodes(client: SyncRedis, shards: int) -> list[str]:
    """``host:port`` of the master serving each request shard ("single" for one Redis)."""
    if not is_cluster(client):
        return ["single"] * shards
    return [client.get_node_from_key(k).name for k in K.request_streams(shards)]


def start_scheduler(topo: Topology, index: int) -> subprocess.Popen[str]:
    """One scheduler process; returns once it is serving."""
    env = dict(os.environ, KVPUSH_REDIS_URL=topo.settings.redis_url or "",
               KVPUSH_REDIS_CLUSTER=str(topo.cluster).lower(),
               KVPUSH_REQUEST_SHARDS=str(topo.request_shards),
               KVPUSH_SCHEDULER_ID=f"bench-sched-{index}", KVPUSH_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.loadtest.bench_scheduler", "--serve"],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        proc.wait(10)
        raise BenchFailed(f"scheduler {index} did not start: {line!r}")
    return proc


def stop_scheduler(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM; the scheduler's counters and decision times (JSON on its last line)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise BenchFailed("a scheduler did not stop within 30 s") from None
    return json.loads(out.strip().splitlines()[-1])


def serve() -> None:
    """Scheduler process: prints READY, serves, prints its counters as JSON on SIGTERM."""
    from kvpush.common.runtime import run
    from kvpush.common.settings import SchedulerSettings
    from kvpush.services.scheduler import Scheduler

    async def main() -> None:
        sched = Scheduler(SchedulerSettings())
        task = asyncio.create_task(sched.run())
        await sched.ready.wait()
        cpu0 = time.process_time()
        print("READY", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sched.close()
        s = sched.stats
        print(json.dumps({"assigned": s.assigned, "round_trips": s.round_trips,
                          "read": s.read, "cpu_s": time.process_time() - cpu0,
                          "decision_ms": [round(x * 1000, 4) for x in s.decision_s]}),
              flush=True)

    run(main())


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")


async def drive(topo: Topology, rate: float, seconds: float) -> dict[str, float]:
    """Enqueue ``rate`` req/s for ``seconds`` over the shards; returns latency figures."""
    tx = async_redis(topo.settings)
    rx = async_redis(topo.settings)
    sent: dict[str, float] = {}
    got: dict[str, float] = {}
    total = int(rate * seconds)
    gateways = [f"{GATEWAY}-{g}" for g in range(topo.gateways)]

    async def reader(gateway: str, cursor: bytes) -> None:
        # One task per gateway stream: on a Cluster one XREAD may not span slots.
        key = K.assignments(gateway)
        while len(got) < total:
            args, kw = stream_read(rx, {key: cursor}, count=1000, block=200)
            reply = await rx.execute_command(*args, **kw)
            now = time.monotonic()
            for _, entries in reply or []:
                for eid, f in entries:
                    cursor = eid
                    a = decode(f[b"m"], Assignment)
                    if not a.ok:
                        raise BenchFailed(f"rejected: {a.error}")
                    got[a.request_id] = now

    cursors = []
    for g in gateways:  # before the first request: every answer comes after these
        last = await rx.xrevrange(K.assignments(g), "+", "-", count=1)
        cursors.append(last[0][0] if last else b"0-0")
    readers = [asyncio.create_task(reader(g, c)) for g, c in zip(gateways, cursors, strict=True)]
    t0 = time.monotonic()
    n = 0
    while n < total:
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        if due > n:
            pipe = tx.pipeline(transaction=False)
            ids = []
            for i in range(n, due):
                rid = f"cmpl-{uuid.uuid4().hex}"
                req = ScheduleRequest(request_id=rid, gateway_id=gateways[i % len(gateways)],
                                      prompt_tokens=512, max_tokens=64,
                                      deadline_ms=now_ms() + 60_000)
                pipe.xadd(K.requests_for(rid, topo.request_shards),
                          {b"m": encode(req), b"tp": b"00-x-y-00"})
                ids.append(rid)
            ts = time.monotonic()
            await pipe.execute()
            for rid in ids:
                sent[rid] = ts
            n = due
        await asyncio.sleep(0.001)
    send_s = time.monotonic() - t0
    try:
        await asyncio.wait_for(asyncio.gather(*readers), timeout=120)
    finally:
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await tx.aclose()
        await rx.aclose()
    done_s = max(got.values()) - t0
    lat = sorted((got[r] - sent[r]) * 1000 for r in sent)
    return {
        "target": rate,
        "offered": total / send_s,
        "decisions_per_s": total / done_s,
        "p50_ms": statistics.median(lat),
        "p99_ms": _pct(lat, 0.99),
        "max_ms": lat[-1],
        "requests": total,
    }


def bench_rate(topo: Topology, client: SyncRedis, rate: float, seconds: float,
               decodes: int, prefills: int) -> dict[str, Any]:
    """One point: an empty Redis, the fleet, fresh schedulers, ``rate`` for ``seconds``."""
    from kvpush.common.runtime import run

    client.flushall()
    publish_engines(client, decodes, prefills)
    procs: list[subprocess.Popen[str]] = []
    nodes = masters(client)
    try:
        for i in range(topo.schedulers):
            procs.append(start_scheduler(topo, i))
        for node in nodes:
            node.config_resetstat()
        row: dict[str, Any] = run(drive(topo, rate, seconds))
    finally:
        cmds = commandstats(nodes)
        stats = [stop_scheduler(p) for p in procs if p.poll() is None]
    n = row["requests"]
    decided = [x for s in stats for x in s["decision_ms"]]
    hot = {c: cmds.get(c, 0) for c in ("evalsha", "set", "xadd", "xack", "xreadgroup")}
    row.update({
        "sched_p50_ms": _pct(decided, 0.5),
        "sched_p99_ms": _pct(decided, 0.99),
        "assigned_by_scheduler": [s["assigned"] for s in stats],
        # XADD: the bench's request plus the scheduler's assignment; XREAD is the bench's.
        "sched_rt_per_req": sum(s["round_trips"] for s in stats) / n,
        "sched_cpu_us_per_req": sum(s["cpu_s"] for s in stats) / n * 1e6,
        "cmds_per_req": sum(cmds.values()) / n,
        "hot_cmds_per_req": sum(hot.values()) / n,
        "refresh_cmds_per_req": (cmds.get("hgetall", 0) + cmds.get("hget", 0)) / n,
        "breakdown": {c: round(v / n, 3) for c, v in sorted(cmds.items())},
    })
    return row


def markdown(topo: Topology, rows: list[dict[str, Any]], args: argparse.Namespace,
             placement: list[str]) -> str:
    """The report: setup, one line per rate, the command mix."""
    where = "a Redis Cluster" if topo.cluster else "one Redis"
    lines = [
        f"simulated engines: {args.decode_engines} decode + {args.prefill_engines} prefill; "
        f"{args.seconds:g} s per rate; {topo.schedulers} scheduler process(es) on {where}; "
        f"{topo.request_shards} request shard(s) on {', '.join(placement)}; "
        f"{topo.gateways} gateway stream(s)", "",
        "| target/s | offered/s | decided/s | p50 ms | p99 ms | max ms | sched p50 ms "
        "| sched p99 ms | per scheduler | sched RT/req | sched CPU us/req | cmds/req "
        "| hot/req | refresh/req |",
        "|" + "---:|" * 14,
    ]
    for r in rows:
        lines.append(
            f"| {r['target']:.0f} | {r['offered']:.0f} | {r['decisions_per_s']:.0f} "
            f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} "
            f"| {r['sched_p50_ms']:.3f} | {r['sched_p99_ms']:.3f} "
            f"| {'/'.join(map(str, r['assigned_by_scheduler']))} "
            f"| {r['sched_rt_per_req']:.3f} | {r['sched_cpu_us_per_req']:.1f} "
            f"| {r['cmds_per_req']:.2f} | {r['hot_cmds_per_req']:.2f} "
            f"| {r['refresh_cmds_per_req']:.2f} |")
    lines += ["", "Redis commands per request by command (INFO commandstats over every master; "
              "Lua-internal calls included):"]
    lines += [f"- {r['target']:.0f}/s: {json.dumps(r['breakdown'])}" for r in rows]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser, *, rates: bool = True,
                  redis_url: bool = True) -> None:
    """Flags of the scheduler benchmark (``kvpush bench`` shares ``--rates`` and, with the
    placement benchmark, ``--redis-url``: a Redis to empty and use)."""
    g = p.add_argument_group("scheduler benchmark")
    if rates:
        g.add_argument("--rates", default=None, help=f"requests per second ({DEFAULT_RATES})")
    g.add_argument("--seconds", type=float, default=5.0, help="seconds per rate")
    g.add_argument("--decode-engines", type=int, default=64, help="simulated decode engines")
    g.add_argument("--prefill-engines", type=int, default=32, help="simulated prefill engines")
    if redis_url:
        g.add_argument("--redis-url", default=None,
                       help="Redis to use: it is EMPTIED (FLUSHALL) per rate; default: a local "
                            "one of its own (KVPUSH_REDIS_URL is not used, on purpose)")
    g.add_argument("--redis-cluster", action="store_true",
                   help="a Redis Cluster: --redis-url names a node, else a local three-master "
                        "cluster is started")
    g.add_argument("--request-shards", type=int, default=1, help="KVPUSH_REQUEST_SHARDS")
    g.add_argument("--schedulers", type=int, default=1, help="scheduler processes")
    g.add_argument("--gateways", type=int, default=1,
                   help="gateway ids the requests are spread over (assignment streams)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run every rate on the chosen topology, print the table (and write it under --out)."""
    from kvpush.services.local.local_redis import LocalRedis
    from kvpush.services.local.redis_topologies import LocalCluster

    if min(args.request_shards, args.schedulers, args.gateways) < 1:
        raise SystemExit("--request-shards, --schedulers and --gateways must be at least 1")
    local: LocalRedis | LocalCluster | None = None
    url = args.redis_url
    if url is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvpush-bench-"))
        local = (LocalCluster(workdir) if args.redis_cluster else LocalRedis(workdir)).start()
        url = local.url
    topo = Topology(CommonSettings(redis_url=url, redis_cluster=args.redis_cluster),
                    args.request_shards, args.schedulers, args.gateways)
    client = sync_redis(topo.settings)
    rows = []
    try:
        placement = shard_nodes(client, topo.request_shards)
        for rate in (float(x) for x in (args.rates or DEFAULT_RATES).split(",")):
            rows.append(bench_rate(topo, client, rate, args.seconds, args.decode_engines,
                                   args.prefill_engines))
    finally:
        client.close()
        if local is not None:
            local.stop()
    report = markdown(topo, rows, args, placement)
    print("\n" + report)
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(report)
        (out / "results.json").write_text(json.dumps(
            {"request_shards": topo.request_shards, "schedulers": topo.schedulers,
             "gateways": topo.gateways, "cluster": topo.cluster, "shard_nodes": placement,
             "rows": rows}, indent=2))
        print(f"report written to {out}")
    return 0


def main() -> None:
    """``python -m kvpush.loadtest.bench_scheduler``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write results.md and results.json here")
    add_arguments(ap)
    args = ap.parse_args()
    if args.serve:
        serve()
        return
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(run_from_args(args))


if __name__ == "__main__":
    main()
