"""An in-process ``Transport`` for unit tests: agents in one process copy blocks with memmove.

Like SGLang's ``fake`` disaggregation backend, it lets the sender and receiver run without
NIXL. Agents find each other by name in a :class:`FakeFabric` (the module's
:data:`FABRIC` unless one is passed); an agent's metadata is its name. A WRITE copies
the page's byte runs (or the peer's paired runs) per (region, block) from
``base_addrs[region] + block * stride`` of the local layout to the same place of the
peer's, when it completes: at once, or after
``polls_to_complete`` polls. ``fail_writes`` makes WRITEs end FAILED (nothing copied) and
``frozen`` keeps them IN_PROGRESS, as a peer that stopped answering would.

The registered memory must outlive the transfers: the fake copies raw addresses.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.common.wire import AgentInfo, KVLayout
from kvpush.connector.page_layout import Runs
from kvpush.connector.transport import (
    WHOLE,
    Peer,
    TransferFailed,
    TransferTimeout,
    Xfer,
    XferState,
    block_stride,
    check_compatible,
    page_runs,
    paired_runs,
)

logger = logging.getLogger(__name__)


class FakeFabric:
    """The agents that can reach each other, by name."""

    def __init__(self) -> None:
        self.agents: dict[str, FakeTransport] = {}

    def join(self, agent: FakeTransport) -> None:
        """Add ``agent``; a newer agent of the same name replaces the older one."""
        self.agents[agent.name] = agent

    def leave(self, agent: FakeTransport) -> None:
        """Remove ``agent`` (only if it is still the one registered under its name)."""
        if self.agents.get(agent.name) is agent:
            del self.agents[agent.name]

    def get(self, name: str) -> FakeTransport:
        """The agent called ``name``; :class:`TransferFailed` when it is gone."""
        agent = self.agents.get(name)
        if agent is None:
            raise TransferFailed(f"no fake agent {name!r}")
        return agent


FABRIC = FakeFabric()


@dataclass
class _Pending:
    """What a posted fake WRITE will do when it completes."""

    regions: list[int]
    local_blocks: list[int]
    remote_blocks: list[int]
    notif: bytes
    polls_left: int


class FakeTransport:
    """A ``Transport`` whose peers are other ``FakeTransport`` objects of one fabric."""

    def __init__(self, name: str, backends: Sequence[str] = ("FAKE",), *,
                 fabric: FakeFabric | None = None, polls_to_complete: int = 0) -> None:
        self.name = name
        self.backends: list[str] = list(backends)
        self.fabric = fabric if fabric is not None else FABRIC
        self.polls_to_complete = polls_to_complete
        """Polls a WRITE needs before it completes; 0: it completes when posted."""
        self.fail_writes = False
        """WRITEs end FAILED when they would complete, with nothing copied."""
        self.frozen = False
        """WRITEs stay IN_PROGRESS (a frozen peer) until this is cleared."""
        self.layout: KVLayout | None = None
        self.writes: list[Xfer] = []  # every WRITE posted, for tests to inspect
        self._peers: dict[tuple[str, int], Peer] = {}
        self._inbox: deque[tuple[str, bytes]] = deque()
        self.fabric.join(self)

    # -- local memory --------------------------------------------------------------------
    def register(self, layout: KVLayout, ranges: Sequence[tuple[int, int]]) -> None:
        """Remember ``layout``; the memory itself is addressed directly."""
        self.layout = layout

    def metadata(self) -> bytes:
        """The agent name: all a fake peer needs to find this agent."""
        return self.name.encode()

    # -- peers ---------------------------------------------------------------------------
    def peer(self, info: AgentInfo, local: Runs = WHOLE, remote: Runs = WHOLE) -> Peer:
        """The peer for ``info``, which must be an agent of this fabric."""
        key = (info.engine_id, info.rank)
        cached = self._peers.get(key)
        if (cached is not None and cached.generation == info.generation
                and cached.asked == (local, remote)):
            return cached
        if cached is not None:
            self.drop_peer(cached)
        assert self.layout is not None, "register() before adding peers"
        check_compatible(self.layout, info.layout)
        asked = (local, remote)
        local, remote = paired_runs(self.layout, info.layout, local, remote)
        name = info.agent_metadata.decode()
        self.fabric.get(name)
        peer = Peer(info.engine_id, info.rank, info.generation, name, info.layout, None,
                    local=local, remote=remote, asked=asked)
        self._peers[key] = peer
        return peer

    def drop_peer(self, peer: Peer) -> None:
        """Forget a peer; the next :meth:`peer` rebuilds it."""
        if self._peers.get((peer.engine_id, peer.rank)) is peer:
            del self._peers[(peer.engine_id, peer.rank)]
        peer.dropped = True

    # -- transfers -----------------------------------------------------------------------
    def write(self, peer: Peer, regions: Sequence[int], local_blocks: Sequence[int],
              remote_blocks: Sequence[int], notif: bytes = b"") -> Xfer:
        """Post a WRITE; raises :class:`TransferFailed` for a block outside either cache
        (NIXL refuses to prepare such a transfer)."""
        assert self.layout is not None
        if len(local_blocks) != len(remote_blocks):
            raise ValueError("local and remote block lists differ in length")
        for blocks, layout, side in ((local_blocks, self.layout, "local"),
                                     (remote_blocks, peer.layout, "remote")):
            if any(not 0 <= b < layout.num_blocks for b in blocks):
                raise TransferFailed(f"{side} block outside 0..{layout.num_blocks - 1}")
        if any(not 0 <= r < len(self.layout.base_addrs) for r in regions):
            raise TransferFailed("region outside the registered layout")
        n = len(regions) * len(local_blocks)
        xfer = Xfer(_Pending(list(regions), list(local_blocks), list(remote_blocks), notif,
                             self.polls_to_complete),
                    peer, n * sum(k for _o, k in page_runs(self.layout, peer.local)),
                    n * len(page_runs(self.layout, peer.local)), time.monotonic_ns())
        self.writes.append(xfer)
        self._advance(xfer)
        return xfer

    def _advance(self, xfer: Xfer) -> None:
        """One step of progress: count down, then complete (copy) or fail."""
        pending = xfer.handle
        assert isinstance(pending, _Pending)
        if self.frozen:
            return
        if pending.polls_left > 0:
            pending.polls_left -= 1
            return
        if self.fail_writes:
            self._finish(xfer, XferState.FAILED, "fake WRITE failed")
            return
        try:
            target = self.fabric.get(xfer.peer.agent_name)
        except TransferFailed as exc:
            self._finish(xfer, XferState.FAILED, str(exc))
            return
        self._copy(pending, target, xfer.peer)
        self._finish(xfer, XferState.DONE)
        if pending.notif:
            target._inbox.append((self.name, pending.notif))

    def _copy(self, pending: _Pending, target: FakeTransport, peer: Peer) -> None:
        src, dst = self.layout, target.layout
        assert src is not None and dst is not None
        src_stride, dst_stride = block_stride(src), block_stride(dst)
        pieces = list(zip(page_runs(src, peer.local), page_runs(dst, peer.remote),
                          strict=True))
        for r in pending.regions:
            for lb, rb in zip(pending.local_blocks, pending.remote_blocks, strict=True):
                for (lo, n), (ro, _n) in pieces:
                    ctypes.memmove(dst.base_addrs[r] + rb * dst_stride + ro,
                                   src.base_addrs[r] + lb * src_stride + lo, n)

    @staticmethod
    def _finish(xfer: Xfer, state: XferState, error: str | None = None) -> None:
        xfer.state = state
        xfer.error = error
        xfer.done_ns = time.monotonic_ns()

    def poll(self, xfer: Xfer) -> XferState:
        """Progress the transfer one step and return its state."""
        if xfer.state is XferState.IN_PROGRESS:
            self._advance(xfer)
        return xfer.state

    def abandon(self, xfer: Xfer) -> None:
        """Give up on an in-progress transfer: it ends FAILED with nothing copied."""
        if xfer.state is XferState.IN_PROGRESS:
            self._finish(xfer, XferState.FAILED, "abandoned past deadline")

    def wait(self, xfers: Sequence[Xfer], deadline_ns: int) -> None:
        """Poll until every transfer is done. A frozen transport never progresses, so it
        times out at once instead of sleeping until ``deadline_ns``."""
        while True:
            pending = [x for x in xfers if self.poll(x) is XferState.IN_PROGRESS]
            failed = [x for x in xfers if x.state is XferState.FAILED]
            if failed:
                raise TransferFailed(f"{len(failed)} transfer(s) failed: {failed[0].error}")
            if not pending:
                return
            if self.frozen or time.monotonic_ns() >= deadline_ns:
                raise TransferTimeout(f"{len(pending)} transfer(s) still in progress")

    # -- notifications -------------------------------------------------------------------
    def notify(self, peer: Peer, msg: bytes) -> None:
        """Deliver ``msg`` to the peer's inbox, after everything sent to it before."""
        self.fabric.get(peer.agent_name)._inbox.append((self.name, msg))

    def notifications(self) -> list[tuple[str, bytes]]:
        """Everything delivered to this agent since the last call, in order."""
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def close(self) -> None:
        """Drop every peer and leave the fabric."""
        for peer in list(self._peers.values()):
            self.drop_peer(peer)
        self.fabric.leave(self)
