"""FaultyBackend: scheduled storage failures on top of a real backend."""

from __future__ import annotations

import time

import pytest
import torch

from hicache_fsm.errors import ConfigError, StorageError, StorageTimeout, StorageUnavailable
from hicache_fsm.storage import KeyNamespace, StorageBackend, page_keys
from hicache_fsm.storage.faults import Fault, FaultyBackend
from hicache_fsm.storage.file import FileBackend
from hicache_fsm.storage.memory import MemoryBackend

KEYS = page_keys(list(range(32)), 4)  # 8 page hashes


class Pool:
    """Minimal duck-typed host pool with one view per page."""

    def __init__(self, pages: int, page_nbytes: int) -> None:
        self.page_nbytes = page_nbytes
        self.page_size = 4
        self.data = torch.zeros(pages, page_nbytes, dtype=torch.uint8)

    def page_views(self, page_id: int) -> list[torch.Tensor]:
        return [self.data[page_id]]

    def read_page(self, page_id: int) -> torch.Tensor:
        return self.data[page_id].clone()

    def write_page(self, page_id: int, data) -> None:
        self.data[page_id].copy_(torch.as_tensor(data, dtype=torch.uint8))


@pytest.fixture(params=["memory", "file"])
def inner(request, tmp_path) -> StorageBackend:
    backend = MemoryBackend(KeyNamespace("m")) if request.param == "memory" else FileBackend(tmp_path, KeyNamespace("m"))
    yield backend
    backend.close()


def test_no_faults_is_transparent(inner):
    f = FaultyBackend(inner, [])
    assert f.batch_set(KEYS[:2], [b"a", b"b"]) == [True, True]
    assert f.batch_exists(KEYS[:3]) == 2
    assert f.batch_get(KEYS[:3]) == [b"a", b"b", None]
    assert f.namespace == inner.namespace and f.stats()["faults_injected"] == 0
    assert f.calls("batch_get") == 1


@pytest.mark.parametrize("kind, exc", [("error", StorageError), ("unavailable", StorageUnavailable)])
def test_raise_on_chosen_call_index(inner, kind, exc):
    f = FaultyBackend(inner, [Fault(kind, method="batch_get", calls=1)])
    f.batch_set([KEYS[0]], [b"a"])
    assert f.batch_get([KEYS[0]]) == [b"a"]  # call 0
    with pytest.raises(exc):
        f.batch_get([KEYS[0]])  # call 1
    assert f.batch_get([KEYS[0]]) == [b"a"]  # call 2
    assert f.fired == [("batch_get", 1, kind)]
    assert f.stats()["errors"] == 1 and f.stats()["faults_injected"] == 1


def test_timeout_sleeps_then_raises(inner):
    f = FaultyBackend(inner, [Fault("timeout", method="batch_exists", delay=0.05)])
    start = time.monotonic()
    with pytest.raises(StorageTimeout):
        f.batch_exists([KEYS[0]])
    assert time.monotonic() - start >= 0.05


def test_slow_answers_normally(inner):
    f = FaultyBackend(inner, [Fault("slow", delay=0.02, times=1)])
    inner.batch_set([KEYS[0]], [b"a"])
    start = time.monotonic()
    assert f.batch_get([KEYS[0]]) == [b"a"]
    assert time.monotonic() - start >= 0.02
    assert f.batch_get([KEYS[0]]) == [b"a"] and len(f.fired) == 1  # times=1


def test_after_means_done_but_answer_lost(inner):
    f = FaultyBackend(inner, [Fault("unavailable", method="batch_set", after=True)])
    with pytest.raises(StorageUnavailable):
        f.batch_set([KEYS[0]], [b"a"])
    assert inner.batch_get([KEYS[0]]) == [b"a"]


def test_partial_batches(inner):
    f = FaultyBackend(inner, [Fault("partial", keep=2)])
    assert f.batch_set(KEYS[:4], [b"0", b"1", b"2", b"3"]) == [True, True, False, False]
    assert inner.batch_exists(KEYS[:4]) == 2  # the dropped pages were never stored
    inner.batch_set(KEYS[2:4], [b"2", b"3"])
    assert f.batch_exists(KEYS[:4]) == 2
    assert f.batch_get(KEYS[:4]) == [b"0", b"1", None, None]
    src = Pool(3, 8)
    src.data[:] = 7
    assert f.batch_set_from(KEYS[4:7], src, [0, 1, 2]) == [True, True, False]
    assert f.batch_get_into(KEYS[4:7], Pool(3, 8), [0, 1, 2]) == [True, True, False]
    assert [k for _, _, k in f.fired] == ["partial"] * 5


