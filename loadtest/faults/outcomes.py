"""What the fault scenarios send and count: the stack's deadlines, one request and its
outcome (ok, failed clean, cancelled, unclear, lost), open-loop load, and a scenario's row."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

MODEL = "tiny"

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
    prefill_tp: int = 1
    decode_tp: int = 1
    """Tensor-parallel sizes; each engine's ranks share that engine's core."""

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
                if not text and tokens == 0 and choice.get("finish_reason") != "stop":
                    return done(UNCLEAR, 200, f"200 with an empty answer: {data!r:.300}")
                return done(OK, 200, "", tokens)
            tokens, finished, finish = 0, False, None
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
                    finish = choice.get("finish_reason") or finish
                    if choice.get("text"):
                        tokens += 1
                        if tokens == 1 and disconnect_at_token:
                            return done(CANCELLED, 200, "client disconnected mid-stream",
                                        tokens)
            # A random-weight model may end at once (EOS) or emit only tokens that detokenize
            # to nothing: a complete answer with a proper finish_reason and empty text.
            if finished and (tokens or finish in ("stop", "length")):
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


def record_raise(res: ScenarioResult, exc: BaseException) -> None:
    """A scenario that raised: the row notes it and fails (the suite goes on)."""
    res.notes.append(f"scenario raised {type(exc).__name__}: {exc}"[:300])
    res.leaks.setdefault("scenario_error", str(exc)[:200])
