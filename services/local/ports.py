"""Free loopback TCP ports for engines, gateways and embedded Redis started on one machine."""

from __future__ import annotations

import collections
import socket
import threading


class NoFreePort(RuntimeError):
    """No suitable free port was found."""


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
