"""Engine zygotes: an engine forked from a warm zygote is the process a fresh interpreter
would have been (command line, session, CPUs, environment, output, exit status), dies with
the launcher that asked for it, and a hostile peer on the zygote's socket changes nothing.

The engines here fork from the session's zygotes (tests/conftest.py), so each boots in a
few seconds; the one that serves HTTP is the only full engine start this file adds."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kvpush.common import wire
from kvpush.services.engine.launcher import ENGINE_MAIN, EngineProcess, EngineSpec
from kvpush.services.engine.zygote import Zygote, recv_message, send_message
from kvpush.services.engine.zygote_pool import (
    ZYGOTE_MAIN,
    ForkedEngine,
    ZygotePool,
    import_env,
    zygote_key,
    zygote_pool,
)
from kvpush.services.local.models import resolve as local_model
from tests.e2e_util import free_port_pair
from tests.polling import alive, until

pytestmark = pytest.mark.slow


def _pool_dir() -> Path:
    return Path(os.environ["KVPUSH_ENGINE_ZYGOTE_DIR"])


def _env() -> dict[str, str]:
    """An engine's environment, pinned like the other engines here (one zygote for all)."""
    return EngineSpec(heartbeat=False, cpus="0").env()


def test_a_zygote_is_keyed_by_what_imports_read_not_by_per_engine_settings() -> None:
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "KVPUSH_REDIS_URL": "redis://a",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "OTEL_RESOURCE_ATTRIBUTES": "x=1",
           "VLLM_API_KEY": "secret"}
    key = zygote_key("/py", env)
    other_engine = {**env, "KVPUSH_REDIS_URL": "redis://b", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5602",
                    "OTEL_RESOURCE_ATTRIBUTES": "x=2", "VLLM_API_KEY": "other"}
    assert zygote_key("/py", other_engine) == key
    assert import_env(env) == {"PATH": "/bin"}
    # Engines pinned to other cores share the zygote: the fork applies a thread count and
    # one place. OpenMP reads anything else when torch loads, so it keys the zygote.
    assert zygote_key("/py", {**env, "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}",
                              "OMP_PROC_BIND": "true"}) == key
    assert zygote_key("/py", {**env, "OMP_PLACES": "{0},{1}"}) != key
    assert zygote_key("/py", {**env, "OMP_PROC_BIND": "spread"}) != key
    assert zygote_key("/other/python", env) != key


