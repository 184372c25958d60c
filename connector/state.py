"""Per-request transfer state machines of the scheduler side: pure transitions, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    """Where one request's KV transfer stands, on either engine."""

    # -- prefill (sender) --------------------------------------------------------------
    WAIT_TARGET = "wait_target"
    """Prefill is running; decode has not published where the KV goes yet."""
    PUSHING = "pushing"
    """Target known, prefill still running: layers are written as they are computed."""
    HELD = "held"
    """Prefill finished before the target arrived: its blocks are held for the push."""
    DRAINING = "draining"
    """Prefill finished and the worker owns the push (writes, seal or cancel in flight)."""
    # -- decode (receiver) -------------------------------------------------------------
    AWAIT_ALLOC = "await_alloc"
    """Decode has seen the request but has not allocated its blocks yet."""
    RECEIVING = "receiving"
    """Blocks allocated and published as the push target; waiting for ``PushDone``."""
    RECEIVED = "received"
    """Every block arrived; the request decodes."""
    FAILED = "failed"
    """The push failed or missed its deadline; vLLM fails or recomputes by policy."""
    ABANDONED = "abandoned"
    """The request ended while the push was in flight; blocks wait for the push to stop."""
    # -- terminal ----------------------------------------------------------------------
    DONE = "done"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        """True once nothing more happens to the request."""
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.DONE, TransferState.EXPIRED, TransferState.ABORTED})


class Action(enum.Enum):
    """Side effects a transition asks the scheduler side to carry out."""

    SEND_TARGET = "send_target"
    """Hand the push target to the workers (next connector metadata)."""
    CANCEL_PUSH = "cancel_push"
    """Tell the workers to stop writing and tell decode the push failed."""
    RELEASE_BLOCKS = "release_blocks"
    """Tell the workers to report the held request finished so vLLM frees its blocks."""
    PUBLISH_TARGET = "publish_target"
    """Publish the decode blocks as a ``PushTarget`` for the prefill engine."""
    PUBLISH_CANCEL = "publish_cancel"
    """Tell the prefill engine to drop the push (decode no longer wants it)."""
    ABANDON_RECV = "abandon_recv"
    """Tell the decode workers the request ended; free once the push has stopped."""
    RELEASE_RESERVATION = "release_reservation"
    """Release the decode reservation in Redis (idempotent)."""


class InvalidTransition(RuntimeError):
    """An event that cannot happen in the current state (a connector bug)."""


@dataclass
class Outcome:
    """What a transition did: the new state, the side effects, and for
    ``request_finished`` whether vLLM must keep the blocks."""

    state: TransferState
    actions: tuple[Action, ...] = ()
    hold_blocks: bool = False


