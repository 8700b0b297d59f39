"""The whole HiCache protocol as the tools drive it: policy obligations, load-back indices, attach / detach.

``ProtocolAdapter`` is ``HiCacheAdapter`` plus what the residency spec's own
invariants cannot see, checked after every step:

- **policy obligations**: under ``write_through_selective`` a match backs up
  exactly the device-only nodes whose hit count reached the threshold (not one
  hit early, not one late) unless the host is full; under ``write_back`` /
  ``write_behind`` eviction never drops the only copy of a node unless its
  backup was refused for lack of host room;
- **load-back indices**: the device slots ``load_back`` hands the engine are
  the chain's slots, in chain order, cover the whole host hit of the match,
  and once the load is acknowledged they read back, bit for bit, the KV that
  was written for those tokens;
- **attach / detach** of the storage tier as engine actions (a detach with
  transfers in flight must be refused), and storage steps whose batch comes
  back **partial** (one page missing from a read, ``partial_storage``, or
  refused by a write, ``partial_backup``: a per-key result; the explorer
  runs both, the fuzzer's seeded runs the first);
- **eviction order** (``testing.recency``): the adapter counts how the engine
  used each node, and an eviction never takes a node used later (LFU: more
  often) than a candidate it left; nor does the cache's eviction order rank two
  nodes against those records at any time (``order_agrees``); the records, in
  the cache's own eviction order, are part of the state key;
- **write_through**: an insert leaves no node of its path device-only unless
  a backup was refused for host room; and a backup is refused for host room
  only when no host copy could be evicted to make it (``refusal_justified``);
- **what the engine is handed** (``testing.obligations``): every node still
  loading on a matched prefix or above a load-back is covered by a wait it
  got (``loads_waited``); under ``wait_complete`` a prefetch is not ready while
  its transfer runs (``wait_complete_due``); under ``write_behind`` a cold
  device-only node with host room is backed up by the next poll
  (``write_behind_due``; each node's idle polls join the state key, and the
  explorer polls as a step of its own: ``HiCacheAdapter.applicable``);
- **reset** as an engine action (memory tiers only): the engine's handles go,
  jobs in flight end as the executor saw them (copies landed or dropped), and
  the cache must be empty at once (no node, no used page, no pending job);
  the acknowledgements of those jobs arrive after the reset and must be
  ignored, each one counted ``late_cancelled_completions``, never applied.
  How many resets a path ran and the acks still waiting join the state key.

The ``prefetch`` and ``storage_link`` spec invariants (pages inserted only as
they arrived, ``no_transfer_while_detached``) come from the cache itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_fsm.testing.adapter import HiCacheAdapter, Rejected, StorageFault, fingerprints
from hicache_fsm.testing.memory_families import (chain_loads_family, foreign_tenant_family, host_room_families,
                                                  layout_families, namespace_families, option_families, order_family,
                                                  pressure_family, recency_families, reset_family,
                                                  storage_option_family)
from hicache_fsm.testing.obligations import (DeviceWatch, batch_bound_problem, freeable_device_tokens,
                                            load_back_limit_problem, load_back_refusal_problem, overshoot_problem,
                                            prefetch_admission_problem, storage_step_watch, unstored_nodes,
                                            unwaited_loads, wait_complete_problem, write_behind_problems,
                                            write_behind_snapshot)
from hicache_fsm.testing.recency import UseLog, UseLogListener
from hicache_fsm.testing.start_families import cp_host_full_family, prefetch_split_family

__all__ = ["ProtocolAdapter"]


class ProtocolAdapter(HiCacheAdapter):
    """``HiCacheAdapter`` with policy, load-back and storage-link checks and actions (see module docstring)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._step_problems: list[str] = []
        self._loads: list[tuple[torch.Tensor, tuple[int, ...], int]] = []  # (slots, prefix tokens, chain tokens)
        self.uses = UseLog(self.config.eviction_policy)
        self.resets = 0  # resets this path ran (the explorer bounds them)
        # acks of jobs a reset cancelled, still in the executor's queue: (kind, ok, node ids); the late-ack count
        # they must add once polled
        self._stale: tuple[tuple[str, bool, tuple[int, ...]], ...] = ()
        self._late_due = 0
        # write_behind: the device-only nodes, polls, refusals and host room at the last check (a function of
        # the state then, so not part of the key)
        self._write_behind_seen = write_behind_snapshot(self.cache) if self.config.write_policy == "write_behind" \
            else None
        # ``store_due``: the cache's poll count at the last check, and the nodes a poll then left unstored
        self._polls_seen = 0
        self._unstored: frozenset[int] = frozenset()
        self._watch_refusals()
        self.cache.driver.add_listener(UseLogListener(self))

    def supports(self, op: str) -> bool:
        if op == "reset" and self.backend is not None:
            return False  # a storage tier's reset waits for its threads: memory tiers only
        if op in ("attach_storage", "detach_storage", "partial_storage", "partial_backup") and self.backend is None:
            return False
        if op in ("store_remote", "stored_prefix") and self.backend is not None \
                and self.cache.storage.link.state != "attached":
            return False  # no other instance writes through a closed backend
        return super().supports(op)

    def clone(self) -> ProtocolAdapter:
        link = self.cache.storage.link if self.cache.storage is not None else None
        if link is not None and link.backend is None:  # detached: fork with the last backend, then drop it
            link.backend = self.backend
            try:
                new = super().clone()
            finally:
                link.backend = None
            new.cache.storage.link.backend = None
        else:
            new = super().clone()
        new._step_problems = []
        new._loads = list(self._loads)
        new.uses = self.uses.copy()
        new._watch_refusals()  # the fork's eviction is a new object: watch it for the copy
        new.cache.driver.add_listener(UseLogListener(new))  # a fork's driver starts with no listener
        return new

    def _watch_refusals(self) -> None:
        """``refusal_justified``: every backup of this cache (insert, match, eviction, write_behind, explicit)
        that is refused for host room leaves no host copy it could have evicted to make that room."""
        eviction = self.cache.eviction
        backup = type(eviction).try_backup.__get__(eviction)

        def try_backup(node) -> bool:
            started = backup(node)
            if not started and eviction.attached.cp is None and len(eviction.host):
                self._step_problems.append(f"refusal_justified: the backup of node {node.id} was refused for host "
                                           f"room while host copies {sorted(eviction.host.ids())} could be evicted")
            return started

        eviction.try_backup = try_backup

    # ------------------------------------------------------------------ how the engine used each node

    def _looked_up(self, tokens: Sequence[int], step, *args: Any) -> Any:
        """Run ``step``, a lookup of ``tokens`` (``match_prefix`` first): the nodes it matched count a hit."""
        tokens = self._aligned(tokens)
        tree = self.cache.tree
        _, matched, partial = self.walk(tokens)
        result = step(*args)
        self.uses.sync(tree.nodes())
        path, _, _ = self.walk(tokens[: matched + partial])
        self.uses.used(path, hit=True)
        return result

    def insert(self, tokens: Sequence[int], priority: int = 0) -> bool:
        """Insert; the prompt's whole path is used (at ``priority``), and under write_through nothing on it
        stays device-only unless a backup was refused for host room."""
        tree = self.cache.tree
        before = {n.id for n in tree.nodes()}
        refused = self.cache.counters["backup_host_full"]
        ok = super().insert(tokens, priority)
        if not ok:
            return ok
        path, _, _ = self.walk(tokens)
        # the nodes this insert made; a split's upper half has its record already, None for a node of the cache's
        new = {n.id for n in path if n.id not in before and not self.uses.knows(n.id)}
        self.uses.sync(tree.nodes())
        self.uses.used(path, hit=False, new=new, priority=priority)
        if self.config.write_policy == "write_through" and self.cache.storage is None:
            left = [n.id for n in path if n.state == "device"]
            if len(left) > self.cache.counters["backup_host_full"] - refused:
                self._step_problems.append(f"policy_write_through: insert left node(s) {left} device-only without "
                                           f"a refused backup")
        return ok

    def alloc_for_insert(self, num_tokens: int):
        """``alloc_device``, judged: it succeeds when free and freeable tokens cover it (``alloc_due``), and its
        eviction frees what it owes (``headroom_kept``)."""
        watch = DeviceWatch(self.cache, "alloc_device", num_tokens)
        slots = super().alloc_for_insert(num_tokens)
        room = watch.free + watch.could
        if slots is None and num_tokens <= room:
            self._step_problems.append(f"alloc_due: no device slots for {num_tokens} tokens, though {room} were "
                                       f"free or could go at once")
        self._step_problems += watch.problems()
        return slots

    def lock(self, tokens: Sequence[int]) -> int | None:
        return self._looked_up(tokens, super().lock, tokens)

    def prefetch(self, tokens: Sequence[int]):
        """A prefetch, its admission judged against the limits this adapter configured (``prefetch_admission``)."""
        runtime = self.cache.storage.runtime
        held = runtime.occupied_tokens
        request = self._looked_up(tokens, super().prefetch, tokens)
        op = runtime.active.get(request) if request is not None else None
        problem = prefetch_admission_problem(self, op.num_tokens, held) if op is not None else None
        self._step_problems += [problem] if problem else []
        return request

    def evict_host(self, num_tokens: int) -> int:
        from hicache_fsm.bindings.residency import EVICTED
        from hicache_fsm.eviction import Eviction

        tree = self.cache.tree
        self.uses.sync(tree.nodes())
        candidates = [n for n in tree.nodes() if Eviction.is_host_candidate(n)]
        on_host = [n for n in tree.nodes() if n.state in EVICTED]
        freed = super().evict_host(num_tokens)
        self._step_problems += overshoot_problem("evict_host", num_tokens, freed,
                                                 [n for n in on_host if not tree.owns(n) or n.state not in EVICTED])
        gone = [n for n in candidates if not tree.owns(n)]
        self._step_problems += self.uses.order_problems("host", gone, [n for n in candidates if tree.owns(n)],
                                                        self._describe)
        return freed

    def _device_evicted(self, num_tokens: int) -> int:
        """Device eviction, its victims judged against the candidates it left in place."""
        from hicache_fsm.bindings.residency import ON_DEVICE
        from hicache_fsm.eviction import Eviction

        tree = self.cache.tree
        self.uses.sync(tree.nodes())
        candidates = [(n, n.state) for n in tree.nodes() if Eviction.is_device_candidate(n)]
        keeps_unbacked = self.config.keeps_unbacked
        could = freeable_device_tokens(tree.root, keeps_unbacked)
        on_device = [n for n in tree.nodes() if n.state in ON_DEVICE]
        freed = super().evict(num_tokens)
        self._step_problems += overshoot_problem("evict", num_tokens, freed,
                                                 [n for n in on_device if not tree.owns(n) or n.state not in ON_DEVICE])
        if freed < min(num_tokens, could):
            self._step_problems.append(f"evict_due: evict({num_tokens}) freed {freed} device tokens, though "
                                       f"{could} could go at once")
        gone = [n for n, _ in candidates if not tree.owns(n) or n.state not in ON_DEVICE]
        # a device-only node may stay for its backup (write_back, or host-only children): not a choice of order
        stayed = [n for n, state in candidates if tree.owns(n) and n.state == state
                  and not (state == "device" and (keeps_unbacked or n.children))]
        self._step_problems += self.uses.order_problems("device", gone, stayed, self._describe)
        return freed

    def _describe(self, node: Any) -> str:
        prefix = self.prompt_to(node) if self.cache.tree.owns(node) else "(removed)"
        return f"node {node.id} {prefix}"

    def state_key_orbit(self):
        """The cache's key, plus the use records ranked along the cache's eviction order, the resets run and
        the acks of cancelled jobs still waiting."""
        key, orbit = super().state_key_orbit()
        tree = self.cache.tree
        self.uses.sync(tree.nodes())
        ranked = self._ranked()
        waiting = self._stale if self.executor.completions_waiting else ()  # polled ones are checked and gone
        key = (key, self.uses.rank_key(ranked), self.resets, waiting)
        if self.config.write_policy == "write_behind":  # how long each node has been idle, up to when it is cold
            idle, polls = self.config.write_behind_idle_steps, self.cache.driver.polls
            key += (tuple(min(polls - n.last_poll, idle) for n in ranked),)
        return key, orbit

    # ------------------------------------------------------------------ policy obligations

    def match(self, tokens: Sequence[int]):
        return self._looked_up(tokens, self._match, tokens)

    def _match(self, tokens: Sequence[int]):
        if self.config.write_policy != "write_through_selective":
            return super().match(tokens)
        before = {n.id: n.state for n in self.cache.tree.nodes()}
        room = self.host_pool.allocator.available_tokens
        refused = self.cache.counters["backup_host_full"]
        result = super().match(tokens)
        threshold = self.config.write_through_threshold
        path, _, _ = self.walk(tokens)
        # a backup earlier on the path may take the room a later one needed: that one is refused, and counted
        left = self.cache.counters["backup_host_full"] - refused
        for n in path:
            started = before.get(n.id) == "device" and n.state != "device"
            if started and n.hit_count < threshold:
                self._step_problems.append(f"policy_selective: node {n.id} backed up at {n.hit_count} hits, "
                                           f"the threshold is {threshold}")
            if n.state == "device" and n.hit_count >= threshold and room >= n.num_tokens:
                if left > 0:
                    left -= 1
                    continue
                self._step_problems.append(f"policy_selective: node {n.id} reached {n.hit_count} hits "
                                           f"(threshold {threshold}) with host room but was not backed up")
        return result

    def matched(self, tokens: Sequence[int]):
        """``match_prefix``, whose loads must cover every node of the matched prefix still loading
        (``loads_waited``)."""
        m = super().matched(tokens)
        path = self.cache.tree.path_to_root(m.last_device_node)
        self._step_problems += [f"loads_waited: match_prefix handed the engine node {n.id} ({n.state}) without a "
                                f"wait for its load" for n in unwaited_loads(self.cache.outbox, path, m.loads)]
        return m

    def evict(self, num_tokens: int) -> int:
        if not self.config.keeps_unbacked:
            return self._device_evicted(num_tokens)
        device_only = {n.id for n in self.cache.tree.nodes() if n.state == "device"}
        refused = self.cache.counters["backup_host_full"]
        freed = self._device_evicted(num_tokens)
        dropped = [i for i in device_only if self.cache.tree.get(i) is None]
        if len(dropped) > self.cache.counters["backup_host_full"] - refused:
            self._step_problems.append(f"policy_keeps_only_copy: {self.config.write_policy} dropped device-only "
                                       f"node(s) {sorted(dropped)} without a refused backup")
        return freed

    # ------------------------------------------------------------------ load-back indices

    def load_back(self, tokens: Sequence[int]) -> int:
        return self._looked_up(tokens, self._load_back, tokens)

    def _load_back(self, tokens: Sequence[int]) -> int:
        m = self.match_prefix(tokens)
        if m.host_hit_length == 0:
            self.cache.flush()
            return 0
        anchor = m.last_device_node
        held = frozenset(n.id for n in self.cache.tree.path_to_root(anchor)) if not anchor.is_root else frozenset()
        watch = DeviceWatch(self.cache, "load_back", m.host_hit_length, held)
        lb = self.cache.load_back(m.last_host_node)
        limit = load_back_limit_problem(m.host_hit_length, self.config)
        if limit is None:  # within the limits: its eviction is judged
            self._step_problems += watch.problems()
        elif lb is not None:
            self._step_problems.append(limit)
        if lb is not None:
            above = self.cache.tree.path_to_root(lb.nodes[0].parent)
            self._step_problems += [f"loads_waited: the load-back below node {n.id} ({n.state}) does not wait for "
                                    f"its load" for n in unwaited_loads(self.cache.outbox, above, [lb.handle])]
        self.cache.flush()
        if lb is None:
            problem = load_back_refusal_problem(self.clone(), tokens)
            self._step_problems += [problem] if problem else []
            return 0
        chain = list(lb.nodes)
        want = torch.cat([n.device_indices for n in chain]) if chain else torch.empty(0, dtype=torch.int64)
        got = lb.device_indices
        if not torch.equal(got, want):
            self._step_problems.append(f"load_back_indices: handed the engine slots {got.tolist()}, the chain's "
                                       f"slots in order are {want.tolist()}")
        if int(got.numel()) != m.host_hit_length:
            self._step_problems.append(f"load_back_indices: loaded {int(got.numel())} tokens of a host hit of "
                                       f"{m.host_hit_length}")
        for a, b in zip(chain, chain[1:]):
            if b.parent is not a:
                self._step_problems.append(f"load_back_indices: chain node {b.id} does not follow {a.id}")
        prefix = self.prompt_to(chain[-1]) if chain else ()
        self._loads.append((got, tuple(prefix), int(got.numel())))
        return int(got.numel())

    def _loading_slots(self) -> set[int]:
        from hicache_fsm.bindings.residency import LOADING

        return {i for n in self.cache.tree.nodes() if n.state in LOADING for i in n.device_indices.tolist()}

    def watched_loads(self) -> list[tuple[torch.Tensor, tuple[int, ...], int]]:
        """Load-backs still in flight, whose slots are read back once acknowledged (the state key has them;
        the others are checked in the state they ended in and forgotten)."""
        loading = self._loading_slots()
        return [load for load in self._loads if any(i in loading for i in load[0].tolist())]

    def _load_violations(self) -> list[str]:
        """Acknowledged loads read back, through the slots the engine was handed, what was written."""
        loading = self._loading_slots()
        problems, keep = [], []
        dev_fp = self._pool_lists()[0]
        for slots, prefix, n in self._loads:
            idx = slots.tolist()
            if any(i in loading for i in idx):
                keep.append((slots, prefix, n))
                continue
            if not self._still_holds(prefix, idx):
                continue  # evicted or failed since: nothing the engine may read any more
            want = fingerprints(prefix)[-n:]
            got = [dev_fp[i] for i in idx]
            if got != want:
                problems.append(f"load_back_readback: the slots load_back returned for {list(prefix)} read {got}, "
                                f"{want} was written")
        self._loads = keep
        return problems

    def _still_holds(self, prefix: tuple[int, ...], idx: list[int]) -> bool:
        from hicache_fsm.bindings.residency import ON_DEVICE

        path, matched, partial = self.walk(prefix)
        if partial or matched != len(prefix):
            return False
        held = [i for n in path if n.state in ON_DEVICE for i in n.device_indices.tolist()]
        return len(held) >= len(idx) and held[-len(idx):] == idx

    # ------------------------------------------------------------------ a failed load is never reported done

    def fail_job(self, job_id: int) -> None:
        """Fail a job; a node whose load (H2D) this was must come out retried (still ``loading``) or rolled
        back to its host copy, never with a device copy the cache now counts valid."""
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE
        from hicache_fsm.jobs import JobKind

        job = next((j for j in self.executor.pending_jobs() if j.id == job_id), None)
        loading = [] if job is None or job.kind is not JobKind.H2D else [
            n for n in (self.cache.tree.get(i) for i in job.node_ids) if n is not None and n.state in LOADING]
        super().fail_job(job_id)
        for node in loading:
            if node.state in ON_DEVICE and node.state not in LOADING:
                self._step_problems.append(f"failed_load_not_done: node {node.id}'s load failed, yet it is "
                                           f"{node.state} (its device copy never landed)")

    # ------------------------------------------------------------------ prefetch hits are pages inserted

    def prefetch_ready(self, request):
        tier = self.cache.storage
        op = tier.runtime.active.get(request) if tier is not None else None
        before = None if op is None else op.state
        ready = self._counting_hits(f"prefetch_ready({request!r})", super().prefetch_ready, request)
        if tier is not None:
            self._step_problems += wait_complete_problem(request, before, ready, tier.options.stop_policy)
        return ready

    def abort(self, request):
        return self._counting_hits(f"abort({request!r})", super().abort, request)

    def _counting_hits(self, what: str, step, request):
        """Run ``step``; the prefetch hits it reports (``stats()['prefetch_hit_tokens']``) must equal the
        tokens the tree gained (what ``match_prefix`` can now return), never the tokens storage found."""
        tier = self.cache.storage
        if tier is None:
            return step(request)
        hits, held = tier.stats()["prefetch_hit_tokens"], self._cached_tokens()
        result = step(request)
        hits, gained = tier.stats()["prefetch_hit_tokens"] - hits, self._cached_tokens() - held
        if hits != gained:
            self._step_problems.append(f"prefetch_hits_equal_pages_inserted: {what} reported {hits} hit tokens, "
                                       f"the tree gained {gained}")
        return result

    def _cached_tokens(self) -> int:
        from hicache_fsm.bindings.residency import ON_DEVICE, ON_HOST

        return sum(n.num_tokens for n in self.cache.tree.nodes()
                   if n.parent is not None and (n.state in ON_HOST or n.state in ON_DEVICE))

    # ------------------------------------------------------------------ storage link and partial results

    def detach_storage(self) -> None:
        """The operator detaches storage (refused while storage transfers are in flight)."""
        from hicache_fsm.errors import StorageLinkError

        try:
            self.cache.storage.detach()
        except StorageLinkError as exc:
            raise Rejected(str(exc)) from None
        self.cache.poll()

    def attach_storage(self, fail: bool = False) -> None:
        """The operator attaches a storage (a fresh ``memory://``; ``fail``: its first call fails and the
        attach rolls back). The explorer tries it only while no node claims pages in storage."""
        from hicache_fsm.errors import StorageLinkError
        from hicache_fsm.storage import open_backend
        from hicache_fsm.storage.faults import FaultyBackend

        tier = self.cache.storage
        if tier.link.state != "detached":
            raise Rejected(f"storage link is {tier.link.state}")
        if self.prefetching() or any(n.state.endswith(("_stored", "_storing")) for n in self.cache.tree.nodes()):
            raise Rejected("nodes or prefetches still claim pages of the previous storage (a fresh store "
                           "cannot hold them)")
        self.backend = FaultyBackend(open_backend("memory://"), self.faults)
        faulty = fail or bool(self.faults.armed)  # an armed storage fault may hit the attach's first call
        if fail:
            self.faults.fail_next()
        try:
            tier.attach(self.backend, **_attach_options(tier))
        except StorageLinkError as exc:
            if not faulty:
                raise
            raise Rejected(str(exc)) from None
        finally:
            self.faults.clear_next()
        self.cache.poll()

    def complete_storage(self, step_id: str) -> None:
        """Run a queued storage step; a hit query or transfer run without faults finds what storage holds."""
        watch = storage_step_watch(self, step_id)
        super().complete_storage(step_id)
        self._step_problems += watch() if watch else []

    def partial_storage(self, step_id: str) -> None:
        """Run one queued storage step whose backend returns one page short (a per-key partial result)."""
        self._run_short(step_id, "get")

    def partial_backup(self, step_id: str) -> None:
        """Run one queued backup whose backend stores all but its last page (refused: a per-key result)."""
        self._run_short(step_id, "set")

    def _run_short(self, step_id: str, call: str) -> None:
        """Run a storage step with its next ``call`` answered one page short."""
        armed = list(self.faults.armed)
        self.faults.arm(StorageFault("short", call=call))
        try:
            self._run_storage(step_id, False)
        finally:  # a step that made no such call leaves no fault behind
            self.faults.armed = [e for e in self.faults.armed if any(e is a for a in armed)]

    def time_passes(self) -> None:
        """The prefetch timeout of every running prefetch expires (the tier's clock is the explorer's:
        time moves only by this step, so no verdict depends on how fast the machine runs)."""
        tier = self.cache.storage
        tier.advance(tier.options.timeout_max + 1.0)
        self.cache.poll()

    def lose_storage(self) -> int:
        """The storage backend loses every page it held (a restart without persistence); the engine's
        maintenance check (``StorageTier.verify_stored``) finds it and every stored node goes back to
        "not stored" (``storage_lost``) to be backed up again. Returns how many nodes moved back."""
        from hicache_fsm.errors import StorageLinkError

        if not self._stored_nodes():
            raise Rejected("no node is stored")
        if self.faults.armed:  # the maintenance check would hit it after the pages are gone
            raise Rejected("a storage fault is armed")
        try:
            self.backend.clear()
            moved = self.cache.storage.verify_stored()
        except StorageLinkError as exc:
            raise Rejected(str(exc)) from None
        self.cache.poll()
        return moved

    def _stored_nodes(self) -> list:
        tier = self.cache.storage
        if tier is None or tier.link.state != "attached" or not tier.healthy:
            return []
        return [n for n in self.cache.tree.nodes() if n.parent is not None and n.state.endswith("_stored")]

    def extra_steps(self) -> list:
        from hicache_fsm.testing.checks import Step

        tier = self.cache.storage
        out = [Step("lose_storage")] if self._stored_nodes() and not self.faults.armed else []
        if tier is not None and tier.options.stop_policy == "timeout" and self.prefetching():
            out.append(Step("time_passes"))
        return out

    def _applicable(self, op: str, args: tuple) -> bool:
        if op in ("partial_storage", "partial_backup"):  # a transfer reads pages, a backup writes them
            steps = self.storage_steps()
            return 0 <= args[0] < len(steps) and steps[args[0]].kind == ("s2h" if op == "partial_storage" else "h2s")
        if op == "attach_storage":
            return self.cache.storage.link.state == "detached" and not self.prefetching() and not any(
                n.state.endswith(("_stored", "_storing")) for n in self.cache.tree.nodes())
        if op == "detach_storage":  # detached: a no-op detach (the spec's self-loop)
            return self.cache.storage.link.state in ("attached", "detached")
        return super().applicable(op, args)

    # ------------------------------------------------------------------ reset

    def reset(self, acked: bool = True) -> None:
        """The engine flushes its cache (weights updated): its locks, pins and load-backs go with it. Each job in
        flight ends as the executor saw it, its copy landed (``acked``) or dropped, before ``HiCache.reset``;
        the acks wait in the executor's queue for the next poll, which must ignore them."""
        stale = self.executor.pending_jobs()
        self._own_kv()
        self._kv_writes += 1
        for job in stale:
            (self.executor.complete if acked else self.executor.fail)(job.id)
        late = self.cache.counters["late_cancelled_completions"]
        self.cache.reset()
        self._locks, self._pins, self._requests, self._loads = {}, {}, {}, []
        self.uses = UseLog(self.config.eviction_policy)
        self.resets += 1
        self._stale += tuple((j.kind.value, acked, tuple(j.node_ids)) for j in stale)
        self._late_due = late + len(self._stale) if self._stale else 0
        self._step_problems += self._reset_problems()

    def _reset_problems(self) -> list[str]:
        """``reset_empties``: nothing cached, no page used, no job pending or queued, no engine page."""
        cache = self.cache
        left = [n.id for n in cache.tree.nodes() if n.parent is not None]
        problems = [f"reset_empties: node(s) {left} survived the reset"] if left else []
        for tier, alloc in (("device", self.device_pool.allocator), ("host", self.host_pool.allocator)):
            if alloc.used_pages:
                problems.append(f"reset_empties: {alloc.used_pages} {tier} page(s) still used after the reset")
        jobs = cache.outbox.pending_jobs()
        if jobs or cache.outbox.queued_jobs():
            problems.append(f"reset_empties: job(s) {[j.id for j in jobs]} still pending after the reset")
        if cache.engine_pages:
            problems.append(f"reset_empties: engine pages {sorted(cache.engine_pages)} kept after the reset")
        return problems

    def _late_ack_problems(self) -> list[str]:
        """``late_ack_ignored``: once polled, every ack of a job a reset cancelled was counted late, none applied."""
        if not self._stale or self.executor.completions_waiting:
            return []
        got, self._stale = self.cache.counters["late_cancelled_completions"], ()
        if got == self._late_due:
            return []
        return [f"late_ack_ignored: the acks of jobs a reset cancelled were polled; {got} late acks counted, "
                f"{self._late_due} due"]

    def applicable(self, op: str, args: tuple) -> bool:
        if op == "reset":  # an empty cache with no job in flight: the reset changes nothing
            return len(self.cache.tree) > 0 or bool(self.executor.pending_jobs())
        return self._applicable(op, args)

    # ------------------------------------------------------------------ invariants

    def kv_violations(self) -> list[str]:
        """KV read-back (also run after steps that land on a known state), plus this step's obligations."""
        problems, self._step_problems = self._step_problems, []
        self.uses.sync(self.cache.tree.nodes())  # nodes the cache made or dropped by itself
        return (problems + self._late_ack_problems() + self._write_behind_problems() + self._order_problems()
                + self._store_problems() + self._batch_problems() + super().kv_violations() + self._load_violations())

    def _batch_problems(self) -> list[str]:
        """``batch_bound`` for the backend calls since the last check (see ``testing.obligations``)."""
        if self.faults is None:
            return []
        widest, self.faults.widest = self.faults.widest, 0
        problem = batch_bound_problem(widest, self.batch_pages)
        return [problem] if problem else []

    def _store_problems(self) -> list[str]:
        """``store_due`` when a poll ran since the last check (see ``testing.obligations``)."""
        tier = self.cache.storage
        polls = self.cache.driver.polls
        polled, self._polls_seen = polls != self._polls_seen, polls
        if tier is None or not tier.accepting_backups():
            self._unstored = frozenset()
            return []
        if not polled:
            return []
        left = {n.id for n in unstored_nodes(self.cache.tree.nodes())}
        stuck, self._unstored = sorted(left & self._unstored), frozenset(left)
        return [f"store_due: node(s) {stuck} stayed without their host copy in storage and without a backup "
                f"running over two polls with storage taking backups"] if stuck else []

    def _ranked(self) -> list:
        """The cache's nodes in its own eviction order (first to go first)."""
        return sorted((n for n in self.cache.tree.nodes() if n.parent is not None), key=self.cache.eviction.sort_key)

    def _order_problems(self) -> list[str]:
        """``order_agrees``: the cache's eviction order never ranks two nodes against the engine's use records
        (a node used later, LFU: more, placed first), whether or not an eviction has taken one of them yet."""
        ranked = self._ranked()
        pairs, _ = self.uses.rank_key(ranked)
        policy = self.config.eviction_policy
        return [f"order_agrees: the {policy} eviction order would take {self._describe(ranked[i])} before "
                f"{self._describe(ranked[j])}, though the engine used the latter less recently (LFU: less often)"
                for i, j in pairs[:1]]

    def _write_behind_problems(self) -> list[str]:
        """``write_behind_due`` / ``_early`` / ``_batch`` of the step since the last check (``testing.obligations``)."""
        if self._write_behind_seen is None:  # not write_behind: nothing to judge, no snapshot taken
            return []
        before, self._write_behind_seen = self._write_behind_seen, write_behind_snapshot(self.cache)
        return write_behind_problems(before, self.cache)