def test_a_fork_gives_the_engine_the_openmp_threads_and_cores_its_zygote_imported_without(
) -> None:
    """libgomp reads ``OMP_*`` once, when torch loads: an engine forked from a zygote that
    imported without them still runs the thread count and the place it asked for."""
    code = textwrap.dedent("""
        import os, torch
        from kvpush.services.engine.zygote import apply_openmp_env
        pid = os.fork()
        if pid == 0:
            os.environ.update(OMP_NUM_THREADS="1", OMP_PLACES="{1}", OMP_PROC_BIND="true")
            apply_openmp_env()
            torch.ones(256, 256) @ torch.ones(256, 256)
            ok = torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {1}
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]


def test_a_forked_engine_is_the_process_a_fresh_interpreter_would_be(tmp_path: Path) -> None:
    port = free_port_pair()
    log = tmp_path / "engine.log"
    spec = EngineSpec(role="both", connector="none", port=port, engine_id="zyg-a", cpus="0",
                      heartbeat=False, api_key="zyg-token", log_path=log)
    engine = EngineProcess(spec, resolve=local_model)
    with engine:
        proc = engine.proc
        assert isinstance(proc, ForkedEngine)
        pid = proc.pid
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        assert f"-m {ENGINE_MAIN} " in cmd and f"--port {port}" in cmd and "taskset" not in cmd
        assert ZYGOTE_MAIN in " ".join(p.parent().cmdline()), "forked by a zygote"
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid, "a session of its own"
        assert p.cpu_affinity() == [0]
        assert p.cwd() == os.getcwd()
        # Its own environment: the API key it was given, which the zygote never had.
        assert "VLLM_API_KEY" not in psutil.Process(p.parent().pid).environ()
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        ok = httpx.get(url, headers={"Authorization": "Bearer zyg-token"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
        # vLLM's engine core is forked from the API server as in a fresh interpreter.
        core = p.children()
        assert [c.name() for c in core] == ["VLLM::EngineCore"]
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        assert proc.poll() is None
    # stop() sent SIGTERM to the group; the status came back over the connection.
    assert proc.returncode is not None
    assert alive([p, *core]) == []
    text = log.read_text()
    assert "Starting vLLM" in text or "vLLM API server" in text, text[-2000:]
    assert "spawned, not forked" not in text


def test_an_engine_that_fails_reports_its_exit_status(tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as out:
        proc = zygote_pool(_pool_dir()).fork(
            sys.executable, ["--max-model-len", "not-a-number"], _env(), cpus=None,
            stdout=out.fileno(), stderr=out.fileno(), title=f"python -m {ENGINE_MAIN}")
        assert proc.wait(60) == 2  # argparse's usage error
    assert "max-model-len" in (tmp_path / "out.log").read_text()


def test_an_engine_no_zygote_can_fork_starts_the_ordinary_way(tmp_path: Path) -> None:
    """A zygote that cannot start (here an "interpreter" that exits at once) costs the
    engine nothing but the wait: the launcher's own start takes over."""
    pool = ZygotePool(tmp_path / "zygotes")
    with open(tmp_path / "out.log", "wb") as out:
        proc = pool.fork("/bin/false", [], _env(), cpus=None, stdout=out.fileno(),
                         stderr=out.fileno(), title="false",
                         fallback=lambda: subprocess.Popen(["sh", "-c", "exit 7"]))
        assert proc.wait(60) == 7
    assert proc.popen is not None and proc.pid == proc.popen.pid
    orphan = pool.fork("/bin/false", [], _env(), cpus=None, stdout=1, stderr=2, title="x")
    assert orphan.wait(60) == 1 and orphan.pid is None


_LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvpush.services.engine.launcher import EngineProcess, EngineSpec
    from kvpush.services.local.models import resolve
    spec = EngineSpec(role="both", connector="none", port=int(sys.argv[1]), cpus="0",
                      engine_id="zyg-orphan", heartbeat=False, log_path=Path(sys.argv[2]))
    engine = EngineProcess(spec, resolve).start().wait_ready()
    print(engine.pid, flush=True)
    time.sleep(600)
""")


def test_a_forked_engine_dies_with_its_sigkilled_launcher(tmp_path: Path) -> None:
    """The launcher is gone without a word: its connection to the zygote closes, and the
    zygote stops the engine it forked for it (SIGTERM, as the parent-death signal would)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(free_port_pair()), str(tmp_path / "e.log")],
        stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(launcher.stdout.readline()))  # type: ignore[union-attr]
        tree = [server, *server.children(recursive=True)]
        zygote = server.parent()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        until(lambda: not alive(tree), "the engine stopped", timeout_s=30, step_s=0.2)
        assert zygote.is_running(), "a shared zygote outlives its launchers"
    finally:
        launcher.kill()
        launcher.wait()


def test_an_orphaned_engine_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    """An engine still starting does not act on SIGTERM (vLLM's API server, like this
    shell); the zygote kills its process group once the grace has passed. The zygote's
    bookkeeping runs here on a real process group of its own."""
    engine = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 120 & wait"],
                              start_new_session=True)
    zygote = Zygote("/unused", idle_exit_s=0, stop_grace_s=0.5)
    ours, theirs = socket.socketpair()
    theirs.close()
    try:
        zygote.engines[engine.pid] = ours
        shell = psutil.Process(engine.pid)
        until(lambda: len(shell.children()) == 1, "the group formed", 10, step_s=0.2)
        group = [shell, *shell.children()]
        zygote._launcher_gone(ours, engine.pid)  # SIGTERM: ignored
        time.sleep(0.3)
        zygote._kill_overdue()
        assert engine.poll() is None, "still in its grace"
        time.sleep(0.4)
        zygote._kill_overdue()  # SIGKILL to the group
        assert engine.wait(10) == -signal.SIGKILL
        until(lambda: not alive(group), "the whole group killed", 10, step_s=0.2)
    finally:
        engine.kill()
        engine.wait()


