"""Process hygiene: children die with their launcher (even SIGKILLed); clean stop on signals."""

from __future__ import annotations

import ctypes
import logging
import signal
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """``preexec_fn`` that asks the kernel to SIGTERM the child when its parent dies.

    This is what keeps ``kvpush engine`` / ``kvpush up`` from leaving orphan engines behind
    when they are killed with SIGKILL and get no chance to clean up.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_event_on_signals(what: str) -> threading.Event:
    """An event set by SIGTERM or SIGINT, for foreground commands that stop cleanly."""
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: stopping %s", signum, what)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return stop


def drain_events_on_signals(what: str) -> tuple[threading.Event, threading.Event]:
    """Two events for commands that drain before they stop: the first SIGTERM or SIGINT
    sets ``stop`` (drain, then stop), any later one sets ``now`` (stop at once)."""
    stop, now = threading.Event(), threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            logger.info("signal %d again: stopping %s at once", signum, what)
            now.set()
        else:
            logger.info("signal %d: draining %s, then stopping (signal again to stop now)",
                        signum, what)
            stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return stop, now
