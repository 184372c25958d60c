"""The locustfile, headless, against a real vLLM CPU engine: its custom metrics and reports.

It runs on the package's decode engine (requests without transfer parameters are served
whole, as by any engine), so no engine boots for it alone; its random token-id prompts
share no prefix block with the other modules' text prompts.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.engine.launcher import EngineProcess

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def engine(stack: dict[str, Any]) -> EngineProcess:
    """The package's decode engine, for both load modes (each run's requests are its own)."""
    return stack["pair"].decode


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_locust_headless_reports_ttft_tpot_itl(tmp_path: Path, mode: str,
                                               engine: EngineProcess) -> None:
    prefix = tmp_path / "run"
    extra = ["--qps", "2"] if mode == "open" else []
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest/locustfile.py"),
         "--host", engine.url, "--headless", "-u", "2", "-r", "2", "-t", "12s",
         "--csv", str(prefix), "--html", str(tmp_path / "report.html"),
         "--input-len", "64", "--output-len", "8", "--seed", "7", *extra,
         "--stop-timeout", "20"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    completions = rows["/v1/completions"]
    assert int(completions["Request Count"]) > 0
    assert int(completions["Failure Count"]) == 0
    n = int(completions["Request Count"])
    # One E2E sample per successful request; TTFT/TPOT for those whose tokens had text (a
    # random-weight model now and then generates 8 tokens that detokenize to nothing), and
    # up to 7 gaps between 8 tokens' chunks; all under "anon" since no API key was given.
    timed = int(rows["TTFT [anon]"]["Request Count"])
    assert int(rows["E2E [anon]"]["Request Count"]) == n
    assert n // 2 < timed <= n
    assert int(rows["TPOT [anon]"]["Request Count"]) <= timed
    assert 0 < int(rows["ITL [anon]"]["Request Count"]) <= 7 * timed
    assert float(rows["TTFT [anon]"]["Average Response Time"]) > 0
    assert (tmp_path / "report.html").stat().st_size > 1000
