"""Free loopback TCP ports for engines, gateways and embedded Redis started on one machine."""

from __future__ import annotations

import collections
import errno
import socket
import threading


class NoFreePort(RuntimeError):
    """No suitable free port was found."""


class PortUnavailable(OSError):
    """A port a kvpush server is to listen on cannot be bound, most often because another
    program holds it: the message names the port, what it is for and the setting (and,
    where the command line sets it, the flag) that moves it."""

    def __init__(self, host: str, port: int, what: str, setting: str,
                 code: int = errno.EADDRINUSE, reason: str = "") -> None:
        super().__init__(code, reason or "address already in use")
        self.host, self.port, self.what, self.setting = host, port, what, setting
        self.flag: str | None = None
        """The command's flag that moves the port (the CLI fills it in), if it has one."""

    @classmethod
    def of(cls, exc: OSError, host: str, port: int, what: str, setting: str) -> PortUnavailable:
        """The failed bind ``exc`` of ``host:port``, explained."""
        return cls(host, port, what, setting, exc.errno or errno.EADDRINUSE,
                   exc.strerror or str(exc))

    def __str__(self) -> str:
        moves = f"{self.flag} or {self.setting}" if self.flag else self.setting
        if self.errno == errno.EADDRINUSE:
            return (f"port {self.port} ({self.what}) is already in use on {self.host}: stop "
                    f"the program that holds it, or pick another port with {moves}")
        return (f"cannot listen on {self.host}:{self.port} ({self.what}): {self.strerror} "
                f"(the port is set with {moves})")


def ensure_port_free(host: str, port: int, what: str, setting: str) -> None:
    """Raise :class:`PortUnavailable` unless a server could listen on ``host:port`` now
    (bound as servers bind, with SO_REUSEADDR, so a port left in TIME_WAIT counts as free).

    For ports bound later by another process (an engine, redis-server): checked before
    anything slow starts, so a taken one is named at once, not after an engine's boot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise PortUnavailable.of(exc, host, port, what, setting) from None


# Ports this process handed out lately. A port is free only until its user binds it, and
# the kernel may offer the same one to the next bind to port 0: two engines asked for in a
# row, both booting before either binds, would then share one port and each other's
# requests.
_GIVEN: collections.deque[int] = collections.deque(maxlen=4096)
_LOCK = threading.Lock()


def _unbound_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _claim(first: int, count: int) -> bool:
    """Record ``first .. first + count - 1`` as handed out, unless one of them already was."""
    with _LOCK:
        wanted = range(first, first + count)
        if any(p in _GIVEN for p in wanted):
            return False
        _GIVEN.extend(wanted)
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that this process
    has not handed out lately."""
    return free_port_range(1)


def free_port_pair() -> int:
    """A port p with p and p + 1 both free: an engine's HTTP port and its NIXL side channel."""
    return free_port_range(2)


def free_port_range(count: int) -> int:
    """A port p with p .. p + count - 1 all free (engines of one role count up by 2), none
    of them handed out by this process lately."""
    for _ in range(100):
        port = _unbound_port()
        try:
            for extra in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + extra))
        except OSError:
            continue
        if _claim(port, count):
            return port
    raise NoFreePort(f"no {count} consecutive free ports on 127.0.0.1")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` now, for a server that starts serving later.

    Holding it keeps the port ours while engines boot: a port that is only known to be
    free can be taken in between (by a NIXL listener, say). It listens at once because
    Linux lets a second SO_REUSEADDR socket bind a port that is bound but not listening;
    connections made early wait in the backlog until the server serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds its own: a restarted stack reuses a port left in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
