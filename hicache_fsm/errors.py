"""One error hierarchy for the whole library.

Every error the library raises on bad input or an illegal request derives from
``HiCacheError`` so an engine can catch one type; each subclass names what was
wrong and where. Raising one of these never leaves a structure half-changed.
"""

from __future__ import annotations

from typing import NamedTuple


class HiCacheError(Exception):
    """Base class of every error hicache_fsm raises on purpose."""


class SpecError(HiCacheError):
    """A spec file is malformed; carries the file and line of the problem."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        self.problems: list[SpecError] = [self]  # every problem found; the first is this one
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class BindingError(HiCacheError):
    """A machine was compiled against an implementation that lacks a named guard or effect."""


class InvalidTransition(HiCacheError):
    """A trigger is not legal in the object's current state (nothing changed)."""

    def __init__(self, machine: str, state: str, trigger: str, detail: str = "") -> None:
        self.machine = machine
        self.state = state
        self.trigger = trigger
        msg = f"{machine}: trigger {trigger!r} is not allowed in state {state!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class GuardRejected(InvalidTransition):
    """A trigger is legal in the state, but every guard on it said no (nothing changed)."""


class AllocationError(HiCacheError):
    """A page allocator was asked to do something impossible (double free, bad index)."""


class ConfigError(HiCacheError):
    """A configuration value is impossible (sizes, layouts, policies)."""


class UnknownNode(HiCacheError):
    """A node id does not name a live node of this cache."""


class UnknownJob(HiCacheError):
    """A completion names a job that is not pending (unknown, or already acked)."""


class JobOwnerError(UnknownJob):
    """A completion came from someone other than the job's owner (the storage tier runs h2s / s2h jobs)."""


class CompletionFailure(NamedTuple):
    """One completion that could not be applied, and why (an ``UnknownJob``, or what applying it raised)."""

    completion: object
    error: Exception


class CompletionsFailed(HiCacheError):
    """``poll`` / ``complete`` applied every completion it could; ``failures`` could not be applied.

    Raised only after every other completion of the batch was applied, so one
    bad completion never loses the others. ``applied`` are the completions
    that ended their jobs (what ``poll`` would have returned), those whose
    follow-up transitions raised included: their job is over either way.
    """

    def __init__(self, failures: list[CompletionFailure], applied: list | None = None) -> None:
        self.failures = list(failures)
        self.applied = list(applied or ())
        lines = [f"{type(f.error).__name__}: {f.error}" for f in self.failures]
        super().__init__(f"{len(lines)} completion(s) could not be applied: " + "; ".join(lines))


class WrongThread(HiCacheError):
    """A cache was called from a thread other than the one that drives it (nothing changed).

    A cache belongs to one thread at a time; see ``HiCache.release_thread``.
    """


class LockError(HiCacheError):
    """A lock count would go negative, or a locked node was asked to be freed."""


class BadIndices(HiCacheError):
    """An index tensor has the wrong dtype, device, length or alignment."""


class StorageError(HiCacheError):
    """A storage backend failed (I/O error, timeout, server down)."""


class StorageLinkError(HiCacheError):
    """Attach/detach of a storage backend was refused or failed."""


class LayerWriteError(HiCacheError):
    """A context-parallel per-layer write was used out of protocol."""


class StorageUnavailable(StorageError):
    """A storage backend cannot be reached (server down, connection refused, closed)."""


class StorageTimeout(StorageError):
    """A storage operation did not finish within its deadline."""


class StorageFull(StorageError):
    """A storage backend ran out of space (disk full, quota, server out of memory)."""


class StorageKeyError(StorageError, ValueError):
    """A storage key, namespace part, token id or batch argument is malformed."""


class StorageURLError(StorageError, ConfigError):
    """A storage URL names an unknown scheme or has an impossible form, or a backend option is unusable."""


class UnknownStorageOption(StorageURLError):
    """Options the backend has no keyword for: ``names``, beside the ones it has, ``known``."""

    def __init__(self, scheme: str, names: list[str], known: list[str]) -> None:
        super().__init__(f"unknown {scheme}:// storage option(s) {', '.join(names)}; known: {', '.join(known)}")
        self.scheme = scheme
        self.names = names
        self.known = known


class TraceError(HiCacheError):
    """A trace file is missing or malformed; carries the file and line of the problem."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class DiagramError(HiCacheError):
    """A diagram could not be rendered (Graphviz missing, failed or timed out)."""


class BadTokenIds(BadIndices, ValueError):
    """A token id is out of the range storage keys encode, or not an integer at all.

    ``position`` is the index of the first bad element (None when the container
    itself is wrong) and ``value`` that element.
    """

    def __init__(self, message: str, position: int | None = None, value: object = None) -> None:
        self.position = position
        self.value = value
        super().__init__(message)


class TokenIdTypeError(BadTokenIds, TypeError):
    """A token id (or the sequence holding them) has a type that is not an integer."""


class MissingExtra(HiCacheError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that brings it."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        super().__init__(f"{feature} needs {module}: pip install 'hicache_fsm[{extra}]'", name=module)


class GroupError(HiCacheError):
    """A tensor-parallel group collective failed: a rank died, timed out, or the ranks disagree.

    The group cannot be trusted afterwards: every later agreement raises again.
    """


class RankTimeout(GroupError):
    """A rank did not join a group collective within the timeout (hung, slow, or dead)."""


class RanksDiverged(GroupError):
    """The ranks reached an agreement point with different state (a bug, or ranks fed different requests)."""
