"""Page copy throughput of TorchExecutor (random page order) beside a plain contiguous copy.

Every page of the device pool is backed up to a shuffled set of host pages
(D2H), then loaded back to a shuffled set of device pages (H2D), through
``TorchExecutor``. The baseline is one ``dst.copy_(src)`` of the same number
of bytes between the same two buffers, timed interleaved in the same run.
``ratio`` is the worse of the two directions' executor/baseline ratios.
``--engine`` makes the device pool adopt per-layer buffers laid out as an
engine's (``hicache_fsm.engine_kv``) instead of allocating its one buffer;
the baseline then copies from a flat device buffer of the same size.

On CUDA it also times a load until its first layer is ready (the engine's
``wait(0)``): ``first_layer_share`` is that time over the whole load's, near
``1 / layers`` when layers arrive one by one (plus launch costs), near 1 when
layer 0 waits for all of them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache_fsm.bench.common import interleaved_medians, machine_description, report
from hicache_fsm.commands.args import UsageError, check_fits, positive_int, seed_int
from hicache_fsm.engine_kv import adopt_sglang_mha, adopt_vllm
from hicache_fsm.errors import ConfigError
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.jobs import JobBatch, JobKind
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape, default_device

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ENGINES = ("own", "sglang_mha", "vllm")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", choices=LAYOUTS, default="page_first")
    parser.add_argument("--engine", choices=ENGINES, default="own",
                        help="device memory: the pool's own buffer, or adopted SGLang MHA / vLLM per-layer buffers")
    parser.add_argument("--page-size", type=positive_int, default=64)
    parser.add_argument("--tokens", type=positive_int, default=8192, help="tokens moved (and size of each pool)")
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--seed", type=seed_int, default=0)


def _shuffled_indices(pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(pages, generator=gen)
    return (perm[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _device_pool(engine: str, shape: KVShape, tokens: int, ps: int) -> DeviceKVPool:
    if engine == "own":
        return DeviceKVPool(shape, tokens, ps)
    device = default_device()
    dims = (shape.heads, shape.head_dim)
    if engine == "sglang_mha":
        k, v = ([torch.empty((tokens, *dims), dtype=shape.dtype, device=device) for _ in range(shape.layers)]
                for _ in range(2))
        return adopt_sglang_mha(k, v, ps)
    caches = [torch.empty((2, tokens // ps, ps, *dims), dtype=shape.dtype, device=device) for _ in range(shape.layers)]
    return adopt_vllm(caches)


def run(args: argparse.Namespace) -> dict:
    ps = args.page_size
    tokens = args.tokens
    if tokens % ps:  # whole pages are what the executor moves: a remainder would be measured as not moved
        raise UsageError(f"--tokens must be a whole number of pages of --page-size {ps}, got {tokens}")
    if args.engine == "sglang_mha" and tokens < 2 * ps:  # its pool keeps page 0 as SGLang's padding page
        raise UsageError(f"--engine sglang_mha keeps page 0 for SGLang: --tokens must be at least two pages "
                         f"({2 * ps}), got {tokens}")
    try:
        shape = KVShape(args.layers, args.heads, args.head_dim, DTYPES[args.dtype])
    except ConfigError as exc:  # a size no KV shape takes: the flags' mistake
        raise UsageError(f"--layers / --heads / --head-dim: {exc}") from None
    # in host memory: the host pool, and on the CPU also the device pool and a contiguous copy of it
    copies = 1 if torch.cuda.is_available() else 3
    check_fits(tokens, shape.token_bytes * copies, "--tokens",
               f"KV of {shape.token_bytes} bytes a token, {copies} copies")
    device = _device_pool(args.engine, shape, tokens, ps)
    host = HostKVPool(shape, tokens, ps, args.layout)
    for buffer in device.buffers:
        buffer.normal_()
    gen = torch.Generator().manual_seed(args.seed)
    pages = tokens // ps
    d2h = JobBatch(JobKind.D2H, (), _shuffled_indices(pages, ps, gen), _shuffled_indices(pages, ps, gen))
    h2d = JobBatch(JobKind.H2D, (), _shuffled_indices(pages, ps, gen), _shuffled_indices(pages, ps, gen))
    executor = TorchExecutor(device, host)
    flat_host = host.kv.view(-1)
    flat_dev = device.kv.view(-1) if device.kv is not None else torch.randn(flat_host.shape, dtype=shape.dtype,
                                                                             device=device.device)
    cuda = device.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run_batch(batch: JobBatch):
        def fn() -> None:
            executor.submit(batch)
            executor.synchronize()
            executor.poll()
        return fn

    def contiguous(dst: torch.Tensor, src: torch.Tensor):
        def fn() -> None:
            dst.copy_(src, non_blocking=cuda)
            sync()
        return fn

    times = interleaved_medians({
        "d2h": run_batch(d2h),
        "contiguous_d2h": contiguous(flat_host, flat_dev),
        "h2d": run_batch(h2d),
        "contiguous_h2d": contiguous(flat_dev, flat_host),
    }, repeats=args.repeats, warmup=1)
    first_layer = _first_layer_seconds(executor, h2d, device.device, args.repeats) if cuda else None
    executor.close()
    nbytes = tokens * shape.token_bytes
    gbps = {name: nbytes / t / 1e9 for name, t in times.items()}
    ratio_d2h = gbps["d2h"] / gbps["contiguous_d2h"]
    ratio_h2d = gbps["h2d"] / gbps["contiguous_h2d"]
    result = {
        "benchmark": "copy",
        "layout": args.layout,
        "engine": args.engine,
        "page_size": ps,
        "tokens": tokens,
        "bytes": nbytes,
        "device": str(device.device),
        "pinned": host.pinned,
        "d2h_gbps": round(gbps["d2h"], 3),
        "h2d_gbps": round(gbps["h2d"], 3),
        "gbps": round(min(gbps["d2h"], gbps["h2d"]), 3),
        "contiguous_d2h_gbps": round(gbps["contiguous_d2h"], 3),
        "contiguous_h2d_gbps": round(gbps["contiguous_h2d"], 3),
        "contiguous_gbps": round(min(gbps["contiguous_d2h"], gbps["contiguous_h2d"]), 3),
        "ratio_d2h": round(ratio_d2h, 3),
        "ratio_h2d": round(ratio_h2d, 3),
        "ratio": round(min(ratio_d2h, ratio_h2d), 3),
        "machine": machine_description(),
    }
    if first_layer is not None:
        result["h2d_first_layer_ms"] = round(first_layer * 1e3, 3)
        result["first_layer_share"] = round(first_layer / times["h2d"], 3)
    rows = [
        ("layout / page size", f"{args.layout} / {ps}"),
        ("device memory", args.engine),
        ("bytes moved per direction", f"{nbytes / 1e6:.1f} MB ({tokens} tokens, {pages} pages, shuffled)"),
        ("device", f"{device.device} (host pinned: {host.pinned})"),
        ("executor d2h / h2d", f"{gbps['d2h']:.2f} / {gbps['h2d']:.2f} GB/s"),
        ("contiguous d2h / h2d", f"{gbps['contiguous_d2h']:.2f} / {gbps['contiguous_h2d']:.2f} GB/s"),
        ("ratio d2h / h2d (min)", f"{ratio_d2h:.2f} / {ratio_h2d:.2f} ({min(ratio_d2h, ratio_h2d):.2f})"),
    ]
    if first_layer is not None:
        rows.append(("h2d first layer ready", f"{first_layer * 1e3:.2f} ms ({result['first_layer_share']:.2f} of "
                                               f"the load; {1 / shape.layers:.2f} a layer)"))
    report("bench copy: executor page copies vs one contiguous copy", rows, result, args.json)
    return result


def _first_layer_seconds(executor: TorchExecutor, batch: JobBatch, device: torch.device, repeats: int) -> float:
    """Median seconds from submitting the load ``batch`` until its layer 0 is ready on the current stream."""
    samples = []
    for _ in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        handle = executor.submit(batch)
        handle.wait(0)
        torch.cuda.current_stream(device).synchronize()
        samples.append(time.perf_counter() - t0)
        executor.synchronize()
        executor.poll()
    return statistics.median(samples[1:])
