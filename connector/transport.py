"""The transport seam: what worker code needs from a KV transport, and the shared types."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpush.common.wire import AgentInfo, KVLayout


class TransportError(RuntimeError):
    """Base of every transport failure."""


class BackendUnavailable(TransportError):
    """A requested backend plugin is missing or could not be initialised."""


class LayoutMismatch(TransportError):
    """The peer's KV layout cannot receive this engine's blocks as they are."""


class TransferFailed(TransportError):
    """The transport reported an error for a transfer (peer gone, connection reset)."""


class TransferTimeout(TransportError):
    """A transfer was still in progress when its deadline passed (peer frozen or slow)."""


class XferState(enum.Enum):
    """State of one posted transfer as the transport reports it."""

    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PageSlice:
    """A byte range of every block's page: ``length`` 0 is the whole page."""

    offset: int = 0
    length: int = 0


WHOLE = PageSlice()


@dataclass
class Peer:
    """A remote agent, prepared once per peer generation, with the byte ranges of each
    block a WRITE to it carries (a head slice under heterogeneous TP)."""

    engine_id: str
    rank: int
    generation: int
    agent_name: str
    layout: KVLayout
    dlist: object  # the transport's prepared remote descriptors (None when it needs none)
    dropped: bool = False
    local: PageSlice = WHOLE  # of this rank's pages
    remote: PageSlice = WHOLE  # of the peer's pages
    local_dlist: object = None  # the local descriptors of ``local`` (None: whole pages)


@dataclass
class Xfer:
    """One posted WRITE."""

    handle: object  # the transport's transfer handle
    peer: Peer
    nbytes: int
    descriptors: int
    posted_ns: int
    state: XferState = XferState.IN_PROGRESS
    done_ns: int = 0
    error: str | None = None
    tags: dict[str, object] = field(default_factory=dict)


def head_bytes(layout: KVLayout) -> int:
    """Bytes of one KV head in one block's page (the whole page for an MLA latent)."""
    return layout.block_len // max(layout.kv_heads, 1)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise :class:`LayoutMismatch` unless every local head of a block fits the same
    head of a remote block as is (TP sizes may differ: the heads per page then do)."""
    problems = []
    for attr in ("block_size", "dtype", "kv_splits", "page", "layer_groups",
                 "total_kv_heads"):
        a, b = getattr(local, attr), getattr(remote, attr)
        if a != b:
            problems.append(f"{attr} {a} != {b}")
    if head_bytes(local) != head_bytes(remote):
        problems.append(f"bytes per head and block {head_bytes(local)} != "
                        f"{head_bytes(remote)}")
    if len(local.base_addrs) != len(remote.base_addrs):
        problems.append(f"regions {len(local.base_addrs)} != {len(remote.base_addrs)}")
    if problems:
        raise LayoutMismatch("peer KV layout differs: " + ", ".join(problems))


def block_stride(layout: KVLayout) -> int:
    """Bytes between consecutive blocks of one region."""
    return layout.block_stride or layout.block_len


class Transport(Protocol):
    """One agent per worker rank that WRITEs registered KV blocks into peers' blocks.

    Nothing progresses in the background: posting, polling, waiting and reading
    notifications are what move transfers forward. A completed WRITE is visible at the
    peer, so a notification sent after it cannot overtake the data.
    """

    backends: list[str]

    def register(self, layout: KVLayout, ranges: Sequence[tuple[int, int]]) -> None:
        """Register the memory ``ranges`` (addr, len) holding the blocks of ``layout``."""
        ...

    def metadata(self) -> bytes:
        """This agent's metadata blob, published for peers (``AgentInfo.agent_metadata``)."""
        ...

    def peer(self, info: AgentInfo, local: PageSlice = WHOLE, remote: PageSlice = WHOLE
             ) -> Peer:
        """The prepared peer for ``info``, its WRITEs carrying byte range ``local`` of
        each local page into range ``remote`` of the peer's; raises
        :class:`TransportError` when unusable."""
        ...

    def drop_peer(self, peer: Peer) -> None:
        """Forget a peer (it restarted or failed); the next :meth:`peer` rebuilds it."""
        ...

    def write(self, peer: Peer, regions: Sequence[int], local_blocks: Sequence[int],
              remote_blocks: Sequence[int], notif: bytes = b"") -> Xfer:
        """Post a WRITE of ``local_blocks`` to ``remote_blocks`` for every region in
        ``regions``; a post the peer refused comes back as a FAILED :class:`Xfer`."""
        ...

    def poll(self, xfer: Xfer) -> XferState:
        """Progress and return the transfer's state (non-blocking)."""
        ...

    def abandon(self, xfer: Xfer) -> None:
        """Give up on an in-progress transfer; it ends FAILED."""
        ...

    def wait(self, xfers: Sequence[Xfer], deadline_ns: int) -> None:
        """Block until every transfer is done; raise :class:`TransferTimeout` at the
        ``time.monotonic_ns()`` deadline and :class:`TransferFailed` on an error."""
        ...

    def notify(self, peer: Peer, msg: bytes) -> None:
        """Send a bare notification (no data) to ``peer``."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) received since the last call, in order."""
        ...

    def close(self) -> None:
        """Drop every peer."""
        ...
