"""What the cache owes the engine beyond its own invariants, checked by ``ProtocolAdapter`` around its steps.

- ``loads_waited``: every node on a prefix the engine is handed whose device
  copy is still being loaded is covered by a wait the engine got with it (a
  match's ``loads``, a load-back's handle and its ``deps``). Reading layer
  ``i`` after ``wait(i)`` must be safe: a load it does not wait for may land
  after the forward pass read its slots.
- ``wait_complete_due``: under the ``wait_complete`` stop policy a prefetch
  is not ready while its hit query or transfer is still running.
- ``write_behind_due``: a poll that finds a device-only node cold (idle for
  ``write_behind_idle_steps`` polls, counting this one) with host room for it
  backs up at least one node, unless a backup was refused for host room (the
  write_behind promise); ``write_behind_early``: it backs up no node that is
  still warm; ``write_behind_batch``: it backs up at most
  ``write_behind_batch_tokens`` tokens, or one node (a node larger than the
  whole batch goes alone, or never would).
- ``evict_due``: ``evict(n)`` frees at least ``n`` device tokens, or all that
  could go at once (``freeable_device_tokens``): nodes with a host copy, and
  device-only subtrees a policy that keeps no unbacked KV may drop, unlocked
  and with nothing in flight below them; ``alloc_due``: ``alloc_device(n)``
  succeeds when free and freeable tokens add up to ``n``; ``evict_just_enough``:
  ``evict(n)`` and ``evict_host(n)`` stop once ``n`` tokens are freed (the last
  victim may overshoot, no victim more).
- ``headroom_kept``: ``alloc_device(n)`` and ``load_back`` evict only when
  the free device tokens fall short, and then free the shortfall plus
  ``eviction_headroom_tokens``, or all that could go at once, and no victim
  past that.
- ``load_back_limits``: a load-back that starts loads at least
  ``load_back_threshold`` and at most ``load_back_max_tokens`` tokens.
- ``prefetch_admission``: a prefetch admitted fetches at least the tier's
  ``prefetch_threshold`` (one page at least) and keeps every running
  prefetch within ``prefetch_capacity_tokens``; ``prefetch_revoke``: a hit
  query revokes its prefetch exactly when the hits fall short of the
  threshold; ``batch_bound``: no backend call takes more than ``batch_pages``
  keys. The limits are the adapter's (what it configured), not the tier's.
- ``store_due``: with storage taking backups (attached, healthy), no node is
  left over two polls with a host copy storage lacks and no backup of it
  running (``unstored_nodes``): a D2H ack starts the node's storage backup,
  and the poll after a failure, an attach or a recovery retries the rest.
- ``query_exact`` / ``transfer_exact``: a prefetch's hit query (transfer),
  run without an injected fault, finds (lands) exactly the leading pages
  storage holds of what it asked for (read).
- ``load_back_due``: a load-back of a host hit within ``load_back_threshold`` /
  ``load_back_max_tokens`` is refused only when the device cannot make room for
  it: on a copy of the cache, with the matched prefix locked and the chain's
  host copies pinned (what ``load_back`` protects while it evicts), an
  eviction of the shortfall leaves too little room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hicache_fsm.eviction import DEVICE_EVICTABLE, RESIDENT
from hicache_fsm.storage.retry import UNSTORED

if TYPE_CHECKING:
    from hicache_fsm.radix import TreeNode
    from hicache_fsm.results import LoadHandle

__all__ = ["DeviceWatch", "batch_bound_problem", "freeable_device_tokens", "load_back_limit_problem",
           "load_back_refusal_problem", "overshoot_problem", "prefetch_admission_problem", "storage_step_watch",
           "unstored_nodes", "unwaited_loads", "wait_complete_problem", "write_behind_problems",
           "write_behind_snapshot"]


def _waited(handles: Iterable[LoadHandle]) -> set[int]:
    """Ids of ``handles`` and of every load they wait for in turn (their ``deps``)."""
    seen: set[int] = set()
    todo = list(handles)
    while todo:
        handle = todo.pop()
        if id(handle) not in seen:
            seen.add(id(handle))
            todo += handle.deps
    return seen


def unwaited_loads(outbox: Any, nodes: Iterable[TreeNode], handles: Iterable[LoadHandle]) -> list[TreeNode]:
    """The loading nodes among ``nodes`` whose pending load no handle of ``handles`` (or its deps) waits for."""
    from hicache_fsm.bindings.residency import LOADING

    waited = _waited(handles)
    return [n for n in nodes if n.state in LOADING and not any(id(h) in waited for h in outbox.handles_of(n))]


def wait_complete_problem(request: object, state_before: str | None, ready: bool, stop_policy: str) -> list[str]:
    """``wait_complete_due``: a prefetch reported ready while its query or transfer was running."""
    from hicache_fsm.storage.prefetch import THREAD_STATES

    if ready and stop_policy == "wait_complete" and state_before in THREAD_STATES:
        return [f"wait_complete_due: prefetch {request!r} reported ready while {state_before} (wait_complete waits "
                f"for the whole transfer)"]
    return []


def write_behind_snapshot(cache: Any) -> tuple[int, int, int, dict[int, tuple[int, int]]]:
    """What ``write_behind_problems`` judges the next step against: the poll count, the backups refused for host
    room, the free host tokens and each device-only node's (last poll, tokens)."""
    nodes = {n.id: (n.last_poll, n.num_tokens) for n in cache.tree.nodes() if n.parent is not None
             and n.state == "device"}
    return cache.driver.polls, cache.counters["backup_host_full"], cache.host_allocator.available_tokens, nodes


