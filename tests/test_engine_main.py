"""The engine's main module forks vLLM's engine core only when nothing in the API server
makes a fork unsafe: each case runs in a fresh interpreter so its threads are the only ones."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(body: str) -> str:
    code = "from kvpush.services.engine import vllm_main as m\n" + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_lone_main_thread_forks_the_engine_core() -> None:
    assert _run("""
        print(m.foreign_threads(), m.engine_core_context(False).get_start_method())
    """) == "[] fork"


def test_pyzmq_io_threads_do_not_prevent_the_fork() -> None:
    out = _run("""
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind("tcp://127.0.0.1:*")
        print(m.engine_core_context(False).get_start_method())
        sock.close(linger=0)
        ctx.term()
    """)
    assert out == "fork"


def test_a_traced_api_servers_span_processor_does_not_prevent_the_fork() -> None:
    """vLLM's ``--otlp-traces-endpoint`` starts OpenTelemetry's batch span processor in the
    API server; it renews itself in a forked child, which still exports its spans."""
    out = _run("""
        import os
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter)
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
        ctx = m.engine_core_context(False)
        print(m.foreign_threads(), ctx.get_start_method())
        pid = os.fork()
        if pid == 0:
            with provider.get_tracer("t").start_as_current_span("in-child"):
                pass
            provider.force_flush()
            names = [s.name for s in exporter.get_finished_spans()]
            os._exit(0 if names == ["in-child"] else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out == "[] fork\n0"


def test_any_other_thread_makes_the_engine_core_spawn() -> None:
    out = _run("""
        import threading
        stop = threading.Event()
        t = threading.Thread(target=stop.wait, daemon=True)
        t.start()
        print(len(m.foreign_threads()), m.engine_core_context(False).get_start_method())
        stop.set()
    """)
    assert out == "1 spawn"


def test_an_operator_asking_for_spawn_gets_spawn() -> None:
    assert _run("print(m.engine_core_context(True).get_start_method())") == "spawn"


def test_a_forked_child_does_not_signal_through_the_parents_wakeup_fd() -> None:
    out = _run("""
        import os, signal, socket
        r, w = socket.socketpair()
        w.setblocking(False)
        signal.set_wakeup_fd(w.fileno())
        os.register_at_fork(after_in_child=m.forget_parent_signals)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out == "0"
