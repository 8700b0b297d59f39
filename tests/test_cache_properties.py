"""Stateful property test: random engine calls and random job outcomes, invariants after every step.

The KV the engine writes for a token is a function of its (namespace, prefix)
(``cache_helpers.expected_kv``), and ``written`` records every prefix ever
inserted, so whatever the cache returns for a prefix, on the device or the
host, can be checked byte for byte.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_helpers import expected_kv, make_cache, put, put_fresh
from hicache_fsm.bindings.residency import LOADING
from hicache_fsm.cache import RESIDENT
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import GuardRejected, LockError
from hicache_fsm.spec import load_builtin
from hicache_fsm.transitions_dispatch import TransitionsDispatcher

PAGE = 2
tokens_st = st.lists(st.integers(0, 2), min_size=PAGE, max_size=7 * PAGE).map(
    lambda t: tuple(t[: len(t) - len(t) % PAGE]))
ns_st = st.sampled_from([None, None, "lora"])


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back", "write_behind"]),
        eviction=st.sampled_from(["lru", "lfu", "priority"]),
        via_transitions=st.sampled_from([False, False, False, True]),
        device_pages=st.integers(4, 12),
        host_pages=st.integers(6, 24),
    )
    def setup(self, policy, eviction, via_transitions, device_pages, host_pages):
        config = CacheConfig(write_policy=policy, eviction_policy=eviction, write_through_threshold=2,
                             write_behind_idle_steps=1)
        self.cache, self.ex = make_cache(page=PAGE, device_pages=device_pages, host_pages=host_pages, config=config)
        if via_transitions:
            self.cache.residency = TransitionsDispatcher(load_builtin("residency"))
        self.written: dict[tuple, tuple] = {}  # (namespace, tokens) -> expected (k, v)
        self.locks: list = []
        self.loads: list = []

    # ---------------------------------------------------------------- helpers

    def _path(self, node):
        return list(reversed(list(self.cache.tree.path_to_root(node))))

    def _check_match(self, tokens, ns, m) -> None:
        """Device KV up to the first loading node, host KV of every backed-up node, all as written."""
        cache = self.cache
        last = m.last_host_node
        if last.is_root:
            return
        full = cache.tree.prefix_tokens(last)
        assert tuple(tokens)[: len(full)] == full
        assert any(k[0] == ns and k[1][: len(full)] == full for k in self.written), "matched a prefix never written"
        ek, ev = expected_kv(full, ns)
        pos = 0
        device_ok = True
        for node in self._path(last):
            n = node.num_tokens
            if node.state in LOADING:
                device_ok = False  # its device copy is valid only once its load lands
            if device_ok and node.state in RESIDENT:
                k, v = cache.device_pool.read(node.device_indices)
                assert torch.equal(k, ek[:, pos : pos + n]) and torch.equal(v, ev[:, pos : pos + n]), node
            if node.host_indices is not None and node.state != "writing_host":
                k, v = cache.host_pool.read(node.host_indices)
                assert torch.equal(k, ek[:, pos : pos + n]) and torch.equal(v, ev[:, pos : pos + n]), node
            pos += n

    def _pick(self, data):
        """Tokens and namespace: mostly a (cut) prefix of something written, sometimes new ones."""
        if self.written and data.draw(st.integers(0, 3)) > 0:
            ns, tokens = data.draw(st.sampled_from(sorted(self.written, key=repr)))
            cut = data.draw(st.integers(1, len(tokens) // PAGE)) * PAGE
            extra = data.draw(st.sampled_from([(), (), (2, 2), (0, 1, 2, 0)]))
            return tokens[:cut] + extra, ns
        return data.draw(tokens_st), data.draw(ns_st)

    def _some_node(self, tokens, ns):
        path = self.cache.tree.walk(tokens, ns)[0]
        return path[-1] if path else None

    # ---------------------------------------------------------------- engine calls

    @rule(data=st.data(), fresh=st.booleans(), priority=st.integers(0, 3))
    def insert(self, data, fresh, priority):
        tokens, ns = self._pick(data)
        res = (put_fresh if fresh else put)(self.cache, tokens, ns, priority)
        if res is not None:
            self.written[(ns, tokens)] = expected_kv(tokens, ns)

    @rule(data=st.data())
    def match(self, data):
        tokens, ns = self._pick(data)
        m = self.cache.match_prefix(tokens, ns)
        self._check_match(tokens, ns, m)

    @rule(data=st.data())
    def lock(self, data):
        tokens, ns = self._pick(data)
        m = self.cache.match_prefix(tokens, ns)
        node = m.last_device_node
        if not node.is_root:
            self.cache.lock(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(1, 16))
    def evict(self, n):
        self.cache.evict(n * PAGE)

    @rule(n=st.integers(1, 16))
    def evict_host(self, n):
        self.cache.evict_host(n * PAGE)

    @rule(data=st.data())
    def evict_node(self, data):
        tokens, ns = self._pick(data)
        node = self._some_node(tokens, ns)
        if node is None:
            return
        before = self.cache.snapshot()
        try:
            self.cache.evict_node(node)
        except (LockError, GuardRejected):
            assert self.cache.snapshot() == before

    @rule(data=st.data())
    def load_back(self, data):
        evicted = sorted((n for n in self.cache.tree.nodes() if n.state in ("host", "host_stored")), key=lambda n: n.id)
        if evicted and data.draw(st.booleans()):
            node = data.draw(st.sampled_from(evicted))  # an evicted node, by the engine's path
            tokens, ns = self.cache.tree.prefix_tokens(node), node.namespace
        else:
            tokens, ns = self._pick(data)
        m = self.cache.match_prefix(tokens, ns)
        lb = self.cache.load_back(m.last_host_node)
        event(f"load_back: host hit {m.host_hit_length > 0}, started {lb is not None}")
        if lb is not None:
            assert all(n.state in LOADING for n in lb.nodes)
            self.loads.append(lb)

    @rule(data=st.data(), n=st.integers(1, 16))
    def evict_then_load_back(self, data, n):
        """Make a written prefix host-only (backups land, device eviction) and start its load-back."""
        tokens, ns = self._pick(data)
        self.engine_step()
        self.cache.evict(n * PAGE)
        m = self.cache.match_prefix(tokens, ns)
        lb = self.cache.load_back(m.last_host_node)
        event(f"evict_then_load_back: host hit {m.host_hit_length > 0}, started {lb is not None}")
        if lb is not None:
            self.loads.append(lb)

    @rule(data=st.data())
    def write_backup(self, data):
        tokens, ns = self._pick(data)
        node = self._some_node(tokens, ns)
        if node is None:
            return
        before = self.cache.snapshot()
        if node.state == "device":
            self.cache.write_backup(node)
        else:
            try:
                self.cache.write_backup(node)
            except GuardRejected:
                assert self.cache.snapshot() == before
            else:
                raise AssertionError("write_backup of a node that is not device-only was accepted")

    # ---------------------------------------------------------------- executor and acks

    @precondition(lambda self: self.cache.pending_job_ids())
    @rule(picks=st.lists(st.tuples(st.integers(0, 100), st.sampled_from([True, True, True, False])),
                         min_size=1, max_size=4),
          poll=st.booleans())
    def finish_jobs(self, picks, poll):
        self.cache.flush()  # hand queued jobs to the executor
        retries = self.cache.counters["load_retries"]
        for i, ok in picks:
            ids = self.ex.pending_job_ids()
            if not ids:
                break
            job = ids[i % len(ids)]
            if ok:
                self.ex.complete(job)
            else:
                self.ex.fail(job)
        if poll:
            self.cache.poll()
            event(f"failed load retried: {self.cache.counters['load_retries'] > retries}")

    @rule()
    def poll(self):
        self.cache.poll()

    @rule()
    def engine_step(self):
        """A step with a fast executor: everything started so far lands, then the acks are applied."""
        self.cache.flush()
        self.ex.complete_all()
        self.cache.poll()

    @precondition(lambda self: self.loads)
    @rule(layer=st.integers(0, 1))
    def wait_finished_load(self, layer):
        for lb in list(self.loads):
            if lb.handle.done():
                lb.wait(layer)  # must not raise once every job behind it has finished
                self.loads.remove(lb)

    @rule(data=st.data())
    def reset(self, data):
        if data.draw(st.integers(0, 9)) != 0:
            return
        stale = self.ex.pending_job_ids()
        self.cache.reset()
        for job in stale:  # what a synchronizing executor would do: the copies never land
            self.ex.fail(job, "cancelled")
        self.cache.poll()
        self.locks.clear()
        self.loads.clear()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    @invariant()
    def eviction_candidates_equal_a_recomputation(self):
        """The maintained candidate sets (and device-child counts) equal a from-scratch recomputation,
        and every candidate's heap entry sits at or below its current key (so pops come in policy order)."""
        if hasattr(self, "cache"):
            assert self.cache.eviction.violations() == []

    @invariant()
    def state_counts_equal_a_recomputation(self):
        """The driver's per-state node counts (what metrics export) equal a count of the tree."""
        if hasattr(self, "cache"):
            counted = Counter(node.state for node in self.cache.tree.nodes() if not node.is_root)
            assert {s: n for s, n in self.cache.driver.state_counts.items() if n} == dict(counted)

    @invariant()
    def lock_counts_match_held_locks(self):
        if not hasattr(self, "cache"):
            return
        expected: dict[int, int] = {}
        for node in self.locks:
            for n in self.cache.tree.path_to_root(node):
                expected[n.id] = expected.get(n.id, 0) + 1
        for n in self.cache.tree.nodes():
            if not n.is_root:
                assert n.lock_ref == expected.get(n.id, 0), (n, n.lock_ref, expected.get(n.id, 0))


CacheMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheProperties = CacheMachine.TestCase
