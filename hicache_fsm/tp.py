"""Tensor-parallel agreement: ranks of one model keep identical caches.

Theory of operation. An engine serving one model over a tensor-parallel group
runs one ``HiCache`` per rank, each over its shard of the KV heads. The ranks
feed their caches the same requests in the same order, and every cache
decision that depends only on those calls (match, insert, eviction,
allocation) is deterministic, so the trees stay identical. What a rank
*observes alone* is different: its copies finish at other times, its storage
may miss or fail a page another rank's has, its prefetch thread is slower.
Such observations never act directly. They are reduced with MIN over the
group first, and every rank acts on the agreed value:

* acks: a completion is applied once every rank has it (ok only if every
  rank's copy was ok), in the emission order of the jobs;
* storage: prefetch hit counts, pages landed, transfer ends, storage health
  and the clock that times prefetches and backup retries (see
  ``hicache_fsm.storage.agreement``);
* load-back admission when device memory is short.

``StepAgreement`` does this with one ``all_reduce(MIN)`` per ``poll`` (after
the fixed-size header every collective starts with, see ``RankGroup.min``): every
*section* (the acks, the storage tier) contributes a header and a window of
items of fixed width. The window sizes of the next step are agreed in this
step (a rank that needs more room says so; the group takes the largest), so
every rank always sends a vector of the same length. The headers carry each
value ``x`` also as ``-x``: MIN of both tells whether all ranks sent the same
``x`` (``min(x) == -min(-x)``); if not, the ranks diverged and
``RanksDiverged`` is raised instead of acting on garbage.

Failure. Each collective waits at most ``timeout_s``; a rank that died or
hangs makes the others raise ``RankTimeout`` (a ``GroupError``) within it,
never hang. A failed group stays failed: later agreements raise at once.

A group of one rank (or none) costs nothing: values pass through unreduced.
"""

from __future__ import annotations

import datetime
import time
import zlib
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from hicache_fsm.config import check_seconds
from hicache_fsm.errors import ConfigError, GroupError, RanksDiverged, RankTimeout

DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 7 * 86400.0  # a failure guard, not a wait (far larger ones overflow timedelta and gloo's clock)
MAX_RANKS = 64  # rank processes one run may start: each imports torch (seconds and hundreds of MB apiece)
MIN_WINDOW = 16  # items per section a step always has room for
PURPOSE_STEP = 1  # what a collective is for (``RankGroup.min``): a step's agreement
PURPOSE_ATTACH = 2  # every rank is attaching storage now
PURPOSE_GATHER = 3  # every rank gathers a tensor of the same shape and dtype
PURPOSE_BUILD = 4  # every rank is building its cache: the configurations must match
PURPOSE_ATTACH_COMMIT = 5  # every rank opened its storage backend (or failed to): attach everywhere or nowhere
PURPOSE_LOAD_ROOM = 6  # every rank has device room for a load-back
PURPOSE_ENGINE = 7  # an engine's own decision taken on every rank (the simulator's, a benchmark's)

# The gloo groups made beside engine groups of another backend, one per set of ranks and default group: a
# second RankGroup over the same ranks reuses it (a group named from its ranks can be made once).
_GLOO_BESIDE: dict[tuple[int, ...], tuple[Any, Any]] = {}


def _gloo_beside(group: Any, timeout: datetime.timedelta) -> Any:
    """A gloo group over the ranks of ``group`` (an NCCL group: the agreements are CPU collectives).

    Only the group's own ranks make it (``use_local_synchronization``): an
    engine whose world holds several tensor-parallel groups (with pipeline or
    data parallelism) makes one per group, each from its own ranks, where a
    world-wide ``new_group`` named by a global counter joined ranks of
    different groups.
    """
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    world = dist.group.WORLD
    made = _GLOO_BESIDE.get(ranks)
    if made is not None and made[0] is world:
        return made[1]
    try:
        gloo = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot make a gloo group over ranks {list(ranks)} for the cache's agreements: {exc}") \
            from None
    _GLOO_BESIDE[ranks] = (world, gloo)
    return gloo


