"""L3 storage page throughput (set/get GB/s) against raw I/O on the same medium.

A page is ``page_tokens`` tokens of K and V for every layer
(2 x tokens x layers x kv_heads x head_dim x dtype bytes; the default 64 x 16 x 8
x 128 x bf16 is 4 MiB). The backend stores ``--pages`` pages from a host pool
with ``batch_set_from`` and reads them back with ``batch_get_into`` (zero-copy
into the same preallocated pool). In the same run, alternating with it, a raw
baseline moves the same bytes on the same medium:

* ``file://``: plain files in a sibling directory, one per page, written with
  one unbuffered ``write`` and read with ``readinto`` into the same kind of
  preallocated host page, using the same number of threads as the backend;
* ``redis://``: pipelined ``SET`` / ``GET`` of values of the page size on the
  same server (the raw GET only receives the bytes; the backend also verifies
  and copies them into the host page);
* ``mooncake://``: Mooncake's own ``batch_put_from`` / ``batch_get_into`` of
  the same registered host pages through the backend's client (the backend
  adds its header and checksum, and verifies every page it reads). Give the
  URL a ``segment_mb`` that holds both copies (2 x pages x page size, plus room:
  the master evicts past 90% full); without one the benchmark sizes it
  (``mooncake_segment_mb``), and one too small is refused before anything is written.

Before every set round both sides delete what the previous round wrote
(untimed), so neither side ever skips or overwrites. Reported: ``set_gbps``,
``get_gbps``, ``raw_set_gbps``, ``raw_get_gbps``, ``set_ratio`` and ``get_ratio``
(backend / raw; medians of ``--repeats`` rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import torch

from hicache_fsm.bench.common import machine_description, report
from hicache_fsm.commands.args import UsageError, check_fits, positive_int
from hicache_fsm.errors import StorageError
from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.urls import file_directory


class _BenchPool:
    """A minimal host pool: ``pages`` rows of ``page_nbytes`` bytes."""

    def __init__(self, pages: int, page_nbytes: int, page_size: int, fill: bool) -> None:
        self.page_nbytes = page_nbytes
        self.page_size = page_size
        if fill:
            gen = torch.Generator().manual_seed(1234)
            self.data = torch.randint(0, 256, (pages, page_nbytes), dtype=torch.uint8, generator=gen)
        else:
            self.data = torch.zeros(pages, page_nbytes, dtype=torch.uint8)

    def read_page(self, page_id: int) -> torch.Tensor:
        return self.data[page_id].clone()

    def write_page(self, page_id: int, data) -> None:
        self.data[page_id].copy_(torch.as_tensor(data, dtype=torch.uint8).reshape(-1))

    def page_views(self, page_id: int) -> list[torch.Tensor]:
        return [self.data[page_id]]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="backend URL (default: a temporary file:// directory)")
    parser.add_argument("--pages", type=positive_int, default=32, help="pages per round (default 32)")
    parser.add_argument("--page-tokens", type=positive_int, default=64, help="tokens per page (default 64)")
    parser.add_argument("--layers", type=positive_int, default=16)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per element (bf16: 2)")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1, help="I/O threads of the file backend and its baseline")


def _medians(rounds: int, steps: list[tuple[str, Callable[[], None] | None, Callable[[], None]]]) -> dict[str, float]:
    """Run each (name, untimed setup, timed body) in turn per round; median seconds per name."""
    samples: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    for _ in range(rounds + 1):  # the first round warms up
        for name, setup, body in steps:
            if setup is not None:
                setup()
            start = time.perf_counter()
            body()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts[1:]) for name, ts in samples.items()}


def _file_baseline(root: str, n: int, src: _BenchPool, dst: _BenchPool, threads: int):
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"page-{i:05d}.bin") for i in range(n)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def each(fn, items):
        if pool is None:
            for item in items:
                fn(item)
        else:
            list(pool.map(fn, items))

    def write_one(i: int) -> None:
        with open(paths[i], "wb", buffering=0) as f:
            f.write(memoryview(src.data[i].numpy()))

    def read_one(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(memoryview(dst.data[i].numpy()))

    def clear() -> None:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    return clear, (lambda: each(write_one, range(n))), (lambda: each(read_one, range(n))), pool


def _redis_baseline(url: str, n: int, src: _BenchPool):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30)
    keys = [f"hicache-bench-raw/{i}" for i in range(n)]
    values = [src.data[i].numpy().tobytes() for i in range(n)]

    def clear() -> None:
        client.delete(*keys)

    def set_all() -> None:
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v)
        pipe.execute()

    def get_all() -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        pipe.execute()

    return clear, set_all, get_all, client


SEGMENT_ROOM = 1.5  # the master evicts past 90% full; headers, checksums and allocator slack take the rest
MIN_SEGMENT_MB = 64  # Mooncake's client fails to mount much smaller segments
POOLS = 3  # pages held in memory: the source, ours read back, the raw baseline's read back
TOKEN_ID_BYTES = 40  # a page's token ids, as a list of Python ints, per token


def mooncake_segment_mb(pages: int, page_nbytes: int) -> int:
    """MiB of Mooncake segment the benchmark needs: both copies of every page, with room."""
    return max(MIN_SEGMENT_MB, -(-int(2 * pages * page_nbytes * SEGMENT_ROOM) // (1 << 20)))


def sized_mooncake_url(url: str, pages: int, page_nbytes: int) -> str:
    """``url`` with a ``segment_mb`` large enough; ``UsageError`` when the one it gives is too small."""
    need = mooncake_segment_mb(pages, page_nbytes)
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    given = query.get("segment_mb", [None])[-1]
    if given is None:
        query["segment_mb"] = [str(need)]
        return urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
    if given.isdigit() and int(given) < need:
        raise UsageError(f"segment_mb={given} cannot hold the {2 * pages} pages of {page_nbytes >> 20} MiB this "
                         f"benchmark writes (ours and the raw baseline's); pass segment_mb={need} or more, "
                         f"or fewer --pages")
    return url


def _mooncake_baseline(backend, n: int, src: _BenchPool, dst: _BenchPool):
    store = backend.raw_store
    backend.register_memory(src.data)
    backend.register_memory(dst.data)
    keys = [f"hicache-bench-raw/{i}" for i in range(n)]
    size = src.data.shape[1]
    src_ptrs = [src.data[i].data_ptr() for i in range(n)]
    dst_ptrs = [dst.data[i].data_ptr() for i in range(n)]

    def clear() -> None:
        store.batch_remove(keys, True)

    def set_all() -> None:
        codes = store.batch_put_from(keys, src_ptrs, [size] * n)
        if not all(c == 0 for c in codes):
            raise StorageError(f"raw batch_put_from failed (codes {sorted(set(codes))}); a full segment "
                               "returns -200: raise segment_mb in the URL or lower --pages")

    def get_all() -> None:
        codes = store.batch_get_into(keys, dst_ptrs, [size] * n)
        if not all(c == size for c in codes):
            raise StorageError(f"raw batch_get_into failed (codes {sorted(set(codes))})")

    return clear, set_all, get_all, None


def run(args: argparse.Namespace) -> dict:
    page_nbytes = 2 * args.page_tokens * args.layers * args.kv_heads * args.head_dim * args.dtype_bytes
    n = args.pages
    try:  # one page first: a page too large is the page flags' mistake, not --pages'
        check_fits(1, POOLS * page_nbytes + TOKEN_ID_BYTES * args.page_tokens, "one page")
    except UsageError:
        raise UsageError(f"a page of {page_nbytes} bytes (--page-tokens x --layers x --kv-heads x --head-dim x "
                         f"--dtype-bytes x 2) in {POOLS} pools is more than this machine could hold") from None
    check_fits(n, POOLS * page_nbytes + TOKEN_ID_BYTES * args.page_tokens, "--pages",
               f"{page_nbytes} bytes a page in each of {POOLS} pools, and its token ids")
    tmpdir = None
    url = args.url
    if url is None:
        tmpdir = tempfile.mkdtemp(prefix="hicache-bench-storage-")
        url = f"file://{tmpdir}/store"
    scheme = urlsplit(url).scheme
    if scheme not in ("file", "redis", "rediss", "mooncake"):
        raise UsageError(f"only file://, redis:// and mooncake:// URLs are benchmarked, got {url!r}")

    if scheme == "mooncake":
        url = sized_mooncake_url(url, n, page_nbytes)
    options = {"file": {"io_threads": args.threads}, "mooncake": {}}.get(scheme, {"socket_timeout": 30.0})
    try:
        backend = open_backend(url, namespace=KeyNamespace("bench-storage"), **options)
    except StorageError as exc:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise UsageError(f"cannot open {url}: {exc}") from exc

    src = _BenchPool(n, page_nbytes, args.page_tokens, fill=True)
    dst = _BenchPool(n, page_nbytes, args.page_tokens, fill=False)
    raw_dst = _BenchPool(n, page_nbytes, args.page_tokens, fill=False)
    tokens = torch.randint(0, 50000, (n * args.page_tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    keys = page_keys(tokens, args.page_tokens)
    ids = list(range(n))

    if scheme == "file":
        store_dir = file_directory(urlsplit(url), url)  # opened above: a valid file URL
        raw_root = os.path.join(os.path.dirname(os.path.abspath(store_dir)), os.path.basename(store_dir) + "-raw")
        raw_clear, raw_set, raw_get, closer = _file_baseline(raw_root, n, src, raw_dst, args.threads)
    elif scheme == "mooncake":
        raw_root = None
        raw_clear, raw_set, raw_get, closer = _mooncake_baseline(backend, n, src, raw_dst)
    else:
        raw_root = None
        raw_clear, raw_set, raw_get, closer = _redis_baseline(url, n, src)

    def our_set() -> None:
        ok = backend.batch_set_from(keys, src, ids)
        if not all(ok):
            raise StorageError(f"the backend refused {ok.count(False)} of {n} pages (storage full?)")

    def our_get() -> None:
        ok = backend.batch_get_into(keys, dst, ids)
        if not all(ok):
            raise StorageError(f"the backend missed {list(ok).count(False)} of {n} pages it had stored")

    try:
        times = _medians(
            args.repeats,
            [
                ("set", backend.clear, our_set),
                ("raw_set", raw_clear, raw_set),
                ("get", None, our_get),
                ("raw_get", None, raw_get),
            ],
        )
        if not torch.equal(dst.data, src.data):
            raise SystemExit("bench storage: pages read back differ from pages written")
        backend.clear()
        raw_clear()
    finally:
        if scheme == "file":
            if closer is not None:
                closer.shutdown()
            shutil.rmtree(raw_root, ignore_errors=True)
        elif closer is not None:
            closer.close()
        backend.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)

    total = n * page_nbytes
    gbps = {name: total / t / 1e9 for name, t in times.items()}
    result = {
        "benchmark": "storage",
        "scheme": scheme,
        "pages": n,
        "page_bytes": page_nbytes,
        "total_bytes": total,
        "threads": args.threads if scheme == "file" else 1,
        "repeats": args.repeats,
        "set_gbps": round(gbps["set"], 3),
        "get_gbps": round(gbps["get"], 3),
        "raw_set_gbps": round(gbps["raw_set"], 3),
        "raw_get_gbps": round(gbps["raw_get"], 3),
        "set_ratio": round(gbps["set"] / gbps["raw_set"], 3),
        "get_ratio": round(gbps["get"] / gbps["raw_get"], 3),
        "machine": machine_description(),
    }
    rows = [
        ("backend", f"{scheme} ({n} pages x {page_nbytes / 2**20:.2f} MiB)"),
        ("set", f"{result['set_gbps']:.3f} GB/s  (raw {result['raw_set_gbps']:.3f}, ratio {result['set_ratio']:.2f})"),
        ("get", f"{result['get_gbps']:.3f} GB/s  (raw {result['raw_get_gbps']:.3f}, ratio {result['get_ratio']:.2f})"),
    ]
    report("bench storage: page set/get vs raw on the same medium", rows, result, args.json)
    return result
