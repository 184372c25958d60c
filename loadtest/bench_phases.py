"""Where a kvpush request's time to first token goes, phase by phase, from its trace.

The benchmark client opens a sampled trace per request (its own ``traceparent``), the stack
exports every span to an in-process OTLP receiver, and each request's spans are cut into
phases that add up to the TTFT the client measured (all stamps are wall clock on one host):

* ``gateway``: client send -> the request enters its stream, or its prompt goes to prefill
  early if that is sooner (admission: auth, quota, tokenizing);
* ``schedule``: enqueued -> the first dispatch (stream, match, reservation, assignment);
  0 when the prompt went to prefill at admission (``services/gateway/early_prefill.py``);
* ``prefill``: dispatched -> prefill's forward pass over the prompt ended;
* ``transfer``: forward pass ended -> KV complete on decode (the exposed transfer);
* ``decode``: KV complete -> decode's first event reached the gateway;
* ``answer``: forward pass ended -> prefill's answer reached the gateway;
* ``relay``: the gateway -> the client.

A stream whose first token went out from prefill's answer (``services/gateway/lead.py``)
passes through ``answer`` and has no ``transfer`` or ``decode`` (0 ms); any other through
``transfer`` and ``decode`` and has no ``answer``.

Beside them, facts that do not add up: the control plane's own time (request at the
gateway -> both dispatches, and -> prefill's dispatch), how long after its dispatch decode
published its target, how many prompts had a WRITE posted before the forward pass ended
(layer-wise overlap), the WRITE throughput of the writes posted after the forward pass
(layer-wise ones are paced by it), PushDone sent -> KV complete on decode, and for streams
led by prefill: forward pass ended -> KV complete on decode, and first token sent ->
decode's first event.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.loadtest.bench_client import RequestResult
    from kvpush.loadtest.otlp_receiver import OTLPReceiver, ReceivedSpan

logger = logging.getLogger(__name__)

PHASES = ("gateway", "schedule", "prefill", "transfer", "decode", "answer", "relay")
FACTS = ("control_plane", "prefill_dispatch", "target_after_dispatch", "notify_to_complete",
         "kv_after_forward", "decode_after_lead")


def new_traceparent(sampled: bool = True) -> tuple[str, str]:
    """(traceparent header, trace id) of a fresh trace."""
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if sampled else '00'}", trace_id


@dataclass
class RequestPhases:
    """One traced request cut into phases (ms), or why it could not be."""

    trace_id: str
    phases: dict[str, float]
    facts: dict[str, float]
    overlapped: bool | None  # a WRITE posted before the forward pass ended
    write_mb_s: float | None
    missing: str | None = None
    led: bool = False  # the first token went out from prefill's answer


def cut(result: RequestResult, spans: list[ReceivedSpan]) -> RequestPhases:
    """The phases of one request from its client timing and its spans."""
    tid = result.trace_id or ""
    ms = 1e-6

    def missing(what: str) -> RequestPhases:
        return RequestPhases(tid, {}, {}, None, None, missing=what)

    if not result.ok or result.ttft is None or not result.sent_unix_ns:
        return missing("request failed")
    send = result.sent_unix_ns
    first_token = send + int(result.ttft * 1e9)
    # OTLP span kinds: 2 SERVER, 4 PRODUCER; the gateway's are the only ones in this trace.
    server = next((s for s in spans if s.kind == 2 and s.name.startswith("POST ")), None)
    producer = min((s for s in spans if s.kind == 4), key=lambda s: s.start_unix_ns,
                   default=None)
    decs = [s for s in spans if s.name == "kvpush.dispatch.decode"]
    # After a re-route the flight that answered is the one whose decode sent an event.
    dec = next((s for s in decs if "kvpush.first_event" in s.event_unix_ns),
               decs[0] if decs else None)
    pre = next((s for s in spans if s.name == "kvpush.dispatch.prefill"), None)
    wait = next((s for s in spans if s.name == "kvpush.kv.wait"), None)
    push = next((s for s in spans if s.name == "kvpush.kv.push"), None)
    writes = sorted((s for s in spans if s.name == "kvpush.kv.write"),
                    key=lambda s: s.start_unix_ns)
    for what, span in (("producer", producer), ("decode dispatch", dec),
                       ("prefill dispatch", pre), ("kv.wait", wait)):
        if span is None:
            return missing(what)
    assert producer and dec and pre and wait
    forward_end_ms = wait.attributes.get("kvpush.forward_end_unix_ms") or (
        push.attributes.get("kvpush.forward_end_unix_ms") if push else None)
    first_event = dec.event_unix_ns.get("kvpush.first_event")
    lead = server.event_unix_ns.get("kvpush.first_token_from_prefill") if server else None
    if not forward_end_ms or (first_event is None and lead is None):
        return missing("forward end" if not forward_end_ms else "first event")
    forward_end = int(forward_end_ms) * 1_000_000
    dispatched = min(dec.start_unix_ns, pre.start_unix_ns)
    entered = min(producer.start_unix_ns, dispatched)
    phases = {
        "gateway": (entered - send) * ms,
        "schedule": (dispatched - entered) * ms,
        "prefill": (forward_end - dispatched) * ms,
        "transfer": 0.0, "decode": 0.0, "answer": 0.0,
    }
    if lead is not None:
        phases["answer"] = (lead - forward_end) * ms
        phases["relay"] = (first_token - lead) * ms
    else:
        assert first_event is not None
        phases["transfer"] = (wait.end_unix_ns - forward_end) * ms
        phases["decode"] = (first_event - wait.end_unix_ns) * ms
        phases["relay"] = (first_token - first_event) * ms
    start = server.start_unix_ns if server is not None else send
    facts = {
        "control_plane": (max(dec.start_unix_ns, pre.start_unix_ns) - start) * ms,
        "prefill_dispatch": (pre.start_unix_ns - start) * ms,
        "target_after_dispatch": (wait.start_unix_ns - dec.start_unix_ns) * ms,
    }
    if lead is not None:
        facts["kv_after_forward"] = (wait.end_unix_ns - forward_end) * ms
        if first_event is not None:
            facts["decode_after_lead"] = (first_event - lead) * ms
    overlapped = None
    mb_s = None
    if push is not None:
        facts["notify_to_complete"] = (wait.end_unix_ns - push.end_unix_ns) * ms
    if writes:
        overlapped = writes[0].start_unix_ns < forward_end
        # Layer-wise writes are paced by the forward pass, not by the wire: the rate is
        # that of the writes posted once it ended (catch-ups), when a push has any.
        after = [w for w in writes if w.start_unix_ns >= forward_end]
        nbytes = sum(int(w.attributes.get("kvpush.bytes", 0)) for w in after)
        busy = max((w.end_unix_ns for w in after), default=0) - min(
            (w.start_unix_ns for w in after), default=0)
        if busy > 0 and nbytes:
            mb_s = nbytes / (busy / 1e9) / 1e6
    return RequestPhases(tid, phases, facts, overlapped, mb_s, led=lead is not None)


def _stat(values: list[float]) -> dict[str, float]:
    from kvpush.loadtest.bench_client import percentile

    return {"mean": round(statistics.fmean(values), 3),
            "p50": round(percentile(values, 50) or 0.0, 3),
            "p99": round(percentile(values, 99) or 0.0, 3)}


def summarize(cuts: list[RequestPhases]) -> dict[str, Any]:
    """Mean, p50 and p99 (ms) of every phase and fact over the requests that could be cut."""
    good = [c for c in cuts if c.missing is None]
    out: dict[str, Any] = {"traced": len(cuts), "cut": len(good),
                           "missing": sorted({c.missing for c in cuts if c.missing})}
    if not good:
        return out
    out["phases"] = {ph: _stat([c.phases[ph] for c in good]) for ph in PHASES}
    out["facts"] = {f: _stat(vals) for f in FACTS
                    if (vals := [c.facts[f] for c in good if f in c.facts])}
    out["led"] = f"{sum(c.led for c in good)}/{len(good)}"
    over = [c.overlapped for c in good if c.overlapped is not None]
    out["overlapped"] = f"{sum(over)}/{len(over)}"
    rates = [c.write_mb_s for c in good if c.write_mb_s is not None]
    if rates:
        out["write_mb_s"] = {**_stat(rates), "n": len(rates)}
    return out


def collect(receiver: OTLPReceiver, results: list[RequestResult],
            timeout_s: float = 20.0) -> dict[str, Any]:
    """Wait for the traced requests' spans (engines export in batches every few seconds)
    and summarise their phases."""
    wanted = {r.trace_id for r in results if r.ok and r.trace_id}
    deadline = time.monotonic() + timeout_s
    while True:
        by_trace = receiver.by_trace(wanted)
        done = sum(1 for spans in by_trace.values()
                   if any(s.name == "kvpush.kv.wait" for s in spans)
                   and any(s.name == "kvpush.dispatch.decode" for s in spans)
                   and any(s.name == "kvpush.kv.push" for s in spans))
        if done == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    cuts = [cut(r, by_trace.get(r.trace_id or "", [])) for r in results if r.trace_id]
    summary = summarize(cuts)
    if summary["missing"]:
        logger.warning("phases: %s of %s traced requests could not be cut: %s",
                       summary["traced"] - summary["cut"], summary["traced"],
                       summary["missing"])
    receiver.clear()
    return summary


PHASE_LABELS = {
    "gateway": "gateway admission (client send -> enqueued, or prefill sent early)",
    "schedule": "enqueued -> dispatched (stream, match, reservation; 0: prefill went early)",
    "prefill": "dispatched -> prefill forward pass ended",
    "transfer": "forward pass ended -> KV complete on decode (exposed transfer)",
    "decode": "KV complete -> decode's first event at the gateway",
    "answer": "forward pass ended -> prefill's answer at the gateway",
    "relay": "gateway -> client",
    "control_plane": "request at the gateway -> both dispatches sent",
    "prefill_dispatch": "request at the gateway -> prefill dispatched",
    "target_after_dispatch": "decode dispatched -> its target published",
    "notify_to_complete": "PushDone sent -> KV complete on decode",
    "kv_after_forward": "led by prefill: forward pass ended -> KV complete on decode",
    "decode_after_lead": "led by prefill: first token sent -> decode's first event",
}


def phases_markdown(points: list[Any]) -> str:
    """A table per traced point: mean, p50 and p99 of every phase and fact."""
    traced = [p for p in points if p.extra.get("phases", {}).get("phases")]
    if not traced:
        return ""
    out = ("\n### Time to first token by phase (every request traced)\n\n"
           "Phases add up to the TTFT the client measured; the rows below the line do not "
           "add up (they overlap the phases). A stream whose first token is prefill's "
           "answer has no transfer or decode phase; any other has no answer phase.\n")
    for p in traced:
        ph = p.extra["phases"]
        out += (f"\n{p.system}, {p.model} {p.input_len}/{p.output_len} at {p.rate:g} req/s: "
                f"{ph['cut']} of {ph['traced']} requests cut; the first token from "
                f"prefill's answer in {ph.get('led', '—')}; a WRITE posted before the "
                f"forward pass ended in {ph.get('overlapped', '—')} prompts")
        if "write_mb_s" in ph:
            w = ph["write_mb_s"]
            out += (f"; WRITE throughput of the writes posted after the forward pass "
                    f"{w['p50']:.0f} MB/s p50 ({w['mean']:.0f} mean, {w.get('n', '?')} "
                    "prompts had any)")
        out += ".\n\n| phase | mean ms | p50 ms | p99 ms |\n|---|---|---|---|\n"
        for name in PHASES:
            v = ph["phases"][name]
            out += f"| {PHASE_LABELS[name]} | {v['mean']:.2f} | {v['p50']:.2f} | {v['p99']:.2f} |\n"
        total = sum(ph["phases"][n]["mean"] for n in PHASES)
        out += f"| **sum = TTFT mean** | **{total:.2f}** | | |\n"
        for name, v in ph.get("facts", {}).items():
            out += (f"| *{PHASE_LABELS.get(name, name)}* | {v['mean']:.2f} | {v['p50']:.2f} "
                    f"| {v['p99']:.2f} |\n")
    return out