def _int64s(values: Sequence[int]) -> np.ndarray:
    """``values`` as int64, or ``ConfigError``: a float, a str or an int past int64 is never truncated or parsed."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "ib"):
        raise ConfigError("a group reduction takes a flat sequence of ints within int64")
    return arr.astype(np.int64, copy=False)


class RankGroup:
    """A ``torch.distributed`` process group the caches of one model agree over.

    ``group`` is the engine's tensor-parallel group (None: a single rank).
    Agreements are CPU collectives: a group whose backend is not gloo (NCCL on
    GPU) gets a gloo group over the same ranks beside it, as the reference
    does (creating it is a collective call of every process of the default
    group's members). ``timeout_s`` bounds every collective.
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = check_seconds("timeout_s", timeout_s, maximum=MAX_TIMEOUT_S)  # a failure guard
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self.failed: str | None = None
        self.collectives = 0
        self.collective_s = 0.0  # time spent inside collectives (waiting for the other ranks included)
        if group is None:
            self.group, self.size, self.rank = None, 1, 0
            return
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("a process group needs torch.distributed initialised (init_process_group)")
        if not isinstance(group, dist.ProcessGroup):
            raise ConfigError(f"group must be a torch.distributed ProcessGroup, a RankGroup or None, got "
                              f"{type(group).__name__}")
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0 or self.size < 1:  # torch answers -1 for a group this process is not in
            raise ConfigError("this process is not a member of the group it was given")
        if self.size > 1 and dist.get_backend(group) != "gloo":
            group = _gloo_beside(group, self._timeout)
        self.group = group

    @classmethod
    def of(cls, group: Any) -> "RankGroup":
        """``group`` itself if it is a RankGroup, else a RankGroup over it (None: one rank)."""
        return group if isinstance(group, RankGroup) else cls(group)

    @property
    def solo(self) -> bool:
        return self.size == 1

    def min(self, values: Sequence[int], purpose: int = 0) -> list[int]:
        """Element-wise MIN of ``values`` over the group.

        The ranks first agree on a fixed-size header (``purpose``, length): gloo
        aborts the process on a collective whose sizes differ between ranks, so
        ranks that entered different collectives (one attaching storage while
        another polls) get ``RanksDiverged`` on every rank instead, with nothing
        exchanged and the group still usable.
        """
        if isinstance(purpose, bool) or not isinstance(purpose, int) or not 0 <= purpose < 1 << 62:
            raise ConfigError(f"purpose must be an int in [0, 2**62) (it is sent negated too), got {purpose!r}")
        arr = _int64s(values)
        if self.size == 1:
            return arr.tolist()
        self._check_alive()
        n = len(arr)
        head = self._min([purpose, -purpose, n, -n])
        if head[0] != -head[1] or head[2] != -head[3]:
            raise RanksDiverged(
                f"rank {self.rank} of {self.size}: ranks entered different collectives (here purpose {purpose}, "
                f"{n} values; the group saw purposes {head[0]}..{-head[1]}, lengths {head[2]}..{-head[3]}); "
                "nothing was exchanged")
        return self._min(arr)

    def _min(self, values: Sequence[int] | np.ndarray) -> list[int]:
        import torch.distributed as dist

        t = torch.from_numpy(np.array(values, dtype=np.int64))  # twice as fast as torch.tensor(list)
        self.collectives += 1
        start = time.perf_counter()
        try:
            work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        except RuntimeError as exc:  # a peer already closed its connection
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            raise RankTimeout(f"rank {self.rank} of {self.size}: a peer left ({self.failed})") from exc
        try:
            self._wait(work)
        finally:
            self.collective_s += time.perf_counter() - start
        return t.numpy().tolist()

    def _wait(self, work) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:  # gloo: timeout, or a peer closed its connection (died)
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            raise RankTimeout(
                f"rank {self.rank} of {self.size}: a group collective did not complete within {self.timeout_s:g}s "
                f"or a peer left ({self.failed})") from exc

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise GroupError(f"the rank group failed earlier ({self.failed}); the caches cannot agree any more")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), by rank; an engine's helper, not the cache's.

        The ranks first agree that shapes and dtypes match (gloo aborts the
        process, or reinterprets the bytes, when they do not): ``RanksDiverged``
        on every rank otherwise, with nothing gathered and the group still usable.
        """
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"all_gather wants a tensor, got {type(tensor).__name__}")
        if self.size == 1:
            return [tensor]
        self._check_alive()
        import torch.distributed as dist

        form = digest((str(tensor.dtype), tuple(tensor.shape)))
        lo, neg_hi = self.min([form, -form], PURPOSE_GATHER)
        if lo != -neg_hi:
            raise RanksDiverged(f"rank {self.rank} of {self.size}: all_gather of tensors whose shapes or dtypes "
                                f"differ between ranks (here {tuple(tensor.shape)} {tensor.dtype}); nothing gathered")
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.collectives += 1
        try:
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        except RuntimeError as exc:
            self.failed = str(exc).splitlines()[0][:200]
            raise RankTimeout(f"rank {self.rank}: all_gather failed ({self.failed})") from exc
        self._wait(work)
        return out

    def all_true(self, flag: bool, purpose: int = 0) -> bool:
        """True only if ``flag`` is true on every rank (``purpose``: see ``min``)."""
        return bool(self.min([1 if flag else 0], purpose)[0])

    def same(self, value: int, purpose: int = 0) -> bool:
        """Whether every rank passed the same int (one collective; ``purpose``: see ``min``)."""
        lo, neg_hi = self.min([value, -value], purpose)
        return lo == -neg_hi

    def differing(self, parts: dict[str, object], purpose: int = 0) -> list[str]:
        """The names in ``parts`` whose values are not the same on every rank (one collective; none when solo).

        Every rank must pass the same names in the same order; the values are
        compared by ``digest`` (plain values whose ``repr`` is stable).
        """
        if self.size == 1:
            return []
        digests = [digest((name, value)) for name, value in parts.items()]
        out = self.min([x for d in digests for x in (d, -d)], purpose)
        return [name for i, name in enumerate(parts) if out[2 * i] != -out[2 * i + 1]]


class Section(Protocol):
    """One part of the cache that contributes observations to a step's agreement.

    ``width`` ints per item. ``collect()`` returns the section's items in an
    order every rank shares (emission order, admission order) and a digest of
    what the items refer to (equal on every rank unless they diverged).
    ``apply(items)`` receives the element-wise MIN of the first items, as many
    as fitted in this step's window, and acts on them.
    """

    name: str
    width: int

    def collect(self) -> tuple[list[Sequence[int]], int]: ...

    def apply(self, items: list[list[int]]) -> None: ...


def _window(n: int) -> int:
    size = MIN_WINDOW
    while size < n:
        size *= 2
    return size


def digest(parts: Sequence[object]) -> int:
    """A stable 31-bit digest of plain values (same on every process, unlike ``hash`` of a str)."""
    return zlib.crc32(repr(tuple(parts)).encode()) & 0x7FFFFFFF


def job_identities(jobs: Sequence[Any], cp: bool) -> list[tuple]:
    """What each pending job has alike on every rank, in emission order: its kind and size under tensor
    parallelism (every rank moves the same tokens of its own heads); under context parallelism (``cp``) a
    rank copies only the pages it owns, so its kind, nodes, layer and model instead."""
    if cp:
        return [(j.kind.value, j.node_ids, j.layer, j.draft) for j in jobs]
    return [(j.kind.value, j.num_tokens) for j in jobs]


class StepAgreement:
    """One MIN all-reduce per step over every registered section (see the module docstring)."""

    HEADER = 5  # count, -count, digest, -digest, -wanted window

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.sections: list[Section] = []
        self._windows: list[int] = []
        self.steps = 0
        self.seconds = 0.0  # time in ``step`` (its collective included)

    @property
    def solo(self) -> bool:
        return self.group.solo

    def register(self, section: Section) -> None:
        """Add a section; every rank must register the same sections in the same order."""
        self.sections.append(section)
        self._windows.append(MIN_WINDOW)

    def step(self) -> None:
        """Reduce every section's observations and apply the agreed values (a collective on every rank)."""
        if self.solo:  # one rank: sections act on their observations directly
            return
        start = time.perf_counter()
        try:
            self._step()
        finally:
            self.seconds += time.perf_counter() - start

    def _step(self) -> None:
        step = self.steps + 1  # counted once the collective ran: a section's bad items leave the count as it was
        vec: list[int] = [step, -step]
        bodies: list[list[int]] = []
        for section, window in zip(self.sections, self._windows):
            items, dig = section.collect()
            n = len(items)
            vec += (n, -n, dig, -dig, -n)
            width = section.width
            body = [v for item in items[:window] for v in item]
            if len(body) != min(n, window) * width:
                raise ConfigError(f"section {section.name}: items must have {width} ints each")
            body += [0] * (window * width - len(body))
            bodies.append(body)
        for body in bodies:
            vec += body
        out = self.group.min(vec, PURPOSE_STEP)  # RanksDiverged (another collective elsewhere): no step happened
        self.steps = step
        if out[0] != -out[1]:
            raise RanksDiverged(f"ranks are at different agreement steps (rank {self.group.rank} at {self.steps})")
        pos = 2 + self.HEADER * len(self.sections)
        applies = []
        for i, (section, window) in enumerate(zip(self.sections, self._windows)):
            h = 2 + self.HEADER * i
            n_lo, n_neg_hi, d_lo, d_neg_hi, neg_wanted = out[h:h + self.HEADER]
            if n_lo != -n_neg_hi or d_lo != -d_neg_hi:
                raise RanksDiverged(
                    f"section {section.name}: ranks hold different items (counts {n_lo}..{-n_neg_hi}); "
                    "were they fed the same requests?")
            size = window * section.width
            body = out[pos:pos + size]
            pos += size
            n = min(n_lo, window)
            applies.append((section, [body[j * section.width:(j + 1) * section.width] for j in range(n)]))
            self._windows[i] = _window(-neg_wanted)
        for section, items in applies:
            section.apply(items)


