"""The NIXL ``Transport``: one agent without progress thread, prepared descriptor lists."""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.common.wire import AgentInfo, KVLayout
from kvpush.connector.page_layout import Runs
from kvpush.connector.transport import (
    WHOLE,
    BackendUnavailable,
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

_LOCAL = "NIXL_INIT_AGENT"


def _descs(layout: KVLayout, runs: Runs) -> np.ndarray:
    """Nx3 (addr, len, dev) array, one row per (region, block, run), in that order, each
    run an (offset, length) of the block's page."""
    stride = block_stride(layout)
    base = np.asarray(layout.base_addrs, dtype=np.int64)[:, None, None]
    blocks = (np.arange(layout.num_blocks, dtype=np.int64) * stride)[None, :, None]
    offs = np.asarray([o for o, _n in runs], dtype=np.int64)[None, None, :]
    lens = np.asarray([n for _o, n in runs], dtype=np.int64)[None, None, :]
    addrs = (base + blocks + offs).reshape(-1)
    out = np.empty((addrs.size, 3), dtype=np.int64)
    out[:, 0] = addrs
    out[:, 1] = np.broadcast_to(lens, (len(layout.base_addrs), layout.num_blocks,
                                       len(runs))).reshape(-1)
    out[:, 2] = layout.device_id
    return out


def nixl_api() -> tuple[Any, Any]:
    """NIXL's agent classes: from the ``nixl`` meta package where it is installed, else
    from the CUDA-specific wheel itself (a CUDA 13 host may carry ``nixl-cu13`` alone,
    since the meta package requires the CUDA 12 build as well)."""
    errors = []
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise BackendUnavailable("NIXL is not installed (" + "; ".join(errors) + ")")


class NixlTransport:
    """One NIXL agent per worker rank (a ``Transport``), progressed only by its calls.

    NIXL's progress thread spins a core even when idle, so it is off: posting, polling
    and reading notifications are what move transfers forward, and callers poll only
    while they have something in flight.
    """

    def __init__(self, name: str, backends: Sequence[str]) -> None:
        nixl_agent, nixl_agent_config = nixl_api()
        self.name = name
        self.agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        plugins = set(self.agent.get_plugin_list())
        self.backends: list[str] = []
        for backend in backends:
            if backend not in plugins:
                raise BackendUnavailable(f"NIXL backend plugin {backend!r} is not installed")
            try:
                self.agent.create_backend(backend)
            except Exception as exc:
                hint = " (LIBFABRIC needs libfabric >= 1.21)" if backend == "LIBFABRIC" else ""
                raise BackendUnavailable(
                    f"NIXL backend {backend!r} failed to initialise{hint}: {exc}"
                ) from exc
            self.backends.append(backend)
        self.layout: KVLayout | None = None
        self._local_dlist: object | None = None
        self._local_runs: Runs = ()
        # Local descriptors of other runs of every page (a head slice, another layout's
        # pieces), by runs.
        self._part_dlists: dict[Runs, object] = {}
        self._peers: dict[tuple[str, int], Peer] = {}

    # -- local memory --------------------------------------------------------------------
    def register(self, layout: KVLayout, ranges: Sequence[tuple[int, int]]) -> None:
        """Register ``ranges`` (addr, len) and prepare the local per-block descriptors."""
        mem = layout.memory
        regs = [(addr, length, layout.device_id, "") for addr, length in ranges]
        self.agent.register_memory(regs, mem, backends=self.backends)
        self._local_runs = page_runs(layout)
        self._local_dlist = self.agent.prep_xfer_dlist(
            _LOCAL, _descs(layout, self._local_runs), mem, backends=self.backends)
        self.layout = layout

    def metadata(self) -> bytes:
        """This agent's metadata blob, for the registry."""
        return bytes(self.agent.get_agent_metadata())

    # -- peers ---------------------------------------------------------------------------
    def peer(self, info: AgentInfo, local: Runs = WHOLE, remote: Runs = WHOLE) -> Peer:
        """The prepared peer for ``info``; built once per peer generation and parts."""
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
        local, remote_runs = paired_runs(self.layout, info.layout, local, remote)
        if len(remote_runs) != len(local):
            raise TransferFailed(f"peer {info.agent_name}: {len(remote_runs)} remote runs "
                                 f"per page for {len(local)} local")
        try:
            added = self.agent.add_remote_agent(info.agent_metadata)
            name = added.decode() if isinstance(added, bytes) else str(added)
            dlist = self.agent.prep_xfer_dlist(name, _descs(info.layout, remote_runs),
                                               info.layout.memory, backends=self.backends)
            local_dlist = self._local_part(local)
        except Exception as exc:  # NIXL raises its own exception types
            raise TransferFailed(f"cannot load peer {info.agent_name}: {exc}") from exc
        peer = Peer(info.engine_id, info.rank, info.generation, name, info.layout, dlist,
                    local=local, remote=remote_runs, local_dlist=local_dlist, asked=asked)
        self._peers[key] = peer
        logger.info("NIXL peer %s (engine %s rank %s, generation %s) ready", name,
                    info.engine_id, info.rank, info.generation)
        return peer

    def _local_part(self, runs: Runs) -> object:
        """Local descriptors of ``runs`` of every page (None: the whole pages' own)."""
        if runs in (WHOLE, self._local_runs):
            return None
        assert self.layout is not None
        if runs not in self._part_dlists:
            self._part_dlists[runs] = self.agent.prep_xfer_dlist(
                _LOCAL, _descs(self.layout, runs), self.layout.memory,
                backends=self.backends)
        return self._part_dlists[runs]

    def drop_peer(self, peer: Peer) -> None:
        """Forget a peer (it restarted or failed); the next ``peer()`` rebuilds it."""
        if self._peers.get((peer.engine_id, peer.rank)) is peer:
            del self._peers[(peer.engine_id, peer.rank)]
        if peer.dropped:
            return
        peer.dropped = True
        try:
            self.agent.release_dlist_handle(peer.dlist)
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:
            logger.debug("dropping peer %s: %s", peer.agent_name, exc)

    # -- transfers -----------------------------------------------------------------------
    def write(self, peer: Peer, regions: Sequence[int], local_blocks: Sequence[int],
              remote_blocks: Sequence[int], notif: bytes = b"") -> Xfer:
        """Post a WRITE of ``local_blocks`` to ``remote_blocks`` for every region in
        ``regions``; ``notif`` reaches the peer after the data."""
        assert self.layout is not None and self._local_dlist is not None
        if len(local_blocks) != len(remote_blocks):
            raise ValueError("local and remote block lists differ in length")
        local_runs = page_runs(self.layout, peer.local)
        n_runs = len(local_runs)
        reg = np.asarray(regions, dtype=np.int64)[:, None, None]
        lb = np.asarray(local_blocks, dtype=np.int64)[None, :, None]
        rb = np.asarray(remote_blocks, dtype=np.int64)[None, :, None]
        run = np.arange(n_runs, dtype=np.int64)[None, None, :]
        local_idx = ((reg * self.layout.num_blocks + lb) * n_runs + run).reshape(-1)
        remote_idx = ((reg * peer.layout.num_blocks + rb) * n_runs + run).reshape(-1)
        local_idx, remote_idx = local_idx.astype(np.int32), remote_idx.astype(np.int32)
        try:
            handle = self.agent.make_prepped_xfer(
                "WRITE", peer.local_dlist or self._local_dlist, local_idx, peer.dlist,
                remote_idx, notif, backends=self.backends,
            )
        except Exception as exc:  # NIXL raises its own exception types
            raise TransferFailed(f"cannot prepare WRITE to {peer.agent_name}: {exc}") from exc
        per_page = sum(n for _o, n in local_runs)
        xfer = Xfer(handle, peer, len(regions) * len(local_blocks) * per_page,
                    int(local_idx.size), time.monotonic_ns())
        try:
            status = self.agent.transfer(handle)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError: the peer is gone
            self._finish(xfer, XferState.FAILED, f"post failed: {exc}")
            return xfer
        if status == "ERR":
            self._finish(xfer, XferState.FAILED, "post failed")
        elif status == "DONE":
            self._finish(xfer, XferState.DONE)
        return xfer

    def _finish(self, xfer: Xfer, state: XferState, error: str | None = None) -> None:
        xfer.state = state
        xfer.error = error
        xfer.done_ns = time.monotonic_ns()
        try:
            self.agent.release_xfer_handle(xfer.handle)
        except Exception as exc:
            logger.debug("release of a finished transfer handle failed: %s", exc)

    def poll(self, xfer: Xfer) -> XferState:
        """Progress NIXL and return the transfer's state (non-blocking)."""
        if xfer.state is not XferState.IN_PROGRESS:
            return xfer.state
        try:
            status = self.agent.check_xfer_state(xfer.handle)
        except Exception as exc:  # NIXL raises on a disconnected peer
            self._finish(xfer, XferState.FAILED, f"transfer error: {exc}")
            return xfer.state
        if status == "DONE":
            self._finish(xfer, XferState.DONE)
        elif status == "ERR":
            self._finish(xfer, XferState.FAILED, "transfer error")
        return xfer.state

    def abandon(self, xfer: Xfer) -> None:
        """Give up on an in-progress transfer (past its deadline); best-effort release."""
        if xfer.state is XferState.IN_PROGRESS:
            self._finish(xfer, XferState.FAILED, "abandoned past deadline")

    def wait(self, xfers: Sequence[Xfer], deadline_ns: int) -> None:
        """Block until every transfer is done; raise :class:`TransferTimeout` at the
        ``time.monotonic_ns()`` deadline and :class:`TransferFailed` on an error."""
        pause = 50e-6
        while True:
            pending = [x for x in xfers if self.poll(x) is XferState.IN_PROGRESS]
            failed = [x for x in xfers if x.state is XferState.FAILED]
            if failed:
                raise TransferFailed(f"{len(failed)} transfer(s) failed: {failed[0].error}")
            if not pending:
                return
            if time.monotonic_ns() >= deadline_ns:
                raise TransferTimeout(
                    f"{len(pending)} transfer(s) to {pending[0].peer.agent_name} still in "
                    "progress at the deadline"
                )
            # Backoff keeps a long wait cheap without adding much latency to short ones.
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    # -- notifications -------------------------------------------------------------------
    def notify(self, peer: Peer, msg: bytes) -> None:
        """Send a bare notification (no data) to ``peer``."""
        try:
            self.agent.send_notif(peer.agent_name, msg)
        except Exception as exc:  # NIXL raises its own exception types
            raise TransferFailed(f"notification to {peer.agent_name} failed: {exc}") from exc

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call (also progresses NIXL)."""
        out: list[tuple[str, bytes]] = []
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as exc:  # a peer that died mid-transfer surfaces here
            logger.warning("reading NIXL notifications failed: %s", exc)
            return out
        for agent, msgs in notifs.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        """Drop every peer; the agent is torn down with the object."""
        for peer in list(self._peers.values()):
            self.drop_peer(peer)
