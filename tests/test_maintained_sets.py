"""Sets kept current by the residency driver's reports equal their from-scratch definitions.

Random engine calls, job outcomes and storage steps (some failing, some
making storage unhealthy, detaches and re-attaches) drive a cache with a
storage tier whose work runs only when the test says. After every step the
eviction candidates, write_behind's device-only set and the storage tier's
backup retries are compared with a recomputation from the tree
(``check_candidates``), and after two polls on healthy storage no retry is
left waiting: the sweep started every backup it was owed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache_helpers import make_cache, put
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import StorageLinkError
from hicache_fsm.storage import open_backend
from hicache_fsm.storage.faults import FaultyBackend
from hicache_fsm.storage.retry import UNSTORED, BackupRetries
from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier

PAGE = 2
BASES = ((0, 0, 1, 1, 2, 2, 0, 1, 2, 0, 1, 2), (0, 0, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0), (1, 2) * 6)
# mostly cuts of a few shared sequences (nodes get split), sometimes anything
tokens_st = st.one_of(
    st.tuples(st.sampled_from(BASES), st.integers(1, 6)).map(lambda bk: bk[0][: bk[1] * PAGE]),
    st.lists(st.integers(0, 2), min_size=PAGE, max_size=6 * PAGE).map(lambda t: tuple(t[: len(t) - len(t) % PAGE])),
)

OPTIONS = {"retry_interval": 0.0, "retry_batch_tokens": 1 << 20}  # every sweep is due and starts everything

pytestmark = pytest.mark.usefixtures("quiet_logs")


class MaintainedSets(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_back", "write_behind"]),
        device_pages=st.integers(3, 10),
        host_pages=st.integers(4, 16),
    )
    def setup(self, policy, device_pages, host_pages):
        config = CacheConfig(write_policy=policy, write_behind_idle_steps=1)
        self.cache, self.ex = make_cache(page=PAGE, device_pages=device_pages, host_pages=host_pages, config=config)
        self.cache.check_candidates = True
        self.plan = FaultPlan()
        self.tier = ManualStorageTier.attach_to(self.cache, self._backend(), **OPTIONS)

    def _backend(self):
        return FaultyBackend(open_backend("memory://"), self.plan)  # detach closes a backend: a new one each time

    def teardown(self):
        self.cache.close()

    @rule(tokens=tokens_st)
    def insert(self, tokens):
        put(self.cache, tokens)

    @rule(tokens=tokens_st)
    def match_and_load_back(self, tokens):
        m = self.cache.match_prefix(tokens)
        if m.host_hit_length:
            self.cache.load_back(m.last_host_node)

    @rule(tier=st.sampled_from(["device", "host"]), pages=st.integers(1, 4))
    def evict(self, tier, pages):
        if tier == "device":
            self.cache.evict(pages * PAGE)
        else:
            self.cache.evict_host(pages * PAGE)

    @rule(failures=st.lists(st.booleans(), max_size=4))
    def finish_device_jobs(self, failures):
        """Every started device copy ends (the first few as ``failures`` says), then a poll applies them."""
        self.cache.flush()
        for i, job_id in enumerate(self.ex.pending_job_ids()):
            if i < len(failures) and failures[i]:
                self.ex.fail(job_id, "injected")
            else:
                self.ex.complete(job_id)
        self.cache.poll()

    @rule(hows=st.lists(st.sampled_from(["ok", "refused", "error"]), max_size=6))
    def run_storage_steps(self, hows):
        """Queued storage work runs, oldest first; ``refused``: storage answers but stores nothing (the
        backup backs off); ``error``: storage fails and turns unhealthy until a probe answers."""
        for how in hows:
            steps = self.tier.steps()
            if not steps:
                break
            if how != "ok":
                self.plan.fail_next("partial" if how == "refused" else "error")
            self.tier.run(steps[0].id)
            self.plan.clear_next()
        self.cache.poll()

    @rule(twice=st.booleans())
    def poll(self, twice):
        self.cache.poll()
        if not twice:
            return
        self.cache.poll()  # a backup that failed in the first poll is owed a retry by the second
        if self.tier.accepting_backups():
            retries = self.tier.retries
            assert not retries.ready and not retries.waiting, (list(retries.ready), list(retries.waiting))
            assert not [n.id for n in self.cache.tree.nodes() if n.parent is not None and n.state in UNSTORED]

    @rule()
    def detach_or_attach(self):
        if self.tier.state == "detached":
            self.tier.attach(self._backend(), **OPTIONS)  # host copies made meanwhile are owed a backup
            return
        try:
            self.tier.detach()
        except StorageLinkError:  # transfers in flight: refused, nothing changed
            pass

    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def maintained_sets_equal_a_recomputation(self):
        if hasattr(self, "cache"):
            self.cache.check_invariants()  # check_candidates: eviction sets and backup retries included


MaintainedSets.TestCase.settings = settings(max_examples=30, stateful_step_count=60, deadline=None,
                                            suppress_health_check=list(HealthCheck))
TestMaintainedSets = MaintainedSets.TestCase


# ---------------------------------------------------------------- backup retries on their own, with a clock


class _Node:
    def __init__(self, node_id: int, tokens: int) -> None:
        self.id, self.num_tokens, self.state, self.parent = node_id, tokens, "device", object()


class _Tree:
    def __init__(self) -> None:
        self.by_id: dict[int, _Node] = {}

    def nodes(self):
        return list(self.by_id.values())

    def get(self, node_id):
        return self.by_id.get(node_id)


class RetriesWithAClock(RuleBasedStateMachine):
    """``BackupRetries`` against its contract: a sweep starts only unstored nodes that are due, within the
    budget, all of them when the budget allows, and says ``more`` exactly when an unstored node is left."""

    def __init__(self):
        super().__init__()
        self.retries = BackupRetries()
        self.tree = _Tree()
        self.now = 100.0
        self.next_id = 1

    def _set_state(self, node, state):
        old, node.state = node.state, state
        self.retries.state_changed(node, old)

    @rule(tokens=st.integers(1, 4))
    def new_node(self, tokens):
        node = _Node(self.next_id, tokens)
        self.next_id += 1
        self.tree.by_id[node.id] = node
        self._set_state(node, "device_host")  # a host copy storage does not hold

    @rule(data=st.data())
    def backup_fails(self, data):
        """A retried backup fails while storage answers: back off, then the node is unstored again."""
        storing = [n for n in self.tree.nodes() if n.state == "device_host_storing"]
        if storing:
            node = data.draw(st.sampled_from(storing))
            self.retries.back_off([node.id], interval=data.draw(st.sampled_from([0.0, 1.0, 1.0, 8.0])), now=self.now)
            self._set_state(node, "device_host")

    @rule(data=st.data())
    def backup_lands(self, data):
        storing = [n for n in self.tree.nodes() if n.state == "device_host_storing"]
        if storing:
            node = data.draw(st.sampled_from(storing))
            self.retries.stored([node.id])
            self._set_state(node, "device_host_stored")

    @rule(data=st.data())
    def split(self, data):
        if self.tree.by_id:
            node = data.draw(st.sampled_from(self.tree.nodes()))
            upper = _Node(self.next_id, 1)
            self.next_id += 1
            upper.state = node.state
            self.tree.by_id[upper.id] = upper
            self.retries.split(node, upper)

    @rule(data=st.data())
    def remove(self, data):
        if self.tree.by_id:
            node = data.draw(st.sampled_from(self.tree.nodes()))
            if data.draw(st.booleans()):  # the driver moves a node to ``removed`` first; the set copes either way
                self._set_state(node, "removed")
            del self.tree.by_id[node.id]
            self.retries.removed(node, None)

    @rule()
    def storage_recovers(self):
        self.retries.forgive()

    @rule(seconds=st.sampled_from([0.5, 1.0, 4.0, 30.0, 60.0]))
    def time_passes(self, seconds):
        self.now += seconds

    @rule(budget=st.sampled_from([1, 3, 8, 1 << 20, 1 << 20, 1 << 20]))
    def sweep(self, budget):
        unstored = {n.id for n in self.tree.nodes() if n.state in UNSTORED}
        due = {i for i in unstored if self.retries.failures.get(i, (0.0, 0))[0] <= self.now}
        started = []

        def start(node):
            started.append(node.id)
            self._set_state(node, "device_host_storing")
            return True

        count, more = self.retries.sweep(start, budget, self.now)
        assert count == len(started) and set(started) <= due
        assert sum(self.tree.by_id[i].num_tokens for i in started) <= budget
        left = unstored - set(started)
        assert more == bool(left)
        if budget >= sum(self.tree.by_id[i].num_tokens for i in due):
            assert set(started) == due

    @invariant()
    def maintained_set_equals_a_recomputation(self):
        assert self.retries.violations(self.tree) == []


RetriesWithAClock.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestRetriesWithAClock = RetriesWithAClock.TestCase