def write_behind_problems(before: tuple[int, int, int, dict[int, tuple[int, int]]], cache: Any) -> list[str]:
    """``write_behind_due``, ``write_behind_early`` and ``write_behind_batch`` of a step that ran one poll, from
    ``before`` (``write_behind_snapshot`` taken after the step before it)."""
    polls0, refused0, room, device0 = before
    polls = cache.driver.polls
    if polls != polls0 + 1:
        return []  # no poll ran (or several: not judged)
    config = cache.config
    idle, batch = config.write_behind_idle_steps, config.write_behind_batch_tokens
    live = {n.id: n for n in cache.tree.nodes()}
    started = [(nid, tokens) for nid, (last, tokens) in device0.items() if nid in live and live[nid].state != "device"]
    problems = []
    early = sorted(nid for nid, _ in started if polls - device0[nid][0] < idle)
    if early:
        problems.append(f"write_behind_early: a poll backed up node(s) {early}, used fewer than {idle} polls ago")
    spent = sum(tokens for _, tokens in started)
    if len(started) > 1 and spent > batch:
        problems.append(f"write_behind_batch: a poll backed up {spent} tokens in {len(started)} nodes; the batch is "
                        f"{batch} tokens")
    if not started and cache.counters["backup_host_full"] == refused0:
        late = sorted(nid for nid, (last, tokens) in device0.items() if nid in live and live[nid].state == "device"
                      and polls - last >= idle and tokens <= room)
        if late:
            problems.append(f"write_behind_due: a poll left node(s) {late} device-only, cold and with host room, "
                            f"and backed up nothing")
    return problems


def load_back_limit_problem(total: int, config: Any) -> str | None:
    """``load_back_limits`` for a load-back of ``total`` tokens that started."""
    if total < config.load_back_threshold:
        return (f"load_back_limits: a load-back of {total} tokens started; load_back_threshold is "
                f"{config.load_back_threshold}")
    if config.load_back_max_tokens is not None and total > config.load_back_max_tokens:
        return (f"load_back_limits: a load-back of {total} tokens started; load_back_max_tokens is "
                f"{config.load_back_max_tokens}")
    return None


def prefetch_threshold_tokens(adapter: Any) -> int:
    """The fewest tokens a prefetch of ``adapter``'s tier may fetch: its ``prefetch_threshold``, one page at least."""
    return max(adapter.prefetch_threshold, adapter.page_size)


def prefetch_admission_problem(adapter: Any, tokens: int, held_before: int) -> str | None:
    """``prefetch_admission`` for a prefetch of ``tokens`` admitted while running prefetches held ``held_before``
    host tokens."""
    least = prefetch_threshold_tokens(adapter)
    if tokens < least:
        return f"prefetch_admission: a prefetch of {tokens} tokens was admitted; the threshold is {least}"
    cap = adapter.prefetch_capacity_tokens - adapter.prefetch_capacity_tokens % adapter.page_size
    if held_before + tokens > cap:
        return (f"prefetch_admission: a prefetch of {tokens} tokens was admitted beside {held_before} held by "
                f"running prefetches; the capacity is {cap}")
    return None


