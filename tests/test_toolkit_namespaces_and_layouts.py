"""Tree namespaces and host layouts in the fuzzers.

A prompt's first token names its namespace (``testing.namespaces``): the mapping must be one to one and
keep prefixes (else the fuzzers' model of what must match is wrong), the twins it makes must stay apart in
a correct cache (tree, KV, storage keys), and ``check`` must say so or refuse: ``--namespaces`` on an
adapter that ignores it is a usage error, not a silent pass. ``check --host-layout`` explores a page_first
host, where a copy at the wrong place is found.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from hang_guard import raised_by
from hicache_fsm import cli
from hicache_fsm.testing.adapter import HiCacheAdapter, hicache_structure_violations
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.namespaces import join_namespace, namespace_index, namespace_name, split_namespace

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
prompts = st.lists(st.integers(0, 9), min_size=1, max_size=6).map(tuple)


@given(prompt=prompts, count=st.integers(1, 4))
def test_the_mapping_is_one_to_one(prompt, count):
    namespace, tokens = split_namespace(prompt, count)
    assert len(tokens) == len(prompt) and tokens[1:] == prompt[1:]
    assert join_namespace(namespace, tokens, count) == prompt
    assert namespace_name(namespace_index(namespace)) == namespace


@given(a=prompts, b=prompts, count=st.integers(1, 4))
def test_prompts_share_a_prefix_exactly_when_their_cache_forms_do(a, b, count):
    (na, ta), (nb, tb) = split_namespace(a, count), split_namespace(b, count)
    n = min(len(a), len(b))
    assert (a[:n] == b[:n]) == (na == nb and ta[:n] == tb[:n])


def test_twins_are_the_same_tokens_in_two_namespaces():
    assert split_namespace((1, 3), 2) == (None, (1, 3))
    assert split_namespace((2, 3), 2) == ("tenant-1", (1, 3))
    assert split_namespace((3, 3), 2) == (None, (2, 3))


def test_a_correct_cache_keeps_twins_apart():
    a = HiCacheAdapter(device_pages=8, host_pages=8, namespaces=2, storage=True)
    try:
        assert a.insert((1, 1))
        assert a.match((2, 1)).device_tokens == 0 and a.match((1, 1)).device_tokens == 2
        assert a.insert((2, 1))
        one, two = a.read_kv((1, 1)), a.read_kv((2, 1))
        assert len(one) == len(two) == 2 and one != two
        assert a.kv_violations() == [] and a.invariant_violations() == []
        assert a.storage_keys_of((1, 1)) != a.storage_keys_of((2, 1))  # storage keys seeded per namespace
        assert a.store_remote((2, 3)) == 2 and a.stored_prefix((1, 3)) == 0
        assert "namespaces=2" in a.describe() and not a.symmetric
    finally:
        a.close()


def test_tree_well_formed_sees_a_node_in_another_namespace_than_its_parent():
    a = HiCacheAdapter(device_pages=8, host_pages=8, namespaces=2)
    try:
        assert a.insert((2, 1, 1))
        assert a.insert((2, 1, 2))  # splits: (2, 1) above two children, all in tenant-1
        assert hicache_structure_violations(a.cache) == []
        upper = a.walk((2, 1))[0][-1]
        upper.namespace = None
        problems = hicache_structure_violations(a.cache)
        assert any("by another key than its first page" in p for p in problems)
        assert any("its parent" in p and "'tenant-1'" in p for p in problems)
    finally:
        a.close()


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    exc = raised_by(lambda: sys.exit(cli.main(list(argv))))
    out, err = capsys.readouterr()
    assert isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}"
    return exc.code, out, err


def test_check_explores_two_namespaces(capsys):
    code, out, _ = _cli(capsys, "check", "--namespaces", "2", "--nodes", "2", "--max-depth", "3", "--quiet")
    assert code == 0 and "namespaces=2" in out and "0 violations" in out


def test_check_refuses_namespaces_an_adapter_ignores(capsys):
    code, _, err = _cli(capsys, "check", "--adapter", f"{EXAMPLES / 'tiny_lru_cache.py'}:explorer_factory",
                        "--namespaces", "2")
    assert code == 2 and "--namespaces 2" in err and "Bounds.namespaces" in err


def test_check_explores_a_page_first_host_and_finds_a_copy_at_the_wrong_place(capsys):
    argv = ("check", "--host-layout", "page_first", "--page-size", "2", "--layers", "2", "--nodes", "2",
            "--max-depth", "4", "--quiet")
    code, out, _ = _cli(capsys, *argv)
    assert code == 0 and "0 violations" in out
    with mutant("page_first_host_run_at_device_slot"):
        code, out, _ = _cli(capsys, *argv)
    assert code == 1 and "kv_readback" in out
