"""Mooncake open is bounded: a silent master, impossible sizes, listeners on other addresses; lost keys are noticed.

Skipped, with the reason, when ``mooncake.store`` does not import or the master
binary is missing.
"""

from __future__ import annotations

import socket
import threading

import pytest
from mooncake_fixture import SMALL
from storage_util import make_cache, storage_threads

from hicache_fsm.errors import StorageError, StorageLinkError, StorageUnavailable, StorageURLError
from hicache_fsm.input_limits import available_memory_bytes
from hicache_fsm.storage import KeyNamespace, open_backend
from hicache_fsm.storage.listeners import Listener, own_listeners, probe_rpc
from hicache_fsm.storage.mooncake import mooncake_available

pytestmark = pytest.mark.mooncake
NS = KeyNamespace("mc-bounds")
HANG_GUARD_S = 60  # not a speed assertion: only stops a regression from hanging the suite


@pytest.fixture
def silent_master():
    """A TCP port that accepts connections and never answers (a hung master)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(HANG_GUARD_S)
        for conn in accepted:
            conn.close()
        server.close()


def outcome(fn) -> BaseException | object:
    result: list = []

    def target():
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            result.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert result, f"still running after {HANG_GUARD_S} s"
    return result[0]


def test_probe_tells_a_silent_server_from_a_refused_port(silent_master):
    assert "no answer within 0.2 s" in probe_rpc("127.0.0.1", silent_master, 0.2)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert probe_rpc("127.0.0.1", port, 0.2) is not None  # nothing listens: refused


def test_a_master_that_never_answers_fails_the_open_within_connect_timeout(silent_master):
    if mooncake_available():
        pytest.skip(mooncake_available())
    err = outcome(lambda: open_backend(f"mooncake://127.0.0.1:{silent_master}?{SMALL}", namespace=NS,
                                       connect_timeout=0.5))
    assert isinstance(err, StorageUnavailable) and "no answer within 0.5 s (connect_timeout)" in str(err)


def test_attaching_a_silent_master_rolls_back_typed(silent_master):
    if mooncake_available():
        pytest.skip(mooncake_available())
    cache = make_cache()
    try:
        err = outcome(lambda: cache.attach_storage(f"mooncake://127.0.0.1:{silent_master}?{SMALL}",
                                                   connect_timeout=0.5))
        assert isinstance(err, StorageLinkError) and "no answer within 0.5 s" in str(err)
        assert cache.storage.state == "detached" and not storage_threads()
    finally:
        cache.close()


@pytest.mark.parametrize("query, message", [
    (f"segment_mb={1 << 29}&buffer_mb=16", "more than the"),
    ("buffer_mb=" + "9" * 5000, "positive number of MiB"),
    ("segment_mb=²", "positive number of MiB"),
    ("listen=everywhere", "listen must be"),
], ids=["segment_past_memory", "5000_digits", "unicode_digit", "bad_listen"])
def test_impossible_options_are_refused_before_anything_is_allocated(query, message):
    with pytest.raises(StorageURLError, match=message):
        open_backend(f"mooncake://127.0.0.1:1?{query}", namespace=NS)
    assert (1 << 29) << 20 > available_memory_bytes()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "1", True])
def test_connect_timeout_must_be_a_positive_number(timeout):
    with pytest.raises(StorageURLError, match="connect_timeout"):
        open_backend("mooncake://127.0.0.1:1", namespace=NS, connect_timeout=timeout)


def test_own_listeners_sees_a_socket_of_this_process():
    before = own_listeners()
    if before is None:
        pytest.skip("no /proc")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        mine = Listener("127.0.0.1", sock.getsockname()[1])
        assert mine in own_listeners() and mine not in before and not mine.wildcard
    assert Listener("::", 1).wildcard and str(Listener("::", 1)) == "[::]:1"


def test_the_client_may_not_listen_beyond_the_address_given(mooncake_master):
    if own_listeners() is None:
        pytest.skip("no /proc")
    before = own_listeners()
    url = mooncake_master.url.replace("&listen=any", "")
    with pytest.raises(StorageError, match="listens on .*not only on 127.0.0.1.*listen=any"):
        open_backend(url, namespace=NS)
    assert own_listeners() - before == set()  # the refused client was closed: nothing left listening
    backend = open_backend(mooncake_master.url, namespace=NS)  # listen=any: accepted, knowingly
    backend.close()


def test_a_master_restart_that_lost_the_keys_raises_the_data_epoch(mooncake_master):
    backend = open_backend(mooncake_master.url, namespace=NS)
    try:
        assert backend.data_epoch() == 0
        assert backend.data_epoch() == 0  # nothing lost
        mooncake_master.restart()
        epoch = None
        for _ in range(200):  # the client reconnects to the new master; bounded by attempts, not time
            try:
                epoch = backend.data_epoch()
                break
            except StorageError:
                threading.Event().wait(0.05)
        assert epoch == 1
        assert backend.data_epoch() == 1  # marked again: no second bump
    finally:
        backend.close()
