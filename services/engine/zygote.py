"""A warm engine zygote: one interpreter that has imported vLLM and forks engines on request.

Most of an engine's start is importing torch, transformers and vLLM's API server: about
10 s of CPU on this machine, on every start, restart and scale-up, before the engine does
any work. A zygote pays it once. Launchers (services/engine/zygote_pool.py) connect to its
Unix socket and send a :class:`~kvpush.common.wire.ZygoteFork` with the engine's stdout and
stderr; the zygote forks, and the child becomes the engine process exactly as
``python -m kvpush.services.engine.vllm_main`` would (own session, environment, working
directory, CPUs, command line in ``ps``), then runs it.

The zygote runs no thread of its own, so a fork copies no lock that some other thread holds.
Modules that read the environment when imported saw the zygote's: a launcher uses a zygote
only for engines whose environment differs from it in variables read at run time
(:func:`~kvpush.services.engine.zygote_pool.import_env`). OpenMP's thread count and a single
place are the exception (:func:`openmp_at_fork`): they are given to the child at run time,
so engines pinned to different cores share one zygote.

An engine lives no longer than the connection of the launcher that asked for it: when that
closes (the launcher exited or was killed), the zygote sends the engine's process group
SIGTERM, the parent-death signal a directly started engine gets, and SIGKILL if it is
still there after a grace (an engine still starting may ignore SIGTERM). It also dies with
the zygote (its own parent-death signal). The zygote leaves once it has had no engine for
``--idle-exit-s``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Mapping
from typing import TypeVar

from kvpush.common import wire

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_FDS = 2  # the engine's stdout and stderr
_REQUEST_TIMEOUT_S = 5.0
M = TypeVar("M", bound=wire.Message)


class ZygoteProtocolError(RuntimeError):
    """A peer broke the zygote protocol (short read, bad frame, missing descriptors)."""


# -- framing: a 4-byte length, then the msgpack message ------------------------------------


def send_message(sock: socket.socket, msg: wire.Message, fds: list[int] | None = None) -> None:
    """Send ``msg`` as one frame, with ``fds`` passed alongside its first byte."""
    data = wire.encode(msg)
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise EOFError("connection closed mid-frame" if left < n else "connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, cls: type[M], max_fds: int = 0) -> tuple[M, list[int]]:
    """One frame from ``sock`` decoded as ``cls``, with the descriptors that came with it.

    Raises EOFError when the peer closed before a frame, ZygoteProtocolError on a bad one
    (descriptors received with a bad frame are closed)."""
    fds: list[int] = []
    if max_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not head:
            raise EOFError("connection closed")
    else:
        head = b""
    try:
        head += _recv_exact(sock, _HEADER.size - len(head))
        (n,) = _HEADER.unpack(head)
        if n > wire.MAX_MESSAGE_BYTES:
            raise ZygoteProtocolError(f"frame of {n} bytes exceeds {wire.MAX_MESSAGE_BYTES}")
        return wire.decode(_recv_exact(sock, n), cls), fds
    except (wire.WireError, EOFError, OSError) as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, EOFError) and not head:
            raise
        raise ZygoteProtocolError(str(exc)) from exc
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# -- the zygote ----------------------------------------------------------------------------


#: OpenMP's variables as the launcher sets them for an engine pinned to its cores.
OPENMP_AT_FORK = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")
_ONE_PLACE = re.compile(r"\{(\d+(?:,\d+)*)\}")


def openmp_at_fork(env: Mapping[str, str]) -> bool:
    """Whether a forked engine can be given ``env``'s OpenMP settings at run time.

    libgomp reads its variables once, when torch loads it in the zygote. A thread count can
    be set later (``omp_set_num_threads``), and threads bound to one place are threads
    confined to that place's cores, which the process's CPU affinity does for every thread
    it starts. Several places, or another binding policy, only an import can give."""
    threads = env.get("OMP_NUM_THREADS", "1")
    places = env.get("OMP_PLACES")
    return (threads.isdigit() and int(threads) > 0
            and env.get("OMP_PROC_BIND", "true").lower() == "true"
            and (places is None or _ONE_PLACE.fullmatch(places.strip()) is not None))


def apply_openmp_env() -> None:
    """Give this forked engine what its OpenMP variables ask for, where its zygote imported
    without them (:func:`openmp_at_fork`)."""
    if not openmp_at_fork(os.environ):
        return  # the zygote imported with these very values
    places = os.environ.get("OMP_PLACES")
    if places:
        match = _ONE_PLACE.fullmatch(places.strip())
        assert match is not None
        os.sched_setaffinity(0, {int(c) for c in match.group(1).split(",")})
    if threads := os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))


def preload() -> None:
    """Import what every engine imports before it does any work."""
    # Found at import, and only then, the argv and environment a child's title replaces.
    import setproctitle  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401

    import kvpush.services.engine.vllm_main  # noqa: F401

    # The engine runs the API server's module as __main__, as a fresh interpreter would:
    # its imports stay, the module itself runs anew in each child.
    del sys.modules["vllm.entrypoints.openai.api_server"]


class Zygote:
    """Serves fork requests on ``path`` until idle for ``idle_exit_s`` (0: never); an
    engine whose launcher is gone gets ``stop_grace_s`` between SIGTERM and SIGKILL."""

    def __init__(self, path: str, idle_exit_s: float, stop_grace_s: float = 15.0) -> None:
        self.path = path
        self.idle_exit_s = idle_exit_s
        self.stop_grace_s = stop_grace_s
        self.kill_at: dict[int, float] = {}
        self.pid = os.getpid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.selector = selectors.DefaultSelector()
        #: live engines, each with the connection of the launcher that asked for it
        self.engines: dict[int, socket.socket | None] = {}
        self.last_active = time.monotonic()

    def serve(self) -> None:
        """Listen and fork until idle; the socket file is removed on the way out."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ)
        logger.info("engine zygote %d ready on %s", self.pid, self.path)
        try:
            while not self._idle():
                for key, _ in self.selector.select(0.2):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._launcher_readable(key.fileobj, key.data)  # type: ignore[arg-type]
                self._reap()
                self._kill_overdue()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            logger.info("engine zygote %d leaving (%d engines left)", self.pid,
                        len(self.engines))

    def _idle(self) -> bool:
        return (self.idle_exit_s > 0 and not self.engines
                and time.monotonic() - self.last_active > self.idle_exit_s)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        self.last_active = time.monotonic()
        conn.settimeout(_REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]
            if uid != os.getuid():
                raise ZygoteProtocolError(f"peer uid {uid} is not this zygote's")
            req, fds = recv_message(conn, wire.ZygoteFork, max_fds=_FDS)
            if len(fds) != _FDS:
                raise ZygoteProtocolError(f"{len(fds)} descriptors, want {_FDS}")
            pid = self._fork(req, fds, conn)
        except (ZygoteProtocolError, EOFError, OSError) as exc:
            logger.warning("engine zygote: refused a request: %s", exc)
            with contextlib.suppress(OSError):
                send_message(conn, wire.ZygoteReply(error=str(exc)))
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.engines[pid] = conn
        try:
            send_message(conn, wire.ZygoteReply(pid=pid))
        except OSError:
            self._launcher_gone(conn, pid)
            return
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _launcher_readable(self, conn: socket.socket, pid: int) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            logger.warning("engine zygote: launcher of engine %d sent unexpected bytes", pid)
            return
        self._launcher_gone(conn, pid)

    def _launcher_gone(self, conn: socket.socket, pid: int) -> None:
        """The launcher of ``pid`` is gone: stop the engine, as its parent's death would."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        conn.close()
        if pid in self.engines:
            self.engines[pid] = None
            logger.warning("engine zygote: launcher of engine %d gone; stopping it", pid)
            self._signal(pid, signal.SIGTERM)
            self.kill_at[pid] = time.monotonic() + self.stop_grace_s

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    def _kill_overdue(self) -> None:
        """SIGKILL the orphaned engines that outlived their grace (one still starting may
        not act on SIGTERM at all)."""
        now = time.monotonic()
        for pid, at in list(self.kill_at.items()):
            if pid not in self.engines:
                del self.kill_at[pid]
            elif now > at:
                logger.warning("engine zygote: engine %d ignored SIGTERM; killing it", pid)
                self._signal(pid, signal.SIGKILL)
                del self.kill_at[pid]

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.last_active = time.monotonic()
            conn = self.engines.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(_REQUEST_TIMEOUT_S)
                send_message(conn, wire.ZygoteReply(
                    pid=pid, returncode=os.waitstatus_to_exitcode(status)))
            conn.close()

    def _fork(self, req: wire.ZygoteFork, fds: list[int], conn: socket.socket) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            conn.close()
            code = self._become_engine(req, fds)
        except BaseException:  # the child must never return into the zygote's loop
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _become_engine(self, req: wire.ZygoteFork, fds: list[int]) -> int:
        """In the child: turn into the engine process and run it; its exit code."""
        os.setsid()
        from kvpush.services.proc import child_preexec

        child_preexec()  # dies with the zygote
        if os.getppid() != self.pid:
            return 1
        for conn in self.engines.values():
            if conn is not None:
                conn.close()
        self.selector.close()
        self.listener.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            if fd > 2:
                os.close(fd)
        fds.clear()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # The engine configures its own logging, as it would in a fresh interpreter.
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        if req.title:  # before the environment changes: the title may take its space
            import setproctitle

            setproctitle.setproctitle(req.title)
        os.chdir(req.cwd)
        os.environ.clear()
        os.environ.update(req.env)
        if req.cpus:
            os.sched_setaffinity(0, req.cpus)
        apply_openmp_env()
        from kvpush.services.engine import vllm_main

        sys.argv = [vllm_main.__file__, *req.argv]
        try:
            vllm_main.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        atexit._run_exitfuncs()
        return code


def main(argv: list[str] | None = None) -> None:
    """``python -m kvpush.services.engine.zygote --socket PATH``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--idle-exit-s", type=float, default=0.0)
    parser.add_argument("--stop-grace-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM unwinds through serve(), which removes the socket; the engines follow
    # through their parent-death signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    preload()
    Zygote(args.socket, args.idle_exit_s, args.stop_grace_s).serve()


if __name__ == "__main__":
    main()