def batch_bound_problem(widest: int, batch_pages: int) -> str | None:
    """``batch_bound``: the widest backend call of a step took ``widest`` keys."""
    if widest <= batch_pages:
        return None
    return f"batch_bound: a storage call took {widest} keys; batch_pages is {batch_pages}"


class DeviceWatch:
    """``headroom_kept`` for one call that may evict device KV to make room for ``wanted`` tokens (``alloc_device``
    or ``load_back``): taken before the call, judged after it. ``held``: ids of nodes the call keeps on the device
    while it evicts (a load-back's matched prefix)."""

    def __init__(self, cache: Any, call: str, wanted: int, held: frozenset[int] = frozenset()) -> None:
        from hicache_fsm.bindings.residency import ON_DEVICE

        self.cache, self.call, self.wanted = cache, call, wanted
        self.free = cache.device_allocator.available_tokens
        self.could = freeable_device_tokens(cache.tree.root, cache.config.keeps_unbacked, held)
        self.evicted = cache.counters["evicted_device_tokens"]
        self.on_device = [n for n in cache.tree.nodes() if n.state in ON_DEVICE]

    def problems(self) -> list[str]:
        from hicache_fsm.bindings.residency import ON_DEVICE

        cache = self.cache
        evicted = cache.counters["evicted_device_tokens"] - self.evicted
        if self.free >= self.wanted:
            return [f"headroom_kept: {self.call} of {self.wanted} tokens evicted {evicted} device tokens with "
                    f"{self.free} free"] if evicted else []
        capacity = cache.device_allocator.capacity_tokens
        if self.wanted > capacity:  # no eviction could make room: none is owed, and any would only lose KV
            return [f"headroom_kept: {self.call} of {self.wanted} tokens, more than the device pool's {capacity}, "
                    f"evicted {evicted} device tokens"] if evicted else []
        target = self.wanted - self.free + cache.config.eviction_headroom_tokens
        problems = []
        if evicted < min(target, self.could):
            problems.append(f"headroom_kept: {self.call} of {self.wanted} tokens with {self.free} free evicted "
                            f"{evicted} device tokens; it owes the shortfall plus eviction_headroom_tokens, {target}, "
                            f"and {self.could} could go at once")
        tree = cache.tree
        victims = [n for n in self.on_device if not tree.owns(n) or n.state not in ON_DEVICE]
        return problems + overshoot_problem(f"{self.call}'s eviction", target, evicted, victims)


def load_back_refusal_problem(fork: Any, tokens: tuple[int, ...]) -> str | None:
    """``load_back_due`` for a refused load-back of ``tokens``, judged on ``fork`` (a copy of the adapter taken
    after the refusal, spent by this call): the problem, or None when the refusal was justified."""
    cache = fork.cache
    cfg = cache.config
    match = fork.match_prefix(tokens)
    total = match.host_hit_length
    if total == 0 or total < cfg.load_back_threshold or (
            cfg.load_back_max_tokens is not None and total > cfg.load_back_max_tokens):
        return None
    anchor = match.last_device_node
    chain = []  # the host-only nodes below the matched device prefix, down to the last host hit
    node = match.last_host_node
    while node is not anchor and not node.is_root:
        chain.append(node)
        node = node.parent
    if not anchor.is_root:
        cache.lock(anchor)
    for n in chain:
        cache.pin_host(n)
    room = cache.device_allocator.available_tokens
    if room < total:
        cache.evict(total - room)
        room = cache.device_allocator.available_tokens
    if room < total:
        return None
    return (f"load_back_due: a load-back of a {total}-token host hit was refused, yet the device has room for it "
            f"(or eviction makes it, the matched prefix locked and the chain pinned): {room} tokens free")


# states whose device copy an eviction frees at once, the node staying with its host copy
_BACKED_ON_DEVICE = DEVICE_EVICTABLE - {"device"}


