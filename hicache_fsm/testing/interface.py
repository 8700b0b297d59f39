"""Adapters: the one interface the protocol fuzzers drive a cache through.

A ``CacheAdapter`` speaks in token sequences, not in the cache's own objects,
so the same stateful machine (``stateful.py``) and the same bounded explorer
(``explorer.py``) run against any prefix cache: ``HiCacheAdapter`` wraps our
``HiCache`` with a ``ManualExecutor`` (every job waits until the driver
completes or fails it, so every acknowledgement order is reachable), and
``docs/fuzzing.md`` adapts a small two-tier LRU cache written for the example.

Operations, all optional except ``insert``, ``match``, ``read_kv`` and
``invariant_violations``:

=====================  ==========================================================
insert(tokens)         compute KV for ``tokens`` and hand it to the cache -> bool
match(tokens)          longest cached prefix -> ``MatchInfo`` (counts as a hit)
lock / unlock          pin a matched prefix on the device (engine-held lock ids)
locked_device_tokens() per held lock, the tokens of its prefix the device serves now
pin_host / unpin_host  pin the host copy of the node that ends at ``tokens``
evict / evict_host     free at least N tokens of a tier -> tokens freed
load_back(tokens)      start loading the host-only part of a match -> tokens
backup(tokens)         back up the device-only node ending at ``tokens`` -> bool
pending_jobs()         jobs in flight; ``complete_job`` / ``fail_job`` end one
redeliver(job_id)      acknowledge a finished job again (must be ``Rejected``)
prefetch(tokens)       storage prefetch of what memory lacks of a prompt -> request
prefetching()          requests whose prefetch is still running (``JobInfo``)
prefetch_ready / abort poll a prefetch like a scheduler step / abort its request
storage_fault(fault)   make the storage tier raise / time out as scheduled
storage_steps()        queued storage work; ``complete_storage`` / ``fail_storage``
                       run one (hit query, S2H transfer, H2S backup, probe)
store_remote(tokens)   another instance sharing the storage tier stores a prompt's KV
read_kv(tokens)        per token, the KV fingerprint read from each valid copy
unowned_refs()         locks / pins on entries that neither the engine nor a running
                       operation owns (checked after every job ends)
capacity()             tokens each tier may hold (``Occupancy``): ``occupancy`` never exceeds it
eviction_policy()      ``"lru"``: the fuzzers judge every victim by the uses they ran
=====================  ==========================================================

An operation the adapter does not override raises ``NotSupported``; the
stateful machine and the explorer consult ``supports(name)`` and never pick
it. A cache that refuses an operation with its documented error is reported
as ``Rejected``; the fuzzers then check that nothing changed (``snapshot``).

KV content is checked end to end: ``insert`` writes, for token ``i`` of a
prompt, a value derived from the prefix ``tokens[:i+1]`` (``kv_fingerprint``)
into every layer, exactly as a transformer's KV depends only on the tokens up
to it. ``read_kv`` reads back every copy the cache claims is valid (device,
host, ...); any copy that differs from the fingerprint is a lost or stale copy.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import attrs

__all__ = ["OPTIONAL_OPS", "REQUIRED_OPS", "CacheAdapter", "JobInfo", "MatchInfo", "NotSupported", "Occupancy",
           "Rejected", "StorageFault"]


class NotSupported(Exception):
    """The adapter does not implement this operation; rules that need it are skipped."""


class Rejected(Exception):
    """The cache refused the operation with its documented error; it must have changed nothing."""


def _token_count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """A count of tokens: an int >= 0 (an adapter's negative or float count is its bug, named where it is made)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen
class MatchInfo:
    """Tokens of a prompt served from the device, then from the host (after the device part)."""

    device_tokens: int = attrs.field(validator=_token_count)
    host_tokens: int = attrs.field(default=0, validator=_token_count)

    @property
    def total(self) -> int:
        return self.device_tokens + self.host_tokens


@attrs.frozen
class JobInfo:
    """One job in flight: its id, kind (``d2h``, ``h2d``, ``h2s``, ``s2h``, ...) and a description."""

    id: int
    kind: str
    detail: tuple = ()


@attrs.frozen
class Occupancy:
    """Tokens in use per tier (used to check that evictions report what they freed)."""

    device_tokens: int = attrs.field(validator=_token_count)
    host_tokens: int = attrs.field(default=0, validator=_token_count)


@attrs.frozen
class StorageFault:
    """One scheduled storage failure: calls of ``call`` after the ``after``-th fail ``count`` times.

    ``kind`` is ``raise`` (the backend raises), ``timeout`` (the call times
    out), ``short`` (a batch returns fewer pages) or ``corrupt`` (a page
    fails its checksum). ``call`` is ``get``, ``set``, ``exists`` or ``any``.
    """

    kind: str
    call: str = "any"
    after: int = 0
    count: int = 1


# every adapter implements these: one raising ``NotSupported`` is an adapter bug, not an operation to skip
REQUIRED_OPS = ("insert", "match", "read_kv", "invariant_violations")
OPTIONAL_OPS = (
    "lock", "unlock", "held_locks", "locked_device_tokens", "pin_host", "unpin_host", "held_pins", "evict",
    "evict_host",
    "load_back", "backup", "complete_job", "fail_job", "redeliver", "prefetch", "prefetching", "prefetch_ready",
    "abort", "storage_fault", "storage_steps", "stored_prefix", "store_remote", "complete_storage", "fail_storage",
    "occupancy", "unowned_refs", "capacity", "eviction_policy",
    "snapshot",
    "state_key", "size",
)


class CacheAdapter:
    """Drive a prefix KV cache through token sequences; see the module docstring.

    Subclasses implement ``insert``, ``match``, ``read_kv`` and
    ``invariant_violations`` and whichever optional operations their cache
    has. ``page_size`` is the token granularity (prompts are cut to whole pages).
    """

    name = "cache"
    page_size = 1

    # ------------------------------------------------------------------ capability

    def supports(self, op: str) -> bool:
        """True when this adapter overrides ``op`` (or ``pending_jobs`` returns jobs)."""
        mine = getattr(type(self), op, None)
        base = getattr(CacheAdapter, op, None)
        return mine is not None and mine is not base

    # ------------------------------------------------------------------ required

    def insert(self, tokens: Sequence[int]) -> bool:
        """Compute KV for ``tokens`` (whole pages) and insert it; False when there is no room."""
        raise NotImplementedError

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        raise NotImplementedError

    def read_kv(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """For each token of the longest cached prefix of ``tokens`` that some tier can serve
        now, the fingerprints read from every copy the cache claims is valid (stop at the first
        token with none). Must not change the cache (no hit counts, no splits)."""
        raise NotImplementedError

    def invariant_violations(self) -> list[str]:
        raise NotImplementedError

    # ------------------------------------------------------------------ optional

    def read_kv_many(self, prompts: Iterable[Sequence[int]]) -> dict[tuple, list[tuple[int, ...]]]:
        return {tuple(p): self.read_kv(p) for p in prompts}

    def kv_violations(self) -> list[str]:
        """Optional: check *every* cached token's valid copies against ``kv_fingerprint`` at once
        (faster than reading prompt by prompt). Raise ``NotSupported`` to use ``read_kv``."""
        raise NotSupported("kv_violations")

    def lock(self, tokens: Sequence[int]) -> int | None:
        """Match ``tokens`` and lock the device part; a lock id, or None when nothing is on the device."""
        raise NotSupported("lock")

    def unlock(self, lock_id: int) -> None:
        raise NotSupported("unlock")

    def held_locks(self) -> list[int]:
        raise NotSupported("held_locks")

    def locked_device_tokens(self) -> dict[int, int]:
        """Per held lock id, how many tokens of the prefix it locked the device serves now; reads only.

        A lock promises its prefix stays on the device until ``unlock``: with this, every step is checked
        to keep it (``lock_kept_on_device``). A cache that evicts a locked prefix still serves the right KV
        from a slower tier, so no other generic check can tell."""
        raise NotSupported("locked_device_tokens")

    def pin_host(self, tokens: Sequence[int]) -> int | None:
        raise NotSupported("pin_host")

    def unpin_host(self, pin_id: int) -> None:
        raise NotSupported("unpin_host")

    def held_pins(self) -> list[int]:
        raise NotSupported("held_pins")

    def evict(self, num_tokens: int) -> int:
        raise NotSupported("evict")

    def evict_host(self, num_tokens: int) -> int:
        raise NotSupported("evict_host")

    def load_back(self, tokens: Sequence[int]) -> int:
        raise NotSupported("load_back")

    def backup(self, tokens: Sequence[int]) -> bool | None:
        """True: backup started; False: refused for lack of room; None: no such device-only node."""
        raise NotSupported("backup")

    def pending_jobs(self) -> list[JobInfo]:
        """Jobs in flight (a synchronous cache has none)."""
        return []

    def complete_job(self, job_id: int) -> None:
        raise NotSupported("complete_job")

    def fail_job(self, job_id: int) -> None:
        raise NotSupported("fail_job")

    def finished_jobs(self) -> list[int]:
        """Ids of jobs already completed or failed (candidates for ``redeliver``)."""
        return []

    def redeliver(self, job_id: int) -> None:
        """Deliver a finished job's acknowledgement again; a correct cache raises ``Rejected``."""
        raise NotSupported("redeliver")

    def poll(self) -> None:
        """One engine step with nothing else to do (flush queued work)."""

    def prefetch(self, tokens: Sequence[int]) -> Hashable | None:
        """Start prefetching ``tokens`` from storage; a request id, or None when not admitted."""
        raise NotSupported("prefetch")

    def prefetching(self) -> list[JobInfo]:
        """Prefetches in flight (``id``: the request; ``detail``: its tokens)."""
        return []

    def prefetch_ready(self, request: Hashable) -> bool:
        """Poll a prefetch like a scheduler step: True once it ended (then it leaves ``prefetching``)."""
        raise NotSupported("prefetch_ready")

    def abort(self, request: Hashable) -> None:
        """The request was aborted mid-prefetch; it leaves ``prefetching``."""
        raise NotSupported("abort")

    def storage_fault(self, fault: StorageFault) -> None:
        raise NotSupported("storage_fault")

    def storage_steps(self) -> list:
        """Queued storage work the driver may run (objects with an ``id``); empty when none."""
        return []

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the storage tier holds (no side effects)."""
        raise NotSupported("stored_prefix")

    def store_remote(self, tokens: Sequence[int]) -> int:
        """Another cache sharing the storage tier stores the KV of ``tokens`` there -> tokens written."""
        raise NotSupported("store_remote")

    def complete_storage(self, step_id: Hashable) -> None:
        """Run one queued storage step (hit query, transfer, backup) now."""
        raise NotSupported("complete_storage")

    def fail_storage(self, step_id: Hashable) -> None:
        """Run one queued storage step with its backend call failing."""
        raise NotSupported("fail_storage")

    def occupancy(self) -> Occupancy:
        raise NotSupported("occupancy")

    def capacity(self) -> Occupancy:
        """Tokens each tier may hold; checked against ``occupancy`` after every step (an overflow that
        keeps the KV right shows nowhere else)."""
        raise NotSupported("capacity")

    def eviction_policy(self) -> str | None:
        """``"lru"`` when no page may leave the cache (no tier serves it) while a page used less recently
        stays; the fuzzers then judge every victim (``checks.UseOrder`` says what counts as a use).
        None: not judged."""
        raise NotSupported("eviction_policy")

    def unowned_refs(self) -> dict[Hashable, tuple[int, int]]:
        """Per entry (as ``JobInfo.detail`` names it), the (locks, pins) it holds beyond what the engine's
        ``held_locks`` / ``held_pins`` and running operations own; entries with none are left out."""
        raise NotSupported("unowned_refs")

    def snapshot(self) -> Any:
        """A comparable picture of the whole cache (checks that a rejected call changed nothing)."""
        raise NotSupported("snapshot")

    def state_key(self) -> Hashable:
        """A canonical, hashable abstraction of the state (the explorer's visited set)."""
        raise NotSupported("state_key")

    def size(self) -> int:
        """Number of entries (tree nodes); the explorer bounds it."""
        raise NotSupported("size")

    def machines(self) -> list:
        """Compiled state machines to listen to (coverage)."""
        return []

    def prompt_steps(self, prompt: tuple[int, ...]) -> list:
        """The explorer's extra steps on ``prompt`` for operations of this cache only (``checks.Step``)."""
        return []

    def extra_steps(self) -> list:
        """The explorer's extra steps that take no prompt (``checks.Step``), tried in every state."""
        return []

    def applicable(self, op: str, args: tuple) -> bool:
        """False only when running ``op(*args)`` now surely changes nothing, or has exactly the
        effect of another step the explorer also tries (it skips the clone). Default: True."""
        return True

    def clone(self) -> CacheAdapter:
        """An independent copy (the explorer forks states); deep copy by default."""
        return copy.deepcopy(self)

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.name

