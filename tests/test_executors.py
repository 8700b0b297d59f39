"""TorchExecutor (CPU here, CUDA when present) and ManualExecutor."""

from __future__ import annotations

import random

import pytest
import torch

from hicache_fsm.errors import BadIndices, ConfigError, HiCacheError, UnknownJob
from hicache_fsm.executors import LoadNotFinished, ManualExecutor, TorchExecutor
from hicache_fsm.jobs import Completion, JobKind, TransferJob, merge_jobs
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape

SHAPE = KVShape(layers=3, heads=2, head_dim=8)
DRAFT = KVShape(layers=1, heads=2, head_dim=8)
PS = 4

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tokens_of(pages, ps=PS):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


def make_pools(layout="layer_first", device="cpu", draft=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = DeviceKVPool(SHAPE, 16 * PS, PS, device=device)
    host = HostKVPool(SHAPE, 24 * PS, PS, layout)
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=gen))
    if not draft:
        return dev, host, None, None
    ddev = DeviceKVPool(DRAFT, 16 * PS, PS, device=device, allocator=dev.allocator)
    dhost = HostKVPool(DRAFT, 24 * PS, PS, layout)
    ddev.kv.copy_(torch.randn(ddev.kv.shape, generator=gen))
    return dev, host, ddev, dhost


def job(kind, dev_pages, host_pages, node=1, **kw):
    return TransferJob(kind, (node,), tokens_of(host_pages), tokens_of(dev_pages), **kw)


def batch_of(*jobs):
    (b,) = merge_jobs(jobs)
    return b


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- TorchExecutor on CPU


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_write_then_load(layout):
    dev, host, _, _ = make_pools(layout)
    ex = TorchExecutor(dev, host)
    j1, j2 = job(JobKind.D2H, [3, 4], [7, 1], node=1), job(JobKind.D2H, [9], [2], node=2)
    want = dev.read(tokens_of([3, 4, 9]))
    wait = ex.submit(batch_of(j1, j2))
    assert wait.done()
    assert ex.poll() == [Completion(j1.id), Completion(j2.id)]
    assert ex.poll() == []
    assert same(host.read(tokens_of([7, 1, 2])), want)

    load = job(JobKind.H2D, [0, 12, 13], [7, 1, 2])
    wait = ex.submit(batch_of(load))
    for layer in range(SHAPE.layers):
        wait.wait(layer)  # a no-op that is already done on the CPU
    with pytest.raises(BadIndices):
        wait.wait(SHAPE.layers)
    assert ex.poll() == [Completion(load.id)]
    assert same(dev.read(tokens_of([0, 12, 13])), want)
    ex.synchronize()
    ex.close()
    with pytest.raises(ConfigError, match="closed"):
        ex.submit(batch_of(load))


def test_cpu_per_layer_write():
    dev, host, _, _ = make_pools("page_first")
    ex = TorchExecutor(dev, host)
    j = job(JobKind.D2H, [5], [6], layer=2)
    ex.submit(batch_of(j))
    assert ex.poll() == [Completion(j.id)]
    hk, hv = host.read(tokens_of([6]))
    dk, dv = dev.read(tokens_of([5]))
    assert torch.equal(hk[2], dk[2]) and torch.equal(hv[2], dv[2])
    assert hk[:2].abs().sum() == 0


@pytest.mark.parametrize("kind", [JobKind.H2S, JobKind.S2H])
def test_storage_kinds_are_refused(kind):
    dev, host, _, _ = make_pools()
    ex = TorchExecutor(dev, host)
    j = TransferJob(kind, (1,), tokens_of([0]), keys=("k",))
    with pytest.raises(ConfigError, match="storage"):
        ex.submit(batch_of(j))
    with pytest.raises(HiCacheError):
        ManualExecutor(dev, host).submit(batch_of(j))