def _attach_options(tier) -> dict:
    o = tier.options
    return {"prefetch_threshold": o.prefetch_threshold, "stop_policy": o.stop_policy,
            "prefetch_capacity_tokens": o.prefetch_capacity_tokens, "batch_pages": o.batch_pages,
            "retry_interval": o.retry_interval}


# =========================================================================== the default portfolio of `check`


def protocol_factory(bounds) -> ProtocolAdapter:
    """``explorer.hicache_factory`` with the protocol checks and the storage-link actions."""
    adapter = ProtocolAdapter(device_pages=bounds.device_pages, host_pages=bounds.host_pages,
                              page_size=bounds.page_size, layers=bounds.layers, write_policy=bounds.write_policy,
                              eviction_policy=bounds.eviction_policy, storage=bounds.storage,
                              stop_policy=bounds.stop_policy, namespaces=bounds.namespaces,
                              host_layout=bounds.host_layout, remote_tenant=bounds.remote_tenant,
                              **dict(bounds.cache_options), **dict(bounds.storage_options))
    adapter.track_hits = bounds.track_hits
    return adapter


def cp_factory(world_size: int):
    def make(bounds) -> Any:
        from hicache_fsm.testing.cp import CPAdapter

        return CPAdapter(world_size=world_size, device_pages=bounds.device_pages, host_pages=bounds.host_pages,
                         write_policy=bounds.write_policy)

    return make


