"""A pytest fixture that runs a private ``redis-server`` on a free loopback port.

Use it from a test module with ``from redis_fixture import redis_server``, or for
the whole suite with ``pytest_plugins = ["redis_fixture"]`` in tests/conftest.py.

``redis_server`` (function scope) yields a :class:`RedisServer` with ``url``,
``port``, ``kill()`` (SIGKILL), ``restart()`` (same port), ``pause()`` /
``resume()`` (SIGSTOP / SIGCONT: the server accepts connections but never
answers, for timeout tests) and ``alive``. The server runs without persistence
(``--save '' --appendonly no``) in a temporary directory and is stopped at
teardown. Tests are skipped when no ``redis-server`` binary is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from service_util import wait_until_ready

__all__ = ["RedisServer", "redis_server", "redis_server_binary"]

_START_TIMEOUT = 60.0  # a safety stop only: a busy machine starts a server slowly


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; see the module docstring."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = Path(workdir)
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self._paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.alive:
            return
        log = open(self.workdir / "redis.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.workdir),
                    "--daemonize", "no",
                    "--protected-mode", "yes",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        finally:
            log.close()
        if wait_until_ready(self.proc, lambda: _ping(self.port), _START_TIMEOUT, 0.02):
            return
        self.stop()
        tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the server (clients see connection errors); restart() brings it back."""
        if self.proc is None:
            return
        if self._paused:
            self.resume()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Kill if running, then start again on the same port (data is lost: no persistence)."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections still open, no command is answered."""
        if self.alive and not self._paused:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self.proc is not None and self._paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self._paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self._paused:
            self.resume()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A private redis-server for one test; skips the test if redis-server is not installed."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (e.g. apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing and binding
        server = RedisServer(binary, workdir)
        try:
            server.start()
            break
        except RuntimeError as exc:
            last_error = exc
    else:
        raise RuntimeError(f"could not start redis-server: {last_error}")
    try:
        yield server
    finally:
        server.stop()
