"""Rolling restart of every engine of a real fleet under load via ``kvpush drain``: no failures."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.fleet_util import kvpush_up, signal_engine, until

pytestmark = pytest.mark.slow


def test_rolling_drain_restart_under_load_fails_nothing(tmp_path: Path) -> None:
    codes: list[int] = []
    stop = threading.Event()

    def load(url: str) -> None:
        """One client in a loop for the whole rolling restart."""
        with httpx.Client(timeout=120) as c:
            i = 0
            while not stop.is_set():
                r = c.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": f"# roll {i}\n" + "x = 1\n" * 20,
                    "max_tokens": 8, "temperature": 0})
                codes.append(r.status_code)
                i += 1

    with kvpush_up(tmp_path, prefill=1, decode=2) as fleet:
        loader = threading.Thread(target=load, args=(fleet.url,))
        loader.start()
        try:
            for row in fleet.rows():
                eid = row["engine_id"]
                drain = subprocess.run(
                    [sys.executable, "-m", "kvpush.services.cli", "drain", eid, "--wait",
                     "--timeout", "120"], env=dict(fleet.env, KVPUSH_REDIS_URL=fleet.redis_url),
                    capture_output=True, text=True, timeout=180)
                assert drain.returncode == 0, drain.stdout + drain.stderr
                assert "drained" in drain.stdout
                # Drained: stopping it now costs no request; the supervisor starts it again.
                signal_engine(row["url"], signal.SIGTERM)
                until(lambda eid=eid, gen=row["generation"]: next(
                    (r for r in fleet.rows() if r["engine_id"] == eid
                     and r["generation"] != gen and r["state"] == "ok"), None),
                    f"{eid} back with a new generation", 300)
                fleet.track()
        finally:
            stop.set()
            loader.join(180)
        assert codes and set(codes) == {200}, codes
