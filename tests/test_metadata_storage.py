"""Metadata-mode storage: the keys-only backend, the stepped tier, and trace replay without the testing extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm import trace_replay
from hicache_fsm.errors import ConfigError, StorageKeyError
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.jobs import Completion, JobBatch, JobKind, TransferJob
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.simulate import storage_available
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.keys_only import KeysOnlyBackend
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.trace import load_trace
from hicache_fsm.trace_gen import TraceShape, write
from hicache_fsm.trace_replay import TraceOptions, metadata_backend, metadata_executor, run_trace

ROOT = Path(__file__).resolve().parent.parent
KEYS = [f"{i:064x}" for i in range(8)]
needs_storage = pytest.mark.skipif(not storage_available(), reason="this build has no storage tier")


def host_pool(layout: str = "page_first", dtype=torch.float16) -> HostKVPool:
    return HostKVPool(KVShape(2, 1, 2, dtype), 8 * 4, 4, layout, pin_memory=False)


ops = st.lists(st.one_of(
    st.tuples(st.just("set"), st.lists(st.sampled_from(KEYS), max_size=4, unique=True)),
    st.tuples(st.just("get"), st.lists(st.sampled_from(KEYS), max_size=4)),
    st.tuples(st.just("exists"), st.lists(st.sampled_from(KEYS), max_size=4)),
    st.tuples(st.just("clear"), st.just([])),
), max_size=24)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([None, 2, 5]))
def test_keys_only_answers_every_host_pool_call_as_memory_does(script, cap_pages):
    """Same results and the same stats (bytes included) as memory://, for any sequence of calls."""
    pool = host_pool()
    cap = None if cap_pages is None else cap_pages * pool.page_nbytes
    ns = KeyNamespace("m")
    real, keys_only = MemoryBackend(ns, max_bytes=cap), KeysOnlyBackend(ns, max_bytes=cap)
    for op, keys in script:
        pages = list(range(len(keys)))
        if op == "set":
            got = [b.batch_set_from(keys, pool, pages) for b in (real, keys_only)]
        elif op == "get":
            got = [b.batch_get_into(keys, pool, pages) for b in (real, keys_only)]
        elif op == "exists":
            got = [b.batch_exists(keys) for b in (real, keys_only)]
        else:
            got = [b.clear() for b in (real, keys_only)]
        assert got[0] == got[1], (op, keys)
        assert real.stats() == keys_only.stats()
    assert real.stored_keys() == keys_only.stored_keys()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from(KEYS[:3]), max_size=5), max_size=4))
def test_keys_only_stores_a_key_repeated_within_a_batch_once_as_memory_does(batches):
    pool = host_pool()
    real, keys_only = MemoryBackend(KeyNamespace("m")), KeysOnlyBackend(KeyNamespace("m"))
    for keys in batches:
        pages = list(range(len(keys)))
        assert real.batch_set_from(keys, pool, pages) == keys_only.batch_set_from(keys, pool, pages)
        assert real.stats() == keys_only.stats()


def test_keys_only_reads_another_page_format_as_a_mismatch():
    backend = KeysOnlyBackend(KeyNamespace("m"))
    backend.batch_set_from(KEYS[:2], host_pool("page_first"), [0, 1])
    assert backend.batch_get_into(KEYS[:2], host_pool("layer_first"), [0, 1]) == [False, False]
    assert backend.stats()["format_mismatch"] == 2 and backend.stats()["hits"] == 0
    assert backend.batch_get_into(KEYS[:2], host_pool("page_first"), [2, 3]) == [True, True]


def test_keys_only_refuses_the_bytes_calls_and_bad_arguments():
    backend = KeysOnlyBackend(KeyNamespace("m"))
    with pytest.raises(StorageKeyError, match="no page bytes"):
        backend.batch_set(KEYS[:1], [b"x"])
    with pytest.raises(StorageKeyError, match="no page bytes"):
        backend.batch_get(KEYS[:1])
    with pytest.raises(StorageKeyError, match="page ids"):
        backend.batch_set_from(KEYS[:2], host_pool(), [0])
    assert backend.stored_keys() == [] and backend.stats()["errors"] == 2


def test_a_named_key_set_is_shared_and_namespaced():
    name = "test-shared-keys"
    try:
        a, b = KeysOnlyBackend(KeyNamespace("m"), store=name), KeysOnlyBackend(KeyNamespace("m"), store=name)
        other = KeysOnlyBackend(KeyNamespace("other"), store=name)
        a.batch_set_from(KEYS[:3], host_pool(), [0, 1, 2])
        assert b.batch_exists(KEYS[:4]) == 3 and other.batch_exists(KEYS[:1]) == 0
        other.batch_set_from(KEYS[:1], host_pool(), [0])
        a.clear()
        assert b.batch_exists(KEYS[:1]) == 0 and other.batch_exists(KEYS[:1]) == 1
    finally:
        KeysOnlyBackend.drop_shared(name)


