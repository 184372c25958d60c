"""Helpers for e2e tests with real vLLM CPU engines: start engines, send requests, read metrics.

Reused by every e2e test (stock pull, stock push, kvpush push): copy
``tests/test_e2e_stock_pull.py`` and change the connector.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvpush.services.engine.launcher import EngineProcess, EngineSpec
from kvpush.services.engine.status import metric_sum, scrape
from kvpush.services.local.demo import CompletionFailed, StreamResult, complete, stream_completion
from kvpush.services.local.models import resolve as local_model
from kvpush.services.local.pd_proxy import Backend, PDProxy, create_app
from kvpush.services.local.ports import free_port_pair
from kvpush.services.local.stack import UvicornThread

__all__ = [
    "CompletionFailed",
    "EnginePair",
    "StreamResult",
    "complete",
    "engine_cpus",
    "external_kv_tokens",
    "free_port_pair",
    "greedy_text",
    "metric",
    "proxy_for",
    "start_engine",
    "start_pair",
    "stream_completion",
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
    ``decode_kw`` name their ``cpus``), booted in parallel, stopped on exit."""
    p_cpus, d_cpus = engine_cpus()
    prefill = EngineProcess(
        _spec("prefill", connector, log_dir, **{"cpus": p_cpus, **kw, **(prefill_kw or {})}),
        resolve=local_model,
    )
    decode = EngineProcess(
        _spec("decode", connector, log_dir, **{"cpus": d_cpus, **kw, **(decode_kw or {})}),
        resolve=local_model,
    )
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


def prompt_tokens(url: str, prompt: str, model: str = "tiny") -> int:
    """Token count of ``prompt`` as the engine at ``url`` tokenizes it."""
    import httpx

    resp = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    resp.raise_for_status()
    return int(resp.json()["count"])


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant that is alive now."""
    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []
