"""The block-store profile's contracts on a tiny store written here: request scopes, per-key answers, declined
keys and the "store keeps its keys" rule, nothing to copy, postconditions with the model, policy conformance,
clones of objects that cannot be deep-copied, exact state bounds, interrupted searches and the CLI's usage errors."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.testing.blockstore import (
    BlockStoreAdapter,
    StoreBounds,
    StoreJob,
    StoreWorld,
    canonical,
    chain,
    explore_store,
    run_store_fuzz,
    value_of,
)
from hicache_fsm.testing.blockstore import explorer as explorer_module


class DictStore(BlockStoreAdapter):
    """A correct store of ``capacity`` keys, LRU among ready unread keys; knobs plant misbehaviour."""

    name = "dict_store"
    redelivery = "caller_guarantees_once"
    eviction_policy = "lru"

    def __init__(self, capacity: int = 2, answers: bool = False, drop: bool = False, mru: bool = False) -> None:
        self.capacity, self.answers, self.drop, self.mru = capacity, answers, drop, mru
        self.keys: dict = {}  # key -> [ready, readers], least recently used first
        self.jobs: dict = {}
        self.calls: list = []

    def begin_request(self, request_id):
        self.calls.append("begin")

    def end_request(self, request_id):
        self.calls.append("end")

    def lookup(self, keys):
        self.calls.append("lookup")
        out = []
        for k in keys:
            entry = self.keys.get(k)
            out.append("MISS" if entry is None else "HIT" if entry[0] else "HIT_PENDING")
            if out[-1] != "HIT":
                break
        return out if self.answers else sum(1 for a in out if a == "HIT")

    def store(self, keys):
        self.calls.append("store")
        new = [k for k in keys if k not in self.keys][: 1 if self.drop else None]
        idle = [k for k, (ready, readers) in self.keys.items() if ready and not readers and k not in keys]
        need = len(self.keys) + len(new) - self.capacity
        if need > len(idle):
            return None
        victims = (idle[::-1] if self.mru else idle)[:max(need, 0)]
        for k in victims:
            del self.keys[k]
        self.evicted(victims)
        if not new:
            return StoreJob.nothing()
        for k in new:
            self.keys[k] = [False, 0]
        job = StoreJob(max(self.jobs, default=0) + 1, tuple(new))
        self.jobs[job.id] = ("store", job.keys)
        return job

    def load(self, keys):
        self.calls.append("load")
        for k in keys:
            self.keys[k][1] += 1
            self.keys[k] = self.keys.pop(k)  # most recently used
        self.touched(keys)
        job = StoreJob(max(self.jobs, default=0) + 1, tuple(keys))
        self.jobs[job.id] = ("load", job.keys)
        return job

    def complete(self, job, ok):
        kind, keys = self.jobs.pop(job.id)
        for k in keys:
            if kind == "store":
                if ok:
                    self.keys[k][0] = True
                else:
                    del self.keys[k]
            else:
                self.keys[k][1] -= 1
        return [value_of(k) for k in keys] if kind == "load" else None

    def state_key(self):
        return tuple((k, tuple(v)) for k, v in self.keys.items()), tuple(sorted(self.jobs.values()))


class LockedStore(DictStore):
    """The same store holding a lock (as LMCache's backends do): it cannot be deep-copied."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.lock = threading.Lock()

    def state_key(self):
        with self.lock:
            return super().state_key()


def _stored(world: StoreWorld, keys) -> None:
    assert not world.do("store", keys)
    assert not world.do("complete", next(iter(world.model.jobs)), True)


def test_a_request_is_one_scope_with_several_calls_inside():
    world = StoreWorld(DictStore())
    _stored(world, chain([0]))
    world.adapter.calls.clear()
    assert not world.do("request", chain([0, 1]))
    assert world.adapter.calls == ["begin", "lookup", "load", "store", "end"]
    world.adapter.calls.clear()
    assert not world.do("open") and not world.do("lookup", chain([1])) and not world.do("lookup", chain([0]))
    assert not world.do("close")
    assert world.adapter.calls == ["begin", "lookup", "lookup", "end"]


def test_per_key_answers_are_checked_key_by_key():
    world = StoreWorld(DictStore(answers=True))
    assert not world.do("store", chain([0, 1]))
    assert not world.do("lookup", chain([0]))  # HIT_PENDING while its store is in flight
    world.adapter.lookup = lambda keys: ["HIT"]
    assert any("answered HIT, the model says storing" in p for p in world.do("lookup", chain([0])))
    world.adapter.lookup = lambda keys: ["RETRY"]
    assert not world.do("lookup", chain([0]))  # never wrong
    world.adapter.lookup = lambda keys: []
    assert any("without a miss" in p for p in world.do("lookup", chain([0])))
    world.adapter.lookup = lambda keys: ["MAYBE"]
    assert any("is not one of" in p for p in world.do("lookup", chain([0])))


def test_a_dropped_key_is_a_bug_unless_declined_or_the_rule_is_off():
    world = StoreWorld(DictStore(drop=True))
    assert any("skipped [0/1]" in p for p in world.do("store", chain([0, 1])))
    world = StoreWorld(DictStore(drop=True))
    world.adapter.keeps_keys = False
    assert not world.do("store", chain([0, 1]))
    world = StoreWorld(DictStore())
    world.adapter.store = lambda keys: StoreJob(1, keys[:1], declined=keys[1:])
    assert not world.do("store", chain([0, 1]))
    world.adapter.store = lambda keys: StoreJob(2, keys, declined=keys)
    assert any("both copies and declines" in p for p in world.do("store", chain([1])))


def test_nothing_to_copy_takes_no_job_slot():
    world = StoreWorld(DictStore())
    _stored(world, chain([0]))
    assert not world.do("store", chain([0]))
    assert world.model.jobs == {}
    assert ("complete",) not in {s[:1] for s in world.steps([chain([0])])}


def test_postconditions_receive_the_model():
    world = StoreWorld(DictStore())
    seen = []
    world.adapter.postconditions = lambda op, args, result, model: seen.append(dict(model.keys)) or []
    world.do("store", chain([0]))
    assert seen == [{(0,): "storing"}]


def test_an_inverted_lru_is_caught_and_the_right_one_passes():
    good = explore_store(DictStore, StoreBounds(max_len=2))
    assert good.complete and not good.violations
    bad = explore_store(lambda: DictStore(mru=True), StoreBounds(max_len=2), stop_on_first=True)
    assert bad.violations and bad.violations[0][0][0].startswith("policy: store evicted")


def test_an_unknown_policy_name_is_refused():
    store = DictStore()
    store.eviction_policy = "random"
    with pytest.raises(ValueError, match="eviction_policy"):
        StoreWorld(store)


def test_a_store_holding_a_lock_is_explored_by_replay_with_the_same_result():
    plain = explore_store(DictStore, StoreBounds(max_len=2))
    locked = explore_store(LockedStore, StoreBounds(max_len=2))
    assert locked.complete and not locked.violations
    assert (locked.states, locked.transitions) == (plain.states, plain.transitions)


@settings(max_examples=50, deadline=None)
@given(pages=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=2), max_size=4))
def test_canonical_keys_tell_states_apart_exactly_as_the_handwritten_key(pages):
    a, b = StoreWorld(DictStore()), StoreWorld(DictStore())
    for p in pages:
        a.do("request", chain(p))
        b.do("request", chain(p))
    assert canonical(a.adapter, ("calls",)) == canonical(b.adapter, ("calls",))
    b.do("store", chain([1, 1, 1]))
    same_key = a.adapter.state_key() == b.adapter.state_key()
    assert (canonical(a.adapter, ("calls",)) == canonical(b.adapter, ("calls",))) == same_key


@pytest.mark.parametrize("limit", [1, 7, 30])
def test_max_states_is_never_exceeded(limit):
    result = explore_store(DictStore, StoreBounds(max_states=limit))
    assert result.states == limit and not result.complete and result.stopped == "max_states"


def test_max_depth_bounds_the_search():
    """A model bound: every state within two steps is reached, the run is complete to that depth."""
    result = explore_store(DictStore, StoreBounds(max_depth=2))
    assert result.max_depth == 2 and result.complete and result.depth_bounded and result.stopped == "complete"
    assert "complete to depth 2" in result.summary()
    closed = explore_store(DictStore, StoreBounds(max_len=1, max_depth=None))
    assert closed.complete and not closed.depth_bounded and ", complete," in closed.summary()


class Interrupting(DictStore):
    """Ctrl-C arrives during the 50th lookup."""

    budget = [50]

    def lookup(self, keys):
        self.budget[0] -= 1
        if not self.budget[0]:
            raise KeyboardInterrupt
        return super().lookup(keys)


def test_an_interrupted_search_returns_what_it_found(monkeypatch, tmp_path):
    Interrupting.budget = [50]
    result = explore_store(Interrupting, StoreBounds())
    assert result.stopped == "interrupted" and not result.complete and result.states > 1
    assert result.to_json()["complete"] is False


def test_progress_goes_to_a_terminal_only(monkeypatch):
    class Tty:
        def __init__(self, tty):
            self.text, self.tty = "", tty

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    monkeypatch.setattr(explorer_module, "PROGRESS_EVERY_S", 0.0)
    tty = Tty(True)
    explore_store(DictStore, StoreBounds(max_len=1), progress=tty)
    assert "states/s" in tty.text and "depth" in tty.text
    assert tty.text.rsplit("\r", 1)[-1].startswith("explore: dict_store: ") and ", complete, 0 violations," in tty.text


# ---------------------------------------------------------------------------- the command line


FACTORIES = '''
from hicache_fsm.testing.blockstore import BlockStoreAdapter

def returns_none(**kw):
    return None

def fails(**kw):
    raise RuntimeError("no backend")

class BadPolicy(BlockStoreAdapter):
    eviction_policy = "random"

def bad_policy(**kw):
    return BadPolicy()
'''


@pytest.fixture()
def factories(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        status = main(argv)
        raise SystemExit(status)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


EXAMPLE = "examples/block_offload_manager.py:make_adapter"


@pytest.mark.parametrize("argv, says", [
    (["check", "--adapter", EXAMPLE, "--nodes", "5"], "--nodes: not for a block store"),
    (["check", "--adapter", EXAMPLE, "--host-pages", "3", "--write-policy", "write_back"], "--host-pages, --write-policy"),
    (["check", "--adapter", EXAMPLE, "--max-seconds", "5"], "--max-seconds"),
    (["check", "--adapter", EXAMPLE, "--max-jobs", "0"], "--max-jobs"),
    (["fuzz", "--adapter", EXAMPLE, "--coverage"], "--coverage"),
    (["check", "--adapter", EXAMPLE, "--variant", '{"bgu": 1}'], "does not fit"),
    (["fuzz", "--adapter", EXAMPLE, "--variant", '{"bgu": 1}'], "does not fit"),
    (["fuzz", "--adapter", "examples/tiny_lru_cache.py:make_adapter", "--variant", '{"bgu": 1}'], "does not fit"),
    (["check", "--adapter", "examples/tiny_lru_cache.py:explorer_factory", "--variant", "{}"], "block-store"),
    (["check", "--adapter", EXAMPLE, "--variant", "[" * 5000 + "]" * 5000], "nested deeper"),
    (["fuzz", "--adapter", EXAMPLE, "--variant", '{"a": ' * 40 + "1" + "}" * 40], "nested deeper"),
])
def test_usage_errors_are_one_line(argv, says, capsys, monkeypatch):
    monkeypatch.chdir(pytest.importorskip("hicache_fsm").__file__.rsplit("/hicache_fsm/", 1)[0])
    assert says in _usage_error(argv, capsys)


@pytest.mark.parametrize("name, says", [("returns_none", "returned NoneType"), ("fails", "raised RuntimeError"),
                                        ("bad_policy", "eviction_policy")])
@pytest.mark.parametrize("command", ["check", "fuzz"])
def test_factories_that_fail_are_usage_errors(factories, name, says, command, capsys):
    assert says in _usage_error([command, "--adapter", f"{factories}:{name}"], capsys)


def test_check_json_reports_the_bound_it_stopped_at(capsys, monkeypatch):
    monkeypatch.chdir(pytest.importorskip("hicache_fsm").__file__.rsplit("/hicache_fsm/", 1)[0])
    assert main(["check", "--adapter", EXAMPLE, "--max-states", "30", "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["states"] == 30 and summary["complete"] is False and summary["stopped"] == "max_states"


class DeclinesEverything(DictStore):
    """Declines every key it is asked to store: no step ever changes it, so every check passes vacuously."""

    def store(self, keys):
        self.calls.append("store")
        return StoreJob.nothing(declined=list(keys))


def test_a_store_no_step_changes_checked_nothing_and_does_not_pass():
    result = explore_store(DeclinesEverything, StoreBounds(max_len=2))
    assert not result.ok and not result.violations and result.states == 1
    assert "CHECKED NOTHING" in result.summary() and result.to_json()["checked_nothing"]
    assert explore_store(DictStore, StoreBounds(max_len=2)).ok


def test_random_runs_over_a_store_no_step_changes_checked_nothing():
    """``run_store_fuzz`` passed such a store: the floor ``run_fuzz`` keeps for caches holds for block stores."""
    result = run_store_fuzz(DeclinesEverything, examples=5, steps=8, seed=0)
    assert not result.ok and "the store took no key" in result.checked_nothing and not result.test_code
    assert run_store_fuzz(DictStore, examples=5, steps=8, seed=0).ok