def families_for(variant: dict) -> list[tuple[str, Any, Any]]:
    """The default families a cache configuration (a mutant's ``variant``) lives in."""
    fams = default_families()
    if variant.get("remote_tenant"):  # another tenant's pages on the same storage
        return [f for f in fams if f[1].remote_tenant is not None]
    for field in ("cache_options", "storage_options"):  # a threshold's bug: the families that set it
        options = variant.get(field)
        if options:
            return [f for f in fams if set(options.items()) <= set(getattr(f[1], field))]
    if variant.get("cp"):
        return [f for f in fams if f[0].startswith("cp/")]
    layout = variant.get("host_layout")
    if layout:  # only a pool of that layout runs its copies
        fams = [f for f in fams if f[1].host_layout == layout]
    if variant.get("storage"):
        return [f for f in fams if f[0].startswith("storage/")]
    if variant.get("reset"):  # a bug that only a reset shows: the families that reset first
        fams = [f for f in fams if f[1].max_resets] + [f for f in fams if not f[1].max_resets]
    eviction = variant.get("eviction_policy")
    if eviction:  # the families of that eviction policy first, then the others (they reach deeper bookkeeping)
        fams = [f for f in fams if f[1].eviction_policy == eviction] + [f for f in fams
                                                                        if f[1].eviction_policy != eviction]
    policy = variant.get("write_policy")
    if policy:
        return [f for f in fams if f[1].write_policy == policy and not f[0].startswith("cp/")]
    return [f for f in fams if not f[0].startswith("cp/")]


