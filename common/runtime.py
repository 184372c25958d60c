"""Event-loop runner: every kvpush service runs its asyncio main on uvloop."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh uvloop event loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def freeze_startup_heap() -> None:
    """Put every object alive now (imported libraries, a loaded tokenizer, clients) out of
    the garbage collector's reach, as vLLM's API server does after its start.

    A full collection scans every tracked object, and nothing else runs on the event loop
    meanwhile. With a tokenizer and its libraries loaded, a gateway's full collections took
    0.4-1.0 s under ``kvpush bench overload``: every request in flight, admitted or about
    to be shed, waited that long, and the admitted requests' TTFT tail passed what the
    shedding estimate had admitted them under. Frozen objects are still freed when their
    last reference goes; only reference cycles among them are never collected, and startup
    leaves none worth collecting once ``gc.collect`` ran first.
    """
    gc.collect()
    gc.freeze()


async def watch_loop_lag(observe: Callable[[float], None], period_s: float) -> None:
    """Until cancelled, give ``observe`` the running event loop's lag each ``period_s``:
    how late a timer of that period fired (what every task on the loop waits too)."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period_s)
        observe(loop.time() - t - period_s)


def honour_cancellation() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop and the request got
    lost on the way.

    A ``cancel()`` that lands inside redis-py's asyncio read timeouts can come out as a
    ``TimeoutError`` that redis-py then retries or reads as "no data" (see redis/redis-py
    #2551 and #4063): the task keeps running with ``Task.cancelling()`` set, and whoever
    awaits it after cancelling waits forever. Every long-running loop calls this once a
    round; nothing in kvpush uncancels a task, so a pending request here is a lost one.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def sleep_unless_cancelled(seconds: float) -> None:
    """Sleep between two rounds of a background loop that calls Redis, first raising a
    cancel a library lost during the round (:func:`honour_cancellation`): such a loop,
    cancelled inside a redis-py call, would otherwise sleep and call again forever while
    its owner waits for it to end."""
    honour_cancellation()
    await asyncio.sleep(seconds)
