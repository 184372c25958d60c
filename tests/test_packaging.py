"""Packaging: the wheel installs one import namespace, ``kvpush``, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_the_kvpush_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        check=True, cwd=tmp_path, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("kvpush-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"kvpush", next(t for t in tops if t.endswith(".dist-info"))}
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvpush/connector/push_connector.py" in names
    assert "kvpush/common/quotas.lua" in names
    assert "kvpush/services/gateway/app.py" in names
    assert "kvpush/services/scheduler/loop.py" in names
    assert not any(n.startswith("kvpush/tests") for n in names)