_PRIVATE_LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvpush.services.engine.launcher import EngineProcess, EngineSpec
    from kvpush.services.engine.zygote_pool import zygote_pool
    from kvpush.services.local.models import resolve
    spec = EngineSpec(role="both", connector="none", port=int(sys.argv[1]), cpus="0",
                      heartbeat=False, log_path=Path(sys.argv[2]))
    engine = EngineProcess(spec, resolve).start().wait_ready()
    print(engine.pid, zygote_pool(None).directory, flush=True)
    sys.stdin.readline()
""")


def test_a_launchers_own_zygote_dies_with_it_and_takes_its_engine() -> None:
    """Without a shared directory (``kvpush up`` by default), a launcher's zygotes are its
    own: SIGKILL the launcher and the zygote gets its parent-death signal, and the engine
    it forked its own. Boots a zygote of its own: what it tests is that it is not the
    session's."""
    env = {k: v for k, v in os.environ.items() if k != "KVPUSH_ENGINE_ZYGOTE_DIR"}
    launcher = subprocess.Popen(
        [sys.executable, "-c", _PRIVATE_LAUNCHER, str(free_port_pair()), os.devnull],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid, _ = launcher.stdout.readline().split()  # type: ignore[union-attr]
        engine = psutil.Process(int(pid))
        zygote = engine.parent()
        assert zygote.parent().pid == launcher.pid, "the launcher's own zygote"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        until(lambda: not alive([engine, zygote]), "engine and zygote gone", 60, step_s=0.2)
    finally:
        launcher.kill()
        launcher.wait()


def test_a_hostile_peer_gets_refused_and_the_zygote_keeps_forking(tmp_path: Path) -> None:
    pool = zygote_pool(_pool_dir())
    env = _env()

    def refused(payload: bytes, fds: list[int] | None = None) -> str:
        with pool.connect(sys.executable, env) as conn:
            conn.settimeout(10)
            if fds:
                socket.send_fds(conn, [payload], fds)
            else:
                conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            reply, _ = recv_message(conn, wire.ZygoteReply)
        assert reply.pid is None and reply.error
        return reply.error

    good = wire.encode(wire.ZygoteFork(argv=[], env={}, cwd="/"))
    frame = struct.pack("!I", len(good)) + good
    with open(os.devnull, "wb") as null:
        assert "descriptors" in refused(frame)  # no stdout/stderr came with it
        assert "descriptors" in refused(frame, [null.fileno()])
        assert "malformed" in refused(struct.pack("!I", 5) + b"\xc1junk", [null.fileno()] * 2)
        assert "exceeds" in refused(struct.pack("!I", 1 << 30), [null.fileno()] * 2)
        assert "closed" in refused(struct.pack("!I", 100) + b"short", [null.fileno()] * 2)
        bad_env = wire.encode(wire.ZygoteFork(argv=[], env={}, cwd="/")).replace(b"env", b"ENV")
        refused(struct.pack("!I", len(bad_env)) + bad_env, [null.fileno()] * 2)
    with pool.connect(sys.executable, env):
        pass  # connected and left at once
    # Still forking, and its engine's output goes where its launcher said.
    with open(tmp_path / "out.log", "wb") as out:
        proc = pool.fork(sys.executable, ["--max-model-len", "not-a-number"], env, cpus=None,
                         stdout=out.fileno(), stderr=out.fileno(), title="probe")
        assert proc.wait(60) == 2


def test_a_fork_request_names_its_engine_by_the_wire_schema() -> None:
    """The request and its reply are versioned wire messages, refused on another version."""
    a, b = socket.socketpair()
    with a, b:
        send_message(a, wire.ZygoteReply(pid=7, returncode=-15))
        reply, fds = recv_message(b, wire.ZygoteReply)
        assert (reply.pid, reply.returncode, fds) == (7, -15, [])
        stale = wire.encode(wire.ZygoteReply(v=wire.SCHEMA_VERSION + 1, pid=7))
        a.sendall(struct.pack("!I", len(stale)) + stale)
        with pytest.raises(Exception, match="schema version"):
            recv_message(b, wire.ZygoteReply)
