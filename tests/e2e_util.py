"""Helpers for e2e tests with real vLLM CPU engines: start engines, send requests, read metrics.

Reused by every e2e test (stock pull, stock push, kvpush push): copy
``tests/test_e2e_stock_pull.py`` and change the connector.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import PushTarget, decode, now_ms
from kvpush.services.engine.launcher import EngineProcess, EngineSpec
from kvpush.services.engine.status import metric_sum, scrape
from kvpush.services.local.demo import CompletionFailed, StreamResult, complete, stream_completion
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.pd_proxy import Backend, PDProxy, create_app
from kvpush.services.local.ports import free_port_pair
from kvpush.services.local.stack import UvicornThread

__all__ = [
    "Call",
    "CompletionFailed",
    "EnginePair",
    "StreamResult",
    "code_prompt",
    "complete",
    "completion_body",
    "disaggregated",
    "engine_cpus",
    "external_kv_tokens",
    "free_port_pair",
    "greedy_text",
    "metric",
    "proxy_for",
    "push_decode_params",
    "push_prefill_params",
    "start_engine",
    "start_pair",
    "stream_completion",
    "wait_for_target",
]

# A prompt long enough to span several KV blocks of the tiny model (128 tokens each).
LONG_PROMPT = " ".join(
    f"def function_{i}(value):\n    return value * {i} + len(str(value))\n" for i in range(40)
)


def engine_cpus() -> tuple[str | None, str | None]:
    """Two disjoint CPU lists for prefill and decode (None when only one CPU is allowed)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return str(cpus[0]), str(cpus[-1])


def _spec(role: str, connector: str, log_dir: Path, **kw: Any) -> EngineSpec:
    port = kw.pop("port", None) or free_port_pair()
    return EngineSpec(
        role=role,
        connector=connector,
        port=port,
        engine_id=kw.pop("engine_id", f"{role}-{port}"),
        kv_cache_gib=kw.pop("kv_cache_gib", 0.5),
        log_path=log_dir / f"{role}-{port}.log",
        **kw,
    )


@contextmanager
def start_engine(
    log_dir: Path, role: str = "both", connector: str = "none", **kw: Any
) -> Iterator[EngineProcess]:
    """One running engine (stopped on exit); ``kw`` goes to :class:`EngineSpec`."""
    engine = EngineProcess(_spec(role, connector, log_dir, **kw), local_model)
    with engine:
        yield engine


@dataclass
class EnginePair:
    """A running prefill and decode engine."""

    prefill: EngineProcess
    decode: EngineProcess


