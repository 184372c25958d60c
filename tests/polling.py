"""Polling helpers the tests share: wait for a condition, and list the processes still
running."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil


def until(pred: Callable[[], Any], what: str, timeout_s: float, step_s: float = 0.1,
          ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); the timeout only keeps a
    broken build from hanging. Exceptions of the ``ignore`` types count as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if value := pred():
                return value
        except ignore:
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step_s)


def alive(procs: Iterable[psutil.Process | int]) -> list[int]:
    """Pids among ``procs`` (processes or pids) still running; zombies count as gone."""
    out = []
    for p in procs:
        try:
            proc = p if isinstance(p, psutil.Process) else psutil.Process(p)
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return out
