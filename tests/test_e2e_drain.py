"""Rolling restart of every engine of a real fleet under load via ``kvpush drain``: no failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvpush.services.local.ports import free_port, free_port_range
from kvpush.services.local.stack import engine_rows
from tests.test_stack_fleet import _engine_pid, _ok, _until

pytestmark = pytest.mark.slow


def test_rolling_drain_restart_under_load_fails_nothing(tmp_path: Path) -> None:
    api, redis_port = free_port(), free_port()
    env = dict(os.environ, KVPUSH_REDIS_URL="", KVPUSH_STACK_REDIS_PORT=str(redis_port),
               KVPUSH_STACK_PORT=str(api), KVPUSH_RUN_DIR=str(tmp_path),
               KVPUSH_STACK_PREFILL_PORT=str(free_port_range(2)),
               KVPUSH_STACK_DECODE_PORT=str(free_port_range(4)))
    url, redis_url = f"http://127.0.0.1:{api}", f"redis://127.0.0.1:{redis_port}/0"
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli", "up",
                             "--prefill", "1", "--decode", "2"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    codes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        """One client in a loop for the whole rolling restart."""
        with httpx.Client(timeout=120) as c:
            i = 0
            while not stop.is_set():
                r = c.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": f"# roll {i}\n" + "x = 1\n" * 20,
                    "max_tokens": 8, "temperature": 0})
                codes.append(r.status_code)
                i += 1

    loader = threading.Thread(target=load)
    try:
        _until(lambda: _ok(url) or proc.poll() is not None, "the stack", 300)
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        rows = _until(lambda: len(engine_rows(redis_url)) == 3 and engine_rows(redis_url),
                      "three engines registered", 30)
        loader.start()
        for row in rows:
            eid, port = row["engine_id"], int(row["url"].rsplit(":", 1)[1])
            drain = subprocess.run(
                [sys.executable, "-m", "kvpush.services.cli", "drain", eid, "--wait",
                 "--timeout", "120"], env=dict(env, KVPUSH_REDIS_URL=redis_url),
                capture_output=True, text=True, timeout=180)
            assert drain.returncode == 0, drain.stdout + drain.stderr
            assert "drained" in drain.stdout
            # Drained: stopping it now costs no request; the supervisor starts it again.
            os.killpg(os.getpgid(_engine_pid(port)), signal.SIGTERM)
            _until(lambda eid=eid, gen=row["generation"]: next(
                (r for r in engine_rows(redis_url) if r["engine_id"] == eid
                 and r["generation"] != gen and r["state"] == "ok"), None),
                f"{eid} back with a new generation", 300)
        stop.set()
        loader.join(180)
        assert codes and set(codes) == {200}, codes
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
