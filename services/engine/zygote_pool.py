"""Launcher side of engine zygotes: find or start the right zygote, fork an engine from it.

A zygote serves engines whose environment, apart from variables read at run time
(:func:`import_env`), equals its own: those read while modules are imported (logging, paths,
OpenMP's unless the fork can apply them) keep the values the zygote imported with. So
zygotes are keyed by interpreter and import-time environment; one per key lives in the
pool's directory as ``<key>.sock``, started by whichever launcher needs it first.

A pool without a directory is private: its zygotes die with the launcher process. A pool
on a shared directory (``KVPUSH_ENGINE_ZYGOTE_DIR``) serves every launcher on the host, and
its zygotes leave once idle.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from kvpush.common import wire
from kvpush.services.engine.zygote import (
    OPENMP_AT_FORK,
    ZygoteProtocolError,
    openmp_at_fork,
    recv_message,
    send_message,
)
from kvpush.services.proc import child_preexec

logger = logging.getLogger(__name__)

ZYGOTE_MAIN = "kvpush.services.engine.zygote"
#: Variables an engine reads only once it runs (kvpush's settings, its NIXL side channel,
#: its API key, vLLM's per-rank CPU binding, tracing); anything else may be read at import.
RUNTIME_ENV_PREFIXES = ("KVPUSH_", "OTEL_", "PYTEST_")
RUNTIME_ENV = frozenset({
    "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_API_KEY",
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
    # torch writes its default back into the environment of a process that compiled once
    "TORCHINDUCTOR_CACHE_DIR",
})
_SHARED_IDLE_EXIT_S = 600.0


class ZygoteUnavailable(RuntimeError):
    """No zygote could fork this engine (it failed to start, or refused the request)."""


def is_interpreter(python: str) -> bool:
    """Whether ``python`` is an interpreter itself, not a wrapper script that sets up the
    engine's surroundings (a network namespace, variables) a zygote could not give it."""
    try:
        with open(shutil.which(python) or python, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that modules may read while they are imported (OpenMP's, where
    the fork can give them instead: :func:`~kvpush.services.engine.zygote.openmp_at_fork`)."""
    at_fork = OPENMP_AT_FORK if openmp_at_fork(env) else ()
    return {k: v for k, v in env.items()
            if k not in RUNTIME_ENV and k not in at_fork
            and not k.startswith(RUNTIME_ENV_PREFIXES)}


def zygote_key(python: str, env: dict[str, str]) -> str:
    """Name of the zygote that can fork engines run by ``python`` with ``env``."""
    h = hashlib.sha256(python.encode())
    for k, v in sorted(import_env(env).items()):
        h.update(b"\0" + k.encode() + b"=" + v.encode())
    return h.hexdigest()[:16]


class ForkedEngine:
    """An engine forked by a zygote, watched like a :class:`subprocess.Popen`.

    The fork happens in the background (a zygote may still be importing), so several
    engines start at once as fresh interpreters would; :attr:`pid` waits for it. The exit
    status arrives on the connection that asked for the engine, whose closing stops it.
    Should no zygote fork it, ``fallback`` starts it the ordinary way."""

    def __init__(self, fork: Callable[[], tuple[int, socket.socket]],
                 fallback: Callable[[], subprocess.Popen[bytes]] | None,
                 starter: ThreadPoolExecutor, args: list[str]) -> None:
        self.args = args
        self.returncode: int | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._resolved = threading.Event()
        threading.Thread(target=self._resolve, args=(fork, fallback, starter),
                         name="kvpush-zygote-fork", daemon=True).start()

    def _resolve(self, fork: Callable[[], tuple[int, socket.socket]],
                 fallback: Callable[[], subprocess.Popen[bytes]] | None,
                 starter: ThreadPoolExecutor) -> None:
        try:
            self._pid, self._conn = fork()
        except Exception as exc:  # whatever failed, the engine must still start
            if fallback is None:
                logger.warning("%s", exc)
                self.returncode = 1
            else:
                logger.warning("%s; starting the engine in a fresh interpreter", exc)
                try:
                    # From the long-lived starter thread: the parent-death signal follows
                    # the thread that forked.
                    self.popen = starter.submit(fallback).result()
                except Exception:
                    logger.exception("engine %s could not start", " ".join(self.args[:4]))
                    self.returncode = 1
        finally:
            self._resolved.set()

    @property
    def pid(self) -> int | None:
        """The engine's pid, once forked (None if it never started)."""
        self._resolved.wait()
        return self.popen.pid if self.popen is not None else self._pid

    def poll(self) -> int | None:
        """The exit status if the engine has exited, else None."""
        return self._check(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; raises subprocess.TimeoutExpired after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            resolved = self._resolved.wait(max(left, 0.0))
            code = self._check(max(left, 0.0)) if resolved else None
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    def _check(self, timeout: float) -> int | None:
        if not self._resolved.is_set():
            return None
        if self.popen is not None:
            try:
                return self.popen.wait(timeout) if timeout > 0 else self.popen.poll()
            except subprocess.TimeoutExpired:
                return None
        with self._lock:
            if self.returncode is not None or self._conn is None:
                return self.returncode
            try:
                ready, _, _ = select.select([self._conn], [], [], timeout)
                if not ready:
                    return None
                self._conn.settimeout(5.0)  # a whole frame follows its first byte
                reply, _ = recv_message(self._conn, wire.ZygoteReply)
            except (EOFError, ZygoteProtocolError, OSError, ValueError) as exc:
                # The zygote is gone, and its engines with it (their parent-death signal).
                return self._zygote_gone(exc)
            self.returncode = reply.returncode if reply.returncode is not None else 1
            self._conn.close()
            return self.returncode

    def _zygote_gone(self, exc: BaseException) -> int | None:
        assert self._conn is not None and self._pid is not None
        if not _alive(self._pid):
            logger.warning("engine %d: its zygote is gone (%s); exit status unknown",
                           self._pid, exc)
            self.returncode = -signal.SIGTERM
            self._conn.close()
            return self.returncode
        time.sleep(0.05)  # nothing left to wait on but the pid
        return None


class ZygotePool:
    """Zygotes in ``directory`` (shared), or in a private one that lives with this process."""

    def __init__(self, directory: Path | None = None, ready_timeout_s: float = 300.0) -> None:
        self.shared = directory is not None
        self.directory = Path(directory) if directory else Path(
            tempfile.mkdtemp(prefix="kvpush-zygotes-"))
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.ready_timeout_s = ready_timeout_s
        self._started: list[subprocess.Popen[bytes]] = []
        # The kernel's parent-death signal follows the thread that forked: zygotes are
        # started from this one, which lives as long as the process.
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="kvpush-zygote-starter")
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        if not self.shared:
            atexit.register(self.close)

    def fork(self, python: str, argv: list[str], env: dict[str, str], *, cpus: list[int] | None,
             stdout: int, stderr: int, title: str,
             fallback: Callable[[], subprocess.Popen[bytes]] | None = None) -> ForkedEngine:
        """Start an engine that runs as ``python -m kvpush.services.engine.vllm_main *argv``
        would, its output on the descriptors ``stdout`` and ``stderr`` (kept open until it
        has forked); returns at once. Without a zygote to fork it, ``fallback`` starts it."""
        request = wire.ZygoteFork(argv=argv, env=env, cwd=os.getcwd(), cpus=cpus, title=title)

        def fork() -> tuple[int, socket.socket]:
            key = zygote_key(python, env)
            conn = self.connect(python, env)
            try:
                send_message(conn, request, [stdout, stderr])
                conn.settimeout(30.0)
                reply, _ = recv_message(conn, wire.ZygoteReply)
            except (OSError, EOFError, ZygoteProtocolError) as exc:
                conn.close()
                raise ZygoteUnavailable(f"zygote {key}: {exc}") from exc
            if reply.pid is None:
                conn.close()
                raise ZygoteUnavailable(f"zygote {key} refused: {reply.error}")
            return reply.pid, conn

        return ForkedEngine(fork, fallback, self._starter, title.split())

    def connect(self, python: str, env: dict[str, str]) -> socket.socket:
        """A connection to the zygote for ``python`` and ``env``, started if there is none."""
        key = zygote_key(python, env)
        path = self.directory / f"{key}.sock"
        with contextlib.suppress(OSError):
            return _connect(path)
        # One launcher starts a missing zygote; the others wait on the lock, then connect.
        with self._key_lock(key), open(self.directory / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(OSError):
                return _connect(path)
            proc = self._starter.submit(self._start, key, python, env).result()
            deadline = time.monotonic() + self.ready_timeout_s
            while True:
                try:
                    return _connect(path)
                except OSError:
                    pass
                if proc.poll() is not None:
                    raise ZygoteUnavailable(
                        f"zygote {key} exited with {proc.returncode}; see "
                        f"{self.directory / f'{key}.log'}")
                if time.monotonic() > deadline:
                    raise ZygoteUnavailable(f"zygote {key} not ready in {self.ready_timeout_s} s")
                time.sleep(0.1)

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _start(self, key: str, python: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.directory / f"{key}.log", "ab")  # noqa: SIM115 - handed to the child
        with log:
            proc = subprocess.Popen(
                [python, "-m", ZYGOTE_MAIN, "--socket", str(self.directory / f"{key}.sock"),
                 "--idle-exit-s", str(_SHARED_IDLE_EXIT_S if self.shared else 0)],
                env=import_env(env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                # A private zygote dies with this process; a shared one outlives it.
                preexec_fn=None if self.shared else child_preexec,
            )
        (self.directory / f"{key}.pid").write_text(str(proc.pid))
        logger.info("started engine zygote %s (pid %d) in %s", key, proc.pid, self.directory)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        """Stop the zygotes of a private pool (a shared pool's stay for other launchers)."""
        if self.shared:
            return
        for proc in self._started:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self._started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self._started.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_zygotes(directory: Path, timeout_s: float = 10.0) -> int:
    """Stop every zygote of a shared ``directory``; how many were running."""
    procs = []
    for pidfile in Path(directory).glob("*.pid"):
        sock = str(pidfile.with_suffix(".sock"))
        with contextlib.suppress(ValueError, OSError, psutil.Error):
            proc = psutil.Process(int(pidfile.read_text()))
            if ZYGOTE_MAIN in proc.cmdline() and sock in proc.cmdline():  # not a reused pid
                proc.terminate()
                procs.append(proc)
    deadline = time.monotonic() + timeout_s
    while any(_alive(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(procs)


_POOLS: dict[Path | None, ZygotePool] = {}
_POOLS_LOCK = threading.Lock()


def zygote_pool(directory: Path | None) -> ZygotePool:
    """This process's pool on ``directory`` (None: its private pool)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(directory)
        if pool is None:
            pool = _POOLS[directory] = ZygotePool(directory)
        return pool
