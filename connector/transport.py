"""The transport seam: what worker code needs from a KV transport, and the shared types."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpush.common.wire import AgentInfo, KVLayout
from kvpush.connector import page_layout
from kvpush.connector.page_layout import PageGeometry, Runs


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


# The runs of a page a WRITE carries; empty: every byte of the page, in the page's runs.
WHOLE: Runs = ()


@dataclass
class Peer:
    """A remote agent, prepared once per peer generation, with the byte runs of each
    block a WRITE to it carries, piece for piece (``page_layout.pair``: a head slice under
    heterogeneous TP, a token-major page's per-token runs)."""

    engine_id: str
    rank: int
    generation: int
    agent_name: str
    layout: KVLayout
    dlist: object  # the transport's prepared remote descriptors (None when it needs none)
    dropped: bool = False
    local: Runs = WHOLE  # of this rank's pages
    remote: Runs = WHOLE  # of the peer's pages
    asked: tuple[Runs, Runs] = (WHOLE, WHOLE)  # the runs it was built for (its cache key)
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


def geometry_of(layout: KVLayout) -> PageGeometry:
    """The page geometry a layout publishes (a peer without one is vLLM's CPU page:
    head-major, K of every token then V, contiguous)."""
    content = page_layout.Content(
        page_layout.Content.LATENT if layout.page == "latent" else layout.content)
    heads = 1 if content is page_layout.Content.LATENT else max(layout.kv_heads, 1)
    parts = 1 if content is page_layout.Content.LATENT else max(layout.parts, 1)
    per_token = layout.block_len // max(heads * layout.block_size, 1)
    part_bytes = layout.part_bytes or per_token // parts
    token_stride = layout.token_stride or (
        part_bytes if content is page_layout.Content.SPLIT else per_token)
    return PageGeometry(
        layout=layout.cache_layout, content=content, heads=heads, parts=parts,
        tokens=layout.block_size, part_bytes=part_bytes,
        head_stride=layout.head_stride or layout.block_len // heads,
        part_stride=layout.part_stride or (
            layout.block_size * part_bytes if content is page_layout.Content.SPLIT
            else part_bytes),
        token_stride=token_stride,
    )


def page_runs(layout: KVLayout, runs: Runs = WHOLE) -> Runs:
    """``runs``, or every byte of a page of ``layout`` in its fewest runs."""
    return runs or page_layout.runs(geometry_of(layout))


def paired_runs(local: KVLayout, remote: KVLayout, local_runs: Runs = WHOLE,
                remote_runs: Runs = WHOLE) -> tuple[Runs, Runs]:
    """The runs a WRITE between two pages carries, piece for piece: as given, or for whole
    pages as ``page_layout.pair`` finds them (two layouts' whole pages hold their bytes in
    different orders even where each is one run); raises :class:`LayoutMismatch`."""
    if local_runs or remote_runs:
        return page_runs(local, local_runs), page_runs(remote, remote_runs)
    try:
        return page_layout.pair(geometry_of(local), geometry_of(remote))
    except page_layout.UnmappableLayouts as exc:
        raise LayoutMismatch(f"cannot push: {exc}") from exc


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise :class:`LayoutMismatch` unless every local head of a block can be written
    into a remote head as is: the same model bytes per head, whatever the two pages'
    layouts (TP sizes may differ: the heads per page then do)."""
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
    if not problems:
        try:
            page_layout.check_pairable(geometry_of(local), geometry_of(remote))
        except page_layout.UnmappableLayouts as exc:
            problems.append(str(exc))
    if problems:
        raise LayoutMismatch(
            f"peer KV layout differs (local {local.cache_layout}/{local.content}, peer "
            f"{remote.cache_layout}/{remote.content}): " + ", ".join(problems))


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

    def peer(self, info: AgentInfo, local: Runs = WHOLE, remote: Runs = WHOLE) -> Peer:
        """The prepared peer for ``info``, its WRITEs carrying byte runs ``local`` of
        each local page into runs ``remote`` of the peer's, piece for piece; raises
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
