"""Mooncake Store backend (``mooncake://HOST:PORT[?metadata=...&segment_mb=...&buffer_mb=...&listen=...]``).

Needs the ``[mooncake]`` extra (``mooncake-transfer-engine-non-cuda``; on Debian
also ``libibverbs1``, even for TCP). ``HOST:PORT`` is the ``mooncake_master``'s
RPC address; ``metadata`` defaults to ``P2PHANDSHAKE`` (or the master's HTTP
metadata server URL); each client mounts ``segment_mb`` MiB of its own memory
into the distributed pool and keeps a ``buffer_mb`` MiB transfer buffer.

* Zero-copy: the first call with a host pool registers the pool's whole backing
  storage (``register_buffer``); pages then go straight between the pool's page
  views and the store with ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers``. The shared header (magic, lengths,
  checksum, page format, key copy) travels in a small registered scratch
  buffer as the first part of the same object. Values not in registered memory
  (the bytes API) are copied.
* Payload checksum: ``none`` by default (``?checksum=wsum64`` or
  ``checksum=`` to add one). Pages live in peers' RAM and move over TCP/RDMA,
  whose own integrity checks cover the bytes; the header (key copy, page
  format, size, header CRC) is verified on every read, which is what catches a
  page stored under another key, in another format or cut short. Hashing each
  page on both sides would cost more than the transfer (about 2 GB/s here
  against Mooncake's ~10 GB/s).
* Keys already stored are skipped (``batch_is_exist`` first): Mooncake's
  ``put`` on an existing key keeps the old value anyway, and stored pages are
  content-addressed.
* A stored page whose holder died lingers for the master's client TTL
  (~10 s): ``is_exist`` says 1, the transfer fails. Such a read is a miss; so
  is a value of another size (another page format, or damaged: reported as
  ``format_mismatch`` / ``corrupt``). Unlike the other backends, this one
  leaves a corrupt value in place (Mooncake has no compare-and-delete), so the
  next backup of its node skips the key as stored. Writes that land on such a
  segment fail (``set_failures``) and are retried by the tier.
* An unreachable master raises :class:`~hicache_fsm.errors.StorageUnavailable`;
  at open this happens within ``connect_timeout`` seconds: the TCP connect and
  a handshake probe (a master that accepts but never answers) share it, before
  ``setup`` runs, tried again while a master that answers refuses the client
  (it just started, or the machine is loaded) until ``connect_timeout`` has
  passed. A master restart loses every key: reads then miss;
  ``data_epoch()`` goes up so the tier checks and stores its pages again.
  Keys the master evicts under memory pressure are not reported to eviction
  listeners (the client is never told); ``StorageTier.verify_stored`` finds them.
* ``segment_mb + buffer_mb`` past the memory available is refused before the
  library allocates. ``listen=local`` (default): the client may listen only on
  ``local_host``; this Mooncake version's transfer engine listens on every
  interface, so open fails (StorageError, nothing left open) unless the URL
  says ``listen=any``.
* ``clear()`` removes this namespace's keys (``remove_by_regex``, forced past
  leases); nothing else.

Environment set while the library loads and each client sets up, then put
back as it was (a refused attach leaves none of it behind):
``MC_TCP_BIND_ADDRESS``, this attach's own local host (``local_host``, else
``127.0.0.1`` for a loopback master: Mooncake would otherwise advertise a
non-loopback address); and, unless already set,
``MC_STORE_CLIENT_SETUP_RETRIES=1`` (a missing master would block ~90 s) and
``MC_LOG_LEVEL=ERROR`` / ``GLOG_minloglevel=2`` (its INFO logging is loud).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from hicache_fsm.errors import StorageError, StorageUnavailable, StorageURLError
from hicache_fsm.input_limits import available_memory_bytes
from hicache_fsm.storage.backend_checks import check_seconds
from hicache_fsm.storage.base import (
    EXISTS,
    FAILED,
    WRITTEN,
    StorageBackend,
    check_host_pool,
)
from hicache_fsm.storage.blob import HEADER, CorruptPage, decode_blob, parse_header, verify_payload
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.listeners import own_listeners, probe_rpc
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["MooncakeBackend", "mooncake_available"]

logger = logging.getLogger("hicache_fsm.storage")

# Mooncake error codes this backend tells apart (mooncake-store types.h)
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
# TRANSFER_FAIL (-800): the holder is gone, or the buffers do not fit the value: a miss
_UNREACHABLE_BELOW = -900  # RPC_FAIL and below (metadata service, client state): the master is not answering

_QUERY_KEYS = ("metadata", "segment_mb", "buffer_mb", "local_host", "checksum", "listen")
_SCRATCH_BYTES = 1 << 20
_MAX_MIB_DIGITS = 9  # 10**9 MiB is past any machine; longer numbers are refused before int()
SETUP_RETRY_S = 0.2  # between two setups a master refused, within connect_timeout
_EPOCH_KEY = "__hicache_fsm_epoch__"  # one small object per client: gone after a master restart lost every key


_QUIET = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
_ENV_LOCK = threading.RLock()  # os.environ is the process's: one attach at a time sets and restores it


@contextlib.contextmanager
def _library_env(bind_address: str | None = None) -> Iterator[None]:
    """The environment the library reads as it loads and sets up (setup retries, log level: unless set; the
    bind address: this attach's), restored on leaving, so no attach, refused or not, changes the process's."""
    wanted = {name: os.environ.get(name, value) for name, value in _QUIET.items()}
    if bind_address is not None:
        wanted["MC_TCP_BIND_ADDRESS"] = bind_address
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def mooncake_available() -> str | None:
    """None when ``mooncake.store`` imports; else why not (for skips and error messages)."""
    try:
        with _library_env():
            import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError for a missing libibverbs
        return f"mooncake is not importable ({type(exc).__name__}: {exc}); pip install 'hicache_fsm[mooncake]'"
    return None


def _parse_url(url: str) -> tuple[str, int, dict[str, str]]:
    parts = urlsplit(url)
    if parts.scheme.lower() != "mooncake" or parts.path not in ("", "/"):
        raise StorageURLError(f"mooncake URLs look like mooncake://HOST:PORT[?metadata=...], got {url!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise StorageURLError(f"bad port in {url!r}: {exc}") from None
    if not host or port is None:
        raise StorageURLError(f"mooncake URLs need HOST:PORT (the master's RPC port), got {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(_QUERY_KEYS))
    if unknown:
        raise StorageURLError(f"unknown mooncake URL parameters {unknown}; known: {', '.join(_QUERY_KEYS)}")
    return host, port, query


def _mib(query: dict[str, str], name: str, default: int) -> int:
    text = query.get(name)
    if text is None:
        return default << 20
    if not re.fullmatch(f"[0-9]{{1,{_MAX_MIB_DIGITS}}}", text) or int(text) < 1:
        raise StorageURLError(f"{name} must be a positive number of MiB, got {text[:40]!r}")
    return int(text) << 20


def _check_memory(segment: int, buffer: int) -> None:
    """Refuse, before the library allocates, a segment plus buffer this machine does not have."""
    available = available_memory_bytes()
    if segment + buffer > available:
        raise StorageURLError(f"segment_mb + buffer_mb = {(segment + buffer) >> 20} MiB is more than the "
                              f"{available >> 20} MiB of memory available")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_address(master: str, port: int) -> str:
    """The address this host reaches the master from (what the store advertises)."""
    if _is_loopback(master):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((master, port))
        return sock.getsockname()[0]


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class MooncakeBackend(StorageBackend):
    """Pages as Mooncake Store objects under ``namespace.prefix + key`` (see the module docstring)."""

    scheme = "mooncake"

    def __init__(
        self,
        url: str,
        namespace: KeyNamespace | None = None,
        *,
        connect_timeout: float = 2.0,
        checksum: str | None = None,
        page_format: PageFormat | None = None,
    ) -> None:
        host, port, query = _parse_url(url)
        super().__init__(namespace, checksum=checksum or query.get("checksum") or "none", page_format=page_format)
        self.url = url
        self.master = f"{host}:{port}"
        metadata = query.get("metadata") or "P2PHANDSHAKE"
        segment = _mib(query, "segment_mb", 256)
        buffer = _mib(query, "buffer_mb", 64)
        listen = query.get("listen", "local")
        if listen not in ("local", "any"):
            raise StorageURLError(f"listen must be 'local' or 'any', got {listen[:40]!r}")
        timeout = check_seconds("connect_timeout", connect_timeout)
        _check_memory(segment, buffer)
        missing = mooncake_available()
        if missing:
            raise StorageUnavailable(missing)
        why = probe_rpc(host, port, timeout)  # connect and a bounded handshake: setup alone could block ~30 s
        if why is not None:
            raise StorageUnavailable(f"mooncake master {self.master} unreachable: {why}")
        local = query.get("local_host") or _local_address(host, port)
        before = own_listeners()
        with _library_env(local):
            self._mc = self._set_up(local, metadata, segment, buffer, timeout)
        if listen == "local":
            self._refuse_foreign_listeners(before, local)
        self.epoch = 0
        self._epoch_marked = False
        self._epoch_key = f"{self.namespace.prefix}{_EPOCH_KEY}{os.getpid()}_{id(self):x}"
        self._lock = threading.Lock()  # one call at a time: the scratch buffer is shared
        self._regions: list[tuple[int, int]] = []
        self._registered: list[Any] = []  # keeps registered tensors / storages alive
        self._scratch = torch.empty(_SCRATCH_BYTES, dtype=torch.uint8)
        self._register(self._scratch.data_ptr(), _SCRATCH_BYTES, self._scratch)
        self._scratch_view = memoryview(self._scratch.numpy())

    def _set_up(self, local: str, metadata: str, segment: int, buffer: int, timeout: float) -> Any:
        """A client set up with the master (StorageUnavailable when it still refuses after ``timeout`` seconds).

        A master that answers the handshake may still refuse its first clients (one just started, or a
        loaded machine: "Client not available"): setup is tried again until ``timeout`` has passed.
        """
        from mooncake.store import MooncakeDistributedStore

        deadline = time.monotonic() + timeout
        while True:
            client = MooncakeDistributedStore()
            code = client.setup(local, metadata, segment, buffer, "tcp", "", self.master)
            if code == 0:
                return client
            client.close()
            if time.monotonic() >= deadline:
                raise StorageUnavailable(f"mooncake setup with master {self.master} failed (code {code})")
            time.sleep(SETUP_RETRY_S)

    def _refuse_foreign_listeners(self, before: set | None, local: str) -> None:
        """StorageError (store closed) when setup opened a listener on an address other than ``local``."""
        after = own_listeners()
        if before is None or after is None:
            return  # no /proc: nothing to compare (documented)
        foreign = sorted(str(li) for li in after - before if li.address != local)
        if foreign:
            self._mc.close()
            raise StorageError(
                f"the mooncake client listens on {', '.join(foreign)}, not only on {local}: this mooncake "
                "version binds its transfer listeners to every interface; add listen=any to the URL to accept that")

    # -- registration -------------------------------------------------------

    @property
    def raw_store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for baselines in benchmarks)."""
        return self._mc

    def _register(self, ptr: int, size: int, owner: Any) -> None:
        code = self._mc.register_buffer(ptr, size)
        if code != 0:
            raise StorageError(f"mooncake register_buffer of {size} bytes failed (code {code})")
        self._regions.append((ptr, ptr + size))
        self._registered.append(owner)

    def register_memory(self, tensor: torch.Tensor) -> None:
        """Register the whole storage behind a CPU tensor for zero-copy transfers (once per storage)."""
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if size and not self._inside(ptr, size):
                self._register(ptr, size, storage)

    def _inside(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= end for start, end in self._regions)

    def _register_pool(self, host_pool: Any, page_ids: Sequence[int]) -> None:
        views = getattr(host_pool, "page_views", None)
        ids = page_ids.tolist() if hasattr(page_ids, "tolist") else list(page_ids)
        if views is None or not ids:
            return
        for view in views(ids[0]):
            if isinstance(view, torch.Tensor) and view.device.type == "cpu":
                self.register_memory(view)

    def batch_get_into(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        check_host_pool(host_pool)
        if not self.closed:
            self._register_pool(host_pool, page_ids)
        return super().batch_get_into(keys, host_pool, page_ids)

    def batch_set_from(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        check_host_pool(host_pool)
        if not self.closed:
            self._register_pool(host_pool, page_ids)
        return super().batch_set_from(keys, host_pool, page_ids)

    # -- hooks ----------------------------------------------------------------

    def _check(self, code: int, what: str) -> None:
        if code <= _UNREACHABLE_BELOW:
            raise StorageUnavailable(f"mooncake {what}: master {self.master} not answering (code {code})")

    def data_epoch(self) -> int:
        """Goes up each time the master is found to have lost what this client stored (a restart).

        A small marker object is stored at the first check; when it is gone,
        every key stored before may be gone too: whoever marked pages stored
        must check them again (``batch_exists``) and store the missing ones.
        """
        self._check_open()
        with self._lock:
            codes = self._mc.batch_is_exist([self._epoch_key])
            if codes and codes[0] < 0:
                self._check(codes[0], "is_exist")
                raise StorageError(f"mooncake is_exist failed (code {codes[0]})")
            if not codes or codes[0] == 0:
                if self._epoch_marked:
                    self.epoch += 1
                    logger.warning("mooncake master %s lost this client's keys (restart?); epoch %d",
                                   self.master, self.epoch)
                code = self._mc.put(self._epoch_key, b"1")
                self._epoch_marked = code in (0, OBJECT_ALREADY_EXISTS)
                if code not in (0, OBJECT_ALREADY_EXISTS):
                    self._check(code, "put")
        return self.epoch

    def _exists(self, skeys: list[str]) -> int:
        n = 0
        for code in self._mc.batch_is_exist(skeys):
            if code < 0:
                self._check(code, "is_exist")
                raise StorageError(f"mooncake is_exist failed (code {code})")
            if code == 0:
                break
            n += 1
        return n

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        for skey in skeys:
            payload = self._fetch_whole(skey, fmt)
            out.append(None if payload is None else bytes(payload))
        return out

    def _fetch_whole(self, skey: str, fmt: bytes) -> memoryview | None:
        """The verified payload of one key by copy (bytes API, and sizing up a value that did not fit).

        None for a miss, including a value whose holder died (the copy fails too).
        """
        with self._lock:
            blob = self._mc.get(skey)
        if not blob:
            return None
        try:
            return decode_blob(blob, skey.encode(), fmt)
        except CorruptPage as exc:
            self._report_corrupt(skey, exc)
            return None

    @staticmethod
    def _split(indices: list[int], skeys: list[str]) -> list[list[int]]:
        """``indices`` cut so that each piece's headers fit the scratch buffer."""
        per_call = max(1, _SCRATCH_BYTES // (HEADER.size + max(len(k.encode()) for k in skeys)))
        return [indices[i:i + per_call] for i in range(0, len(indices), per_call)]

    def _get_into(self, skeys: list[str], dests: list[list[memoryview]], fmt: bytes) -> list[bool]:
        if not all(self._inside(_address(p), len(p)) for parts in dests for p in parts):
            return super()._get_into(skeys, dests, fmt)  # not registered memory: copy
        out: list[bool] = []
        for chunk in self._split(list(range(len(skeys))), skeys):
            out += self._get_chunk([skeys[i] for i in chunk], [dests[i] for i in chunk], fmt)
        return out

    def _get_chunk(self, skeys: list[str], dests: list[list[memoryview]], fmt: bytes) -> list[bool]:
        heads = []
        offset = 0
        for skey in skeys:
            size = HEADER.size + len(skey.encode())
            heads.append((offset, size))
            offset += size
        base = self._scratch.data_ptr()
        ptrs = [[base + off] + [_address(p) for p in parts] for (off, _), parts in zip(heads, dests)]
        sizes = [[size] + [len(p) for p in parts] for (_, size), parts in zip(heads, dests)]
        with self._lock:
            codes = self._mc.batch_get_into_multi_buffers(skeys, ptrs, sizes)
            head_bytes = [bytes(self._scratch_view[off:off + size]) for off, size in heads]
        out = []
        resize = []
        for i, (skey, code, parts) in enumerate(zip(skeys, codes, dests)):
            expected = sum(sizes[i])
            if code < 0 and code != OBJECT_NOT_FOUND:
                self._check(code, "get")
            if code == expected:
                try:
                    payload_len, algo, check = parse_header(head_bytes[i], skey.encode(), fmt)
                    if payload_len != expected - len(head_bytes[i]):
                        raise CorruptPage("payload length mismatch")
                    verify_payload(parts, algo, check)
                except CorruptPage as exc:
                    self._report_corrupt(skey, exc)
                    out.append(False)
                    continue
                out.append(True)
            elif code == OBJECT_NOT_FOUND:
                out.append(False)
            else:  # another size (another format, or damaged), or a dead holder (-800): a miss
                resize.append(skey)
                out.append(False)
        for skey in resize:  # rare: read the whole value by copy to say which
            if self._fetch_whole(skey, fmt) is not None:  # readable, our format, yet another size: damaged
                self._report_corrupt(skey, "stored value has another size than this page")
        return out

    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:
        present = set()
        for skey, code in zip(skeys, self._mc.batch_is_exist(skeys)):
            if code < 0:
                self._check(code, "is_exist")
            elif code:
                present.add(skey)
        outcomes = dict.fromkeys(present, EXISTS)
        todo = [i for i, skey in enumerate(skeys) if skey not in present]
        zero_copy = [i for i in todo if all(self._inside(_address(p), len(p)) for p in payloads[i])]
        copied = sorted(set(todo) - set(zero_copy))
        if zero_copy:
            for chunk in self._split(zero_copy, skeys):
                outcomes.update(self._put_chunk([skeys[i] for i in chunk], [payloads[i] for i in chunk], fmt))
        for i in copied:
            blob = b"".join([self._encode_header(skeys[i], payloads[i], fmt), *payloads[i]])
            with self._lock:
                code = self._mc.put(skeys[i], blob)
            outcomes[skeys[i]] = self._outcome(skeys[i], code)
        return [outcomes[skey] for skey in skeys]

    def _put_chunk(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> dict[str, str]:
        base = self._scratch.data_ptr()
        ptrs, sizes = [], []
        with self._lock:
            offset = 0
            for skey, parts in zip(skeys, payloads):
                head = self._encode_header(skey, parts, fmt)
                self._scratch_view[offset:offset + len(head)] = head
                ptrs.append([base + offset] + [_address(p) for p in parts])
                sizes.append([len(head)] + [len(p) for p in parts])
                offset += len(head)
            codes = self._mc.batch_put_from_multi_buffers(skeys, ptrs, sizes)
        return {skey: self._outcome(skey, code) for skey, code in zip(skeys, codes)}

    def _outcome(self, skey: str, code: int) -> str:
        if code == 0:
            return WRITTEN
        if code == OBJECT_ALREADY_EXISTS:
            return EXISTS
        self._check(code, "put")
        logger.debug("mooncake: storing page %s failed (code %d)", skey, code)
        return FAILED

    def _clear(self) -> None:
        pattern = "^" + re.escape(self.namespace.prefix)
        with self._lock:
            code = self._mc.remove_by_regex(pattern, True)
        if code < 0:
            self._check(code, "remove_by_regex")
            raise StorageError(f"mooncake remove_by_regex failed (code {code})")

    def _close(self) -> None:
        with self._lock:
            self._mc.close()
            self._registered.clear()
            self._regions.clear()

    def debug_corrupt(self, key: str) -> bool:
        skey = self.namespace.storage_key(key)
        with self._lock:
            blob = self._mc.get(skey)
            if not blob:
                return False
            damaged = bytearray(blob)
            damaged[-1] ^= 0xFF
            return self._mc.upsert(skey, bytes(damaged)) == 0
