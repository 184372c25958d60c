"""An embedded Redis server for the local stack and the tests: a real ``redis-server`` child."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from kvpush.services.local.ports import free_port
from kvpush.services.proc import child_preexec

logger = logging.getLogger(__name__)


class RedisUnavailable(RuntimeError):
    """No ``redis-server`` binary, or it did not come up."""


class LocalRedis:
    """A ``redis-server`` process bound to loopback, with its data under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        appendonly: bool = False,
        *,
        config_file: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        # redis-server enters --dir before it opens --logfile: a relative path would miss.
        self.workdir = Path(workdir).absolute()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.config_file = config_file
        """Config file read first (Sentinel mode needs one it can rewrite)."""
        self.extra_args = list(extra_args)
        """Further ``--option value`` pairs (cluster mode, replication, ``--sentinel``)."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL of this server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start the server and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisUnavailable("redis-server is not on PATH (run `make setup`)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            *([str(self.config_file)] if self.config_file is not None else []),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]
        # Own session: a Ctrl-C to the stack's process group must not stop Redis before the
        # engines have removed their status from it.
        self.proc = subprocess.Popen(args, preexec_fn=child_preexec, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited with {self.proc.returncode}")
            try:
                client.ping()
                logger.info("embedded Redis on %s", self.url)
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, no final save) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
