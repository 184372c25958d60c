"""Prefill side of the late-write fence: a push never tells decode its blocks are free while
one of its WRITEs could still land there.

A WRITE handed to the transport cannot be taken back: releasing its NIXL handle leaves the
bytes in the socket or the NIC queue, and a link that heals delivers them. So a push that
gives up on WRITEs still in flight leaves them here, polled until each has completed or
failed; only then does decode get a PushDone with ``fenced`` set, and only then may it give
the request's blocks back to vLLM (connector/receiver.py holds them until it has). A
request whose PushDone went out is closed: this rank takes no target for it again, so no
WRITE can follow the fence.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvpush.common.wire import PushDone
from kvpush.connector.transport import Peer, Transport, TransportError, Xfer, XferState

logger = logging.getLogger(__name__)

# Closed requests remembered, at most: a target for one of them is refused.
_MAX_CLOSED = 65_536


@dataclass
class _Left:
    """WRITEs of one request that its push stopped waiting for."""

    rid: str
    peers: list[Peer]
    xfers: list[Xfer]
    until_ns: int  # monotonic: past it the handles are released and no fence goes out
    tp_size: int


class Fence:
    """The WRITEs this rank left in flight, and the requests it closed."""

    def __init__(self, max_s: float, send: Callable[[Peer, PushDone], None]) -> None:
        self.max_ns = int(max_s * 1e9)
        self._send = send
        self._left: list[_Left] = []
        self._lingering_told = 0  # lingering as last reported to the scheduler side
        # rid -> (expiry, whether decode still waits for word: no PushDone went out)
        self._closed: collections.OrderedDict[str, tuple[int, bool]] = (
            collections.OrderedDict())

    def leave(self, rid: str, peers: list[Peer], xfers: list[Xfer], tp_size: int) -> None:
        """Keep polling ``xfers`` of ``rid`` (written to ``peers``) after its push ended."""
        self._left.append(_Left(rid, list(peers), list(xfers),
                                time.monotonic_ns() + self.max_ns, tp_size))

    def close(self, rid: str, owes: bool = False) -> None:
        """``rid``'s push ended here: no target for it is taken again. ``owes``: no
        PushDone went out (no decode was known to tell)."""
        self._closed[rid] = (time.monotonic_ns() + 2 * self.max_ns, owes)
        self._closed.move_to_end(rid)
        while len(self._closed) > _MAX_CLOSED:
            self._closed.popitem(last=False)

    def closed(self, rid: str) -> bool:
        """True when ``rid``'s push ended on this rank (decode may have closed it)."""
        entry = self._closed.get(rid)
        if entry is None:
            return False
        if entry[0] < time.monotonic_ns():
            del self._closed[rid]
            return False
        return True

    def owes(self, rid: str) -> bool:
        """True unless decode was told that ``rid``'s push ended here: an unknown
        request never pushed anything from this rank."""
        return not self.closed(rid) or self._closed[rid][1]

    @property
    def lingering(self) -> int:
        """Requests whose WRITEs are still being waited for."""
        return len(self._left)

    def take_lingering(self) -> int | None:
        """:attr:`lingering`, when it changed since the last call (the engine keeps
        stepping, so polling them, while any are left)."""
        n = len(self._left)
        if n == self._lingering_told:
            return None
        self._lingering_told = n
        return n

    def unpushed(self, rid: str, peers: Callable[[], list[Peer]], tp_size: int) -> None:
        """Tell decode that this rank ended ``rid``'s push with no WRITE in flight where no
        target ever reached it (nor will: ``rid`` is closed here), so that decode fails the
        receive now and frees its blocks instead of at its quarantine's bound. ``peers``
        are the decode ranks to tell; it raises as ``targets.engine_peers`` does."""
        if not self.owes(rid):
            return
        self.close(rid)
        try:
            to = peers()
        except (TransportError, LookupError, ValueError, redis.RedisError) as exc:
            # ValueError: a name no engine can have (read from Redis, so anyone's).
            logger.info("cannot tell decode that %s ended here unpushed: %s", rid, exc)
            return
        self._tell(to, rid, "prefill ended it unpushed", tp_size)

    def poll(self, transport: Transport) -> None:
        """Poll the WRITEs left in flight; tell decode once all of a request's ended."""
        if not self._left:
            return
        now = time.monotonic_ns()
        keep: list[_Left] = []
        for left in self._left:
            left.xfers = [x for x in left.xfers
                          if transport.poll(x) is XferState.IN_PROGRESS]
            if left.xfers and now < left.until_ns:
                keep.append(left)
                continue
            if left.xfers:
                # Decode cut this rank off by now (its quarantine ends at the same bound).
                logger.warning("WRITEs of %s still in flight after %.0f s; released without "
                               "a fence", left.rid, self.max_ns / 1e9)
                for xfer in left.xfers:
                    transport.abandon(xfer)
                continue
            self._tell(left.peers, left.rid, "WRITEs left in flight ended", left.tp_size)
        self._left = keep

    def _tell(self, peers: list[Peer], rid: str, why: str, tp_size: int) -> None:
        """The fence itself: a failed PushDone saying no WRITE for ``rid`` can land."""
        for peer in peers:
            self._send(peer, PushDone(request_id=rid, ok=False, fenced=True, error=why,
                                      tp_size=tp_size))
