"""Per-request transfer states, one enum per role; the scheduler side's pure machines."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    """Where one request stands on the prefill engine's scheduler side."""

    WAIT_TARGET = "wait_target"
    """Prefill is running; decode has not published where the KV goes yet."""
    PUSHING = "pushing"
    """Target known, prefill still running: layers are written as they are computed."""
    HELD = "held"
    """Prefill finished before the target arrived: its blocks are held for the push."""
    DRAINING = "draining"
    """Prefill finished and the worker owns the push (writes, seal or cancel in flight)."""
    DONE = "done"
    """The workers reported the push over; vLLM frees the blocks."""
    EXPIRED = "expired"
    """The deadline passed before any target: nothing is or will be pushed."""
    ABORTED = "aborted"
    """The request ended with nothing pushed and no block held."""

    @property
    def terminal(self) -> bool:
        """True once nothing more happens to the request."""
        return self in (PrefillState.DONE, PrefillState.EXPIRED, PrefillState.ABORTED)


class DecodeState(enum.Enum):
    """Where one request stands on the decode engine's scheduler side."""

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
    DONE = "done"
    """The request ended after its receive did; the reservation is released."""
    ABORTED = "aborted"
    """The request ended before its blocks were allocated."""

    @property
    def terminal(self) -> bool:
        """True once nothing more happens to the request."""
        return self in (DecodeState.DONE, DecodeState.ABORTED)


class PushState(enum.Enum):
    """A prefill worker's push of one request (``sender.PushJob``)."""

    WAIT_TARGET = "wait_target"
    """No target yet: blocks are computed but nothing is written."""
    PUSHING = "pushing"
    """Peer ready: WRITEs are posted as blocks become final."""
    DONE = "done"
    """Every block written and complete; PushDone ok=True goes out."""
    ABORTED = "aborted"
    """Stopped on purpose (cancelled, released, deadline); PushDone ok=False goes out."""
    FAILED = "failed"
    """A WRITE or the peer failed; PushDone ok=False goes out when the peer is known."""

    @property
    def ended(self) -> bool:
        """True once no WRITE will be posted and PushDone can be sealed."""
        return self in (PushState.DONE, PushState.ABORTED, PushState.FAILED)


class RecvState(enum.Enum):
    """A decode worker's receive of one request (``receiver.RecvJob``)."""

    RECEIVING = "receiving"
    """Waiting for PushDone; the request waits in vLLM (or ended meanwhile: abandoned)."""
    QUARANTINED = "quarantined"
    """Given up (failed, deadline passed), but a prefill rank may still have WRITEs in
    flight: vLLM keeps the blocks until every rank that writes them said none can land
    (``PushDone.fenced``), or ``quarantine_max_s`` passed."""


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


@dataclass
class Transition:
    """What an event did: the new state, the side effects, and for
    ``request_finished`` whether vLLM must keep the blocks."""

    state: PrefillState | DecodeState
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

    state: PrefillState = PrefillState.WAIT_TARGET
    has_target: bool = False
    cancelled: bool = False
    history: list[str] = field(default_factory=list)

    def _go(self, event: str, state: PrefillState, *actions: Action,
            hold: bool = False) -> Transition:
        self.history.append(event)
        self.state = state
        return Transition(state, tuple(actions), hold)

    def _stay(self, event: str) -> Transition:
        self.history.append(event)
        return Transition(self.state)

    def on_target(self) -> Transition:
        """Decode published the push target."""
        s = self.state
        if self.has_target or self.cancelled or s.terminal:
            return self._stay("target")
        self.has_target = True
        if s is PrefillState.WAIT_TARGET:
            return self._go("target", PrefillState.PUSHING, Action.SEND_TARGET)
        if s is PrefillState.HELD:
            return self._go("target", PrefillState.DRAINING, Action.SEND_TARGET)
        return self._stay("target")

    def on_cancel(self) -> Transition:
        """Decode no longer wants the KV (its request ended or failed)."""
        s = self.state
        if self.cancelled or s.terminal:
            return self._stay("cancel")
        self.cancelled = True
        if s is PrefillState.WAIT_TARGET:
            # Nothing written; prefill finishes on its own and frees normally.
            return self._stay("cancel")
        if s is PrefillState.PUSHING:
            return self._go("cancel", PrefillState.PUSHING, Action.CANCEL_PUSH)
        if s is PrefillState.HELD:
            return self._go("cancel", PrefillState.DRAINING, Action.RELEASE_BLOCKS)
        # DRAINING: the worker may have writes in flight; it must finish them.
        return self._go("cancel", PrefillState.DRAINING, Action.CANCEL_PUSH)

    def on_finished(self, ok: bool) -> Transition:
        """vLLM ended the request (``request_finished``); decides whether blocks are held."""
        s = self.state
        if s is PrefillState.WAIT_TARGET:
            if ok and not self.cancelled:
                return self._go("finished", PrefillState.HELD, hold=True)
            return self._go("finished", PrefillState.ABORTED)
        if s is PrefillState.PUSHING:
            # Writes may be in flight from the source blocks: the worker frees them.
            if ok and not self.cancelled:
                return self._go("finished", PrefillState.DRAINING, hold=True)
            return self._go("finished", PrefillState.DRAINING, Action.CANCEL_PUSH,
                            hold=True)
        if s.terminal:
            # Deadline passed while running: nothing was or will be written.
            return self._go("finished", s)
        # A second request_finished is a vLLM bug, but raising here would kill the engine
        # (this runs in its scheduler); the blocks stay held until the push ends.
        logger.warning("request_finished twice (state %s); keeping the blocks held", s.value)
        self.history.append("finished")
        return Transition(s, hold_blocks=self.holds_blocks)

    def on_deadline(self) -> Transition:
        """The push deadline passed."""
        s = self.state
        if s is PrefillState.WAIT_TARGET:
            return self._go("deadline", PrefillState.EXPIRED)
        if s is PrefillState.PUSHING:
            if self.cancelled:
                return self._stay("deadline")
            self.cancelled = True
            return self._go("deadline", PrefillState.PUSHING, Action.CANCEL_PUSH)
        if s is PrefillState.HELD:
            return self._go("deadline", PrefillState.DRAINING, Action.RELEASE_BLOCKS)
        if s is PrefillState.DRAINING and not self.cancelled:
            self.cancelled = True
            return self._go("deadline", PrefillState.DRAINING, Action.CANCEL_PUSH)
        return self._stay("deadline")

    def on_worker_done(self) -> Transition:
        """Every worker reported the request finished sending: vLLM frees the blocks."""
        if self.state is PrefillState.DRAINING:
            return self._go("worker_done", PrefillState.DONE)
        return self._stay("worker_done")

    @property
    def holds_blocks(self) -> bool:
        """True while vLLM keeps this request's blocks for the connector."""
        return self.state in (PrefillState.HELD, PrefillState.DRAINING)


