"""Page-aligned radix tree: match / insert / split, and splits in a live cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, put
from hicache_fsm.radix import RadixTree
from hicache_fsm.tokens import pack_token_ids, token_id_bytes

PAGE = 2


def tree_insert(tree: RadixTree, tokens: tuple[int, ...], namespace=None):
    """Insert like the cache does: walk, split a partial match, add the rest as one child."""
    tokens = tree.aligned(tokens)
    path, matched, partial = tree.walk(tokens, namespace)
    parent = path[-1] if path else tree.root
    if partial:
        child = parent.children[tree.child_key(namespace, tokens, matched)]
        parent = tree.split(child, partial)
        matched += partial
    if matched < len(tokens):
        return tree.add_child(parent, tokens, namespace, matched)  # the key is sliced lazily
    return parent


def common_prefix(a: tuple, b: tuple, page: int) -> int:
    n = 0
    while n + page <= min(len(a), len(b)) and a[n : n + page] == b[n : n + page]:
        n += page
    return n


def check_shape(tree: RadixTree) -> None:
    for node in tree.nodes():
        if node.is_root:
            continue
        assert node.key and len(node.key) % tree.page_size == 0
        assert node.parent.children[tree.child_key(node.namespace, node.key, 0)] is node
        if not node.parent.is_root:
            assert node.parent.namespace == node.namespace
    for node in tree.nodes():
        firsts = [k for k in node.children]
        assert len(firsts) == len(set(firsts))


token_seqs = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=14).map(tuple), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(seqs=token_seqs, probe=st.lists(st.integers(0, 3), max_size=16).map(tuple))
def test_match_is_longest_page_aligned_common_prefix(seqs, probe):
    tree = RadixTree(PAGE)
    for s in seqs:
        tree_insert(tree, s)
        check_shape(tree)
    for s in seqs:
        path, matched, partial = tree.walk(s)
        assert (matched, partial) == (len(tree.aligned(s)), 0)
        assert tree.prefix_tokens(path[-1]) if path else True
        if path:
            assert tree.prefix_tokens(path[-1]) == tree.aligned(s)
    path, matched, partial = tree.walk(probe)
    best = max(common_prefix(tree.aligned(probe), tree.aligned(s), PAGE) for s in seqs)
    assert matched + partial == best
    assert matched % PAGE == 0 and partial % PAGE == 0
    if path:
        assert tree.prefix_tokens(path[-1]) == probe[:matched]


@settings(max_examples=100, deadline=None)
@given(seqs=token_seqs, other=st.sampled_from(["a", b"", 0, ("t", 1)]))
def test_no_namespace_and_a_namespace_keep_separate_subtrees(seqs, other):
    """A child without a namespace is keyed by its first page alone, one with a namespace by the pair: no mix-up."""
    tree = RadixTree(PAGE)
    for s in seqs:
        tree_insert(tree, s, namespace=None)
        tree_insert(tree, s, namespace=other)
    check_shape(tree)
    for s in seqs:
        for ns in (None, other):
            path, matched, partial = tree.walk(s, ns)
            assert (matched, partial) == (len(tree.aligned(s)), 0)
            assert all(node.namespace == ns for node in path)
    assert len(tree) == 2 * sum(1 for n in tree.nodes() if not n.is_root and n.namespace is None)


@settings(max_examples=100, deadline=None)
@given(seqs=token_seqs, ns=st.sampled_from(["a", "b", None]))
def test_namespaces_never_match_each_other(seqs, ns):
    tree = RadixTree(PAGE)
    for s in seqs:
        tree_insert(tree, s, namespace="lora-1")
    for s in seqs:
        if ns != "lora-1":
            assert tree.walk(s, ns) == ([], 0, 0)
        assert tree.walk(s, "lora-1")[1] == len(tree.aligned(s))
    # the same tokens in a second namespace make a separate subtree
    for s in seqs:
        tree_insert(tree, s, namespace="lora-2")
    check_shape(tree)
    for node in tree.nodes():
        if not node.is_root:
            assert node.namespace in ("lora-1", "lora-2")
            chain = [n.namespace for n in tree.path_to_root(node)]
            assert set(chain) == {node.namespace}


@settings(max_examples=150, deadline=None)
@given(
    n_pages=st.integers(2, 8),
    at_page=st.integers(1, 7),
    lock=st.integers(0, 3),
    host_ref=st.integers(0, 2),
    hits=st.integers(0, 9),
    jobs=st.sets(st.integers(1, 100), max_size=3),
    with_host=st.booleans(),
    state=st.sampled_from(["device", "writing_host", "device_host", "loading", "host"]),
)
def test_split_keeps_both_halves_consistent(n_pages, at_page, lock, host_ref, hits, jobs, with_host, state):
    at_page = min(at_page, n_pages - 1)
    tree = RadixTree(PAGE)
    parent = tree_insert(tree, (9, 9))
    tokens = tuple(range(n_pages * PAGE))
    node = tree.add_child(parent, tokens, None)
    child = tree.add_child(node, (7, 7), None)
    node.state = state
    node.device_indices = torch.arange(100, 100 + n_pages * PAGE)
    node.host_indices = torch.arange(40, 40 + n_pages * PAGE) if with_host else None
    node.lock_ref, node.host_ref, node.hit_count, node.last_access, node.priority = lock, host_ref, hits, 5, 3
    node.pending_jobs = set(jobs)
    node.storage_keys = tuple(f"k{i}" for i in range(n_pages))
    before = tree.prefix_tokens(child)
    upper = tree.split(node, at_page * PAGE)

    assert upper.parent is parent and node.parent is upper and child.parent is node
    assert upper.key + node.key == tokens and len(upper.key) == at_page * PAGE
    assert tree.prefix_tokens(child) == before
    assert upper.state == node.state == state
    assert upper.lock_ref == node.lock_ref == lock  # a lock below counts on every ancestor
    assert node.host_ref == host_ref and upper.host_ref == 0  # the pin stays with its holder's node
    assert upper.hit_count == node.hit_count == hits
    assert upper.pending_jobs == node.pending_jobs == set(jobs)
    assert upper.pending_jobs is not node.pending_jobs
    assert (upper.last_access, upper.priority) == (node.last_access, node.priority)
    assert torch.equal(torch.cat([upper.device_indices, node.device_indices]), torch.arange(100, 100 + n_pages * PAGE))
    if with_host:
        assert torch.equal(torch.cat([upper.host_indices, node.host_indices]), torch.arange(40, 40 + n_pages * PAGE))
    else:
        assert upper.host_indices is None and node.host_indices is None
    assert upper.storage_keys + node.storage_keys == tuple(f"k{i}" for i in range(n_pages))
    assert len(upper.storage_keys) == at_page
    check_shape(tree)


@pytest.mark.parametrize("at", [0, 3, 8, 10])
def test_split_rejects_bad_offsets(at):
    tree = RadixTree(4)
    node = tree_insert(tree, tuple(range(8)))
    with pytest.raises(ValueError):
        tree.split(node, at)


def test_add_child_and_remove_leaf_guard_shape():
    tree = RadixTree(2)
    a = tree_insert(tree, (1, 2, 3, 4))
    version = tree.version
    with pytest.raises(ValueError):
        tree.add_child(tree.root, (1, 2, 5, 6), None)  # same first page as a
    assert list(tree.root.children.values()) == [a] and len(tree) == 1 and tree.version == version
    with pytest.raises(ValueError):
        tree.add_child(a, (5,), None)  # not whole pages
    b = tree.add_child(a, (5, 6), None)
    with pytest.raises(ValueError):
        tree.remove_leaf(a)
    v = tree.version
    tree.remove_leaf(b)
    assert tree.version > v and not tree.owns(b)


# ------------------------------------------------------------------ splits inside a live cache


def test_split_during_inflight_backup_enrols_both_halves():
    cache, ex = make_cache(page=2)
    res = put(cache, range(8))
    node = res.node
    assert node.state == "writing_host"
    (job,) = cache.pending_job_ids()
    m = cache.match_prefix(tuple(range(4)) + (99, 99))  # splits node at 4 tokens
    upper = m.last_device_node
    assert upper is node.parent and upper.pending_jobs == node.pending_jobs == {job}
    cache.check_invariants()
    cache.poll()
    ex.complete(job)
    cache.poll()
    assert upper.state == node.state == "device_host" and not upper.pending_jobs and not node.pending_jobs
    cache.check_invariants()


def test_split_during_failed_backup_frees_both_host_halves():
    cache, ex = make_cache(page=2)
    node = put(cache, range(8)).node
    cache.match_prefix(tuple(range(2)))
    upper = node.parent
    host_free = cache.host_allocator.free_pages
    cache.poll()
    ex.fail(cache.pending_job_ids()[0])
    cache.poll()
    assert upper.state == node.state == "device"
    assert upper.host_indices is None and node.host_indices is None
    assert cache.host_allocator.free_pages == host_free + 4
    cache.check_invariants()


def test_split_of_loading_chain_completes_on_both_halves():
    cache, ex = make_cache(page=2)
    node = put(cache, range(8)).node
    drain(cache, ex)
    assert cache.evict(8) == 8 and node.state == "host"
    lb = cache.load_back(cache.match_prefix(range(8)).last_host_node)
    assert lb is not None and node.state == "loading"
    m = cache.match_prefix((0, 1, 2, 3, 50, 51))
    upper = node.parent
    assert upper.state == "loading" and upper.pending_jobs == node.pending_jobs
    assert m.loads == (lb.handle,)
    cache.check_invariants()
    drain(cache, ex)
    assert upper.state == node.state == "device_host"
    cache.check_invariants()


def test_split_keeps_lock_and_hit_counts_in_cache():
    cache, ex = make_cache(page=2, config=None)
    node = put(cache, range(8)).node
    cache.lock(node)
    cache.match_prefix(range(8))
    hits = node.hit_count
    cache.match_prefix((0, 1, 2, 3))
    upper = node.parent
    assert upper.lock_ref == node.lock_ref == 1
    assert upper.hit_count == hits + 1 and node.hit_count == hits
    cache.unlock(node)
    assert upper.lock_ref == node.lock_ref == 0
    cache.check_invariants()


def test_keys_are_packed_pages_and_split_like_the_ints_they_hold():
    tree = RadixTree(PAGE)
    tokens = tuple(range(100, 100 + 4 * PAGE))
    node = tree.add_child(tree.root, tokens, None, PAGE)
    assert node.num_tokens == 3 * PAGE and node.raw == token_id_bytes(tokens[PAGE:])
    assert tree.walk(tokens)[1] == 0  # the first page is not in the tree: only the tail is
    assert tree.walk(tokens[PAGE:]) == ([node], 3 * PAGE, 0)
    assert tree.walk(pack_token_ids(tokens[PAGE:])) == ([node], 3 * PAGE, 0)
    assert node.key == tokens[PAGE:]
    lazy = tree.add_child(node, tuple(range(4 * PAGE)), None, 2 * PAGE)
    upper = tree.split(lazy, PAGE)
    assert (upper.key, lazy.key) == (tuple(range(2 * PAGE, 3 * PAGE)), tuple(range(3 * PAGE, 4 * PAGE)))
    assert tree.prefix_ids(lazy).raw == token_id_bytes(tokens[PAGE:] + tuple(range(2 * PAGE, 4 * PAGE)))
    for bad_start in (-1, 4 * PAGE, 1):
        with pytest.raises(ValueError):
            tree.add_child(tree.root, tuple(range(500, 500 + 4 * PAGE)), None, bad_start)


@pytest.mark.parametrize("as_tuple", [True, False])
def test_walk_splitting_splits_a_partly_matched_node_for_tokens_in_any_form(as_tuple):
    """The storage tier walks fetched tokens as a tuple; the child lookup must use the tree's packed key."""
    cache, ex = make_cache(page=4)
    try:
        put(cache, tuple(range(1, 9)))  # one node of two pages
        drain(cache, ex)
        probe = tuple(range(1, 5)) + (99, 98, 97, 96)
        tokens = probe if as_tuple else pack_token_ids(probe)
        path, matched = cache.driver.walk_splitting(tokens, None)
        assert matched == 4 and [n.num_tokens for n in path] == [4]
        assert sorted(n.num_tokens for n in cache.tree.nodes() if not n.is_root) == [4, 4]
    finally:
        cache.close()


