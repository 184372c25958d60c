"""Hostile input at kvpush's three edges, tried on the real fault stack.

Client edge: malformed, oversized and unauthenticated requests to a gateway with tenant auth
and tight limits, and connections that never finish their headers. Engine edge: requests sent
straight to an engine's port, without the internal token or with malformed
``kv_transfer_params``. Control plane: garbage written where the schedulers, the engines'
connectors and the gateway read Redis (request stream, engine statuses, push targets,
assignments). Each probe must get its clear 4xx, or be dropped with a log line; afterwards
every engine and scheduler is the same process, healthy, and serving, and nothing is held.

``tests/test_faults.py`` asserts it; ``kvpush reliability`` reports it.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvpush.common.quotas import usage
from kvpush.common.settings import GatewaySettings
from kvpush.common.tenancy import Quotas, create_tenant
from kvpush.common.wire import SCHEMA_VERSION, EngineStatus, ScheduleRequest, now_ms
from kvpush.loadtest.faults.harness import FaultStack
from kvpush.loadtest.faults.outcomes import MODEL, OK, send_request
from kvpush.services.engine.status import publish_status, remove_status
from kvpush.services.local.local_redis import free_port
from kvpush.services.local.stack import UvicornThread

logger = logging.getLogger(__name__)

CLIENT, ENGINE, CONTROL = "client", "engine", "control plane"
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello world"}]
TENANT = "hostile-probe"
# The guarded gateway's limits, tight enough that the probes below cross them.
LIMITS: dict[str, Any] = {
    "gateway_auth": True,
    "gateway_max_body_bytes": 64 * 1024,
    "gateway_max_header_bytes": 4096,
    "gateway_max_json_depth": 16,
    "gateway_max_tokens": 1000,
    "gateway_max_model_len": 512,
    "gateway_header_timeout_s": 1.0,
}


def _raw(path: str, text: str) -> tuple[str, bytes]:
    return path, text.encode()


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"


# (path, JSON body or raw bytes, status, param the error must name or None)
HOSTILE_BODIES: list[tuple[str, Any, int, str | None]] = [
    (*_raw(C, '{"prompt": "hello", "temperature": NaN}'), 400, "temperature"),
    (*_raw(C, '{"prompt": "hello", "temperature": Infinity}'), 400, "temperature"),
    (*_raw(CHAT, '{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}'),
     400, "top_p"),
    (*_raw(C, '{"prompt": "hello", "temperature": 1e999}'), 400, "temperature"),
    (*_raw(C, '{"prompt": "hello", "logit_bias": {"5": NaN}}'), 400, "logit_bias.5"),
    (C, {"prompt": "hello", "max_tokens": 10**30}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    (C, {"prompt": "hello", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": 5.0}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": True}, 400, "max_tokens"),
    (C, {"prompt": "hello " * 40, "max_tokens": 600}, 400, "max_tokens"),  # past the context
    (C, {"prompt": "hello", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hello", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "hello", "top_k": "1"}, 400, "top_k"),
    (C, {"prompt": "hello", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hello", "logit_bias": {"5": 1000}}, 400, "logit_bias.5"),
    (C, {"prompt": "hello", "stream_options": {"evil": True}}, 400, "stream_options.evil"),
    (C, {"prompt": "hello", "model": "m" * 1000}, 400, "model"),
    (C, {"prompt": [10**9]}, 400, "prompt"),
    (C, {"prompt": ["hello", ""]}, 400, "prompt[1]"),  # batches: the bad prompt is named
    (C, {"prompt": [[1, 2], [10**9]]}, 400, "prompt[1]"),
    (C, {"prompt": ["hello", [1, 2]]}, 400, "prompt"),
    (C, {"prompt": ["hello"] * 5000}, 400, "prompt"),
    (C, {"prompt": ["hello", "hello"], "max_tokens": 10**6}, 400, "max_tokens"),
    ("/tokenize", b'["prompt"]', 400, None),
    (C, {"prompt": "hello", "kv_transfer_params": {"kvpush": "decode"}}, 400,
     "kv_transfer_params"),
    (C, _nested(40), 400, "a"),
    (C, _nested(30000), 400, None),  # deeper than Python's own recursion limit
    (C, b'{"prompt": "x"', 400, None),
    (C, b'\xff\xfe{"prompt": 1}', 400, None),
    (C, b'["prompt"]', 400, None),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"truncation": True, "max_length": 1}},
     400, "chat_template_kwargs.truncation"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"max_length": 1}}, 400,
     "chat_template_kwargs.max_length"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs.tokenize"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
     "chat_template_kwargs.chat_template"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": "yes"}}, 400,
     "chat_template_kwargs.enable_thinking"),
    (CHAT, {"messages": MSGS, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    (CHAT, {"messages": [{"role": 1, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": MSGS, "tools": "all of them"}, 400, "tools"),
    (CHAT, {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    (C, b'{"prompt": "' + b"a" * (100 * 1024) + b'"}', 413, None),
]

# Malformed kvpush params sent straight to an engine: (what, params).
HOSTILE_KV_PARAMS: list[tuple[str, Any]] = [
    ("role is not kvpush's", {"kvpush": "both", "request_id": "x"}),
    ("no request id", {"kvpush": "prefill"}),
    ("empty request id", {"kvpush": "prefill", "request_id": ""}),
    ("request id not a string", {"kvpush": "prefill", "request_id": 7}),
    ("decode without prefill engine", {"kvpush": "decode", "request_id": "x"}),
    ("engine id breaks key layout", {"kvpush": "decode", "request_id": "x",
                                     "prefill_engine": "p}:{evil"}),
    ("engine id too long", {"kvpush": "decode", "request_id": "x",
                            "prefill_engine": "p" * 500}),
    ("deadline a string", {"kvpush": "prefill", "request_id": "x", "deadline_ms": "soon"}),
    ("deadline negative", {"kvpush": "prefill", "request_id": "x", "deadline_ms": -5}),
    ("fencing token huge", {"kvpush": "decode", "request_id": "x", "prefill_engine": "p",
                            "fencing_token": 10**30}),
    ("unknown field", {"kvpush": "prefill", "request_id": "x", "block_ids": [1, 2]}),
    ("params not an object", ["kvpush", "prefill"]),
    ("traceparent too long", {"kvpush": "prefill", "request_id": "x",
                              "traceparent": "0" * 4096}),
]


def error_problem(status_code: int, body: Any, status: int, param: str | None,
                  internal: tuple[str, ...] = ()) -> str | None:
    """What is wrong with an error answer (None: a clean OpenAI error naming ``param``)."""
    if status_code != status:
        return f"HTTP {status_code}, wanted {status}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"not an OpenAI error: {str(body)[:120]}"
    if err["code"] != status or err["type"] != "invalid_request_error":
        return f"code/type {err['code']}/{err['type']}"
    if param is not None and (err["param"] != param or param not in err["message"]):
        return f"names {err['param']!r}, wanted {param!r}"
    for name in ("Traceback", "Error:", "pydantic", "127.0.0.1", "(char ", *internal):
        if name in str(err["message"]):
            return f"message leaks {name!r}"
    return None


@dataclass
class ProbeResult:
    """One hostile input and what came of it."""

    edge: str
    name: str
    expect: str
    got: str
    ok: bool


@dataclass
class HostileReport:
    """Every probe, and the state of the stack after all of them."""

    probes: list[ProbeResult] = field(default_factory=list)
    after: dict[str, Any] = field(default_factory=dict)
    took_s: float = 0.0

    def failed(self) -> list[ProbeResult]:
        return [p for p in self.probes if not p.ok]

    def violations(self) -> list[str]:
        """Broken promises: a probe without its answer, or harm done to the stack."""
        out = [f"{p.edge} / {p.name}: {p.got}" for p in self.failed()]
        out += [f"after: {k} = {v}" for k, v in self.after.items()
                if k.startswith("!") and v]
        return out


class _Records(logging.Handler):
    """Log records of the in-process gateways, to show a probe was logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class HostileRun:
    """Runs the probes against a started :class:`FaultStack`."""

    def __init__(self, st: FaultStack) -> None:
        self.st = st
        self.report = HostileReport()
        self.r = st.direct()
        self.gw: UvicornThread | None = None
        self.gw_app: Any = None
        self.auth: dict[str, str] = {}
        self.records = _Records()
        self.internal = tuple(st.specs[role].engine_id for role in st.specs)

    # -- bookkeeping ----------------------------------------------------------------------
    def add(self, edge: str, name: str, expect: str, problem: str | None,
            got: str = "") -> None:
        self.report.probes.append(ProbeResult(edge, name, expect, problem or got or expect,
                                              problem is None))

    def _log_text(self, *names: str) -> str:
        return "\n".join((self.st.logs / n).read_text(errors="replace")
                         for n in names if (self.st.logs / n).exists())

    # -- the guarded gateway ----------------------------------------------------------------
    def start_gateway(self) -> None:
        from kvpush.services.gateway import create_app

        st = self.st
        gs = GatewaySettings(
            redis_url=st.redis_url, gateway_id="kvft-gw-hostile", gateway_model=MODEL,
            gateway_tokenizer=str(st.engines["decode"].model_path),
            gateway_request_timeout_s=st.cfg.request_timeout_s,
            engine_api_key=st.engine_api_key, **LIMITS)
        self.gw_app = create_app(gs)
        self.gw = UvicornThread(self.gw_app, "127.0.0.1", free_port(), bounds=gs).start()
        self.r.delete(st.keys.tenant(TENANT))
        _, key = create_tenant(self.r, TENANT, tenant_id=TENANT,
                               quotas=Quotas(concurrent_requests=64,
                                             tokens_per_minute=10**7))
        self.auth = {"Authorization": f"Bearer {key}"}
        logging.getLogger("kvpush").addHandler(self.records)

    def stop(self) -> None:
        logging.getLogger("kvpush").removeHandler(self.records)
        if self.gw is not None:
            self.gw.stop()
        self.r.close()

    def served(self, url: str | None = None, stream: bool = True,
               headers: dict[str, str] | None = None) -> bool:
        """One good request through a gateway gets a complete answer."""
        return send_request(url or self.gw.url, 0, stream=stream, cfg=self.st.cfg,  # type: ignore[union-attr]
                            tag="hostile-after", headers=headers or self.auth).kind == OK

    # -- client edge ----------------------------------------------------------------------
    def client_edge(self) -> None:
        assert self.gw is not None
        url = self.gw.url
        with httpx.Client(timeout=30) as http:
            for path, body, status, param in HOSTILE_BODIES:
                name = _describe(path, body)
                expect = f"{status}" + (f" naming {param}" if param else "")
                if isinstance(body, bytes):
                    resp = http.post(url + path, content=body, headers={
                        **self.auth, "content-type": "application/json"})
                else:
                    resp = http.post(url + path, json=body, headers=self.auth)
                self.add(CLIENT, name, expect, error_problem(
                    resp.status_code, _json(resp), status, param, self.internal))
            good = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            for name, headers in (("no API key", {}),
                                  ("unknown API key", {"Authorization": "Bearer sk-nope"}),
                                  ("malformed Authorization", {"Authorization": "Basic x"})):
                resp = http.post(url + C, json=good, headers=headers)
                self.add(CLIENT, name, "401", None if resp.status_code == 401
                         else f"HTTP {resp.status_code}")
            resp = http.post(url + C, json=good, headers={**self.auth, "x-big": "a" * 5000})
            self.add(CLIENT, "header block over the limit", "431",
                     None if resp.status_code == 431 else f"HTTP {resp.status_code}")
            for path in ("/metrics", "/docs", "/openapi.json"):
                resp = http.get(url + path)
                self.add(CLIENT, f"GET {path} on the API port", "404",
                         None if resp.status_code == 404 else f"HTTP {resp.status_code}")
        host, port = url.removeprefix("http://").split(":")
        for name, payload in (("connection that sends nothing", b""),
                              ("header block sent a byte at a time", b"POST /v1/comp")):
            self.add(CLIENT, name, "closed after the header timeout",
                     _slow_loris(host, int(port), payload, LIMITS["gateway_header_timeout_s"]))

    # -- engine edge ----------------------------------------------------------------------
    def engine_edge(self) -> None:
        token = {"Authorization": f"Bearer {self.st.engine_api_key}"}
        body = {"model": MODEL, "prompt": "hello hostile", "max_tokens": 2}
        with httpx.Client(timeout=60) as http:
            for role, eng in self.st.engines.items():
                url = f"{eng.url}/v1/completions"
                for name, headers in (("no internal token", {}),
                                      ("wrong internal token", {"Authorization": "Bearer x"})):
                    resp = http.post(url, json=body, headers=headers)
                    self.add(ENGINE, f"{role}: {name}", "401",
                             None if resp.status_code == 401 else f"HTTP {resp.status_code}")
                for what, params in HOSTILE_KV_PARAMS:
                    resp = http.post(url, json={**body, "kv_transfer_params": params},
                                     headers=token)
                    problem = None if resp.status_code == 400 and \
                        "kv_transfer_params" in resp.text else \
                        f"HTTP {resp.status_code}: {resp.text[:100]}"
                    self.add(ENGINE, f"{role}: kv_transfer_params {what}",
                             "400 naming kv_transfer_params", problem)

    # -- control plane --------------------------------------------------------------------
    def control_plane(self) -> None:
        self._request_stream()
        self._engine_statuses()
        self._targets_and_assignments()

    def _request_stream(self) -> None:
        k = self.st.keys
        req = ScheduleRequest(request_id="hostile-r", gateway_id="kvft-gw-hostile",
                              prompt_tokens=10, max_tokens=2,
                              deadline_ms=now_ms() + 60_000, enqueued_ms=now_ms())

        def tweak(**kw: object) -> dict[bytes, bytes]:
            d = msgspec.structs.asdict(req)
            d.update(kw)
            return {b"m": msgspec.msgpack.encode(d)}

        entries: list[tuple[str, dict[bytes, bytes], str]] = [
            ("entry without a message", {b"x": b"1"}, "no 'm' field"),
            ("message not msgpack", {b"m": b"\xc1\xc1\xc1"}, "malformed"),
            ("unknown schema version", tweak(v=99), "schema version 99"),
            ("negative prompt tokens", tweak(prompt_tokens=-1), "negative"),
            ("message over the size limit", {b"m": b"\x00" * (2 << 20)}, "exceeds"),
            ("gateway id that breaks key layout", tweak(gateway_id="gw}{evil"), "invalid id"),
            ("deadline years ahead", tweak(deadline_ms=now_ms() + 10 * 365 * 86_400_000),
             "day ahead"),
        ]
        before = len(self.st.dead_letters())
        for _name, fields, _says in entries:
            self.r.xadd(k.requests(), fields)
        deadline = time.monotonic() + 30
        while len(self.st.dead_letters()) < before + len(entries) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        reasons = [f.get(b"reason", b"").decode(errors="replace")
                   for f in self.st.dead_letters()[before:]]
        for name, _fields, says in entries:
            hit = any(says in reason for reason in reasons)
            self.add(CONTROL, f"request stream: {name}", f"dead-lettered ({says})",
                     None if hit else f"no dead letter saying {says!r} in {reasons}")

    def _engine_statuses(self) -> None:
        k = self.st.keys

        def status(eid: str, role: str = "decode") -> EngineStatus:
            # Would win placement if believed: far more free blocks than the real engines.
            return EngineStatus(engine_id=eid, role=role, url="http://127.0.0.1:9",
                                model=MODEL, block_size=self.st.cfg.block_size,
                                total_blocks=100_000, free_blocks=100_000, generation=1,
                                updated_ms=now_ms())

        cases: list[tuple[str, str, dict[str, Any] | None]] = [
            ("hx-role", "role nobody knows", {"role": "boss"}),
            ("hx-url", "URL not http(s)", {"url": "file:///etc/passwd"}),
            ("hx-blocks", "block count not a number", {"total_blocks": "lots"}),
            ("hx-free", "negative free blocks", {"free_blocks": -5}),
            ("hx-size", "block size zero", {"block_size": 0}),
            ("hx-type", "status key not a hash", None),
        ]
        for eid, _name, fields in cases:
            publish_status(self.r, k, status(eid), ttl_s=120)
            if fields is None:
                self.r.delete(k.engine(eid))
                self.r.set(k.engine(eid), b"not a hash", ex=120)
            else:
                self.r.hset(k.engine(eid), mapping=fields)
        self.r.zadd(k.engines(), {"bad id {with} braces": now_ms()})
        served = all(self.served(stream=s) for s in (True, False))
        # Each scheduler reads the statuses at its next engine refresh.
        marks = [f"engine {eid}" for eid, _n, _f in cases] + ["invalid id"]
        deadline = time.monotonic() + 20
        while True:
            logs = self._log_text("sched-a.log", "sched-b.log")
            if all(m in logs for m in marks) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for eid, name, _fields in cases:
            problem = None if f"engine {eid}:" in logs or f"engine {eid} " in logs else \
                "no log line from a scheduler"
            if not served:
                problem = "good requests were not served while it was registered"
            self.add(CONTROL, f"engine status: {name}", "skipped with a log line; good "
                     "requests still served on the real engines", problem)
        self.add(CONTROL, "engine index: id that breaks key layout", "skipped with a log line",
                 None if "invalid id" in logs else "no log line from a scheduler")
        for eid, _name, _fields in cases:
            remove_status(self.r, k, eid)
        self.r.zrem(k.engines(), "bad id {with} braces")

    def _targets_and_assignments(self) -> None:
        k = self.st.keys
        prefill = self.st.specs["prefill"].engine_id
        far = now_ms() + 10 * 365 * 86_400_000
        target = {"v": SCHEMA_VERSION, "request_id": "hostile-unknown",
                  "decode_engine": "kvft-nobody", "decode_generation": 1,
                  "block_ids": [list(range(10_000))], "skip_blocks": [0],
                  "num_tokens": 10, "deadline_ms": far}
        self.r.xadd(k.targets(prefill), {b"x": b"no message"})
        self.r.xadd(k.targets(prefill), {b"m": b"\xc1 garbage"})
        self.r.xadd(k.targets(prefill), {b"m": msgspec.msgpack.encode(target)})
        self.r.xadd(k.assignments("kvft-gw-hostile"), {b"m": b"\xc1 garbage"})
        self.r.xadd(k.assignments("kvft-gw-hostile"), {b"m": msgspec.msgpack.encode([1, 2])})
        served = self.served()
        pre_log = self._log_text("prefill.log")
        bad_targets = pre_log.count("skipping bad target entry")
        self.add(CONTROL, "push targets: entries without a message or not msgpack",
                 "skipped with a log line by the prefill connector",
                 None if bad_targets >= 2 else f"{bad_targets} log lines")
        self.add(CONTROL, "push target for an unknown request, decode and year",
                 "held no longer than the push deadline cap; engine serves on",
                 None if served else "a good request failed after it")
        gw_lines = [line for line in self.records.lines if "bad assignment" in line]
        self.add(CONTROL, "assignment stream: garbage and a wrong message type",
                 "skipped with a log line by the gateway; it serves on",
                 None if len(gw_lines) >= 2 and served else
                 f"{len(gw_lines)} log lines, served={served}")

    # -- after ------------------------------------------------------------------------------
    def check_after(self, pids: dict[str, int | None]) -> None:
        st, after = self.st, self.report.after
        with httpx.Client(timeout=10) as http:
            for role, eng in st.engines.items():
                alive = eng.pid == pids[role] and http.get(f"{eng.url}/health").status_code \
                    == 200
                after[f"!{role} engine restarted or unhealthy"] = not alive
        after["!schedulers exited"] = [n for n, p in st.schedulers.items()
                                       if p.poll() is not None]
        after["!good requests failed"] = not (self.served() and self.served(st.url, False))
        held, waited = st.wait_drained()
        after["!held after the probes"] = held
        assert self.gw_app is not None
        after["!hostile gateway flights"] = sorted(self.gw_app.state.gateway.active)
        u = usage(self.r, TENANT)
        after["!quota units held"] = {k: v for k, v in u.items()
                                      if k == "concurrent_leases" and v}
        secret = st.engine_api_key
        after["!internal token in a log"] = [p.name for p in Path(st.logs).iterdir()
                                             if secret in p.read_text(errors="replace")]
        after["drained in"] = f"{waited:.1f} s"

    def run(self) -> HostileReport:
        """All probes, then the checks; never raises for a probe that went wrong."""
        t0 = time.monotonic()
        pids = {role: eng.pid for role, eng in self.st.engines.items()}
        self.start_gateway()
        try:
            for step in (self.client_edge, self.engine_edge, self.control_plane):
                try:
                    step()
                except Exception as exc:  # one broken step must not hide the others
                    logger.exception("hostile step %s broke", step.__name__)
                    self.add("harness", step.__name__, "runs", f"{type(exc).__name__}: {exc}")
            self.check_after(pids)
        finally:
            self.stop()
        self.report.took_s = time.monotonic() - t0
        return self.report


def run_hostile(st: FaultStack) -> HostileReport:
    """Try every hostile probe on ``st``; see the module docstring."""
    return HostileRun(st).run()


def _describe(path: str, body: Any) -> str:
    text = body.decode(errors="replace") if isinstance(body, bytes) else \
        msgspec.json.encode(body).decode()
    if len(text) > 70:
        text = text[:60] + f"... ({len(text)} bytes)"
    return f"{path.removeprefix('/v1/')} {text}"


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text[:200]


def _slow_loris(host: str, port: int, payload: bytes, timeout_s: float) -> str | None:
    """None when the server closes a connection stuck in its header block in time."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.settimeout(timeout_s + 10)
        t0 = time.monotonic()
        try:
            for ch in payload:
                s.send(bytes([ch]))
                time.sleep(min(0.2, timeout_s / 4))
            while s.recv(4096):
                pass
        except OSError:
            pass  # a reset or a broken pipe: the server closed it
        took = time.monotonic() - t0
        return None if took < timeout_s + 8 else f"still open after {took:.1f} s"