@dataclass
class PrefillTransfer:
    """Scheduler-side life of one request on the prefill engine.

    Events: ``target`` (decode published its blocks), ``cancel`` (decode gave up),
    ``finished`` (vLLM ``request_finished``; ``ok`` is False for aborts and errors),
    ``deadline`` (wall clock passed the push deadline) and ``worker_done`` (workers
    reported the request finished sending). Unknown or late events are absorbed, never
    raised: they come from other processes and may arrive in any order.
    """

    state: TransferState = TransferState.WAIT_TARGET
    has_target: bool = False
    cancelled: bool = False
    history: list[str] = field(default_factory=list)

    def _go(self, event: str, state: TransferState, *actions: Action,
            hold: bool = False) -> Outcome:
        self.history.append(event)
        self.state = state
        return Outcome(state, tuple(actions), hold)

    def _stay(self, event: str) -> Outcome:
        self.history.append(event)
        return Outcome(self.state)

    def on_target(self) -> Outcome:
        """Decode published the push target."""
        s = self.state
        if self.has_target or self.cancelled or s.terminal:
            return self._stay("target")
        self.has_target = True
        if s is TransferState.WAIT_TARGET:
            return self._go("target", TransferState.PUSHING, Action.SEND_TARGET)
        if s is TransferState.HELD:
            return self._go("target", TransferState.DRAINING, Action.SEND_TARGET)
        return self._stay("target")

    def on_cancel(self) -> Outcome:
        """Decode no longer wants the KV (its request ended or failed)."""
        s = self.state
        if self.cancelled or s.terminal:
            return self._stay("cancel")
        self.cancelled = True
        if s is TransferState.WAIT_TARGET:
            # Nothing written; prefill finishes on its own and frees normally.
            return self._stay("cancel")
        if s is TransferState.PUSHING:
            return self._go("cancel", TransferState.PUSHING, Action.CANCEL_PUSH)
        if s is TransferState.HELD:
            return self._go("cancel", TransferState.DRAINING, Action.RELEASE_BLOCKS)
        # DRAINING: the worker may have writes in flight; it must finish them.
        return self._go("cancel", TransferState.DRAINING, Action.CANCEL_PUSH)

    def on_finished(self, ok: bool) -> Outcome:
        """vLLM ended the request (``request_finished``); decides whether blocks are held."""
        s = self.state
        if s is TransferState.WAIT_TARGET:
            if ok and not self.cancelled:
                return self._go("finished", TransferState.HELD, hold=True)
            return self._go("finished", TransferState.ABORTED)
        if s is TransferState.PUSHING:
            # Writes may be in flight from the source blocks: the worker frees them.
            if ok and not self.cancelled:
                return self._go("finished", TransferState.DRAINING, hold=True)
            return self._go("finished", TransferState.DRAINING, Action.CANCEL_PUSH,
                            hold=True)
        if s.terminal:
            # Deadline passed while running: nothing was or will be written.
            return self._go("finished", s)
        raise InvalidTransition(f"request_finished twice (state {s.value})")

    def on_deadline(self) -> Outcome:
        """The push deadline passed."""
        s = self.state
        if s is TransferState.WAIT_TARGET:
            return self._go("deadline", TransferState.EXPIRED)
        if s is TransferState.PUSHING:
            if self.cancelled:
                return self._stay("deadline")
            self.cancelled = True
            return self._go("deadline", TransferState.PUSHING, Action.CANCEL_PUSH)
        if s is TransferState.HELD:
            return self._go("deadline", TransferState.DRAINING, Action.RELEASE_BLOCKS)
        if s is TransferState.DRAINING and not self.cancelled:
            self.cancelled = True
            return self._go("deadline", TransferState.DRAINING, Action.CANCEL_PUSH)
        return self._stay("deadline")

    def on_worker_done(self) -> Outcome:
        """Every worker reported the request finished sending: vLLM frees the blocks."""
        if self.state is TransferState.DRAINING:
            return self._go("worker_done", TransferState.DONE)
        return self._stay("worker_done")

    @property
    def holds_blocks(self) -> bool:
        """True while vLLM keeps this request's blocks for the connector."""
        return self.state in (TransferState.HELD, TransferState.DRAINING)


@dataclass
class DecodeTransfer:
    """Scheduler-side life of one request on the decode engine.

    Events: ``allocated`` (blocks allocated, target can be published), ``recv_done``
    (workers reported finished receiving, ``ok`` False when the push failed or
    timed out) and ``finished`` (vLLM ``request_finished``).
    """

    state: TransferState = TransferState.AWAIT_ALLOC
    history: list[str] = field(default_factory=list)

    def _go(self, event: str, state: TransferState, *actions: Action) -> Outcome:
        self.history.append(event)
        self.state = state
        return Outcome(state, tuple(actions))

    def _stay(self, event: str) -> Outcome:
        self.history.append(event)
        return Outcome(self.state)

    def on_allocated(self) -> Outcome:
        """Blocks for the prompt were allocated."""
        if self.state is TransferState.AWAIT_ALLOC:
            return self._go("allocated", TransferState.RECEIVING, Action.PUBLISH_TARGET)
        return self._stay("allocated")

    def on_recv_done(self, ok: bool) -> Outcome:
        """Workers reported the receive over (``PushDone`` or deadline)."""
        s = self.state
        if s is TransferState.RECEIVING:
            if ok:
                return self._go("recv_done", TransferState.RECEIVED)
            return self._go("recv_done", TransferState.FAILED, Action.PUBLISH_CANCEL)
        if s is TransferState.ABANDONED:
            return self._go("recv_done", TransferState.DONE)
        return self._stay("recv_done")

    def on_finished(self) -> Outcome:
        """vLLM ended the request (done, aborted or failed)."""
        s = self.state
        if s is TransferState.AWAIT_ALLOC:
            return self._go("finished", TransferState.ABORTED,
                            Action.PUBLISH_CANCEL, Action.RELEASE_RESERVATION)
        if s is TransferState.RECEIVING:
            return self._go("finished", TransferState.ABANDONED, Action.PUBLISH_CANCEL,
                            Action.ABANDON_RECV, Action.RELEASE_RESERVATION)
        if s in (TransferState.RECEIVED, TransferState.FAILED):
            return self._go("finished", TransferState.DONE, Action.RELEASE_RESERVATION)
        return self._stay("finished")
