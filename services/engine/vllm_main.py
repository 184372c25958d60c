"""The engine process's main module: vLLM's OpenAI API server, with its engine core forked.

On CPU, vLLM starts the engine core with ``spawn``: a fresh interpreter that imports torch
and vLLM again, seconds of CPU on every engine start and restart (half of a tiny engine's
boot on this machine) before it does any work. The API server has imported all of it by the
time it starts the engine core, and at that point it runs no thread but pyzmq's I/O threads
(no OpenMP pool, no tokenizer pool), so the engine core is forked from it instead: it starts
with everything imported, and an engine restarts in about half the time, which is what a
fleet's failover and scale-up wait for. A traced engine also runs OpenTelemetry's batch
span processor, which has exported nothing yet and renews its locks, queue and thread in a
forked child.

Should the API server hold any other thread when it starts the engine core, or the operator
ask for ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, the engine core is spawned as vLLM would.
Tensor-parallel workers are always spawned, by the engine core, as vLLM does.

This module stays cheap to import: a spawned child imports its parent's main module first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import runpy
import signal
import threading
import time
from contextlib import suppress
from multiprocessing.context import BaseContext

logger = logging.getLogger(__name__)

#: pyzmq's background threads (one pair per context) only wait on their own sockets; a fork
#: copies none of them and pyzmq gives the child fresh contexts.
_FORK_SAFE_THREAD_PREFIXES = ("ZMQbg/",)
#: Python threads (by their Python name; the kernel's name is the process's) that are safe
#: to fork past: OpenTelemetry's batch processors reinitialise their locks, empty their
#: queue and start a new worker in a forked child (os.register_at_fork).
_FORK_SAFE_PYTHON_THREADS = ("OtelBatch",)
_THREAD_NAMING_GRACE_S = 1.0


def foreign_threads(task_dir: str = "/proc/self/task") -> list[str]:
    """Names of this process's threads, other than the calling one, that are not known to
    be safe to fork past (a lock one of them holds would stay held in the child)."""
    me = str(threading.get_native_id())
    safe = {str(t.native_id) for t in threading.enumerate()
            if t.name.startswith(_FORK_SAFE_PYTHON_THREADS)}
    names = []
    for tid in os.listdir(task_dir):
        if tid == me or tid in safe:
            continue
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if not name.startswith(_FORK_SAFE_THREAD_PREFIXES):
            names.append(name)
    return names


def forget_parent_signals() -> None:
    """Drop the signal wakeup fd a forked child inherits: the API server's event loop set
    one, and the engine core would otherwise write the signals it catches into its
    parent's loop."""
    with suppress(ValueError):  # not the main thread: it has no wakeup fd to forget
        signal.set_wakeup_fd(-1)


def engine_core_context(spawn_requested: bool) -> BaseContext:
    """The multiprocessing context the engine core is started with: ``fork`` unless that
    is unsafe or the operator asked for ``spawn``."""
    if not spawn_requested:
        # A thread names itself just after it starts (pyzmq's do), so a thread still
        # carrying the process's name may be one that has not run yet: look again briefly.
        deadline = time.monotonic() + _THREAD_NAMING_GRACE_S
        while others := foreign_threads():
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        else:
            return multiprocessing.get_context("fork")
        logger.warning("engine core spawned, not forked: the API server runs threads %s", others)
    return multiprocessing.get_context("spawn")


def main() -> None:
    """Run vLLM's API server as ``python -m vllm.entrypoints.openai.api_server`` would, with
    the same arguments (``sys.argv``), its engine core forked where that is safe."""
    # Read before vLLM's CPU platform overwrites it with its own choice.
    spawn_requested = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = lambda: engine_core_context(spawn_requested)
    os.register_at_fork(after_in_child=forget_parent_signals)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")


if __name__ == "__main__":
    main()
