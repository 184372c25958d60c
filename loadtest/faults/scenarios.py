"""One function per fault. Each runs a small bounded load on a shared :class:`FaultStack`,
injects its fault, heals it (or lets the system heal), and returns a :class:`ScenarioResult`:
every request's outcome, what was left held afterwards, and the recovery time.

A scenario restarts only what its fault killed, so the next one finds a whole stack.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import redis

from kvpush.common.wire import ScheduleRequest, encode, now_ms
from kvpush.loadtest.faults.harness import FaultStack, Recovery
from kvpush.loadtest.faults.outcomes import Outcome, ScenarioResult, record_raise, send_request


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    run: Callable[[FaultStack, ScenarioResult], None]
    needs_netns: bool = False


def _until(pred: Callable[[], object], bound_s: float, step: float = 0.05) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return False


def _targets(st: FaultStack) -> int:
    r = st.direct()
    try:
        return int(r.xlen(st.keys.targets(st.specs["prefill"].engine_id)))
    except redis.RedisError:
        return 0
    finally:
        r.close()


def _wait_push(st: FaultStack, before: int, bound_s: float = 30.0) -> bool:
    """Wait until decode published a new push target (a push is pending or in flight)."""
    return _until(lambda: _targets(st) > before, bound_s)


def _engine_running(st: FaultStack, role: str) -> bool:
    from kvpush.services.engine.status import MetricsUnavailable, metric_sum, scrape

    try:
        return metric_sum(scrape(st.engines[role].url, timeout_s=2),
                          "vllm:num_requests_running") > 0
    except MetricsUnavailable:
        return False


def _finish(st: FaultStack, res: ScenarioResult, outcomes: list[Outcome],
            rec: Recovery | float, recovery_from: str = "fault healed") -> None:
    """Account ``outcomes``, take the recovery time (``rec`` is a running prober, or the
    heal time to start probing from now), then wait for everything to drain."""
    res.add(outcomes, st.cfg.request_timeout_s + st.cfg.late_grace_s)
    res.recovery_from = recovery_from
    if isinstance(rec, float):
        rec = st.recover_from(rec)
    res.recovery_s = rec.result()
    res.leaks, res.drain_s = st.wait_drained()
    _check_schedulers(st, res)


def _check_schedulers(st: FaultStack, res: ScenarioResult) -> None:
    """A scheduler that exited is a finding; it is restarted (as a supervisor would) so
    that the next scenario finds a whole stack, and the row says so."""
    for name, proc in list(st.schedulers.items()):
        if proc.poll() is not None:
            tail = (st.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
            last = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "")
            res.notes.append(f"scheduler {name} exited ({proc.returncode}): {last[-200:]}; "
                             "restarted by the harness")
            st.start_scheduler(name)


# ----------------------------------------------------------------------------- scenarios


def baseline(st: FaultStack, res: ScenarioResult) -> None:
    sent = st.net.data_link_bytes() if st.net is not None else None
    outs = st.load(count=6, rate=2).join()
    t = time.monotonic()
    if st.net is not None and sent is not None:
        res.notes.append(f"{st.net.data_link_bytes() - sent} bytes crossed the prefill->decode "
                         "veth (NIXL/UCX over TCP)")
    _finish(st, res, outs, t, "start (no fault)")


def decode_sigkill(st: FaultStack, res: ScenarioResult) -> None:
    before = _targets(st)
    load = st.load(count=8, rate=2, n_lines=20)
    if not _wait_push(st, before):
        res.notes.append("no push target seen before the kill")
    st.signal_engine("decode", signal.SIGKILL)
    outs = load.join()
    took = st.restart_engine("decode")
    res.notes.append(f"decode restarted with a new generation ({took:.0f}s to ready); "
                     "prefill still cached the old generation's agent metadata")
    _finish(st, res, outs, time.monotonic(), "restarted decode ready")


def prefill_sigkill(st: FaultStack, res: ScenarioResult) -> None:
    # Long prompts; decode publishes its push target while prefill computes, so a new
    # target means a prefill is under way.
    before = _targets(st)
    load = st.load(count=8, rate=2, n_lines=70)  # ~1500 tokens: under max_model_len 2048
    if not _wait_push(st, before):
        res.notes.append("no prefill seen under way before the kill")
    st.signal_engine("prefill", signal.SIGKILL)
    outs = load.join()
    took = st.restart_engine("prefill")
    res.notes.append(f"prefill restarted ({took:.0f}s to ready)")
    _finish(st, res, outs, time.monotonic(), "restarted prefill ready")


def decode_sigstop(st: FaultStack, res: ScenarioResult) -> None:
    before = _targets(st)
    load = st.load(count=6, rate=2, n_lines=20)
    _wait_push(st, before)
    st.signal_engine("decode", signal.SIGSTOP)
    frozen = st.cfg.request_timeout_s + 3
    time.sleep(frozen)
    st.signal_engine("decode", signal.SIGCONT)
    heal = st.recover_from(time.monotonic())
    res.notes.append(f"decode frozen {frozen:.0f}s (request deadline "
                     f"{st.cfg.request_timeout_s:.0f}s)")
    _finish(st, res, load.join(), heal)


def engine_restart_generation(st: FaultStack, res: ScenarioResult) -> None:
    """Decode restarts cleanly with a new generation; prefill holds the old agent metadata
    (its NIXL peer cache) and the old metadata key may linger until its TTL."""
    st.probe()  # prefill has certainly cached decode's current generation
    r = st.direct()
    old = r.hget(st.keys.engine(st.specs["decode"].engine_id), "generation")
    took = st.restart_engine("decode")
    new = r.hget(st.keys.engine(st.specs["decode"].engine_id), "generation")
    r.close()
    res.notes.append(f"decode generation {old and old.decode()} -> {new and new.decode()} "
                     f"({took:.0f}s restart)")
    heal = time.monotonic()
    _finish(st, res, st.load(count=6, rate=2).join(), heal, "restarted decode ready")


def scheduler_kill(st: FaultStack, res: ScenarioResult) -> None:
    victim = "sched-a"
    st.arm_file(victim).write_text("after_reserve")
    log = st.logs / f"{victim}.log"
    mark = log.stat().st_size if log.exists() else 0
    load = st.load(count=10, rate=2)

    def crashed() -> bool:
        with open(log, "rb") as f:
            f.seek(mark)
            return b"CRASHPOINT" in f.read()

    hit = _until(crashed, 30, step=0.05)
    st.schedulers[victim].send_signal(signal.SIGKILL)
    st.schedulers[victim].wait(10)
    heal = st.recover_from(time.monotonic())
    if hit:
        res.notes.append(f"{victim} SIGKILLed after reserving, before XADD/XACK; "
                         f"sched-b reclaims after {st.cfg.claim_idle_ms} ms idle")
    else:
        res.notes.append(f"{victim} never reached the crash point (sched-b read every "
                         "entry); killed anyway")
    outs = load.join()
    st.start_scheduler(victim)  # a supervisor's restart; recovery did not need it
    _finish(st, res, outs, heal)


def _set_aof(st: FaultStack, on: bool) -> None:
    r = st.direct()
    try:
        r.config_set("appendonly", "yes" if on else "no")
        _until(lambda: int(r.info("persistence").get("aof_rewrite_in_progress", 0)) == 0
               and int(r.info("persistence").get("aof_rewrite_scheduled", 0)) == 0, 30, 0.1)
    finally:
        r.close()


def _redis_restart(st: FaultStack, res: ScenarioResult, aof: bool) -> None:
    _set_aof(st, aof)
    load = st.load(count=8, rate=2)
    time.sleep(1.5)
    st.restart_redis(appendonly=aof, down_s=1.0)
    heal = st.recover_from(time.monotonic())
    res.notes.append(f"redis SIGKILLed and restarted after 1 s down (appendonly "
                     f"{'yes' if aof else 'no'})")
    _finish(st, res, load.join(), heal, "redis back")


def redis_restart_aof(st: FaultStack, res: ScenarioResult) -> None:
    _redis_restart(st, res, aof=True)


def redis_restart_no_aof(st: FaultStack, res: ScenarioResult) -> None:
    _redis_restart(st, res, aof=False)


def redis_conn_cut(st: FaultStack, res: ScenarioResult) -> None:
    assert st.proxy is not None
    load = st.load(count=8, rate=2)
    cuts = 0
    for _ in range(3):
        time.sleep(1.0)
        cuts += st.proxy.cut()
    heal = st.recover_from(time.monotonic())
    res.notes.append(f"3 cuts 1 s apart reset {cuts} Redis connections")
    _finish(st, res, load.join(), heal)


def redis_delay(st: FaultStack, res: ScenarioResult) -> None:
    assert st.proxy is not None
    load = st.load(count=8, rate=2)
    time.sleep(0.5)
    st.proxy.delay(0.25)
    time.sleep(5)
    st.proxy.heal()
    heal = st.recover_from(time.monotonic())
    res.notes.append("every Redis chunk delayed 250 ms, both ways, for 5 s")
    _finish(st, res, load.join(), heal)


def redis_blackhole(st: FaultStack, res: ScenarioResult) -> None:
    assert st.proxy is not None
    load = st.load(count=6, rate=2)
    time.sleep(0.5)
    st.proxy.blackhole()
    hole = st.cfg.request_timeout_s + 3
    time.sleep(hole)
    st.proxy.heal()
    heal = st.recover_from(time.monotonic())
    res.notes.append(f"Redis silently blackholed (no RST) for {hole:.0f}s, longer than the "
                     "request deadline; then its connections reset")
    _finish(st, res, load.join(), heal)


def poison_and_duplicates(st: FaultStack, res: ScenarioResult) -> None:
    r = st.direct()
    dead_before = int(r.xlen(st.keys.dead_letters()))
    last = r.xrevrange(st.keys.requests(), "+", "-", count=1)
    start_id = last[0][0] if last else b"0-0"
    load = st.load(count=8, rate=2)
    time.sleep(1.5)
    poison = [
        {b"junk": b"1"},  # no 'm'
        {b"m": b"\xc1\xc1not msgpack"},
        {b"m": encode(ScheduleRequest(request_id="bad id with spaces", gateway_id="kvft-gw",
                                      prompt_tokens=10, max_tokens=4,
                                      deadline_ms=now_ms() + 10_000))},
        {b"m": encode(ScheduleRequest(request_id="cmpl-neg", gateway_id="kvft-gw",
                                      prompt_tokens=-5, max_tokens=4,
                                      deadline_ms=now_ms() + 10_000))},
    ]
    for f in poison:
        r.xadd(st.keys.requests(), f)
    # Duplicates of the gateway's own live entries: same request id, new stream entries.
    real = r.xrange(st.keys.requests(), f"({start_id.decode()}", "+")
    real = [(eid, f) for eid, f in real if b"m" in f and f not in poison][:3]
    for _eid, f in real:
        r.xadd(st.keys.requests(), f)
        r.xadd(st.keys.requests(), f)
    outs = load.join()
    heal = time.monotonic()
    expected = len(poison) + 2 * len(real)
    _until(lambda: int(r.xlen(st.keys.dead_letters())) - dead_before >= expected, 20, 0.1)
    dead = int(r.xlen(st.keys.dead_letters())) - dead_before
    r.close()
    res.notes.append(f"{len(poison)} poison + {2 * len(real)} duplicate entries injected; "
                     f"{dead} dead-lettered")
    if dead != expected:
        res.leaks["dead_letter_mismatch"] = f"expected {expected} dead letters, got {dead}"
    _finish(st, res, outs, heal)


def client_disconnect(st: FaultStack, res: ScenarioResult) -> None:
    cfg = st.cfg
    outs: list[Outcome] = []
    lock = threading.Lock()

    def fire(n: int, **kw: object) -> list[threading.Thread]:
        ts = []
        for i in range(n):
            def one(i: int = i) -> None:
                o = send_request(st.url, i, cfg=cfg, tag=f"disc{time.monotonic_ns()}", **kw)
                with lock:
                    outs.append(o)
            t = threading.Thread(target=one, daemon=True)
            t.start()
            ts.append(t)
        return ts

    # Queued: both schedulers frozen, so no assignment comes before the client leaves;
    # the assignments that come later are orphans the gateway must release.
    for p in st.schedulers.values():
        p.send_signal(signal.SIGSTOP)
    try:
        for t in fire(3, stream=True, abandon_after_s=1.5):
            t.join(30)
    finally:
        for p in st.schedulers.values():
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                p.send_signal(signal.SIGCONT)
    # Prefilling: a long prompt, the client leaves before the first token.
    for t in fire(3, stream=True, n_lines=60, abandon_after_s=0.4):
        t.join(30)
    # Streaming: the client leaves after the first token of a long answer.
    for t in fire(3, stream=True, max_tokens=64, disconnect_at_token=True):
        t.join(cfg.client_timeout_s + 10)
    res.notes.append("3 clients each left while queued, while prefilling and mid-stream")
    _finish(st, res, outs, time.monotonic())


def netns_link_cut(st: FaultStack, res: ScenarioResult) -> None:
    assert st.net is not None
    before = _targets(st)
    load = st.load(count=6, rate=2, n_lines=30)
    _wait_push(st, before)
    st.net.cut_data_link()
    down = st.cfg.request_timeout_s + 2
    time.sleep(down)
    st.net.restore_data_link()
    heal = st.recover_from(time.monotonic())
    res.notes.append(f"prefill<->decode veth (the NIXL/UCX path) down {down:.0f}s mid-transfer; "
                     "HTTP and Redis links stayed up")
    _finish(st, res, load.join(), heal, "link back up")


SCENARIOS: list[Scenario] = [
    Scenario("baseline", "no fault (steady load)", baseline),
    Scenario("poison_and_duplicates", "poison and duplicate request-stream entries",
             poison_and_duplicates),
    Scenario("client_disconnect", "client disconnect while queued, prefilling, streaming",
             client_disconnect),
    Scenario("scheduler_kill", "scheduler SIGKILLed between read and ack (after reserving)",
             scheduler_kill),
    Scenario("redis_conn_cut", "Redis connections reset through the TCP proxy",
             redis_conn_cut),
    Scenario("redis_delay", "Redis traffic delayed 250 ms through the TCP proxy", redis_delay),
    Scenario("redis_blackhole", "Redis blackholed (no RST) past the request deadline",
             redis_blackhole),
    Scenario("redis_restart_aof", "Redis crash-restarted mid-load, AOF on", redis_restart_aof),
    Scenario("redis_restart_no_aof", "Redis crash-restarted mid-load, AOF off (data lost)",
             redis_restart_no_aof),
    Scenario("decode_sigstop", "decode engine SIGSTOPped past the deadline, then SIGCONT",
             decode_sigstop),
    Scenario("netns_link_cut", "prefill<->decode link down mid-transfer (netns + veth)",
             netns_link_cut, needs_netns=True),
    Scenario("decode_sigkill", "decode engine SIGKILLed mid-push, restarted", decode_sigkill),
    Scenario("engine_restart_generation",
             "decode restarted with a new generation; prefill holds stale metadata",
             engine_restart_generation),
    Scenario("prefill_sigkill", "prefill engine SIGKILLed mid-prefill, restarted",
             prefill_sigkill),
]

BY_NAME = {s.name: s for s in SCENARIOS}


def run_scenario(st: FaultStack, sc: Scenario) -> ScenarioResult:
    """Run one scenario; an exception inside it becomes a note and a failed row."""
    res = ScenarioResult(sc.name, sc.fault)
    if sc.needs_netns and st.net is None:
        res.skipped = "needs network namespaces (ip netns), not available here"
        return res
    t0 = time.monotonic()
    try:
        sc.run(st, res)
    except Exception as exc:  # the row records it; the suite goes on
        record_raise(res, exc)
    res.duration_s = time.monotonic() - t0
    return res
