"""Late WRITEs: a push's WRITEs that arrive after decode gave the push up never land in
blocks another request uses. Run by ``kvpush reliability`` and ``tests/test_faults_late_write.py``.

The stack (:class:`LateWriteStack`) is the fault stack with two prefill engines: A, whose
pushes the faults hit (it loads ``fault_connector.FaultPushConnector``), and B, which pushes
the victims. Decode has a KV pool of 64 blocks and no prefix cache, so a victim's 47 prompt
blocks fit only with some of those of A's failed request. Every engine checksums every push
(``verify_kv`` 1.0), and decode checks a victim's pushed blocks again when it ends. Requests
go straight to the engines with the ``kv_transfer_params`` the gateway would send, so that
the failed request is A's and the victims are B's.

A row (:func:`run_late_write_row`):

1. The victim's answer alone: pushed from B before the fault.
2. Request R1 is pushed from A. A stops (SIGSTOP) right before layer 1's WRITE, after its
   deadline check: every row has WRITEs that A posts only after decode gave R1 up.
   * ``sigstop``: A stays stopped past R1's deadline and decode's grace.
   * ``link_cut``: A's data link goes down (netns) and A resumes: its WRITEs go into a
     socket whose link is down, past R1's deadline.
   * ``clock_skew``: decode's clock runs 10 s ahead, so decode gives R1 up while A, by its
     own clock, is inside the deadline and writes on time.
3. The victim is pushed from B onto decode after decode gave R1 up; then A resumes or its
   link heals, and the late bytes cross while B's small pushes keep decode progressing.
4. The victim's answer must equal its answer alone, its blocks must not have changed while
   it ran, R1 must fail cleanly, and decode must hold nothing once the row settled.

Guarded, decode keeps R1's blocks until A's fence says none of its WRITEs can still land,
so the victim waits for them. ``guarded=False`` sets the quarantine's bound to 10 ms (as
good as off): the row then measures what the late bytes did, and asserts nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from kvpush.common.wire import KVTransferParams, PushTarget, WireError, decode, now_ms
from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.outcomes import MODEL, FaultConfig, record_raise
from kvpush.services.engine.launcher import EngineSpec
from kvpush.services.engine.status import MetricsUnavailable, Sample, metric_sum, scrape

logger = logging.getLogger(__name__)

FAULT_CONNECTOR = "kvpush.loadtest.faults.fault_connector.FaultPushConnector"
BLOCK = 32
POOL = 64  # decode's KV blocks: the victim fits only with some of the failed request's
FAILED_LEN = 800  # tokens: 25 blocks
VICTIM_LEN = 1500  # tokens: 47 blocks, 9 more than the 38 usable beside the failed request
VICTIM_TOKENS = 450  # decoding when late bytes arrive (unguarded); 61 blocks of the 63
# usable (vLLM keeps block 0), and one for a wake: the victim is never preempted
WAKE_LEN = 20  # one block beside the victim
DEADLINE_S = 6.0
SKEW_S = 10.0  # decode's clock ahead of A's, more than the grace
SKEW_DEADLINE_S = 12.0  # decode gives up 2 s + grace in; A writes on time before 12 s
UNGUARDED_S = 0.01
VICTIM_DEADLINE_S = 60.0  # the victim waits out the quarantine, which is the point

KINDS = {
    "sigstop": "prefill A SIGSTOPped mid-push past the deadline and the grace, then SIGCONT",
    "link_cut": "prefill A's data link cut mid-push (netns), healed after the grace",
    "clock_skew": f"decode's clock {SKEW_S:.0f} s ahead of prefill A's (a fault clock)",
}


class LateWriteStack(FaultStack):
    """The fault stack with prefill A (faults armed), prefill B (victims) and a decode whose
    pool the victim cannot use beside A's failed request; see the module docstring."""

    roles = {"prefill": "prefill", "prefill-b": "prefill", "decode": "decode"}
    # Bytes in A's socket cross within a second of the heal, while the victim runs.
    tcp_rto_max_ms = 1000  # the least Linux takes

    def __init__(self, workdir: Path, cfg: FaultConfig | None = None, a_tp: int = 1) -> None:
        super().__init__(workdir, replace(cfg or FaultConfig(), prefill_tp=1))
        self.a_tp = a_tp
        self._victim: tuple[str, str] | None = None

    @property
    def stack_name(self) -> str:
        return f"TP{self.a_tp} -> TP{self.cfg.decode_tp}"

    def arm_path(self, name: str) -> Path:
        return self.workdir / f"{name}.arm"

    def arm(self, name: str, text: str) -> None:
        self.arm_path(name).write_text(text)

    def _spec(self, name: str) -> EngineSpec:
        spec = super()._spec(name)
        self.arm(name, "")
        extra = {**spec.extra_config, "verify_kv": 1.0, "fault_arm_file": str(self.arm_path(name)),
                 "stats_file": str(self.logs / f"{name}-stats.jsonl")}
        kw: dict[str, Any] = {"connector_class": FAULT_CONNECTOR, "block_size": BLOCK,
                              "max_model_len": (POOL - 1) * BLOCK, "extra_config": extra}
        if name == "prefill":
            kw["tp"] = self.a_tp
        if name == "decode":
            kw["extra_args"] = [*spec.extra_args, "--num-gpu-blocks-override", str(POOL),
                                "--no-enable-prefix-caching"]
        return replace(spec, **kw)

    # -- requests straight to the engines, as the gateway sends them ----------------------
    def leg(self, name: str, rid: str, prompt: list[int], max_tokens: int,
            params: KVTransferParams | None) -> Leg:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0}
        if params is not None:
            body["kv_transfer_params"] = params.to_dict()
        return Leg(self.engines[name].url, body, rid, self.engine_api_key)

    def push_legs(self, prefill: str, rid: str, prompt: list[int], max_tokens: int,
                  deadline_s: float) -> tuple[Leg, Leg]:
        """(decode leg, prefill leg) of one pushed request; neither started."""
        deadline = now_ms() + int(deadline_s * 1000)
        d = self.leg("decode", rid, prompt, max_tokens, KVTransferParams(
            kvpush="decode", request_id=rid, deadline_ms=deadline,
            prefill_engine=self.engines[prefill].engine_id, reservation_id=f"resv-{rid}",
            fencing_token=1))
        p = self.leg(prefill, rid, prompt, 1, KVTransferParams(
            kvpush="prefill", request_id=rid, deadline_ms=deadline,
            decode_engine=self.engines["decode"].engine_id))
        return d, p

    def pushed(self, prefill: str, prompt: list[int], max_tokens: int,
               deadline_s: float = 60.0) -> Leg:
        """Push ``prompt`` from ``prefill`` and decode it; the joined decode leg."""
        d, p = self.push_legs(prefill, f"cmpl-{uuid.uuid4().hex}", prompt, max_tokens,
                              deadline_s)
        d.start()
        self.wait_target(prefill, d.rid, bound_s=deadline_s)
        p.start()
        p.join(120)
        d.join(120)
        return d

    def wait_target(self, prefill: str, rid: str, bound_s: float = 60.0) -> None:
        """Until decode has published its push target for ``rid`` to ``prefill``."""
        r = self.direct()
        stream = self.keys.targets(self.engines[prefill].engine_id)

        def published() -> bool:
            for _id, fields in r.xrange(stream):
                with contextlib.suppress(WireError, KeyError):
                    if decode(fields[b"m"], PushTarget).request_id == rid:
                        return True
            return False

        try:
            _wait(published, bound_s, f"decode's push target for {rid}")
        finally:
            r.close()

    def victim_alone(self, prompt: list[int]) -> tuple[str, str]:
        """The victim's answers with nothing else running (once per stack): pushed from B,
        and computed by decode alone (a colocated engine)."""
        if self._victim is None:
            colocated = self.leg("decode", f"cmpl-{uuid.uuid4().hex}", prompt, VICTIM_TOKENS,
                                 None)
            colocated.start()
            colocated.join(120)
            self._victim = (_text(self.pushed("prefill-b", prompt, VICTIM_TOKENS)),
                            _text(colocated))
        return self._victim

    def stopped(self, name: str) -> bool:
        return any(_is_stopped(p) for p in self.engine_tree(name))

    def decode_metrics(self) -> list[Sample]:
        """One scrape of decode's metrics (empty when it answers none)."""
        try:
            return scrape(self.engines["decode"].url, timeout_s=5)
        except MetricsUnavailable:
            return []

    def decode_metric(self, name: str, samples: list[Sample] | None = None,
                      **labels: str) -> float:
        """``name`` summed over ``labels``, from ``samples`` or a fresh scrape; -1 when
        decode answered no scrape."""
        samples = self.decode_metrics() if samples is None else samples
        return metric_sum(samples, name, **labels) if samples else -1.0

    def push_records(self, name: str, rid: str) -> list[dict[str, Any]]:
        path = self.logs / f"{name}-stats.jsonl"
        out = []
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if rec.get("rid") == rid and rec.get("kind") == "push":
                        out.append(rec)
        return out