def test_bad_batches_raise_before_copying():
    dev, host, _, _ = make_pools()
    ex = TorchExecutor(dev, host)
    bad = [
        TransferJob(JobKind.D2H, (1,), tokens_of([0])),                               # no device indices
        TransferJob(JobKind.D2H, (1,), tokens_of([0, 1]), tokens_of([0])),            # lengths differ
        TransferJob(JobKind.D2H, (1,), tokens_of([30]), tokens_of([0])),              # host out of range
        TransferJob(JobKind.H2D, (1,), tokens_of([0]), torch.arange(1, 5)),           # not aligned
        TransferJob(JobKind.H2D, (1,), tokens_of([0]), tokens_of([0]), layer=1),      # loads are all layers
        TransferJob(JobKind.D2H, (1,), tokens_of([0]), tokens_of([0]), layer=3),      # no such layer
        TransferJob(JobKind.D2H, (1,), tokens_of([0]), tokens_of([0]), draft=True),   # no draft pools
    ]
    for j in bad:
        with pytest.raises(HiCacheError):
            ex.submit(batch_of(j))
    assert host.kv.abs().sum() == 0 and ex.poll() == []


def test_draft_pools_copied_alongside():
    dev, host, ddev, dhost = make_pools("page_first_direct", draft=True)
    ex = TorchExecutor(dev, host, ddev, dhost)
    j = job(JobKind.D2H, [2, 3], [5, 9], draft_host_indices=tokens_of([0, 1]))
    ex.submit(batch_of(j))
    assert ex.poll() == [Completion(j.id)]
    assert same(host.read(tokens_of([5, 9])), dev.read(tokens_of([2, 3])))
    assert same(dhost.read(tokens_of([0, 1])), ddev.read(tokens_of([2, 3])))
    want_t, want_d = dev.read(tokens_of([2, 3])), ddev.read(tokens_of([2, 3]))
    load = job(JobKind.H2D, [10, 11], [5, 9], draft_host_indices=tokens_of([0, 1]))
    ex.submit(batch_of(load))
    assert same(dev.read(tokens_of([10, 11])), want_t)
    assert same(ddev.read(tokens_of([10, 11])), want_d)
    # a per-layer write beyond the draft's depth copies the target layer only
    ex.submit(batch_of(job(JobKind.D2H, [4], [6], layer=2, draft_host_indices=tokens_of([7]))))
    assert dhost.read(tokens_of([7]))[0].abs().sum() == 0
    assert torch.equal(host.read(tokens_of([6]))[0][2], dev.read(tokens_of([4]))[0][2])


def test_draft_flagged_jobs_use_draft_pools_even_when_mixed():
    dev, host, ddev, dhost = make_pools("layer_first", draft=True)
    ex = TorchExecutor(dev, host, ddev, dhost)
    target = job(JobKind.D2H, [1], [2], layer=0)
    draft = job(JobKind.D2H, [1], [3], layer=0, draft=True)
    ex.submit(batch_of(target, draft))
    assert {c.job_id for c in ex.poll()} == {target.id, draft.id}
    assert torch.equal(host.read(tokens_of([2]))[0][0], dev.read(tokens_of([1]))[0][0])
    assert torch.equal(dhost.read(tokens_of([3]))[0][0], ddev.read(tokens_of([1]))[0][0])
    assert host.read(tokens_of([3]))[0].abs().sum() == 0


def test_executor_config_errors():
    dev, host, ddev, dhost = make_pools(draft=True)
    with pytest.raises(ConfigError):
        TorchExecutor(dev, host, ddev, None)
    with pytest.raises(ConfigError):
        TorchExecutor(dev, host, producer_slots=0)
    with pytest.raises(ConfigError):
        TorchExecutor(dev, dhost)


