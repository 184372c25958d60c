"""The suite's own layout under ``make test TEST_WORKERS=N``: every test of a file (of
``e2e_tiny``: of the package) runs on one pytest-xdist worker, so a stack a file shares boots
once, and a stack built on fixed names (the fault suite's network namespaces) never has a
twin on the other worker. Checked on real workers, with this suite's own ``conftest.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

_RECORDING_TEST = '''
import os
from pathlib import Path

import pytest


@pytest.mark.parametrize("i", range(4))
def test_records_its_worker(i: int) -> None:
    out = Path(os.environ["LAYOUT_OUT"]) / f"{Path(__file__).stem}-{i}"
    out.write_text(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_each_file_and_shared_package_runs_on_one_worker(tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    (suite / "e2e_tiny").mkdir(parents=True)
    out.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    for rel in ("test_one.py", "test_two.py", "test_three.py", "e2e_tiny/test_a.py",
                "e2e_tiny/test_b.py"):
        (suite / rel).write_text(_RECORDING_TEST)
    (suite / "e2e_tiny" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadscope", "--no-loadscope-reorder", "--rootdir", str(suite), str(suite)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "LAYOUT_OUT": str(out)})
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, set[str]] = {}
    for f in out.iterdir():
        stem = f.name.rsplit("-", 1)[0]
        unit = "e2e_tiny" if stem in ("test_a", "test_b") else stem
        workers.setdefault(unit, set()).add(f.read_text())
    assert sum(1 for _ in out.iterdir()) == 20
    assert all(len(w) == 1 for w in workers.values()), workers
    # Two workers both got work: the grouping did not serialise the run.
    assert len(set().union(*workers.values())) == 2, workers
