"""Helpers for the slow tests that run a real fleet with ``kvpush up --prefill N --decode M``:
launch and stop it, wait for it, find and signal its engines, send requests through it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.reservations import live_reservations
from kvpush.services.engine.launcher import ENGINE_MAIN
from kvpush.services.engine.status import MetricsUnavailable, metric_sum, scrape
from kvpush.services.local.ports import free_port, free_port_range
from kvpush.services.local.stack import engine_rows
from tests.polling import alive, until


def healthy(url: str) -> bool:
    """Whether the stack's front at ``url`` answers ``/health`` with 200."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def engine_pid(port: int) -> int:
    """Pid of the vLLM API server listening on ``port`` (raises when there is none)."""
    pid = find_engine_pid(port)
    if pid is None:
        raise AssertionError(f"no engine process on port {port}")
    return pid


def find_engine_pid(port: int) -> int | None:
    """Pid of the vLLM API server listening on ``port``, None when there is none."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if ENGINE_MAIN in cmd and "--port" in cmd \
                and cmd[cmd.index("--port") + 1] == str(port):
            return int(p.info["pid"])
    return None


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def port_of(url: str) -> int:
    """The port of an engine URL (``http://127.0.0.1:PORT``)."""
    return int(url.rsplit(":", 1)[1])


def signal_engine(url: str, sig: signal.Signals) -> None:
    """Send ``sig`` to the whole process group of the engine at ``url`` (server, core,
    workers)."""
    os.killpg(os.getpgid(engine_pid(port_of(url))), sig)


@dataclass
class Fleet:
    """A running ``kvpush up``: its front, its Redis, its engines as registered in Redis."""

    url: str
    redis_url: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    engines: list[psutil.Process] = field(default_factory=list)
    """Every engine process seen (restarted ones included once :meth:`track` saw them)."""

    def rows(self) -> list[dict[str, Any]]:
        """The engines registered in Redis (``kvpush status``)."""
        return engine_rows(self.redis_url)

    def urls(self, role: str) -> list[str]:
        """Sorted URLs of the registered engines of ``role``."""
        return sorted(r["url"] for r in self.rows() if r["role"] == role)

    def track(self) -> None:
        """Remember the processes of every engine now registered (for the leak check)."""
        for r in self.rows():
            pid = find_engine_pid(port_of(r["url"]))
            if pid is not None:
                known = {p.pid for p in self.engines}
                self.engines += [p for p in process_tree(pid) if p.pid not in known]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def complete(self, tag: str, max_tokens: int = 4) -> int:
        """One short greedy completion through the front; its HTTP status."""
        r = httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": f"# {tag}\ndef f(x):\n    return x",
            "max_tokens": max_tokens, "temperature": 0})
        return r.status_code

    def gateway_metric(self, name: str, **labels: str) -> float:
        """A metric of the front's gateway (the local stack exposes /metrics)."""
        return metric_sum(scrape(self.url), name, **labels)

    def targets(self, prefill_id: str) -> int:
        """Push targets decode published for prefill ``prefill_id`` so far (one per request
        placed on it)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.xlen(RedisKeys().targets(prefill_id)))
        finally:
            client.close()

    def reservations(self) -> list[str]:
        """Reservations live in Redis right now."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            return [f"{x.engine_id}/{x.reservation_id}" for x in live_reservations(client)]
        finally:
            client.close()

    def engines_busy(self) -> dict[str, str]:
        """Engines that hold KV blocks or requests right now (empty when all are idle)."""
        busy = {}
        for r in self.rows():
            try:
                s = scrape(r["url"], timeout_s=5)
            except MetricsUnavailable as exc:
                busy[r["url"]] = f"unreadable: {exc}"
                continue
            used = metric_sum(s, "vllm:kv_cache_usage_perc")
            running = metric_sum(s, "vllm:num_requests_running")
            waiting = metric_sum(s, "vllm:num_requests_waiting")
            if used or running or waiting:
                busy[r["url"]] = f"usage {used:.3f}, running {running:.0f}, waiting {waiting:.0f}"
        return busy

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Until no reservation is left in Redis and no engine holds blocks or requests."""
        until(lambda: not self.reservations() and not self.engines_busy(),
              "no reservations and idle engines", timeout_s)


@contextmanager
def kvpush_up(tmp_path: Path, prefill: int, decode: int, boot_s: float = 300,
              args: tuple[str, ...] = (), max_decode: int = 0, **env: str) -> Iterator[Fleet]:
    """``kvpush up --prefill N --decode M`` in its own session, on free ports, until every
    engine is registered; stopped with SIGINT on exit (SIGKILL to its group past 90 s).

    On a clean exit it asserts that the stack exited 0 and that every engine process seen
    (:meth:`Fleet.track`) is gone. ``args``: more flags for ``kvpush up``; ``max_decode``:
    decode engines the stack may grow to (their ports are kept free too)."""
    api, redis_port = free_port(), free_port()
    full_env = dict(os.environ, KVPUSH_REDIS_URL="", KVPUSH_STACK_REDIS_PORT=str(redis_port),
                    KVPUSH_STACK_PORT=str(api), KVPUSH_RUN_DIR=str(tmp_path),
                    KVPUSH_STACK_PREFILL_PORT=str(free_port_range(2 * prefill)),
                    KVPUSH_STACK_DECODE_PORT=str(free_port_range(2 * max(decode, max_decode))),
                    **env)
    log_path = tmp_path / "up.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli", "up",
                             "--prefill", str(prefill), "--decode", str(decode), *args],
                            env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    fleet = Fleet(f"http://127.0.0.1:{api}", f"redis://127.0.0.1:{redis_port}/0", full_env,
                  proc, log_path)
    try:
        until(lambda: healthy(fleet.url) or proc.poll() is not None, "the stack", boot_s)
        assert proc.poll() is None, fleet.log_tail()
        roles = ["decode"] * decode + ["prefill"] * prefill
        until(lambda: sorted(r["role"] for r in fleet.rows()) == roles,
              f"{prefill} prefill and {decode} decode engines registered", 30)
        fleet.track()
        yield fleet
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
    assert proc.returncode == 0, fleet.log_tail()
    assert alive(fleet.engines) == [], "engine processes left behind"


def stream_request(client: httpx.Client, url: str, prompt: str, max_tokens: int
                   ) -> dict[str, Any]:
    """One streamed completion: its status, the text tokens received, whether it ended
    with ``[DONE]``, and an error (status line or SSE error event) if any."""
    out: dict[str, Any] = {"status": None, "tokens": 0, "done": False, "error": None}
    try:
        with client.stream("POST", f"{url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True}) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["error"] = resp.read().decode(errors="replace")[:300]
                return out
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    out["error"] = str(msg["error"])[:300]
                    return out
                if (msg.get("choices") or [{}])[0].get("text"):
                    out["tokens"] += 1
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def burst(url: str, n: int, lines: int, tag: str) -> list[httpx.Response]:
    """``n`` concurrent completions of ``lines``-line prompts tagged ``tag``."""
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int) -> httpx.Response:
            return await c.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"# {tag} {i}\n" + "x = 1\n" * lines,
                "max_tokens": 8, "temperature": 0})
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def served(urls: list[str]) -> dict[str, float]:
    """Requests each engine at ``urls`` has served so far."""
    return {u: metric_sum(scrape(u), "vllm:request_success_total") for u in urls}
