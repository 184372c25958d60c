"""What a first run sees when something is in the way: a port another program holds, an
unknown model, no Redis. Each is one line on stderr naming what to change (the flag or
setting), exit status 2, no traceback, and before anything slow starts: no engine boots
in these tests, which run the real ``kvpush`` command against real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvpush.services.local.ports import free_port, free_port_pair

HoldPort = Callable[..., int]


@pytest.fixture
def hold_port() -> Iterator[HoldPort]:
    """``hold_port()`` listens on a free loopback port (or the one given) as another
    program would, until the test ends, and returns it."""
    socks: list[socket.socket] = []

    def hold(port: int | None = None) -> int:
        sock = socket.socket()
        socks.append(sock)
        sock.bind(("127.0.0.1", free_port() if port is None else port))
        sock.listen()
        return int(sock.getsockname()[1])

    yield hold
    for sock in socks:
        sock.close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a first run: no KVPUSH_* settings but free ports of its own, so
    that nothing here meets another stack on this machine."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_")}
    return {**base, "KVPUSH_RUN_DIR": str(tmp_path / "run"),
            "KVPUSH_STACK_PORT": str(free_port()),
            "KVPUSH_STACK_REDIS_PORT": str(free_port()),
            "KVPUSH_STACK_PREFILL_PORT": str(free_port_pair()),
            "KVPUSH_STACK_DECODE_PORT": str(free_port_pair())}


def kvpush(args: list[str], env: dict[str, str]) -> str:
    """Run ``kvpush ARGS``; assert it failed as a first run should; its one error line."""
    proc = subprocess.run([sys.executable, "-m", "kvpush.services.cli", *args], env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"kvpush {args[0]}:")]
    assert len(lines) == 1, out
    return lines[0]


def test_up_with_its_api_port_taken_names_the_port_and_how_to_move_it(env, hold_port):
    port = hold_port()
    line = kvpush(["up", "--port", str(port)], env)
    assert f"port {port}" in line and "already in use" in line, line
    assert "--port or KVPUSH_STACK_PORT" in line, line
    # Without the flag, the setting says where the port came from.
    env["KVPUSH_STACK_PORT"] = str(port)
    assert "--port or KVPUSH_STACK_PORT" in kvpush(["up"], env)


def test_demo_with_the_stack_port_taken(env, hold_port):
    env["KVPUSH_STACK_PORT"] = str(hold_port())
    line = kvpush(["demo"], env)
    assert f"port {env['KVPUSH_STACK_PORT']}" in line, line
    assert "--port or KVPUSH_STACK_PORT" in line, line


def test_up_with_the_embedded_redis_port_taken(env, hold_port, tmp_path):
    env["KVPUSH_STACK_REDIS_PORT"] = str(hold_port())
    line = kvpush(["up"], env)
    assert f"port {env['KVPUSH_STACK_REDIS_PORT']} (the stack's embedded Redis)" in line, line
    assert "KVPUSH_STACK_REDIS_PORT" in line and "KVPUSH_REDIS_URL" in line, line
    assert not (tmp_path / "run" / "redis").exists(), "a redis-server was started"


@pytest.mark.parametrize("connector, role, offset, what", [
    ("kvpush", "PREFILL", 0, "HTTP port"),
    ("kvpush", "DECODE", 0, "HTTP port"),
    ("nixl-pull", "PREFILL", 1, "NIXL side channel"),
])
def test_up_with_an_engine_port_taken_fails_before_any_engine_boots(
        env, hold_port, tmp_path, connector, role, offset, what):
    first = int(env[f"KVPUSH_STACK_{role}_PORT"])
    hold_port(first + offset)
    line = kvpush(["up", "--connector", connector], env)
    assert f"port {first + offset} (engine " in line and what in line, line
    assert f"KVPUSH_STACK_{role}_PORT" in line, line
    # No engine was started: none wrote a log.
    assert not list((tmp_path / "run" / "logs").glob("*.log")), "an engine was started"


def test_gateway_with_its_port_taken_fails_before_it_registers(env, hold_port, redis_url):
    env["KVPUSH_REDIS_URL"] = redis_url
    port = hold_port()
    line = kvpush(["gateway", "--port", str(port)], env)
    assert f"port {port} (the gateway's OpenAI API)" in line, line
    assert "--port or KVPUSH_GATEWAY_PORT" in line, line
    env["KVPUSH_GATEWAY_PORT"] = str(port)
    assert "--port or KVPUSH_GATEWAY_PORT" in kvpush(["gateway"], env)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.keys("*") == [], "the gateway registered although it cannot serve"
    finally:
        client.close()


def test_engine_with_its_port_or_side_channel_taken(env, hold_port, redis_url):
    env["KVPUSH_REDIS_URL"] = redis_url
    port = hold_port()
    line = kvpush(["engine", "--port", str(port)], env)
    assert f"port {port} (the engine's HTTP port)" in line, line
    assert "--port or KVPUSH_ENGINE_PORT" in line, line
    side = hold_port()
    line = kvpush(["engine", "--role", "prefill", "--connector", "nixl-pull",
                   "--port", str(free_port()), "--side-channel-port", str(side)], env)
    assert f"port {side} (the engine's NIXL side channel)" in line, line
    assert "--side-channel-port or KVPUSH_ENGINE_SIDE_CHANNEL_PORT" in line, line


def test_up_with_an_unknown_model(env):
    line = kvpush(["up", "--model", "no-such-model"], env)
    assert "'no-such-model'" in line and "--model, KVPUSH_STACK_MODEL" in line, line


def test_services_that_need_redis_say_what_to_set_without_one(env):
    # No KVPUSH_REDIS_URL, and no local stack's Redis on its port.
    for command in ("gateway", "scheduler"):
        line = kvpush([command], env)
        assert "no Redis: set KVPUSH_REDIS_URL" in line, line


def test_a_server_that_does_not_come_up_is_one_line_and_a_bug_is_a_traceback(
        monkeypatch, capsys):
    from kvpush.services.cli.main import main
    from kvpush.services.engine.launcher import EngineExited
    from kvpush.services.local import stack as stack_mod

    def exits(*args: object, **kwargs: object) -> int:
        raise EngineExited("engine prefill-8100 exited with 1 before it was ready; see x.log")

    monkeypatch.setattr(stack_mod, "run_stack", exits)
    assert main(["up"]) == 1
    assert capsys.readouterr().err == (
        "kvpush up: engine prefill-8100 exited with 1 before it was ready; see x.log\n")

    def bug(*args: object, **kwargs: object) -> int:
        raise ValueError("a bug")

    monkeypatch.setattr(stack_mod, "run_stack", bug)
    with pytest.raises(ValueError, match="a bug"):
        main(["up"])


def test_ensure_port_free_names_a_taken_port_and_an_address_not_here(hold_port):
    import errno

    from kvpush.services.local.ports import PortUnavailable, ensure_port_free

    ensure_port_free("127.0.0.1", free_port(), "a test server", "KVPUSH_X_PORT")  # free: quiet
    port = hold_port()
    with pytest.raises(PortUnavailable) as taken:
        ensure_port_free("127.0.0.1", port, "a test server", "KVPUSH_X_PORT")
    assert isinstance(taken.value, OSError) and taken.value.errno == errno.EADDRINUSE
    assert str(taken.value) == (f"port {port} (a test server) is already in use on 127.0.0.1: "
                                "stop the program that holds it, or pick another port with "
                                "KVPUSH_X_PORT")
    # TEST-NET-1: an address of no interface here.
    with pytest.raises(PortUnavailable, match=r"cannot listen on 192\.0\.2\.1:\d+ \(a test "
                       r"server\): .*\(the port is set with KVPUSH_X_PORT\)"):
        ensure_port_free("192.0.2.1", free_port(), "a test server", "KVPUSH_X_PORT")