def freeable_device_tokens(root: TreeNode, keeps_unbacked: bool, held: frozenset[int] = frozenset()) -> int:
    """Device tokens an eviction can free at once, read off the tree (not the cache's candidate sets): an
    unlocked node with a host copy whose resident descendants can all go, and, when the policy drops
    unbacked KV (``keeps_unbacked`` False), an unlocked device-only subtree with nothing else in it. A node in
    flight (a backup or a load) holds its ancestors too, as does a node in ``held`` (ids locked for the call)."""

    def visit(node: TreeNode) -> tuple[int, bool, bool]:  # (tokens freed below and at node, all go, all dropped)
        freed, go, drop = 0, True, True
        for child in node.children.values():
            f, g, d = visit(child)
            freed, go, drop = freed + f, go and g, drop and d
        state = node.state
        if state not in RESIDENT:
            return freed, True, False  # off the device: nothing to free, and it stays
        if node.lock_ref or not go or node.id in held:
            return freed, False, False
        if state in _BACKED_ON_DEVICE:
            return freed + node.num_tokens, True, False
        if state == "device" and not keeps_unbacked and drop:
            return freed + node.num_tokens, True, True
        return freed, False, False  # in flight, or device-only KV that must be backed up first

    return sum(visit(child)[0] for child in root.children.values())


def unstored_nodes(nodes: Iterable[TreeNode]) -> list[TreeNode]:
    """The nodes whose host copy is not in storage and not on its way there (``store_due``)."""
    return [n for n in nodes if n.parent is not None and n.state in UNSTORED]


def storage_step_watch(adapter: Any, step_id: str) -> Callable[[], list[str]] | None:
    """``query_exact`` / ``transfer_exact`` for storage step ``step_id`` of ``adapter`` (a ``ProtocolAdapter`` with
    storage): when the step is a prefetch's hit query or transfer, no fault is armed and storage takes work, a
    callable to call once the step ran, returning the problem if the step found, or landed, other than the
    leading pages storage holds of what it asked for (read without faults before the step)."""
    from hicache_fsm.storage.threads import leading_hits

    tier = adapter.cache.storage
    step = next((s for s in tier.steps() if s.id == step_id), None)
    if step is None or step.kind not in ("query", "s2h") or adapter.faults.armed or not tier.accepting_backups():
        return None  # not a prefetch's step, a fault to play, or storage detached or down: the step may fail
    kind = step.kind
    op = tier.runtime.active.get(step.detail[0])  # both kinds name their request first
    if op is None or (kind == "s2h" and (op.terminated or op.state != "transferring" or op.job is None)):
        return None  # released, or stopped: what lands no longer counts
    keys = list(op.keys if kind == "query" else op.job.keys)
    inner = adapter.backend.inner
    held = leading_hits(inner.batch_exists(keys), len(keys))
    if kind == "s2h" and held:  # a page a corrupt fault damaged is stored, but reads back as a miss
        from hicache_fsm.storage.page_format import page_format_of

        blobs = inner.batch_get(keys[:held], page_format_of(adapter.host_pool))
        held = next((i for i, blob in enumerate(blobs) if blob is None), held)
    want = held * op.page_size
    landed = op.completed_tokens  # what the cache counted as landed, once the step's events are polled

    def problems() -> list[str]:
        if kind == "query":
            if op.error or op.state in ("admitted", "querying"):
                return []  # not answered (the query failed)
            found = []
            if op.hit_tokens != want:
                found.append(f"query_exact: the hit query of prefetch {op.request_id!r} found {op.hit_tokens} "
                             f"tokens; storage holds the first {want} of the {len(keys) * op.page_size} it asked for")
            short = op.hit_tokens < prefetch_threshold_tokens(adapter)
            if (op.state == "transferring") == short:  # kept to transfer, or revoked (and released at once)
                found.append(f"prefetch_revoke: the hit query of prefetch {op.request_id!r} found {op.hit_tokens} "
                             f"tokens (the threshold is {prefetch_threshold_tokens(adapter)}) and left it "
                             f"{op.state}")
            return found
        got = op.completed_tokens - landed
        if got == want:
            return []
        return [f"transfer_exact: the transfer of prefetch {op.request_id!r} landed {got} tokens; storage holds "
                f"the first {want} of the {len(keys) * op.page_size} it read"]

    return problems


def overshoot_problem(call: str, asked: int, freed: int, victims: list[TreeNode]) -> list[str]:
    """``evict_just_enough`` for ``call(asked)`` that freed ``freed`` tokens taking ``victims`` (nodes that lost
    the tier's copy): the eviction stops once it freed what it was asked, so without its largest victim it
    freed less than that."""
    largest = max((n.num_tokens for n in victims), default=0)
    if freed - largest < asked:
        return []
    return [f"evict_just_enough: {call}({asked}) freed {freed} tokens from {len(victims)} victims; it had freed "
            f"{asked} before its last"]