@dataclass
class DecodeTransfer:
    """Scheduler-side life of one request on the decode engine.

    Events: ``allocated`` (blocks allocated, target can be published), ``recv_done``
    (workers reported finished receiving, ``ok`` False when the push failed or
    timed out) and ``finished`` (vLLM ``request_finished``).
    """

    state: DecodeState = DecodeState.AWAIT_ALLOC
    history: list[str] = field(default_factory=list)
    cancelled: bool = False  # prefill was told to stop

    def _go(self, event: str, state: DecodeState, *actions: Action) -> Transition:
        self.history.append(event)
        self.state = state
        if Action.PUBLISH_CANCEL in actions:
            if self.cancelled:
                actions = tuple(a for a in actions if a is not Action.PUBLISH_CANCEL)
            self.cancelled = True
        return Transition(state, tuple(actions))

    def _stay(self, event: str) -> Transition:
        self.history.append(event)
        return Transition(self.state)

    def on_allocated(self) -> Transition:
        """Blocks for the prompt were allocated."""
        if self.state is DecodeState.AWAIT_ALLOC:
            return self._go("allocated", DecodeState.RECEIVING, Action.PUBLISH_TARGET)
        return self._stay("allocated")

    def on_give_up(self) -> Transition:
        """The workers gave the receive up and hold its blocks until prefill fenced its
        WRITEs: prefill must hear that decode no longer wants them."""
        if self.state is DecodeState.RECEIVING:
            return self._go("give_up", DecodeState.RECEIVING, Action.PUBLISH_CANCEL)
        return self._stay("give_up")

    def on_recv_done(self, ok: bool) -> Transition:
        """Workers reported the receive over (``PushDone`` or deadline)."""
        s = self.state
        if s is DecodeState.RECEIVING:
            if ok:
                return self._go("recv_done", DecodeState.RECEIVED)
            return self._go("recv_done", DecodeState.FAILED, Action.PUBLISH_CANCEL)
        if s is DecodeState.ABANDONED:
            return self._go("recv_done", DecodeState.DONE)
        return self._stay("recv_done")

    def on_finished(self) -> Transition:
        """vLLM ended the request (done, aborted or failed)."""
        s = self.state
        if s is DecodeState.AWAIT_ALLOC:
            return self._go("finished", DecodeState.ABORTED,
                            Action.PUBLISH_CANCEL, Action.RELEASE_RESERVATION)
        if s is DecodeState.RECEIVING:
            return self._go("finished", DecodeState.ABANDONED, Action.PUBLISH_CANCEL,
                            Action.ABANDON_RECV, Action.RELEASE_RESERVATION)
        if s in (DecodeState.RECEIVED, DecodeState.FAILED):
            return self._go("finished", DecodeState.DONE, Action.RELEASE_RESERVATION)
        return self._stay("finished")