def test_empty_batch():
    dev, host, _, _ = make_pools()
    ex = TorchExecutor(dev, host)
    j = TransferJob(JobKind.H2D, (1,), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert ex.submit(batch_of(j)).done()
    assert ex.poll() == [Completion(j.id)]


# ---------------------------------------------------------------- ManualExecutor


def test_manual_completes_in_any_order():
    dev, host, _, _ = make_pools("page_first")
    ex = ManualExecutor(dev, host)
    jobs = [job(JobKind.D2H, [i], [10 + i], node=i) for i in range(5)]
    wait = ex.submit(batch_of(*jobs))
    assert ex.pending_job_ids() == [j.id for j in jobs]
    assert host.kv.abs().sum() == 0  # nothing moves until a test says so
    order = [3, 0, 4]
    for i in order:
        ex.complete(jobs[i].id)
        assert same(host.read(tokens_of([10 + i])), dev.read(tokens_of([i])))
    ex.fail(jobs[1].id, error="disk on fire")
    assert host.read(tokens_of([11]))[0].abs().sum() == 0
    assert not wait.done()
    assert ex.poll() == [Completion(jobs[3].id), Completion(jobs[0].id), Completion(jobs[4].id),
                         Completion(jobs[1].id, False, "disk on fire")]
    assert ex.poll() == []
    assert ex.pending_job_ids() == [jobs[2].id]
    ex.complete(jobs[2].id)
    assert wait.done()
    for done_id in (jobs[2].id, jobs[1].id, 10**9):
        with pytest.raises(UnknownJob):
            ex.complete(done_id)
        with pytest.raises(UnknownJob):
            ex.fail(done_id)


def test_manual_load_wait_raises_until_finished():
    dev, host, _, _ = make_pools()
    ex = ManualExecutor(dev, host)
    w = job(JobKind.D2H, [1, 2], [3, 4])
    ex.submit(batch_of(w))
    ex.complete_all()
    want = dev.read(tokens_of([1, 2]))
    a, b = job(JobKind.H2D, [8], [3], node=1), job(JobKind.H2D, [9], [4], node=2)
    wait = ex.submit(batch_of(a, b))
    with pytest.raises(LoadNotFinished):
        wait.wait(0)
    ex.complete(b.id)
    assert not wait.done()
    with pytest.raises(LoadNotFinished):
        wait.wait(2)
    ex.complete(a.id)
    assert wait.done()
    wait.wait(0)
    assert same(dev.read(tokens_of([8, 9])), want)
    assert issubclass(LoadNotFinished, HiCacheError)


def test_manual_random_interleavings():
    rng = random.Random(5)
    for trial in range(20):
        dev, host, _, _ = make_pools(seed=trial)
        ex = ManualExecutor(dev, host)
        jobs = [job(JobKind.D2H, [i], [i], node=i) for i in range(6)]
        ex.submit(batch_of(*jobs[:3]))
        ex.submit(batch_of(*jobs[3:]))
        ids = ex.pending_job_ids()
        rng.shuffle(ids)
        outcome = {}
        for jid in ids:
            if rng.random() < 0.3:
                ex.fail(jid)
                outcome[jid] = False
            else:
                ex.complete(jid)
                outcome[jid] = True
        done = ex.poll()
        assert [c.job_id for c in done] == ids
        assert all(c.ok == outcome[c.job_id] for c in done)
        for i, j in enumerate(jobs):
            copied = torch.equal(host.read(tokens_of([i]))[0], dev.read(tokens_of([i]))[0])
            assert copied == outcome[j.id]


def test_manual_rejects_bad_batches_whole():
    dev, host, _, _ = make_pools()
    ex = ManualExecutor(dev, host)
    good = job(JobKind.D2H, [0], [0])
    bad = TransferJob(JobKind.D2H, (2,), tokens_of([99]), tokens_of([1]))
    with pytest.raises(BadIndices):
        ex.submit(batch_of(good, bad))
    assert ex.pending_job_ids() == []
    ex.close()
    with pytest.raises(ConfigError):
        ex.submit(batch_of(good))


def test_manual_draft():
    dev, host, ddev, dhost = make_pools(draft=True)
    ex = ManualExecutor(dev, host, ddev, dhost)
    j = job(JobKind.D2H, [1], [2], draft_host_indices=tokens_of([3]))
    ex.submit(batch_of(j))
    ex.complete(j.id)
    assert same(dhost.read(tokens_of([3])), ddev.read(tokens_of([1])))


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_write_load_streams_and_events(layout):
    dev, host, _, _ = make_pools(layout, device="cuda")
    assert host.kv.is_pinned()
    ex = TorchExecutor(dev, host)
    assert ex.write_stream is not None and ex.load_stream is not None
    w = job(JobKind.D2H, [3, 4, 5], [7, 1, 2])
    want = dev.read(tokens_of([3, 4, 5]))
    handle = ex.submit(batch_of(w))
    ex.synchronize()
    assert handle.done()
    assert ex.poll() == [Completion(w.id)]
    assert same(host.read(tokens_of([7, 1, 2])), want)

    dev.kv.zero_()
    load = job(JobKind.H2D, [10, 11, 12], [7, 1, 2])
    wait = ex.submit(batch_of(load))
    out = []
    for layer in range(SHAPE.layers):
        wait.wait(layer)  # the current stream waits for this layer's event only
        out.append(dev.k[layer, tokens_of([10, 11, 12]).cuda()].clone())
    torch.cuda.current_stream().synchronize()
    assert torch.equal(torch.stack(out).cpu(), want[0])
    ex.synchronize()
    assert ex.poll() == [Completion(load.id)]
    ex.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_producer_ring_reuse_and_overlap():
    dev, host, _, _ = make_pools("layer_first", device="cuda")
    host.kv.copy_(torch.randn(host.kv.shape))
    ex = TorchExecutor(dev, host, producer_slots=2)
    waits, jobs = [], []
    for i in range(5):  # more loads than slots: the ring must wait for a slot's last load
        j = job(JobKind.H2D, [i], [i], node=i)
        jobs.append(j)
        waits.append(ex.submit(batch_of(j)))
    waits[-1].wait(SHAPE.layers - 1)
    ex.synchronize()
    assert all(w.done() for w in waits)
    assert sorted(c.job_id for c in ex.poll()) == sorted(j.id for j in jobs)
    for i in range(5):
        assert same(dev.read(tokens_of([i])), host.read(tokens_of([i])))


@pytest.mark.cuda
@needs_cuda
def test_cuda_poll_reports_only_finished():
    dev, host, ddev, dhost = make_pools("page_first", device="cuda", draft=True)
    ex = TorchExecutor(dev, host, ddev, dhost)
    blocker = torch.cuda.Event()
    # hold the load stream: nothing can finish before the host thread releases it
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(ex.load_stream):
        for _ in range(20):
            big = big @ big / 4096
        blocker.record()
    j = job(JobKind.H2D, [1], [1], draft_host_indices=tokens_of([2]))
    wait = ex.submit(batch_of(j))
    early = ex.poll()
    if early:  # reported only if the queued work before it had finished too
        assert blocker.query() and early == [Completion(j.id)]
    if wait.done():
        assert blocker.query()
    ex.synchronize()
    assert wait.done()
    assert (early + ex.poll()) == [Completion(j.id)]
    assert same(ddev.read(tokens_of([1])), dhost.read(tokens_of([2])))


@pytest.mark.cuda
@needs_cuda
def test_cuda_per_layer_write_and_cuda_indices():
    dev, host, _, _ = make_pools("page_first_direct", device="cuda")
    ex = TorchExecutor(dev, host)
    j = TransferJob(JobKind.D2H, (1,), tokens_of([4]).cuda(), tokens_of([2]).cuda(), layer=1)
    ex.submit(batch_of(j))
    ex.synchronize()
    assert ex.poll() == [Completion(j.id)]
    assert torch.equal(host.read(tokens_of([4]))[0][1], dev.read(tokens_of([2]))[0][1])