class Leg(threading.Thread):
    """One completion call on a thread; ``result`` or ``error`` once joined."""

    def __init__(self, url: str, body: dict[str, Any], rid: str, api_key: str) -> None:
        super().__init__(daemon=True, name=f"leg-{rid[-8:]}")
        self.url, self.body, self.rid, self.api_key = url, body, rid, api_key
        self.result: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            resp = httpx.post(f"{self.url}/v1/completions", json=self.body, timeout=150,
                              headers={"X-Request-Id": self.rid,
                                       "Authorization": f"Bearer {self.api_key}"})
            if resp.status_code != 200:
                self.error = f"{resp.status_code}: {resp.text[:200]}"
            else:
                self.result = resp.json()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def failed(self) -> bool:
        """An error status, or a 200 whose choice ended in error (decode's failed push)."""
        if self.error is not None:
            return True
        choice = ((self.result or {}).get("choices") or [{}])[0]
        return choice.get("finish_reason") in ("error", "abort")


@dataclass
class LateWriteResult:
    """One late-write row."""

    name: str
    fault: str
    stack: str
    guarded: bool = True
    victim_equal: bool | None = None
    victim_error: str | None = None
    colocated_equal: bool | None = None
    """The victim's answer equals decode's alone, computed there (a colocated engine)."""
    victim_waited: bool | None = None
    """The victim had not run when the late WRITEs were let go (guarded: it needs R1's
    blocks); running already means the quarantine did not hold them."""
    rechecked: int = 0
    changed: int = 0
    """Victims whose pushed blocks changed while they ran (end-of-request verification)."""
    late_bytes: int | None = None
    late_s: float | None = None
    """How long after R1's deadline its last WRITE ended (negative: before it, by A's clock)."""
    after_give_up_s: float | None = None
    """How long after decode gave R1 up (its deadline and grace, by decode's clock) R1's
    last WRITE ended: the WRITEs that a timer alone would have let land in reused blocks."""
    failed_request: str = ""
    quarantines: dict[str, float] = field(default_factory=dict)
    lost: int = 0
    leaks: dict[str, Any] = field(default_factory=dict)
    drain_s: float | None = None
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: str | None = None

    def violations(self) -> list[str]:
        """What broke the row's invariants (a measurement, ``guarded=False``, breaks none)."""
        if self.skipped or not self.guarded:
            return []
        out = [f"leak: {k}: {v}" for k, v in self.leaks.items() if v]
        if self.lost:
            out.append(f"{self.lost} request(s) lost")
        if self.victim_error:
            out.append(f"victim failed: {self.victim_error}")
        elif not self.victim_equal:
            out.append("the victim's answer differs from its answer alone")
        elif not self.colocated_equal:
            out.append("the victim's answer differs from a colocated engine's")
        if self.changed:
            out.append(f"{self.changed} victim(s) with a block changed while in use")
        if not self.rechecked:
            out.append("no victim was verified at its end")
        if not self.victim_waited:
            out.append("the victim ran before R1's blocks were fenced")
        if self.after_give_up_s is None or self.after_give_up_s <= 0:
            out.append(f"R1's WRITEs did not outlive decode's give-up: {self.after_give_up_s}")
        if self.failed_request != "failed":
            out.append(f"R1 did not fail cleanly: {self.failed_request}")
        q = self.quarantines
        if q.get("entered", 0) < 1 or q.get("fenced", 0) != q.get("entered", 0) \
                or q.get("cut_off", 0):
            out.append(f"R1's blocks were not released by A's fence: {q}")
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["violations"] = self.violations()
        return d