# ---------------------------------------------------------------- the compact node


@settings(max_examples=60, deadline=None)
@given(page=st.sampled_from([1, 2, 4]), pages=st.lists(st.integers(0, 1 << 40), min_size=0, max_size=8, unique=True))
def test_whole_page_slots_are_kept_as_page_ids_and_read_back_the_same(page, pages):
    from hicache_fsm.radix import NO_JOBS

    tree = RadixTree(page)
    node = tree.add_child(tree.root, (1,) * page, None)
    slots = torch.tensor([p * page + k for p in pages for k in range(page)], dtype=torch.int64)
    node.device_indices = slots
    assert type(node.device_slots) is bytes and len(node.device_slots) == 8 * len(pages)
    assert torch.equal(node.device_indices, slots) and node.device_indices.dtype == torch.int64
    assert node.device_indices is not node.device_indices  # a fresh tensor each read: writing one changes no node
    assert node.host_indices is None and node.pending_jobs is NO_JOBS


@pytest.mark.parametrize("slots", [torch.tensor([1, 2], dtype=torch.int64), torch.tensor([0, 1, 2]),
                                   torch.tensor([2, 3], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int64)])
def test_slots_that_are_not_whole_pages_are_kept_as_given(slots):
    tree = RadixTree(2)
    node = tree.add_child(tree.root, (1, 2), None)
    node.host_indices = slots
    assert node.host_indices is slots


