"""Jobs built from a node's page ids: the indices an executor reads are the pages' slots, in order."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.allocator import PageAllocator
from hicache_fsm.jobs import JobKind, PageSlots, TransferJob, merge_jobs

PAGE = 4
POOL_PAGES = 64


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)


def _packed(pages: list[int]) -> bytes:
    return np.asarray(pages, dtype=np.int64).tobytes()


page_lists = st.lists(st.integers(0, POOL_PAGES - 1), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(page_lists, page_lists), min_size=1, max_size=4), st.booleans())
def test_jobs_of_page_ids_read_as_the_slots_of_those_pages(pairs, tensors_too):
    host_alloc, device_alloc = PageAllocator(POOL_PAGES * PAGE, PAGE), PageAllocator(POOL_PAGES * PAGE, PAGE)
    jobs = []
    for i, (host, device) in enumerate(pairs):
        as_tensor = tensors_too and i % 2  # a batch may mix page-id jobs with jobs built from tensors
        jobs.append(TransferJob(JobKind.D2H, (i,),
                                _slots(host) if as_tensor else PageSlots(_packed(host), host_alloc),
                                _slots(device) if as_tensor else PageSlots(_packed(device), device_alloc)))
    for job, (host, device) in zip(jobs, pairs):
        assert job.num_tokens == len(host) * PAGE  # without expanding anything
        assert torch.equal(job.host_indices, _slots(host))
        assert torch.equal(job.device_indices, _slots(device))
        assert job.host_indices is job.host_indices  # expanded once, then kept
    fresh = [TransferJob(JobKind.D2H, (i,), PageSlots(_packed(h), host_alloc), PageSlots(_packed(d), device_alloc))
             for i, (h, d) in enumerate(pairs)]
    for group in (jobs, fresh):
        (batch,) = merge_jobs(group)
        assert batch.jobs == tuple(group)
        assert batch.num_tokens == sum(len(h) for h, _ in pairs) * PAGE
        assert torch.equal(batch.host_indices, torch.cat([_slots(h) for h, _ in pairs]))
        assert torch.equal(batch.device_indices, torch.cat([_slots(d) for _, d in pairs]))
        assert batch.draft_host_indices is None
