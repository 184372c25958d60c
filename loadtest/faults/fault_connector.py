"""The kvpush connector with a fault a scenario arms: a prefill worker that stops itself
(SIGSTOP, the whole engine process) inside a push, after the push passed its deadline check
and before the transport posts a layer's WRITE, as a long GC or page-fault stall or a paused
VM can stop it. Unarmed it is exactly ``KVPushConnector``.

The arm file is named by ``fault_arm_file`` in ``kv_connector_extra_config``; writing
``stop_before_write <layer>`` into it arms the next WRITE of that layer (its region index).
The worker empties the file, prints ``KVPUSH-FAULT stopped`` to the engine log and stops;
the scenario sends SIGCONT, and the WRITE goes out however late it now is.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvpush.connector.push_connector import KVPushConnector
from kvpush.connector.transport import Peer, Xfer


class StallingPushConnector(KVPushConnector):
    """``KVPushConnector`` whose prefill worker can be stopped right before a WRITE."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register as the connector does, then put the stop in front of every WRITE."""
        super().register_kv_caches(kv_caches)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        side = self.worker_side
        if side is None or side.transport is None or not extra.get("fault_arm_file"):
            return
        arm, transport = Path(extra["fault_arm_file"]), side.transport
        write = transport.write

        def stalling_write(peer: Peer, regions: Sequence[int], local: Sequence[int],
                           remote: Sequence[int], *args: Any, **kwargs: Any) -> Xfer:
            try:
                words = arm.read_text().split()
            except OSError:
                words = []
            if len(words) == 2 and words[0] == "stop_before_write" \
                    and int(words[1]) in regions:
                arm.write_text("")
                print("KVPUSH-FAULT stopped", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return write(peer, regions, local, remote, *args, **kwargs)

        transport.write = stalling_write  # type: ignore[method-assign]
