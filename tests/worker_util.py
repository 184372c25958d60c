"""Helpers for tests that drive a connector ``WorkerSide`` (or load a script) by hand."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvpush.connector.metadata import KVPushMetadata
from kvpush.connector.worker_side import WorkerSide


def engine_step(side: WorkerSide, meta: KVPushMetadata | None = None, *,
                layers: Sequence[str]) -> tuple[set[str], set[str], set[str]]:
    """One engine step as vLLM drives a worker: preemptions, metadata, every layer's hook,
    the end of the forward pass, then the transfer results."""
    meta = meta or KVPushMetadata()
    side.handle_preemptions(meta.preempted)
    side.on_metadata(meta)
    for name in layers:
        side.save_kv_layer(name)
    side.wait_for_save()
    return side.get_transfer_results()


def age_quarantines(side: WorkerSide, seconds: float) -> None:
    """Make every receive ``side`` holds quarantined ``seconds`` older (its bound is on the
    monotonic clock, which a test cannot move)."""
    for job in side.receiver.jobs.values():
        job.quarantined_ns -= int(seconds * 1e9)


def load_script(path: Path) -> ModuleType:
    """A file under scripts/ (not a package) loaded as a module of its own name."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module