@contextmanager
def start_pair(
    log_dir: Path,
    connector: str,
    prefill_kw: dict[str, Any] | None = None,
    decode_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> Iterator[EnginePair]:
    """A prefill and a decode engine on disjoint CPUs (unless ``prefill_kw`` or
    ``decode_kw`` name their ``cpus``), booted in parallel, stopped on exit; a ``role`` in
    ``kw`` (``"both"``) replaces each one's."""
    p_cpus, d_cpus = engine_cpus()
    p_kw = {"cpus": p_cpus, **kw, **(prefill_kw or {})}
    d_kw = {"cpus": d_cpus, **kw, **(decode_kw or {})}
    prefill = EngineProcess(_spec(p_kw.pop("role", "prefill"), connector, log_dir, **p_kw),
                            resolve=local_model)
    decode = EngineProcess(_spec(d_kw.pop("role", "decode"), connector, log_dir, **d_kw),
                           resolve=local_model)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        yield EnginePair(prefill, decode)
    finally:
        decode.stop()
        prefill.stop()


@contextmanager
def proxy_for(pair: EnginePair, mode: str) -> Iterator[str]:
    """A running stock-connector proxy in front of ``pair``; yields its base URL."""
    prefill = Backend(
        url=pair.prefill.url,
        engine_id=pair.prefill.engine_id,
        side_channel_host=pair.prefill.spec.host,
        side_channel_port=pair.prefill.spec.resolved_side_channel_port,
    )
    decode = Backend(url=pair.decode.url, engine_id=pair.decode.engine_id)
    front = UvicornThread(
        create_app(PDProxy(mode, prefill, decode)), "127.0.0.1", free_port_pair()
    ).start()
    try:
        yield front.url
    finally:
        front.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """Current value of a Prometheus metric of the engine at ``url`` (summed over series)."""
    return metric_sum(scrape(url), name, **labels)


def external_kv_tokens(url: str) -> float:
    """Prompt tokens the engine took from a KV transfer rather than computing them."""
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def greedy_text(url: str, prompt: str, max_tokens: int = 16, model: str = "tiny") -> str:
    """Greedy completion text of ``prompt``."""
    out = complete(
        url, {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    )
    return out["choices"][0]["text"]


def prompt_ids(url: str, prompt: str, model: str = "tiny") -> list[int]:
    """Token ids of ``prompt`` as the engine at ``url`` tokenizes it."""
    resp = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def prompt_tokens(url: str, prompt: str, model: str = "tiny") -> int:
    """Token count of ``prompt`` as the engine at ``url`` tokenizes it."""
    return len(prompt_ids(url, prompt, model))


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant that is alive now."""
    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def code_prompt(tag: str, n: int = 30) -> str:
    """A prompt of ``n`` small functions, distinct per ``tag`` (no two tags share a block)."""
    return f"# {tag}\n" + " ".join(
        f"def f_{tag}_{i}(x):\n    return x * {i} + {len(tag)}\n" for i in range(n)
    )


def push_prefill_params(rid: str, decode_engine: str, deadline_s: float = 60,
                        traceparent: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` the gateway gives a prefill leg."""
    params = {"kvpush": "prefill", "request_id": rid, "decode_engine": decode_engine,
              "deadline_ms": now_ms() + int(deadline_s * 1000)}
    if traceparent:
        params["traceparent"] = traceparent
    return params


def push_decode_params(rid: str, prefill_engine: str, deadline_s: float = 60,
                       traceparent: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` the gateway gives a decode leg."""
    params = {"kvpush": "decode", "request_id": rid, "prefill_engine": prefill_engine,
              "reservation_id": f"resv-{rid}", "fencing_token": 1,
              "deadline_ms": now_ms() + int(deadline_s * 1000)}
    if traceparent:
        params["traceparent"] = traceparent
    return params


def completion_body(prompt: str | list[int], max_tokens: int,
                    params: dict[str, Any] | None = None,
                    model: str = "tiny") -> dict[str, Any]:
    """A greedy completion request, with ``kv_transfer_params`` when given."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


class Call(threading.Thread):
    """One completion call on a thread; its result or error is read after ``join``."""

    def __init__(self, url: str, body: dict[str, Any], rid: str) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.rid = url, body, rid
        self.result: dict[str, Any] | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        headers = {"X-Request-Id": self.rid}
        tp = (self.body.get("kv_transfer_params") or {}).get("traceparent")
        if tp:
            headers["traceparent"] = tp  # vLLM's llm_request span joins the trace
        try:
            resp = httpx.post(f"{self.url}/v1/completions", json=self.body, timeout=120,
                              headers=headers)
            resp.raise_for_status()
            self.result = resp.json()
        except Exception as exc:  # surfaced by the test
            self.error = exc


def disaggregated(pair: EnginePair, prompt: str, max_tokens: int = 16,
                  decode_first: bool = False, prefill_first: bool = False,
                  rid: str | None = None, decode_params: dict[str, Any] | None = None,
                  traceparent: str | None = None, model: str = "tiny") -> tuple[str, str]:
    """Dispatch prefill and decode legs concurrently, as the gateway does; (rid, text).

    ``decode_first``: prefill starts once decode published its target (layer-wise path);
    ``prefill_first``: decode starts once prefill finished and holds its blocks.
    """
    rid = rid or f"cmpl-{uuid.uuid4().hex}"
    p = Call(pair.prefill.url, completion_body(prompt, 1, push_prefill_params(
        rid, pair.decode.engine_id, traceparent=traceparent), model), rid)
    dparams = {**push_decode_params(rid, pair.prefill.engine_id, traceparent=traceparent),
               **(decode_params or {})}
    d = Call(pair.decode.url, completion_body(prompt, max_tokens, dparams, model), rid)
    if decode_first:
        d.start()
        wait_for_target(pair, rid)
        p.start()
    elif prefill_first:
        p.start()
        p.join(180)
        d.start()
    else:
        p.start()
        d.start()
    p.join(180)
    d.join(180)
    assert p.error is None and d.error is None, (p.error, d.error)
    assert d.result is not None
    return rid, d.result["choices"][0]["text"]


def wait_for_target(pair: EnginePair, rid: str, timeout_s: float = 60) -> None:
    """Until decode has published its push target for ``rid`` on prefill's stream."""
    r = redis.Redis.from_url(pair.prefill.spec.redis_url)
    stream = RedisKeys().targets(pair.prefill.engine_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _id, fields in r.xrange(stream):
            if decode(fields[b"m"], PushTarget).request_id == rid:
                return
        time.sleep(0.02)
    raise AssertionError(f"decode never published a target for {rid}")
