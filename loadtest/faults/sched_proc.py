"""The real push scheduler as a subprocess, with a crash point that a fault scenario arms.

Writing ``after_read`` or ``after_reserve`` into ``$KVPUSH_FAULT_ARM_FILE`` makes the next
batch stop forever at that point (after ``XREADGROUP``, or after reserving but before the
assignment ``XADD`` and the ``XACK``); the process prints ``CRASHPOINT <n>`` and waits to be
SIGKILLed. Unarmed it is exactly ``services.scheduler.Scheduler``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from kvpush.common.log import setup_logging
from kvpush.common.runtime import run
from kvpush.common.settings import SchedulerSettings
from kvpush.services.scheduler import Scheduler, run_scheduler

ARM = Path(os.environ.get("KVPUSH_FAULT_ARM_FILE", "/nonexistent"))


def _armed(point: str) -> bool:
    try:
        return ARM.read_text().strip() == point
    except OSError:
        return False


class FaultScheduler(Scheduler):
    async def handle_entries(self, entries, deliveries=None):
        if entries and _armed("after_read"):
            print("CRASHPOINT", len(entries), flush=True)
            await asyncio.Event().wait()
        await super().handle_entries(entries, deliveries)

    async def answer(self, out):
        if out.assignments and _armed("after_reserve"):
            print("CRASHPOINT", len(out.assignments), flush=True)
            await asyncio.Event().wait()
        await super().answer(out)


async def main() -> None:
    settings = SchedulerSettings()
    await run_scheduler(settings, FaultScheduler(settings))


if __name__ == "__main__":
    setup_logging(SchedulerSettings().log_level)
    run(main())
