"""The TCP sockets this process listens on, read from /proc (Linux), and a bounded RPC liveness probe.

A storage client library may open listeners of its own (Mooncake's transfer
engine does, on every interface); a backend compares what it listens on before
and after opening the library to refuse addresses the user did not give.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time

import attrs

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"


@attrs.frozen
class Listener:
    """One listening socket: its address and port."""

    address: str
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def own_listeners() -> set[Listener] | None:
    """The TCP sockets this process listens on; None where /proc cannot tell (not Linux)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = set()
        for table in PROC_TCP:
            if not os.path.exists(table):
                continue
            with open(table, encoding="ascii") as f:
                for line in f.read().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == LISTEN and fields[9] in inodes:
                        host, port = fields[1].rsplit(":", 1)
                        found.add(Listener(_address(host), int(port, 16)))
        return found
    except OSError:
        return None


def probe_rpc(host: str, port: int, timeout: float) -> str | None:
    """None when a server at ``host:port`` reacts within ``timeout`` seconds in all; else why not.

    Connects, sends a header no RPC server accepts, and waits for any reaction:
    a reply, or (what coro_rpc servers such as mooncake_master do) closing the
    connection. A process that accepts connections but never answers is
    caught here, in ``timeout``, instead of blocking the client library's setup.
    """
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(bytes(32))
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.recv(1)
            except ConnectionResetError:
                pass  # a reaction too
    except socket.timeout:
        return f"no answer within {timeout:g} s (connect_timeout)"
    except OSError as exc:
        return str(exc)
    return None


__all__ = ["Listener", "own_listeners", "probe_rpc"]
