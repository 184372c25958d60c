"""The kvpush connector with faults a scenario arms at run time, through a file.

* Prefill: a worker that stops itself (SIGSTOP, the whole engine process) inside a push,
  after the push passed its deadline check and before the transport posts a layer's WRITE,
  as a long GC or page-fault stall or a paused VM can stop it.
* Decode: a wall clock that runs ahead of the host's (the deadline judge of its receives),
  and the quarantine's bound changed, so that a measurement can run with the guard off.

Unarmed it is exactly ``KVPushConnector``. The arm file is named by ``fault_arm_file`` in
``kv_connector_extra_config``; each line arms one fault:

* ``stop_before_write <layer>``: the next WRITE of that layer (its region index) stops the
  engine; the line is removed and ``KVPUSH-FAULT stopped`` printed to the engine log. The
  scenario sends SIGCONT, and the WRITE goes out however late it now is.
* ``clock_skew_s <seconds>``: decode's receiver reads the wall clock this far ahead.
* ``quarantine_max_s <seconds>``: decode's bound on holding a failed push's blocks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvpush.common.wire import now_ms
from kvpush.connector import receiver as receiver_module
from kvpush.connector.push_connector import KVPushConnector
from kvpush.connector.transport import Peer, Xfer

_REREAD_S = 0.05  # the decode faults take effect within this


class _ArmFile:
    """The faults armed in one file, read again at most every ``_REREAD_S``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read_at = -1.0
        self._lines: list[list[str]] = []

    def lines(self, fresh: bool = False) -> list[list[str]]:
        if fresh or time.monotonic() - self._read_at > _REREAD_S:
            try:
                text = self.path.read_text()
            except OSError:
                text = ""
            self._lines = [line.split() for line in text.splitlines() if line.strip()]
            self._read_at = time.monotonic()
        return self._lines

    def value(self, word: str) -> float | None:
        for words in self.lines():
            if len(words) == 2 and words[0] == word:
                try:
                    return float(words[1])
                except ValueError:
                    return None
        return None

    def take(self, word: str, value: int) -> bool:
        """Whether ``word value`` is armed; if so it is removed (a one-shot fault)."""
        lines = self.lines(fresh=True)
        left = [w for w in lines if w != [word, str(value)]]
        if len(left) == len(lines):
            return False
        self.path.write_text("".join(" ".join(w) + "\n" for w in left))
        self._lines = left
        return True


class FaultPushConnector(KVPushConnector):
    """``KVPushConnector`` with the faults above; see the module docstring."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register as the connector does, then put the faults in place."""
        super().register_kv_caches(kv_caches)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        side = self.worker_side
        if side is None or side.transport is None or not extra.get("fault_arm_file"):
            return
        arm, transport, recv = _ArmFile(Path(extra["fault_arm_file"])), side.transport, \
            side.receiver
        write = transport.write
        default_bound = recv.cfg.quarantine_max_s

        def stalling_write(peer: Peer, regions: Sequence[int], local: Sequence[int],
                           remote: Sequence[int], *args: Any, **kwargs: Any) -> Xfer:
            if any(arm.take("stop_before_write", r) for r in set(regions)):
                print("KVPUSH-FAULT stopped", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return write(peer, regions, local, remote, *args, **kwargs)

        def skewed_now_ms() -> int:
            bound = arm.value("quarantine_max_s") or default_bound
            if bound != recv.cfg.quarantine_max_s:
                recv.cfg = recv.cfg.model_copy(update={"quarantine_max_s": bound})
            return now_ms() + int((arm.value("clock_skew_s") or 0.0) * 1000)

        transport.write = stalling_write  # type: ignore[method-assign]
        # The receiver reads the clock once per poll: the decode faults ride on it.
        receiver_module.now_ms = skewed_now_ms  # type: ignore[attr-defined]