def test_metadata_mode_keeps_keys_only_for_in_process_stores():
    ns = KeyNamespace("m")
    assert isinstance(metadata_backend("memory://", ns), KeysOnlyBackend)
    shared = metadata_backend("memory://cluster", ns)
    assert isinstance(shared, KeysOnlyBackend) and shared.store_name == "metadata-cluster"
    assert metadata_backend("file:///tmp/x", ns) == "file:///tmp/x"
    assert metadata_backend("redis://localhost:6379/0", ns) == "redis://localhost:6379/0"


@pytest.fixture
def small_trace(tmp_path) -> Path:
    shape = TraceShape(requests=60, sessions=4, turns=3, system_prompts=2, system_length=64, user_length=48,
                       output_length=16, block_size=32, seed=3)
    path = tmp_path / "small.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        write(shape, f)
    return path


def _figures(sim) -> dict:
    return {t.name: (t.hit_tokens, t.device_hit_tokens, t.host_hit_tokens, t.storage_hit_tokens, t.computed_tokens,
                     t.prefetches, t.prefetch_timeouts, t.alloc_failures, t.bytes, t.counters) for t in sim.tiers}


@needs_storage
def test_keys_only_replay_matches_a_replay_that_stores_the_bytes(small_trace, monkeypatch):
    """Hit rates, every counter and every byte count are those of the replay through memory:// itself."""
    trace = load_trace(small_trace, 32)
    options = TraceOptions(trace, device_tokens=256, host_tokens=512, page_size=8, device="cpu")
    fast = run_trace(options)
    monkeypatch.setattr(trace_replay, "metadata_backend", lambda url, namespace: url)
    slow = run_trace(options)
    assert fast.tier("device+host+storage").storage_hit_tokens > 0
    assert _figures(fast) == _figures(slow)
    assert [t.hit_rate for t in fast.tiers] == [t.hit_rate for t in slow.tiers]


def test_every_figure_is_that_of_a_replay_whose_executor_copies_the_kv(small_trace, monkeypatch):
    """The metadata executor moves no byte, and hit rates, counters and byte counts are those of real copies."""
    trace = load_trace(small_trace, 32)
    options = TraceOptions(trace, device_tokens=256, host_tokens=512, page_size=8, device="cpu")
    fast = run_trace(options)
    monkeypatch.setattr(trace_replay, "metadata_executor", TorchExecutor)
    slow = run_trace(options)
    assert fast.tier("device+host").host_hit_tokens > 0
    assert _figures(fast) == _figures(slow)
    assert [(t.hit_rate, t.bytes) for t in fast.tiers] == [(t.hit_rate, t.bytes) for t in slow.tiers]


def test_the_metadata_executor_completes_batches_at_the_next_poll_without_copying():
    shape = KVShape(2, 1, 2, torch.float16)
    device, host = DeviceKVPool(shape, 32, 4, "cpu"), HostKVPool(shape, 64, 4, "page_first", pin_memory=False)
    device.kv.fill_(1.0)
    executor = metadata_executor(device, host)
    job = TransferJob(JobKind.D2H, (), torch.arange(0, 8), device_indices=torch.arange(8, 16))
    handle = executor.submit(JobBatch(JobKind.D2H, (job,), job.host_indices, job.device_indices))
    handle.wait(1)
    assert handle.done() and executor.poll() == [Completion(job.id)] and executor.poll() == []
    assert not host.kv.any()  # nothing was copied
    with pytest.raises(ConfigError, match="storage transfers"):
        executor.submit(JobBatch(JobKind.H2S, (), torch.arange(0, 4), None))
    executor.close()
    with pytest.raises(ConfigError, match="closed"):
        executor.submit(JobBatch(JobKind.D2H, (job,), job.host_indices, job.device_indices))


@needs_storage
def test_trace_replay_runs_without_hypothesis(small_trace):
    """``simulate --trace`` needs only the library: the testing extra (hypothesis) may be missing."""
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "from hicache_fsm.cli import main\n"
            f"sys.exit(main(['simulate', '--trace', {str(small_trace)!r}, '--block-size', '32', '--page-size', '8',"
            " '--device', 'cpu', '--json', '--no-progress']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["configs"]["device+host+storage"]["hit_rate"] > 0
    assert "hicache_fsm.testing" not in done.stderr


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet="ab09_-/ \n*", max_size=4), st.just("a" * 257), st.integers(0, 3)),
                max_size=5))
def test_storage_keys_checks_many_keys_as_one_by_one(keys):
    """The batched check accepts exactly what ``storage_key`` accepts key by key, and refuses with its error."""
    ns = KeyNamespace("m")
    try:
        expected = [ns.storage_key(k) for k in keys]
    except StorageKeyError as exc:
        with pytest.raises(StorageKeyError) as got:
            ns.storage_keys(keys)
        assert str(got.value) == str(exc)
    else:
        assert ns.storage_keys(keys) == expected