def default_families() -> list[tuple[str, Any, Any]]:
    """What ``hicache-fsm check`` explores with no flags: (name, ``Bounds``, factory) per family.

    Each family is explored breadth first to its depth bound (``Bounds.max_depth``, a model bound:
    every state within that many steps of the empty cache is reached and checked), so every run is
    complete and gives the same states, coverage and verdict on any machine; no clock is read.
    Together they reach every state of ``residency``, ``prefetch``, ``storage_link`` and
    ``layer_write`` (``check --json`` lists the transitions that stay unreached, with the reason).
    """
    from hicache_fsm.testing.explorer import Bounds

    memory = [(f"memory/{w}", Bounds(nodes=2, device_pages=2, host_pages=2, write_policy=w, max_depth=d),
               protocol_factory)
              for w, d in (("write_through", 5), ("write_back", 6), ("write_through_selective", 4),
                           ("write_behind", 6))]
    # pages of two tokens over two layers: every other family has one of each, where a token offset taken for a
    # page offset, or one layer's slots for another's, cannot show
    memory.append(("memory/pages_and_layers", Bounds(nodes=2, device_pages=2, host_pages=2, page_size=2, layers=2,
                                                     max_depth=5), protocol_factory))
    # best_effort with two-page prompts (a cached prefix anchors a prefetch); the other stop policies with
    # one-page prompts on a one-page device, where every storage state is a few steps deep
    storage = [(f"storage/{p}", Bounds(nodes=2, device_pages=d, host_pages=2, alphabet=1, max_len=d, max_locks=0,
                                        max_pins=0, redeliver=False, storage=True, stop_policy=p,
                                        write_policy=w, max_depth=depth), protocol_factory)
               for p, w, d, depth in (("best_effort", "write_through", 2, 4), ("wait_complete", "write_back", 1, 6),
                                      ("timeout", "write_through", 1, 6))]
    # storage with a one-page host: a prefetch whose anchor is locked or pinned is refused for host room
    storage.append(("storage/host_full", Bounds(nodes=2, device_pages=2, host_pages=1, alphabet=1, max_len=2,
                                                max_locks=0, max_pins=0, redeliver=False, storage=True,
                                                max_depth=4), protocol_factory))
    cp = [(f"cp/{n}_ranks", Bounds(nodes=2, device_pages=2, host_pages=h, alphabet=1, max_len=2, redeliver=False,
                                   write_policy="write_back", max_depth=depth), cp_factory(n))
          for n, h, depth in ((1, 3, 6), (2, 3, 5))]  # a rank's host pool outgrows its device share
    storage += [anchor_family(), prefetch_split_family(protocol_factory)]
    f = protocol_factory
    in_memory, in_storage = namespace_families(f)
    layouts_in_memory, layouts_in_storage = layout_families(f)
    return (memory + [order_family(f), pressure_family(f), chain_loads_family(f), reset_family(f)]
            + recency_families(f) + host_room_families(f) + option_families(f) + [in_memory] + layouts_in_memory
            + storage + [in_storage] + layouts_in_storage + [storage_option_family(f), foreign_tenant_family(f)]
            + cp + [cp_host_full_family()])