def _wait(pred: Callable[[], bool], bound_s: float, what: str, step_s: float = 0.05) -> None:
    end = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} within {bound_s:.0f} s")
        time.sleep(step_s)


def _is_stopped(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _text(leg: Leg) -> str:
    if leg.failed or leg.result is None:
        raise RuntimeError(f"push of {leg.rid} failed: {leg.error or leg.result}")
    return str(leg.result["choices"][0]["text"])


def tokens(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` token ids that no other seed shares a block with."""
    return [100 + (seed * 7919 + i * 104729) % 3000 for i in range(n)]


_QUARANTINE_ENDS = ("entered", "fenced", "cut_off")


def _counters(st: LateWriteStack) -> dict[str, float]:
    samples = st.decode_metrics()
    out = {end: st.decode_metric("kvpush_kv_quarantines_total", samples, end=end)
           for end in _QUARANTINE_ENDS}
    out["rechecked"] = st.decode_metric("kvpush_kv_rechecked_total", samples)
    out["changed"] = st.decode_metric("kvpush_kv_changed_in_use_total", samples)
    return out


def _decode_idle(st: LateWriteStack) -> bool:
    samples = st.decode_metrics()
    return (st.decode_metric("kvpush_kv_quarantined_blocks", samples) == 0
            and st.decode_metric("vllm:kv_cache_usage_perc", samples) == 0)


def run_late_write_row(st: LateWriteStack, kind: str, guarded: bool = True,
                       seed: int = 0) -> LateWriteResult:
    """One row (see the module docstring); an exception becomes a note and a failed row."""
    name = f"{kind}{'' if guarded else '_unguarded'}"
    res = LateWriteResult(name, KINDS[kind], st.stack_name, guarded)
    if kind == "link_cut" and st.net is None:
        res.skipped = "needs network namespaces (ip netns), not available here"
        return res
    t0 = time.monotonic()
    try:
        _run(st, kind, res, seed)
    except Exception as exc:  # the row records it; the suite goes on
        record_raise(res, exc)  # type: ignore[arg-type]
        logger.exception("late-write row %s raised", name)
    finally:
        st.arm("prefill", "")
        st.arm("decode", "")
        st.signal_engine("prefill", signal.SIGCONT)
        if st.net is not None:
            st.net.restore_data_link("prefill")
    res.duration_s = time.monotonic() - t0
    return res


def _run(st: LateWriteStack, kind: str, res: LateWriteResult, seed: int) -> None:
    victim = tokens(1, VICTIM_LEN)
    alone, colocated = st.victim_alone(victim)
    # A first push of R1's length: a cold prefill (two ranks on one core) can take longer
    # than the deadline over it.
    _text(st.pushed("prefill", tokens(100 + seed, FAILED_LEN), 2))
    decode_arm = [] if res.guarded else [f"quarantine_max_s {UNGUARDED_S}"]
    grace = float(st.specs["decode"].extra_config["late_write_grace_s"])
    # Decode gives R1 up at give_up_at (s from the deadline, real time); the victim comes
    # 1.5 s later.
    deadline_s, give_up_at = DEADLINE_S, grace
    if kind == "clock_skew":
        decode_arm.append(f"clock_skew_s {SKEW_S}")
        deadline_s, give_up_at = SKEW_DEADLINE_S, grace - SKEW_S
    give_up_s = deadline_s + give_up_at + 1.5
    st.arm("decode", "".join(f"{line}\n" for line in decode_arm))
    time.sleep(0.2)  # the decode faults take effect within 50 ms
    before = _counters(st)

    rid = f"cmpl-{uuid.uuid4().hex}"
    d, p = st.push_legs("prefill", rid, tokens(200 + seed, FAILED_LEN), 8, deadline_s)
    started, deadline_unix = time.monotonic(), time.time() + deadline_s
    d.start()
    st.wait_target("prefill", rid)
    st.arm("prefill", "stop_before_write 1\n")
    p.start()
    _wait(lambda: st.stopped("prefill"), 30, "prefill A stopped mid-push")
    cut_bytes = None
    if kind == "link_cut":
        assert st.net is not None
        st.net.cut_data_link("prefill")
        cut_bytes = st.net.data_link_bytes("prefill")
        st.signal_engine("prefill", signal.SIGCONT)  # its WRITEs now go into a dead link
    time.sleep(max(0.0, started + give_up_s - time.monotonic()))

    # The victim, from B, after decode gave R1 up; its prompt needs R1's blocks.
    vd, vp = st.push_legs("prefill-b", f"cmpl-{uuid.uuid4().hex}", victim, VICTIM_TOKENS,
                          VICTIM_DEADLINE_S)
    v_started = time.monotonic()
    vd.start()
    vp.start()
    # Unguarded, the victim gets R1's blocks and runs; guarded, it cannot.
    with contextlib.suppress(TimeoutError):
        _wait(lambda: st.decode_metric("vllm:num_requests_running") >= 1, 4.0,
              "the victim running", step_s=0.02)
    res.victim_waited = st.decode_metric("vllm:num_requests_running") < 1
    let_go = time.monotonic() - v_started
    healed_unix, heal_bytes = None, None
    if kind == "link_cut":
        assert st.net is not None
        heal_bytes = st.net.data_link_bytes("prefill")
        healed_unix = time.time()
        st.net.restore_data_link("prefill")
    else:
        st.signal_engine("prefill", signal.SIGCONT)
    # Decode writes bytes that reached its socket into its memory only while it progresses
    # NIXL, which it does while it receives: small pushes from B until the victim ended.
    let_go_at = time.monotonic()
    wakes = threading.Thread(target=_wake, args=(st, vd, seed), daemon=True)
    wakes.start()
    crossed = _Crossing(st, heal_bytes, vd).start() if heal_bytes is not None else None
    legs = (p, d, vp, vd)
    for leg in legs:
        leg.join(VICTIM_DEADLINE_S + 30)
    victim_left_s = time.monotonic() - let_go_at
    wakes.join(30)
    res.lost = sum(leg.is_alive() for leg in legs)
    res.failed_request = "failed" if d.failed else f"answered: {d.result}"[:160]
    if vd.failed or vd.result is None:
        res.victim_error = vd.error or str(vd.result)[:200]
    else:
        res.victim_equal = _text(vd) == alone
        res.colocated_equal = _text(vd) == colocated
    push = st.push_records("prefill", rid)
    if push:
        res.late_s = max(r["end_unix_ns"] for r in push) / 1e9 - deadline_unix
        res.late_bytes = sum(int(r.get("bytes", 0)) for r in push)
    if healed_unix is not None and st.net is not None:
        assert heal_bytes is not None and cut_bytes is not None
        # A's push failed at its deadline, but its WRITEs sat in a socket whose link was
        # down: they crossed only after the heal (the data link's counter says how much).
        res.late_s = healed_unix - deadline_unix
        res.late_bytes = st.net.data_link_bytes("prefill") - heal_bytes
        res.notes.append(f"{heal_bytes - cut_bytes} bytes crossed A's link while it was "
                         f"down, {res.late_bytes} after it healed")
        if crossed is not None and crossed.at_s is not None:
            res.notes.append(f"the late bytes crossed {crossed.at_s:.1f} s after the heal")
    if res.late_s is not None:
        res.after_give_up_s = res.late_s - give_up_at
    # Settle: R1's quarantine ends and the victim's end-of-request check runs.
    with contextlib.suppress(TimeoutError):
        _wait(lambda: _decode_idle(st), st.cfg.settle_s, "decode's blocks all free",
              step_s=0.2)
    after = _counters(st)
    res.quarantines = {end: after[end] - before[end] for end in _QUARANTINE_ENDS}
    res.rechecked = int(after["rechecked"] - before["rechecked"])
    res.changed = int(after["changed"] - before["changed"])
    res.leaks, res.drain_s = st.wait_drained()
    quarantined = st.decode_metric("kvpush_kv_quarantined_blocks")
    if quarantined:
        res.leaks["quarantined_blocks"] = quarantined
    after_s = "-" if res.after_give_up_s is None else f"{res.after_give_up_s:.1f}"
    res.notes.append(
        f"A let go {let_go:.1f} s after the victim was sent, the victim "
        f"{'waiting for blocks' if res.victim_waited else 'running'}; the victim ended "
        f"{victim_left_s:.1f} s later; R1's push: {res.late_bytes} bytes, ended {after_s} s "
        f"after decode gave it up; quarantines {res.quarantines}; pushed requests verified "
        f"at their end {res.rechecked}, changed {res.changed}")
    logger.info("late-write row %s: %s", res.name, res.notes[-1])


class _Crossing(threading.Thread):
    """When the first 64 KiB crossed A's healed link (``at_s`` from the heal), sampled
    while the victim runs."""

    def __init__(self, st: LateWriteStack, healed_bytes: int, victim: Leg) -> None:
        super().__init__(daemon=True, name="late-bytes")
        self.st, self.base, self.victim = st, healed_bytes, victim
        self.at_s: float | None = None

    def start(self) -> _Crossing:  # type: ignore[override]
        super().start()
        return self

    def run(self) -> None:
        assert self.st.net is not None
        t0 = time.monotonic()
        while self.victim.is_alive():
            if self.st.net.data_link_bytes("prefill") - self.base > 65536:
                self.at_s = time.monotonic() - t0
                return
            time.sleep(0.05)


def _wake(st: LateWriteStack, victim: Leg, seed: int) -> None:
    """Small pushes from B while the victim runs (each fits beside it)."""
    end = time.monotonic() + VICTIM_DEADLINE_S
    while victim.is_alive() and st.decode_metric("vllm:num_requests_running") < 1:
        if time.monotonic() > end:
            return
        time.sleep(0.05)
    i = 0
    while victim.is_alive() and time.monotonic() < end:
        i += 1
        with contextlib.suppress(RuntimeError, TimeoutError, redis.RedisError):
            # Past the skew of the clock-skew row: decode must not give a wake up.
            st.pushed("prefill-b", tokens(1000 + seed * 100 + i, WAKE_LEN), 2,
                      deadline_s=SKEW_S + 20.0)

