"""Per-transfer statistics and the one place a push starts and ends (logs, stats file, tracing)."""

from __future__ import annotations

import json
import logging
import statistics
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

logger = logging.getLogger(__name__)


@dataclass
class PushRecord:
    """What one worker rank did for one request's push (or one receive on decode)."""

    kind: str  # "push" | "recv"
    rid: str
    engine_id: str
    peer_engine: str
    rank: int
    ok: bool = True
    error: str | None = None
    bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    xfers: int = 0
    layers: int = 0
    layerwise_xfers: int = 0
    first_post_ns: int = 0  # time.monotonic_ns() of the first WRITE post
    last_done_ns: int = 0  # when the last WRITE was seen complete
    notify_ns: int = 0  # when PushDone was sent (push) or received (recv)
    # (layer index, post time) of the layer-wise WRITEs of the step that ended the prompt
    layer_posts_ns: list[tuple[int, int]] = field(default_factory=list)
    forward_end_ns: int = 0  # end of the forward pass of that step
    wait_ms: float = 0.0  # recv: blocks published -> PushDone

    @property
    def post_to_done_ms(self) -> float:
        """First WRITE posted to last WRITE complete, in milliseconds."""
        if not self.first_post_ns or not self.last_done_ns:
            return 0.0
        return (self.last_done_ns - self.first_post_ns) / 1e6

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view, with the derived timing."""
        out = asdict(self)
        out["post_to_done_ms"] = round(self.post_to_done_ms, 3)
        return out


class KVPushStats(KVConnectorStats):
    """Stats vLLM moves from the workers to its logger: a list of finished transfers."""

    def reset(self) -> None:
        """Forget the interval's records."""
        self.data = {"transfers": []}

    def _records(self) -> list[dict[str, Any]]:
        return self.data.setdefault("transfers", [])

    def add(self, record: PushRecord) -> None:
        """Add one finished transfer."""
        self._records().append(record.to_dict())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Concatenate another interval's (or worker's) records."""
        self._records().extend(other.data.get("transfers", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counts, bytes and post-to-done time percentiles of the interval's pushes."""
        pushes = [r for r in self._records() if r["kind"] == "push"]
        recvs = [r for r in self._records() if r["kind"] == "recv"]
        times = sorted(r["post_to_done_ms"] for r in pushes if r["ok"])
        out: dict[str, int | float] = {
            "pushes": len(pushes),
            "push_failures": sum(1 for r in pushes if not r["ok"]),
            "recvs": len(recvs),
            "recv_failures": sum(1 for r in recvs if not r["ok"]),
            "bytes": sum(r["bytes"] for r in pushes),
            "blocks": sum(r["blocks"] for r in pushes),
            "descriptors": sum(r["descriptors"] for r in pushes),
        }
        if times:
            out["post_to_done_ms_p50"] = round(statistics.median(times), 3)
            out["post_to_done_ms_max"] = round(times[-1], 3)
        return out

    def is_empty(self) -> bool:
        """True when no transfer finished in the interval."""
        return not self._records()


class TransferObserver:
    """Where a push or receive starts and ends: the hook for logs, stats and tracing.

    OpenTelemetry spans (``kvpush.kv.push`` / ``kvpush.kv.wait``) belong in
    :meth:`started` and :meth:`finished`; nothing else in the connector needs to change.
    """

    def __init__(self, stats_file: str | None = None) -> None:
        self._stats = KVPushStats()
        self._stats.reset()
        self._lock = threading.Lock()
        self._file = stats_file

    def started(self, kind: str, rid: str, peer_engine: str) -> None:
        """A push posted its first WRITE, or a receive published its target."""
        logger.debug("kvpush %s start rid=%s peer=%s", kind, rid, peer_engine)

    def finished(self, record: PushRecord) -> None:
        """A push was sealed or given up, or a receive completed or failed."""
        if record.ok:
            logger.info(
                "kvpush %s rid=%s peer=%s rank=%s bytes=%s blocks=%s descs=%s xfers=%s "
                "layers=%s post_to_done_ms=%.3f",
                record.kind, record.rid, record.peer_engine, record.rank, record.bytes,
                record.blocks, record.descriptors, record.xfers, record.layers,
                record.post_to_done_ms,
            )
        else:
            logger.warning("kvpush %s rid=%s peer=%s failed: %s", record.kind, record.rid,
                           record.peer_engine, record.error)
        with self._lock:
            self._stats.add(record)
        if self._file:
            try:
                with open(self._file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record.to_dict()) + "\n")
            except OSError as exc:
                logger.warning("cannot append to stats file %s: %s", self._file, exc)

    def take(self) -> KVPushStats | None:
        """The records since the last call, or None when there are none."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVPushStats()
            self._stats.reset()
            return out
