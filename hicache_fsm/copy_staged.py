"""CUDA copies for the page_first host layouts without a GPU view of the host: whole blocks staged on the GPU.

``zero_copy`` serves pinned host pools that the GPU can address; this module
serves the others (an unpinned pool, a platform that does not map pinned
memory) with memcpys.

In ``page_first`` and ``page_first_direct`` host pools every layer of a run of
pages is one contiguous host block, while one layer of it is scattered. So a
run moves as one asynchronous memcpy of its block between pinned memory and a
GPU staging buffer, and the pages are gathered into (or scattered from) that
buffer on the GPU with one indexed kernel per layer and part, whatever the
number of runs. A copy per run and layer (thousands of tiny copies for a batch
of shuffled pages) is what this replaces: on an H200, ``bench copy`` moved a
page_first load at a fifth of one contiguous DMA that way.

Works for any device pool: ``DeviceKVPool.layer_pages`` is a view of one
layer's pages both for a pool that owns its buffer and for one adopted from an
engine.
"""

from __future__ import annotations

import torch

from hicache_fsm.page_index import Run, gather_pages, index_on, run_positions, scatter_pages
from hicache_fsm.pools import DeviceKVPool, HostKVPool, layer_of

# A backup stages at most this many bytes per part at once (more runs go in further rounds), so backing up a
# large batch does not double its footprint in device memory. A load stages its whole batch: every layer of
# it is scattered from the same buffer, layer by layer, as the executor's layer events come.
STAGE_MAX_BYTES = 256 << 20

STAGED_LAYOUTS = ("page_first", "page_first_direct")


def _rows(host: HostKVPool, tokens: int) -> int:
    """Rows of ``host.kv[part]`` that ``tokens`` tokens take: tokens in page_first, pages in page_first_direct."""
    return tokens if host.layout == "page_first" else tokens // host.page_size


def host_block(host: HostKVPool, part: int, h: int, n: int) -> torch.Tensor:
    """Every layer of a run of host slots: one contiguous block."""
    return host.kv[part].narrow(0, _rows(host, h), _rows(host, n))


def _device_pages(runs: list[Run], page_size: int, device: torch.device) -> torch.Tensor:
    """The device page numbers ``runs`` cover, in run order (the order of the staged blocks)."""
    return index_on(run_positions(runs, page_size)[0], device)


def _staging(dev: DeviceKVPool, host: HostKVPool, part: int, tokens: int) -> torch.Tensor:
    return torch.empty((_rows(host, tokens), *host.kv[part].shape[1:]), dtype=dev.shape.dtype, device=dev.device)


def stage_rounds(host: HostKVPool, runs: list[Run]) -> list[list[Run]]:
    """``runs`` split into consecutive groups of at most ``STAGE_MAX_BYTES`` staged per part (one run at least)."""
    token_bytes = host.shape.token_bytes // host.shape.parts  # staged per part
    rounds: list[list[Run]] = [[]]
    size = 0
    for run in runs:
        if rounds[-1] and size + run[2] * token_bytes > STAGE_MAX_BYTES:
            rounds.append([])
            size = 0
        rounds[-1].append(run)
        size += run[2] * token_bytes
    return rounds


def backup_staged(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], non_blocking: bool) -> None:
    """Every layer of ``runs``, device -> host: gather each layer's pages into staged blocks, then a memcpy a run."""
    ps = dev.page_size
    for group in stage_rounds(host, runs):
        pages = _device_pages(group, ps, dev.device)
        tokens = sum(n for _, _, n in group)
        for part in range(dev.shape.parts):
            staged = _staging(dev, host, part, tokens)
            for layer in range(dev.layers):
                rows = gather_pages(dev.layer_pages(layer)[part], pages)
                layer_of(staged, host.layout, layer, ps).view(rows.dtype).copy_(rows)
            row = 0
            for _, h, n in group:  # the allocator keeps ``staged`` for this stream until these memcpys ran
                host_block(host, part, h, n).copy_(staged.narrow(0, row, _rows(host, n)), non_blocking=non_blocking)
                row += _rows(host, n)


def load_staged(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int, non_blocking: bool,
                staging: dict | None) -> None:
    """One layer of ``runs``, host -> device, scattered from the batch's staged blocks.

    The first layer of a batch stages every run's whole block (one memcpy each)
    in ``staging``, which the caller keeps for the batch; later layers reuse it.
    """
    staging = {} if staging is None else staging
    if "blocks" not in staging:
        tokens = sum(n for _, _, n in runs)
        blocks = []
        for part in range(dev.shape.parts):
            staged = _staging(dev, host, part, tokens)
            row = 0
            for _, h, n in runs:
                staged.narrow(0, row, _rows(host, n)).copy_(host_block(host, part, h, n), non_blocking=non_blocking)
                row += _rows(host, n)
            blocks.append(staged)
        staging["blocks"] = blocks
        staging["pages"] = _device_pages(runs, dev.page_size, dev.device)
    for part, staged in enumerate(staging["blocks"]):
        rows = layer_of(staged, host.layout, layer, dev.page_size)
        scatter_pages(dev.layer_pages(layer)[part], staging["pages"], rows)
