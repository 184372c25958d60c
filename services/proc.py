"""Child-process hygiene: children die with their launcher, even when it is SIGKILLed."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """``preexec_fn`` that asks the kernel to SIGTERM the child when its parent dies.

    This is what keeps ``kvpush engine`` / ``kvpush up`` from leaving orphan engines behind
    when they are killed with SIGKILL and get no chance to clean up.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
