"""Logging setup shared by every kvpush process."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once; respects KVPUSH_LOG_LEVEL when no level is given."""
    lvl = (level or os.environ.get("KVPUSH_LOG_LEVEL") or "INFO").upper()
    root = logging.getLogger()
    if not any(getattr(h, "_kvpush", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._kvpush = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(lvl)