def test_corrupt_turns_into_counted_misses(inner):
    f = FaultyBackend(inner, [Fault("corrupt", method="batch_get", positions=[1], times=1)])
    f.batch_set(KEYS[:3], [b"a" * 16, b"b" * 16, b"c" * 16])
    assert f.batch_get(KEYS[:3]) == [b"a" * 16, None, b"c" * 16]
    assert f.stats()["corrupt"] == 1
    assert f.batch_get([KEYS[1]]) == [None]  # the stored copy stays damaged


def test_corrupt_after_set(inner):
    f = FaultyBackend(inner, [Fault("corrupt", method="batch_set_from")])
    src = Pool(2, 32)
    src.data[:] = 3
    assert f.batch_set_from(KEYS[:2], src, [0, 1]) == [True, True]
    assert inner.batch_get_into(KEYS[:2], Pool(2, 32), [0, 1]) == [False, False]
    assert inner.stats()["corrupt"] == 2


def test_probability_is_seeded_and_reproducible(inner):
    def run(seed: int) -> list:
        f = FaultyBackend(inner, [Fault("error", probability=0.5)], seed=seed)
        outcome = []
        for _ in range(40):
            try:
                f.batch_exists([KEYS[0]])
                outcome.append(True)
            except StorageError:
                outcome.append(False)
        return outcome

    first = run(7)
    assert first == run(7)
    assert 5 < first.count(False) < 35


def test_callable_schedule_and_add(inner):
    seen = []

    def chooser(method, index, keys):
        seen.append((method, index, len(keys)))
        return Fault("unavailable") if method == "clear" else None

    f = FaultyBackend(inner, chooser)
    f.batch_get(KEYS[:2])
    with pytest.raises(StorageUnavailable):
        f.clear()
    assert seen == [("batch_get", 0, 2), ("clear", 0, 0)]
    with pytest.raises(StorageError):
        f.add(Fault("error"))

    g = FaultyBackend(inner)
    g.add(Fault("error", method="batch_set"))
    with pytest.raises(StorageError):
        g.batch_set([KEYS[0]], [b"x"])


@pytest.mark.parametrize("fields, named", [
    (dict(kind="explode"), "kind"), (dict(kind="error", method="batch_frobnicate"), "method"),
    (dict(kind="error", probability=2), "probability"),  # these were taken and behaved as another value
    (dict(kind="error", probability=float("nan")), "probability"), (dict(kind="error", times=-1), "times"),
    (dict(kind="error", times=0), "times"), (dict(kind="slow", delay=-1), "delay"),
    (dict(kind="slow", delay=float("inf")), "delay"), (dict(kind="error", calls="x"), "calls"),
    (dict(kind="error", calls=[-1]), "calls"), (dict(kind="partial", keep=-1), "keep"),
    (dict(kind="corrupt", positions=["a"]), "positions"), (dict(kind="error", after="yes"), "after"),
])
def test_bad_fault_rejected(fields, named):
    with pytest.raises(ConfigError, match=named):
        Fault(**fields)


@pytest.mark.parametrize("inner, schedule, seed, named", [
    ("memory://", (), 0, "wraps a StorageBackend"), (None, 5, 0, "schedule"), (None, ["error"], 0, "schedule"),
    (None, "error", 0, "schedule"), (None, (), "7", "seed"),
])
def test_a_faulty_backend_is_refused_what_it_cannot_run(inner, schedule, seed, named):
    with pytest.raises(ConfigError, match=named):
        FaultyBackend(MemoryBackend() if inner is None else inner, schedule, seed=seed)
    f = FaultyBackend(MemoryBackend(), (Fault("error", method="batch_get") for _ in range(1)))  # read once
    with pytest.raises(ConfigError, match="add takes a Fault"):
        f.add("error")
    with pytest.raises(StorageError):  # the generator's rule was kept, not used up by the check
        f.batch_get([KEYS[0]])


def test_close_closes_inner(inner):
    f = FaultyBackend(inner)
    f.close()
    assert inner.closed
    with pytest.raises(StorageUnavailable):
        f.batch_get([KEYS[0]])
