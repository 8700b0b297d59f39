"""The memory-tier families of ``hicache-fsm check`` past one per write policy, each for a bug class the others
miss: a full one-page host (``host_room_families``), eviction order (``order_family``, ``recency_families``), a
chain loading back under a revived node (``chain_loads_family``) and ``reset``; and, in memory and with storage,
the families of two tree namespaces (``namespace_families``) and of the page_first host layouts
(``layout_families``); those of config thresholds and budgets left at rest by default (``option_families``,
``storage_option_family``); and another tenant's instance on the same storage (``foreign_tenant_family``).

``testing.protocol.default_families`` lists them with the others; each takes the factory that builds the
adapter (``protocol.protocol_factory``), as ``testing.start_families`` does, so this module imports neither it
nor the facade.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["FOREIGN_START", "PRESSURE_START", "chain_loads_family", "foreign_tenant_family", "host_room_families",
           "layout_families", "namespace_families", "option_families", "order_family", "pressure_family",
           "recency_families", "reset_family", "storage_option_family"]


# The start of ``memory/load_back_pressure``: a two-page chain backed up, then evicted (host-only).
PRESSURE_START = (("insert", ((1, 1),)), ("complete_job", (0,)), ("evict", (2,)))


def pressure_family(factory: Callable[[Any], Any], name: str = "memory/load_back_pressure",
                    cache_options: dict | None = None) -> tuple[str, Any, Any]:
    """Three nodes on a three-page device: load-backs under device pressure with locked occupants.

    From a host-only two-page chain (``PRESSURE_START``), every state within four steps: occupants
    inserted (their backups in flight), locked or evicted while the chain loads back (refused for device
    room, or evicting an unlocked occupant), and loads that complete or fail with their nodes locked. The
    host (four pages) keeps the chain's copy while an occupant is backed up. The action set is narrowed
    to what those scenarios use: no match, explicit backup, host eviction, host pins or re-delivered acks
    (the two-node families explore those). ``check --json`` reports both narrowings under
    ``"reductions"``. ``cache_options`` (``Bounds.cache_options``) makes the same family under another
    config (``option_families``).
    """
    from hicache_fsm.testing.checks import Step
    from hicache_fsm.testing.explorer import Bounds

    start = tuple(Step(op, args) for op, args in PRESSURE_START)
    return (name, Bounds(nodes=3, device_pages=3, host_pages=4, alphabet=2, max_len=2, max_pins=0, redeliver=False,
                         omit=("match", "backup", "evict_host"), start=start, max_depth=4,
                         cache_options=cache_options or {}), factory)


def chain_loads_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Any]:
    """One token, prompts of up to three pages on a three-page device and host, six steps deep.

    A three-node chain: its top page loading back, the page below revived by an insert (the engine's own
    slots: on the device at once, under a parent still loading), then a load-back of the third page, whose
    wait must cover the top page's load too (``loads_waited``; a load-back that waited only for the loads
    right above its chain was missed by every other family, whose prompts stop at two nodes). Locks, pins
    and redelivery are left out; complete to its depth.
    """
    from hicache_fsm.testing.explorer import Bounds

    return ("memory/chain_loads",
            Bounds(nodes=3, device_pages=3, host_pages=3, alphabet=1, max_len=3, max_locks=0, max_pins=0,
                   redeliver=False, write_policy="write_through", max_depth=6), factory)


def host_room_families(factory: Callable[[Any], Any]) -> list[tuple[str, Any, Any]]:
    """A one-page host under write_back, write_through and write_through_selective, deeper than ``memory/``.

    ``memory/write_back_host_full``: a load-back's own device eviction starts backups that need the host
    room the chain it loads holds: the chain must stay pinned through it (a chain left unpinned was
    missed by every other family). ``memory/write_through_host_full``: a prompt too long for the host
    is never backed up, a match splits it, its tail is backed up and pinned; device eviction then meets
    a device-only parent of a host-only child whose backup the full host refuses: it must stay (dropping
    it orphaned the child, missed by every other family). ``memory/selective_host_full``: a match's
    due backups need the host room that the copies the match found hold: those must stay pinned through
    the backups' host eviction (a match then reported tokens no tier could serve). Locks and redelivery
    are left out; complete to its depth.
    """
    from hicache_fsm.testing.explorer import Bounds

    return [("memory/write_back_host_full",
             Bounds(nodes=2, device_pages=2, host_pages=1, max_locks=0, max_pins=0, redeliver=False,
                    write_policy="write_back", max_depth=6), factory),
            ("memory/write_through_host_full",
             Bounds(nodes=2, device_pages=2, host_pages=1, max_locks=0, max_pins=1, redeliver=False,
                    write_policy="write_through", max_depth=8), factory),
            ("memory/selective_host_full",
             Bounds(nodes=2, device_pages=2, host_pages=1, alphabet=1, max_locks=0, max_pins=0, redeliver=False,
                    write_policy="write_through_selective", max_depth=7), factory)]


def order_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Any]:
    """Three one-page prompts over a two-page device and host: which node each tier's eviction takes.

    Deep enough (seven steps) for both tiers to hold two candidates after uses in different orders, so the
    eviction-order check (``testing.recency``) judges real choices; backups are write_through's own, and
    explicit backup, load-back, failed jobs, locks and pins are left out (the other families explore those).
    """
    from hicache_fsm.testing.explorer import Bounds

    return ("memory/eviction_order",
            Bounds(nodes=3, device_pages=2, host_pages=2, alphabet=3, max_len=1, max_locks=0, max_pins=0,
                   redeliver=False, omit=("backup", "fail_job", "load_back"), max_depth=7), factory)


def recency_families(factory: Callable[[Any], Any]) -> list[tuple[str, Any, Any]]:
    """Two one-page prompts on a three-page device, per eviction policy: what an insert does to the order.

    A prompt inserted again (or matched) while another stays on the device, then an eviction: every ranking an
    insert or a lookup can give two nodes (under ``priority`` inserts also run at priority 1), judged by
    ``testing.recency`` within five steps. ``write_through_selective`` keeps backups out of the way (none is
    due below the hit threshold), and backup, failed jobs, load-back, locks and pins are left out.
    """
    from hicache_fsm.testing.explorer import Bounds

    return [(f"memory/recency_{p}", Bounds(nodes=2, device_pages=3, host_pages=2, alphabet=2, max_len=1, max_locks=0,
                                            max_pins=0, redeliver=False, write_policy="write_through_selective",
                                            eviction_policy=p, priorities=2 if p == "priority" else 1,
                                            omit=("backup", "fail_job", "load_back"), max_depth=5), factory)
            for p in ("lru", "lfu", "priority")]


def reset_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Any]:
    """One token on a two-page device and host, with at most one ``reset`` per path: the cache must be empty
    at once whatever was cached, locked, pinned or in flight, and the late acks of the jobs it cancelled
    (landed or failed) must change nothing, whenever the next poll takes them."""
    from hicache_fsm.testing.explorer import Bounds

    return ("memory/reset", Bounds(nodes=2, device_pages=2, host_pages=2, alphabet=1, max_resets=1, max_depth=5),
            factory)


def namespace_families(factory: Callable[[Any], Any]) -> tuple[tuple[str, Any, Any], tuple[str, Any, Any]]:
    """The ``check`` families of two namespaces: ``memory/namespaces`` (two-page prompts whose first pages are
    twins: a lookup, insert or split that crosses namespaces shows within five steps) and
    ``storage/namespaces`` (one-page twins: one stored, the other prefetched)."""
    from hicache_fsm.testing.explorer import Bounds

    memory = Bounds(nodes=2, device_pages=2, host_pages=2, namespaces=2, max_depth=5)
    storage = Bounds(nodes=2, device_pages=1, host_pages=2, max_len=1, max_locks=0, max_pins=0, redeliver=False,
                     storage=True, namespaces=2, max_depth=5)
    return ("memory/namespaces", memory, factory), ("storage/namespaces", storage, factory)


# The start of ``storage/<layout>``: a prompt backed up to host page 0, another instance stores a second one.
LAYOUT_START = (("insert", ((2, 2),)), ("complete_job", (0,)), ("store_remote", ((1, 1),)))


def layout_families(factory: Callable[[Any], Any]) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """Per page_first host layout (``page_first``, ``page_first_direct``): ``memory/<layout>``, the bounds of
    ``memory/pages_and_layers`` (pages of two tokens over two layers, five steps) on a host of that layout,
    whose copies index pages and layers each its own way; and ``storage/<layout>``, from ``LAYOUT_START``
    (one-page prompts on a one-page device, three steps): a page fetched or backed up into another host page
    than the one at page 0, where a page number taken for a slot number shows in the bytes stored."""
    from hicache_fsm.testing.checks import Step
    from hicache_fsm.testing.explorer import Bounds

    start = tuple(Step(op, args) for op, args in LAYOUT_START)
    memory, storage = [], []
    for layout in ("page_first", "page_first_direct"):
        memory.append((f"memory/{layout}", Bounds(nodes=2, device_pages=2, host_pages=2, page_size=2, layers=2,
                                                  host_layout=layout, max_depth=5), factory))
        storage.append((f"storage/{layout}", Bounds(nodes=2, device_pages=1, host_pages=2, page_size=2, layers=2,
                                                    max_len=1, max_locks=0, max_pins=0, redeliver=False,
                                                    storage=True, host_layout=layout, start=start, max_depth=3),
                        factory))
    return memory, storage


def option_families(factory: Callable[[Any], Any]) -> list[tuple[str, Any, Any]]:
    """The thresholds and budgets a default config leaves at rest (``Bounds.cache_options``), each where it acts.

    ``memory/headroom``: ``memory/load_back_pressure`` with ``eviction_headroom_tokens=1`` (an allocation or a
    load-back that evicts frees one token more than it lacks, and none when it lacks nothing).
    ``memory/load_back_limits``: the chain of ``memory/chain_loads`` (one token, prompts of up to three pages on
    a three-page device and host) with ``load_back_threshold=2``, ``load_back_max_tokens=2`` (a one- or
    three-token load-back never starts, a two-token one starts when it has room).
    ``memory/write_behind_batch``: two-page prompts under write_behind with ``write_behind_batch_tokens=1`` and
    ``write_behind_idle_steps=1``: a poll backs up one cold token, or one node larger than the whole batch
    alone. ``memory/selective_threshold_1``: write_through_selective backs a node up at its first hit. The
    obligations of ``testing.obligations`` read these fields; with the defaults those paths never run. Locks,
    pins and redelivery are left out (but in ``memory/headroom``); complete to its depth.
    """
    from hicache_fsm.testing.explorer import Bounds

    chain = dict(nodes=3, device_pages=3, host_pages=3, alphabet=1, max_len=3, max_locks=0, max_pins=0,
                 redeliver=False)
    return [pressure_family(factory, "memory/headroom", {"eviction_headroom_tokens": 1}),
            ("memory/load_back_limits", Bounds(**chain, max_depth=5, cache_options={"load_back_threshold": 2,
                                                                                    "load_back_max_tokens": 2}),
             factory),
            ("memory/write_behind_batch",
             Bounds(nodes=2, device_pages=2, host_pages=2, max_locks=0, max_pins=0, redeliver=False,
                    write_policy="write_behind", max_depth=5,
                    cache_options={"write_behind_batch_tokens": 1, "write_behind_idle_steps": 1}), factory),
            ("memory/selective_threshold_1",
             Bounds(nodes=2, device_pages=2, host_pages=2, max_locks=0, max_pins=0, redeliver=False,
                    write_policy="write_through_selective", max_depth=4,
                    cache_options={"write_through_threshold": 1}), factory)]


def storage_option_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Any]:
    """``storage/prefetch_limits``: the storage tier's prefetch limits and batch size set where they bind
    (``Bounds.storage_options``): ``prefetch_threshold=2`` (a one-page prefetch is refused, a hit query that
    finds one page revokes), ``prefetch_capacity_tokens=3`` (two two-page prefetches do not fit at once, on a
    four-page host that would hold them) and ``batch_pages=1`` (a two-page query or transfer takes two calls).
    By default every prefetch of a page is admitted up to the whole host pool, so none of these binds. One
    token, two prefetches at once, four steps; locks, pins and redelivery left out.
    """
    from hicache_fsm.testing.explorer import Bounds

    return ("storage/prefetch_limits",
            Bounds(nodes=2, device_pages=2, host_pages=4, alphabet=1, max_len=2, max_locks=0, max_pins=0,
                   redeliver=False, storage=True, max_prefetches=2, max_depth=4,
                   storage_options={"prefetch_threshold": 2, "prefetch_capacity_tokens": 3, "batch_pages": 1}),
            factory)


# The start of ``storage/foreign_tenant``: another tenant's instance stores a prompt, this cache prefetches it.
FOREIGN_START = (("store_remote", ((1,),)), ("prefetch", ((1,),)))


def foreign_tenant_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Any]:
    """``storage/foreign_tenant``: ``store_remote`` is another tenant's instance on the same storage
    (``Bounds.remote_tenant``), whose KV for the same tokens differs. From ``FOREIGN_START`` (its page stored,
    this cache prefetching the same tokens), every state within four steps: the hit query, the transfer and
    the polls that would insert the page. Storage keys namespaced per tenant find nothing; keys that leave
    the tenant out hit the other tenant's page and read its KV back. One-page prompts on a one-page device."""
    from hicache_fsm.testing.checks import Step
    from hicache_fsm.testing.explorer import Bounds

    start = tuple(Step(op, args) for op, args in FOREIGN_START)
    return ("storage/foreign_tenant",
            Bounds(nodes=2, device_pages=1, host_pages=2, alphabet=2, max_len=1, max_locks=0, max_pins=0,
                   redeliver=False, storage=True, remote_tenant="tenant-b", start=start, max_depth=4), factory)
