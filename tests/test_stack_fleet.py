"""``kvpush up --prefill 1 --decode 2``: a real fleet on one machine that outlives an engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from kvpush.services.engine_status import metric_sum, scrape
from kvpush.services.local.ports import free_port, free_port_range
from kvpush.services.local.stack import engine_rows

pytestmark = pytest.mark.slow


def _until(pred: Callable[[], Any], what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(url: str, tag: str) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": f"# {tag}\ndef f(x):\n    return x", "max_tokens": 4,
        "temperature": 0})
    return r.status_code


def _engine_pid(port: int) -> int:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and "--port" in cmd \
                and cmd[cmd.index("--port") + 1] == str(port):
            return int(p.info["pid"])
    raise AssertionError(f"no engine process on port {port}")


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_up_runs_a_fleet_and_keeps_serving_while_an_engine_restarts(tmp_path: Path) -> None:
    api, redis_port = free_port(), free_port()
    env = dict(os.environ, KVPUSH_REDIS_URL="", KVPUSH_STACK_REDIS_PORT=str(redis_port),
               KVPUSH_STACK_PORT=str(api), KVPUSH_RUN_DIR=str(tmp_path),
               KVPUSH_STACK_PREFILL_PORT=str(free_port_range(2)),
               KVPUSH_STACK_DECODE_PORT=str(free_port_range(4)))
    url, redis_url = f"http://127.0.0.1:{api}", f"redis://127.0.0.1:{redis_port}/0"
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    engines: list[psutil.Process] = []
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli", "up",
                             "--prefill", "1", "--decode", "2"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _until(lambda: _ok(url) or proc.poll() is not None, "the stack", 300)
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        rows = _until(lambda: len(engine_rows(redis_url)) == 3 and engine_rows(redis_url),
                      "three engines registered", 30)
        decodes = sorted(r["url"] for r in rows if r["role"] == "decode")
        for r in rows:
            engines += _tree(_engine_pid(int(r["url"].rsplit(":", 1)[1])))
        assert sorted(r["role"] for r in rows) == ["decode", "decode", "prefill"]
        # The engines take requests from the stack's own front only (internal token).
        direct = httpx.post(f"{decodes[0]}/v1/completions", timeout=30,
                            json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert direct.status_code == 401

        # Concurrent requests spread over both decode engines.
        before = {u: metric_sum(scrape(u), "vllm:request_success_total") for u in decodes}

        async def burst() -> list[int]:
            import asyncio

            async with httpx.AsyncClient(timeout=120) as c:
                async def one(i: int) -> int:
                    r = await c.post(f"{url}/v1/completions", json={
                        "model": "tiny", "prompt": f"# burst {i}\n" + "x = 1\n" * 40,
                        "max_tokens": 8, "temperature": 0})
                    return r.status_code
                return list(await asyncio.gather(*(one(i) for i in range(12))))

        import asyncio

        assert asyncio.run(burst()) == [200] * 12
        served = {u: metric_sum(scrape(u), "vllm:request_success_total") - before[u]
                  for u in decodes}
        assert sum(served.values()) == 12 and all(n > 0 for n in served.values()), served

        # SIGKILL one decode engine's whole process tree: the stack keeps serving.
        victim = decodes[1]
        victim_port = int(victim.rsplit(":", 1)[1])
        old_gen = next(r["generation"] for r in rows if r["url"] == victim)
        os.killpg(os.getpgid(_engine_pid(victim_port)), signal.SIGKILL)
        _until(lambda: victim not in {r["url"] for r in engine_rows(redis_url)},
               "the dead engine withdrawn", 30)
        assert [_complete(url, f"survivor {i}") for i in range(6)] == [200] * 6
        assert proc.poll() is None

        # The supervisor restarts it: back in Redis with a new generation, serving again.
        back = _until(lambda: next((r for r in engine_rows(redis_url) if r["url"] == victim),
                                   None), "the engine restarted", 300)
        assert back["generation"] != old_gen
        engines += _tree(_engine_pid(victim_port))
        assert [_complete(url, f"after restart {i}") for i in range(4)] == [200] * 4
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    # Every engine process, the restarted one's included, is gone.
    assert [p.pid for p in engines if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE] == []