def test_leaves_share_one_read_only_children_mapping_and_nodes_without_jobs_share_no_jobs():
    from hicache_fsm.radix import NO_CHILDREN, NO_JOBS

    tree = RadixTree(PAGE)
    a = tree_insert(tree, (1, 2, 3, 4))
    b = tree_insert(tree, (1, 2, 5, 6))
    upper = a.parent
    assert a.children is NO_CHILDREN and b.children is NO_CHILDREN and len(upper.children) == 2
    with pytest.raises(TypeError):
        NO_CHILDREN[("x", b"")] = a
    a.add_job(7)
    assert a.pending_jobs == {7} and b.pending_jobs is NO_JOBS
    a.drop_job(7)
    assert a.pending_jobs is NO_JOBS
    tree.remove_leaf(a)
    tree.remove_leaf(b)
    assert upper.children is NO_CHILDREN and len(NO_CHILDREN) == 0


def test_a_split_cuts_compact_slots_at_the_page():
    tree = RadixTree(PAGE)
    node = tree_insert(tree, (1, 2, 3, 4, 5, 6))
    node.device_indices = torch.tensor([4, 5, 0, 1, 8, 9], dtype=torch.int64)
    node.host_indices = torch.tensor([2, 3, 6, 7, 10, 11], dtype=torch.int64)
    upper = tree.split(node, 2)
    assert upper.device_indices.tolist() == [4, 5] and node.device_indices.tolist() == [0, 1, 8, 9]
    assert upper.host_indices.tolist() == [2, 3] and node.host_indices.tolist() == [6, 7, 10, 11]


def test_a_deep_copied_node_without_jobs_can_take_one():
    """Explorers deep-copy caches: the copy of the shared empty job set is another empty frozenset."""
    import copy

    tree = RadixTree(PAGE)
    node = tree_insert(tree, (1, 2))
    twin = copy.deepcopy(node)
    twin.add_job(3)
    assert twin.pending_jobs == {3} and not node.pending_jobs
