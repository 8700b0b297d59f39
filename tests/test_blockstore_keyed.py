"""The vLLM-shaped example (examples/keyed_offload_manager.py): per-key answers, an admission filter, request
scopes, LRU and ARC. Its adapter stays small, the correct store passes every variant, the explorer and the
fuzzer (and both commands) catch each planted bug, and the toolkit's reference ARC agrees with the example's."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from example_util import EXAMPLES, load_example

from hicache_fsm.cli import main
from hicache_fsm.testing.blockstore import ARC, LRU, StoreBounds, explore_store, run_store_fuzz

EXAMPLE = EXAMPLES / "keyed_offload_manager.py"
REF = f"{EXAMPLE}:make_adapter"
VARIANTS = [{"policy": p, "store_threshold": t} for p in ("lru", "arc") for t in (1, 2)]

keyed = load_example("keyed_offload_manager.py")


def code_lines(text: str) -> int:
    """Lines that are neither blank nor comments."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def test_adapter_is_under_60_code_lines():
    text = EXAMPLE.read_text()
    adapter = text[text.index("class KeyedOffloadAdapter"):]
    assert code_lines(adapter) < 60


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v['policy']}-t{v['store_threshold']}")
def test_correct_store_passes_every_variant(variant):
    result = explore_store(lambda: keyed.make_adapter(**variant), StoreBounds(alphabet=1, max_len=3))
    assert result.complete and not result.violations and result.states > 20  # three keys, two blocks
    assert run_store_fuzz(keyed.make_adapter, variants=[variant], examples=25, shrink=False).ok


@pytest.mark.parametrize("bug, problem", [("inverted_lru", "policy:"), ("pending_hit", "answered HIT"),
                                          ("unpin_on_finish", "while a load reads it")])
def test_explorer_and_fuzzer_catch_each_planted_bug(bug, problem):
    result = explore_store(lambda: keyed.make_adapter(bug=bug), StoreBounds(), stop_on_first=True)
    assert result.violations and any(problem in p for p in result.violations[0][0])
    fuzz = run_store_fuzz(keyed.make_adapter, variants=[{"bug": bug}], examples=200, shrink=False)
    assert not fuzz.ok


@pytest.mark.parametrize("bug", ["inverted_lru", "pending_hit", "unpin_on_finish"])
def test_both_commands_catch_each_planted_bug(bug, capsys):
    variant = json.dumps({"bug": bug})
    assert main(["check", "--adapter", REF, "--variant", variant, "--stop-on-first", "--quiet", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["violations"] == 1
    assert main(["fuzz", "--adapter", REF, "--variant", variant, "--examples", "200", "--no-shrink", "--quiet"]) == 1
    assert "fuzz: FAILED" in capsys.readouterr().out


def test_threshold_two_declines_keys_seen_once():
    adapter = keyed.make_adapter(store_threshold=2)
    adapter.begin_request(0)
    adapter.lookup([(0,)])
    job = adapter.store([(0,), (1,)])
    adapter.end_request(0)
    assert job.keys == () and job.declined == ((0,), (1,))  # seen once and never: nothing to copy
    adapter.begin_request(1)
    adapter.lookup([(0,)])
    job = adapter.store([(0,)])
    assert job.keys == ((0,),) and job.declined == ()


# ---------------------------------------------------------------------------- the reference ARC, checked against
# an independent implementation (the example's): same victims after any history of inserts, touches and evictions

ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "evict", "ready"]), st.integers(0, 5)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops, capacity=st.integers(1, 4))
def test_reference_arc_picks_the_victims_the_example_arc_picks(ops, capacity):
    ours, ref = keyed.ARCPolicy(capacity), ARC(capacity)
    for op, k in ops:
        key = (k,)
        block = ours.get(key)
        if op == "insert" and block is None:
            ours.insert(key, keyed.BlockStatus(k))
            ref.insert(key)
        elif op == "ready" and block is not None:
            block.ref_cnt = 0
        elif op == "touch":
            ours.touch([key])
            ref.touch(key, block is not None and block.is_ready)
        elif op == "evict":
            eligible = {kk for kk, b in [*ours.t1.items(), *ours.t2.items()] if b.ref_cnt == 0}
            want = ref.choose(eligible, 1)
            got = ours.evict(1, set())
            assert (got is None) == (want is None)
            if got:
                assert [g[0] for g in got] == want
                ref.evict(want[0])
        assert ref.key()[1:3] == (tuple(ours.t1), tuple(ours.t2))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "touch"]), st.integers(0, 5)), max_size=30),
       n=st.integers(1, 3))
def test_reference_lru_evicts_the_least_recently_used(ops, n):
    ref, last_use = LRU(), {}
    for t, (op, k) in enumerate(ops):
        if op == "insert" or (k,) in last_use:
            (ref.insert if op == "insert" else lambda key: ref.touch(key, True))((k,))
            last_use[(k,)] = t
    oldest = sorted(last_use, key=last_use.get)
    assert ref.choose(set(last_use), n) == (oldest[:n] if len(oldest) >= n else None)


def test_the_docs_show_what_check_prints(capsys, monkeypatch):
    root = EXAMPLE.parent.parent
    text = (root / "docs" / "fuzzing.md").read_text()
    section = text[text.index("## Writing a block-store adapter from a blank file"):]
    block = section[section.index("```text\n$ hicache-fsm check"):].split("```")[1].splitlines()[1:]
    argv = shlex.split(block[0].removeprefix("$ hicache-fsm "))
    monkeypatch.chdir(root)
    assert main(argv) == 1
    seconds = re.compile(r"\d+\.\ds$")
    printed = [seconds.sub("_s", line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [seconds.sub("_s", line) for line in block[1:]]