def rank_view(cache: Any) -> tuple:
    """What must be equal on every rank after every step: the tree and what is in flight, not slot ids.

    Per node: its namespace, whole prefix, residency state, lock and host pin
    counts; then the kinds and sizes of pending jobs and the pools' occupancy.
    Under context parallelism (``cache.cp`` attached) a rank copies and keeps
    on host only the pages it owns: each job is then its kind, nodes, layer and
    model, and the host's occupancy is left out.
    """
    tree = cache.tree
    nodes = sorted(
        (repr(n.namespace), tree.prefix_tokens(n), n.state, n.lock_ref, n.host_ref)
        for n in tree.nodes() if not n.is_root
    )
    cp = cache.cp is not None
    jobs = tuple(job_identities(cache.pending_jobs(), cp))
    host = None if cp else cache.host_allocator.free_pages
    return (tuple(nodes), jobs, cache.device_allocator.free_pages, host)


def cache_fingerprint(config: Any, device_pool: Any, host_pool: Any, draft_device_pool: Any = None,
                      draft_host_pool: Any = None) -> dict[str, object]:
    """What every rank's cache must be built with alike: pools of other sizes evict at other times.

    Such ranks drift apart without a job to tell (a device eviction of
    backed-up KV emits none), so it is checked once, when the caches are built.
    Of the KV shape, the head count is left out: a rank's pools hold its own
    shard of the heads. Its layers, head size and dtype are the model's
    (a rank built for another model would load back layers it never stored).
    """
    def tokens(pool: Any) -> int | None:
        return None if pool is None else pool.allocator.size_tokens

    shape = device_pool.shape
    return {
        "config": repr(config),
        "page_size": device_pool.page_size,
        "KV layers": shape.layers,
        "KV head size": shape.head_dim,
        "KV dtype": str(shape.dtype),
        "MLA": shape.mla,
        "device tokens": tokens(device_pool),
        "host tokens": tokens(host_pool),
        "draft device tokens": tokens(draft_device_pool),
        "draft host tokens": tokens(draft_host_pool),
    }


