"""A small asyncio TCP proxy with fault controls, for putting services behind a bad network.

Runs its own event loop on a daemon thread, so synchronous test code drives it directly::

    proxy = TcpProxy(("127.0.0.1", 0), ("127.0.0.1", redis_port)).start()
    ...  # services connect to proxy.port
    proxy.delay(0.5)     # every chunk, both directions, waits 0.5 s (order kept)
    proxy.cut()          # reset every open connection (new ones still pass)
    proxy.down()         # refuse new connections too (accept, then reset at once)
    proxy.blackhole()    # keep connections open but forward nothing (a silent partition)
    proxy.heal()         # back to a clean pass-through; blackholed connections are reset
    proxy.stop()

Controls return once the proxy's loop has applied them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PASS, DOWN, BLACKHOLE = "pass", "down", "blackhole"


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    blackholed: bool = False
    eofs: int = 0


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with RST (SO_LINGER 0), like a dropped connection, not a polite FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()


class TcpProxy:
    """Forward ``listen`` -> ``upstream`` with cut / delay / blackhole / down controls."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.listen = listen
        self.upstream = upstream
        self.mode = PASS
        self.delay_s = 0.0
        self.port = 0
        self.accepted = 0
        self.resets = 0
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy",
                                        daemon=True)

    @property
    def host(self) -> str:
        """Address the proxy listens on."""
        return self.listen[0]

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        """``scheme://host:port/path`` of the proxy."""
        return f"{scheme}://{self.host}:{self.port}{path}"

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> TcpProxy:
        """Bind and serve on the background loop."""
        self._thread.start()
        self._call(self._start())
        logger.info("tcp proxy %s:%d -> %s:%d", self.host, self.port, *self.upstream)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self.listen)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        """Reset every connection, stop listening, stop the loop."""
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._reset_all(lambda c: True)

    def _call(self, coro: object, timeout_s: float = 10.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)  # type: ignore[arg-type]

    # -- controls -------------------------------------------------------------------------
    def cut(self) -> int:
        """Reset every open connection; returns how many. New connections still pass."""
        return int(self._call(self._cut()))  # type: ignore[arg-type]

    async def _cut(self) -> int:
        return self._reset_all(lambda c: True)

    def down(self) -> None:
        """Reset open connections and refuse (reset) new ones until :meth:`heal`."""
        self._call(self._set(DOWN, reset=True))

    def blackhole(self) -> None:
        """Stop forwarding in both directions, silently; connections stay open."""
        self._call(self._set(BLACKHOLE, reset=False))

    def delay(self, seconds: float) -> None:
        """Delay every forwarded chunk by ``seconds`` (0 turns it off)."""
        self._call(self._set_delay(seconds))

    def heal(self) -> None:
        """Plain pass-through again, no delay; connections that were blackholed are reset
        (their bytes were dropped, so their protocol state is broken)."""
        self._call(self._heal())

    async def _set(self, mode: str, reset: bool) -> None:
        self.mode = mode
        if mode == BLACKHOLE:
            for c in self._conns:
                c.blackholed = True
        if reset:
            self._reset_all(lambda c: True)

    async def _set_delay(self, seconds: float) -> None:
        self.delay_s = max(0.0, seconds)

    async def _heal(self) -> None:
        self.mode = PASS
        self.delay_s = 0.0
        self._reset_all(lambda c: c.blackholed)

    def _reset_all(self, which: object) -> int:
        n = 0
        for c in list(self._conns):
            if which(c):  # type: ignore[operator]
                n += 1
                self._drop(c)
        self.resets += n
        return n

    def _drop(self, c: _Conn) -> None:
        _reset(c.client)
        _reset(c.upstream)
        for t in c.tasks:
            t.cancel()
        self._conns.discard(c)

    @property
    def open_connections(self) -> int:
        """Connections currently proxied."""
        return len(self._conns)

    # -- data path ------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Conn(writer, blackholed=self.mode == BLACKHOLE)
        if self.mode == DOWN:
            _reset(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        conn.upstream = up_w
        self._conns.add(conn)
        conn.tasks = [
            asyncio.create_task(self._pipe(conn, reader, up_w)),
            asyncio.create_task(self._pipe(conn, up_r, writer)),
        ]

    async def _pipe(self, conn: _Conn, src: asyncio.StreamReader,
                    dst: asyncio.StreamWriter) -> None:
        # One queue per direction keeps chunk order under a delay.
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(conn, q, dst))
        conn.tasks.append(sender)
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                if conn.blackholed or self.mode == BLACKHOLE:
                    conn.blackholed = True
                    continue  # swallowed
                await q.put((self._loop.time() + self.delay_s, data))
            await q.put((0.0, b""))  # EOF marker
        except (ConnectionError, OSError):
            self._drop(conn)
        except asyncio.CancelledError:
            pass

    async def _send(self, conn: _Conn, q: asyncio.Queue[tuple[float, bytes]],
                    dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                at, data = await q.get()
                if not data:
                    # Half-close: pass the EOF on; the other direction may still flow.
                    with contextlib.suppress(OSError, RuntimeError):
                        if dst.can_write_eof():
                            dst.write_eof()
                    conn.eofs += 1
                    if conn.eofs >= 2:  # both sides closed: a clean end
                        for w in (conn.client, conn.upstream):
                            with contextlib.suppress(Exception):
                                w.close()  # type: ignore[union-attr]
                        self._conns.discard(conn)
                    return
                wait = at - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if conn.blackholed:
                    continue
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            self._drop(conn)
        except asyncio.CancelledError:
            pass
