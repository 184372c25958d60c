"""Control-plane benchmark: the real push scheduler against many simulated engines in real Redis.

The scheduler runs in its own process (as in production); this process plays the gateways:
it enqueues ``ScheduleRequest``\\s open-loop at a fixed rate and reads the ``Assignment``\\s.
"Added latency" is enqueue (just before the XADD) to the assignment read back, i.e. all the
control plane adds to a request. Redis work is read from ``INFO commandstats`` deltas
(commands issued inside the Lua scripts count too) and from the scheduler's own count of
round trips. Prints a table; asserts nothing about timings.

    python -m loadtest.bench_scheduler --rates 250,500,1000,2000 --seconds 5
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
from pathlib import Path

import redis
import redis.asyncio as aioredis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import Assignment, EngineStatus, ScheduleRequest, decode, encode, now_ms

logger = logging.getLogger(__name__)
K = RedisKeys()
GATEWAY = "bench"


def publish_engines(client: redis.Redis, decodes: int, prefills: int) -> None:
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


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT."""
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in client.info("commandstats").items()}


def start_scheduler(redis_url: str) -> subprocess.Popen[str]:
    env = dict(os.environ, KVPUSH_REDIS_URL=redis_url, KVPUSH_SCHEDULER_ID="bench-sched",
               KVPUSH_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.loadtest.bench_scheduler", "--serve"],
                            env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"scheduler did not start: {line!r}")
    return proc


def stop_scheduler(proc: subprocess.Popen[str]) -> dict[str, int]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
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
        s = sched.stats
        print(json.dumps({"assigned": s.assigned, "round_trips": s.round_trips,
                          "read": s.read, "cpu_s": time.process_time() - cpu0}), flush=True)

    run(main())


async def drive(redis_url: str, rate: float, seconds: float) -> dict[str, float]:
    """Enqueue ``rate`` req/s for ``seconds``; returns latency figures."""
    tx = aioredis.Redis.from_url(redis_url)
    rx = aioredis.Redis.from_url(redis_url)
    sent: dict[str, float] = {}
    got: dict[str, float] = {}
    total = int(rate * seconds)
    last = await rx.xrevrange(K.assignments(GATEWAY), "+", "-", count=1)
    cursor = last[0][0] if last else b"0-0"

    async def reader() -> None:
        nonlocal cursor
        while len(got) < total:
            reply = await rx.xread({K.assignments(GATEWAY): cursor}, count=1000, block=200)
            now = time.monotonic()
            for _, entries in reply or []:
                for eid, f in entries:
                    cursor = eid
                    a = decode(f[b"m"], Assignment)
                    if not a.ok:
                        raise RuntimeError(f"rejected: {a.error}")
                    got[a.request_id] = now

    rtask = asyncio.create_task(reader())
    t0 = time.monotonic()
    n = 0
    while n < total:
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        if due > n:
            pipe = tx.pipeline(transaction=False)
            ids = []
            for _ in range(due - n):
                rid = f"cmpl-{uuid.uuid4().hex}"
                req = ScheduleRequest(request_id=rid, gateway_id=GATEWAY, prompt_tokens=512,
                                      max_tokens=64, deadline_ms=now_ms() + 60_000)
                pipe.xadd(K.requests(), {b"m": encode(req), b"tp": b"00-x-y-00"})
                ids.append(rid)
            ts = time.monotonic()
            await pipe.execute()
            for rid in ids:
                sent[rid] = ts
            n = due
        await asyncio.sleep(0.001)
    send_s = time.monotonic() - t0
    await asyncio.wait_for(rtask, timeout=120)
    done_s = max(got.values()) - t0
    await tx.aclose()
    await rx.aclose()
    lat = sorted((got[r] - sent[r]) * 1000 for r in sent)
    return {
        "target": rate,
        "offered": total / send_s,
        "decisions_per_s": total / done_s,
        "p50_ms": statistics.median(lat),
        "p99_ms": lat[int(0.99 * (len(lat) - 1))],
        "max_ms": lat[-1],
        "requests": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="250,500,1000,2000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--decode-engines", type=int, default=64)
    ap.add_argument("--prefill-engines", type=int, default=32)
    ap.add_argument("--redis-url", default=os.environ.get("KVPUSH_REDIS_URL"))
    args = ap.parse_args()
    if args.serve:
        serve()
        return
    logging.basicConfig(level=logging.WARNING)

    from kvpush.common.runtime import run
    from kvpush.services.local.local_redis import LocalRedis

    local = None
    url = args.redis_url
    if url is None:
        local = LocalRedis(Path(tempfile.mkdtemp(prefix="kvpush-bench-"))).start()
        url = local.url
    client = redis.Redis.from_url(url)
    rows = []
    try:
        for rate in (float(x) for x in args.rates.split(",")):
            client.flushall()
            publish_engines(client, args.decode_engines, args.prefill_engines)
            proc = start_scheduler(url)
            client.config_resetstat()
            try:
                row = run(drive(url, rate, args.seconds))
            finally:
                cmds = commandstats(client)
                stats = stop_scheduler(proc)
            n = row["requests"]
            hot = {c: cmds.get(c, 0) for c in ("evalsha", "set", "xadd", "xack", "xreadgroup")}
            # XADD: the bench's request plus the scheduler's assignment; XREAD is the bench's.
            row["sched_rt_per_req"] = stats["round_trips"] / n
            row["sched_cpu_us_per_req"] = stats["cpu_s"] / n * 1e6
            row["cmds_per_req"] = sum(cmds.values()) / n
            row["hot_cmds_per_req"] = sum(hot.values()) / n
            row["refresh_cmds_per_req"] = (cmds.get("hgetall", 0) + cmds.get("hget", 0)) / n
            row["breakdown"] = {c: round(v / n, 3) for c, v in sorted(cmds.items())}
            rows.append(row)
    finally:
        client.close()
        if local is not None:
            local.stop()

    print(f"\nsimulated engines: {args.decode_engines} decode + {args.prefill_engines} "
          f"prefill; {args.seconds:.0f} s per rate; scheduler in its own process\n")
    hdr = (f"{'target/s':>9} {'offered/s':>10} {'decided/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
           f"{'max ms':>8} {'sched RT/req':>13} {'sched CPU us/req':>17} {'cmds/req':>9} "
           f"{'hot/req':>8} {'refresh/req':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['target']:9.0f} {r['offered']:10.0f} {r['decisions_per_s']:10.0f} "
              f"{r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['max_ms']:8.3f} "
              f"{r['sched_rt_per_req']:13.3f} {r['sched_cpu_us_per_req']:17.1f} "
              f"{r['cmds_per_req']:9.2f} "
              f"{r['hot_cmds_per_req']:8.2f} {r['refresh_cmds_per_req']:12.2f}")
    print("\nRedis commands per request by command (INFO commandstats; Lua-internal calls "
          "included):")
    for r in rows:
        print(f"  {r['target']:.0f}/s: {json.dumps(r['breakdown'])}")


if __name__ == "__main__":
    main()