# The start of ``storage/prefetch_anchor``: a cached anchor, another instance stores its next page, a prefetch.
ANCHOR_START = (("insert", ((1,),)), ("store_remote", ((1, 2),)), ("prefetch", ((1, 2),)))


def anchor_family() -> tuple[str, Any, Any]:
    """From a prefetch anchored at a cached prefix (``ANCHOR_START``), every state within three steps: its hit
    query and transfer run, fail or come back short, and the scheduler polls it, so the fetched page lands
    under its anchor (or is dropped) where the tree and the KV read-back see it."""
    from hicache_fsm.testing.checks import Step
    from hicache_fsm.testing.explorer import Bounds

    start = tuple(Step(op, args) for op, args in ANCHOR_START)
    return ("storage/prefetch_anchor", Bounds(nodes=2, device_pages=2, host_pages=2, alphabet=1, max_len=2,
                                              max_locks=0, max_pins=0, redeliver=False, storage=True, start=start,
                                              max_depth=3), protocol_factory)


# Why each transition the default families never fire stays unfired (``check --json``: ``"unreached"``).
UNREACHED_REASONS: dict[str, dict[str, str]] = {
    "prefetch": {
        "failed --abort--> aborted": "the tier releases a failed prefetch at the next poll, before an abort can "
                                     "reach it (abort_prefetch drains first)",
        "querying --abort--> aborted": "with a manual storage tier 'querying' lasts only while a query step runs; "
                                       "between steps the op is admitted or past its query",
        "querying --stop--> terminated": "as above: no step boundary falls inside 'querying'",
        "revoked --abort--> aborted": "a revoked prefetch is released at the next poll, before an abort",
        "terminated --abort--> aborted": "a terminated prefetch is released at the next poll, before an abort",
    },
}
