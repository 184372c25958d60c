"""Packaging: the wheel installs one import namespace, ``kvpush``, and nothing else."""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _room_files(*rooms: str) -> list[Path]:
    return [p for room in rooms for p in sorted((REPO / room).rglob("*.py"))]


def test_imports_point_one_way() -> None:
    """The runtime never imports the local tools, the load tests or the tests; the gateway
    and the scheduler never import each other (they meet only in Redis). The command line
    is the one door to both: ``kvpush up`` and ``kvpush bench`` import their tools lazily."""
    runtime = [p for p in _room_files("common", "connector", "services")
               if not p.is_relative_to(REPO / "services" / "local")
               and not p.is_relative_to(REPO / "services" / "cli")]
    wrong = {str(p.relative_to(REPO)): sorted(
        m for m in _imports(p)
        if m.split(".")[0] == "tests" or m.startswith(("kvpush.services.local", "kvpush.loadtest")))
        for p in runtime}
    assert {p: m for p, m in wrong.items() if m} == {}
    pairs = (("services/gateway", "kvpush.services.scheduler"),
             ("services/scheduler", "kvpush.services.gateway"))
    crossing = {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.startswith(other))
                for room, other in pairs for p in _room_files(room)}
    assert {p: m for p, m in crossing.items() if m} == {}


def test_services_top_holds_only_rooms_and_shared_helpers() -> None:
    """A newcomer opening ``services/`` sees its rooms, not a flat list of modules."""
    loose = sorted(p.name for p in (REPO / "services").glob("*.py"))
    assert loose == ["__init__.py", "proc.py"]
