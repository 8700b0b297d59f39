"""A pytest fixture that runs a private ``mooncake_master`` on free loopback ports.

``mooncake_master`` (function scope) yields a :class:`MooncakeMaster` with
``url`` (``mooncake://127.0.0.1:PORT?segment_mb=..&buffer_mb=..&listen=any``), ``port``,
``kill()`` (SIGKILL: every key is lost), ``restart()`` (same port) and
``alive``. Tests are skipped, with the reason, when ``mooncake.store`` does not
import (the ``[mooncake]`` extra, or ``libibverbs1``, is missing) or no
``mooncake_master`` binary is found next to the interpreter or on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
from pathlib import Path

import pytest

from hicache_fsm.storage.mooncake import mooncake_available
from service_util import wait_until_ready

__all__ = ["MooncakeMaster", "free_port", "mooncake_master", "mooncake_master_binary", "start_master"]

_START_TIMEOUT = 60.0  # a safety stop only: a busy machine starts a server slowly
SMALL = "segment_mb=64&buffer_mb=16&listen=any"  # test clients mount little memory; this mooncake listens on every interface


def mooncake_master_binary() -> str | None:
    beside = os.path.join(sysconfig.get_path("scripts"), "mooncake_master")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """One mooncake_master process on 127.0.0.1; see the module docstring."""

    def __init__(self, binary: str, workdir: Path, client_ttl: int = 10) -> None:
        self.binary = binary
        self.workdir = Path(workdir)
        self.port = free_port()
        self.metrics_port = free_port()
        self.client_ttl = client_ttl
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}?{SMALL}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.alive:
            return
        with open(self.workdir / "master.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--rpc_port={self.port}",
                    "--rpc_address=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--metrics_host=127.0.0.1",
                    "--enable_metric_reporting=false",
                    f"--client_ttl={self.client_ttl}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        if wait_until_ready(self.proc, lambda: _listening(self.port), _START_TIMEOUT, 0.05):
            return
        self.stop()
        tail = (self.workdir / "master.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"mooncake_master did not listen on port {self.port}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the master: clients see RPC failures, and every key is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


def start_master(workdir: Path, **kwargs) -> MooncakeMaster:
    """Start a master (skips the test when mooncake is missing); the caller stops it."""
    reason = mooncake_available()
    if reason:
        pytest.skip(reason)
    binary = mooncake_master_binary()
    if binary is None:
        pytest.skip("no mooncake_master binary (pip install 'hicache_fsm[mooncake]')")
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing and binding
        master = MooncakeMaster(binary, workdir, **kwargs)
        try:
            master.start()
            return master
        except RuntimeError as exc:
            last_error = exc
    raise RuntimeError(f"could not start mooncake_master: {last_error}")


@pytest.fixture
def mooncake_master(tmp_path_factory: pytest.TempPathFactory):
    """A private mooncake_master for one test."""
    master = start_master(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master
    finally:
        master.stop()
