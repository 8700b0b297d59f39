"""Indexed page moves on any device: the gathers and scatters the CUDA copy paths are made of.

Pages move bit for bit through integer views of the same width: the indexed
kernels have no float8 variants, and no value is converted on the way. Under
torch's deterministic mode a scatter is an ``index_put_``: a deterministic
``index_copy_`` rewrites its whole destination, which here is a whole layer
of a pool that other pages of (and, for an engine's buffer, other streams)
are writing meanwhile.
"""

from __future__ import annotations

import numpy as np
import torch

Run = tuple[int, int, int]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def run_positions(runs: list[Run], unit: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Device and host positions (tokens, or pages with ``unit`` = page size) that ``runs`` cover, in run order."""
    arr = np.asarray(runs, dtype=np.int64).reshape(-1, 3) // unit
    lengths = arr[:, 2]
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(arr[:, 0], lengths) + within, np.repeat(arr[:, 1], lengths) + within


def index_on(positions: np.ndarray, device: torch.device) -> torch.Tensor:
    """``positions`` as an index tensor on ``device``.

    On CUDA the copy starts from pinned memory: from pageable memory the
    driver first waits for the stream, which waits for the engine's compute,
    and the caller (the engine's thread) would wait with it.
    """
    index = torch.from_numpy(positions)
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element's width: indexed kernels then move any dtype, float8 too."""
    return t.view(_BITS[t.element_size()])


def gather_pages(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` along dim 0, as integers of the element's width (bits, not values)."""
    return as_bits(src).index_select(0, index)


def scatter_pages(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[index] = rows`` along dim 0, in place, bit for bit (``rows`` of ``dst``'s dtype or its bits)."""
    dst, rows = as_bits(dst), as_bits(rows)
    if torch.are_deterministic_algorithms_enabled():
        dst.index_put_((index,), rows)
    else:
        dst.index_copy_(0, index, rows)