class PoolState:
    """A step section with no items: the tree's node count and content mark, and the pools' free pages, compared
    across ranks.

    The acks compare only pending jobs; this catches the ranks whose trees
    went apart without one (other requests on one rank, of another length or
    the same, an eviction one rank had to make), at the next ``poll`` instead
    of at a hung model collective.
    Under context parallelism (a CP runtime in ``attached``) each rank's host
    holds only the pages it owns, so the host's free pages are left out.
    """

    name = "pool state"
    width = 0

    def __init__(self, tree: Any, device_pool: Any, host_pool: Any, attached: Any) -> None:
        tree.marking = True  # the tree keeps its content mark from now on (it is empty: nothing to add up)
        self.tree = tree
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.attached = attached

    def collect(self) -> tuple[list[Sequence[int]], int]:
        host = self.host_pool.allocator.free_pages if self.attached.cp is None else None
        tree = self.tree
        return [], digest((len(tree.by_id), tree.content_mark, self.device_pool.allocator.free_pages, host))

    def apply(self, items: list[list[int]]) -> None:
        """Nothing to act on: the comparison is the header's."""


def view_digest(view: tuple) -> int:
    """``rank_view`` as one int, to compare across ranks with ``RankGroup.same``."""
    return zlib.crc32(repr(view).encode()) & 0x7FFFFFFF


__all__ = ["DEFAULT_TIMEOUT_S", "MAX_RANKS", "MAX_TIMEOUT_S", "PURPOSE_ATTACH", "PURPOSE_ATTACH_COMMIT",
           "PURPOSE_BUILD", "PURPOSE_ENGINE", "PURPOSE_GATHER", "PURPOSE_LOAD_ROOM", "PURPOSE_STEP", "PoolState",
           "RankGroup", "Section", "StepAgreement", "cache_fingerprint", "digest", "job_identities", "rank_view",
           "view_digest"]
