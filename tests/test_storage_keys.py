"""Page keys (chained SHA-256) and key namespaces."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.errors import HiCacheError, StorageKeyError
from hicache_fsm.storage.keys import KeyNamespace, page_hash, page_keys, validate_page_keys

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


def reference_hash(token_ids, prior_hash=None):
    """The chaining rule, written out the slow way: prior digest bytes, then each token as u32 LE."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_page_hash_matches_reference_bytes():
    first = page_hash([1, 2, 3, 4])
    assert first == reference_hash([1, 2, 3, 4])
    assert first == hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])).hexdigest()
    second = page_hash([5, 6, 7, 8], first)
    assert second == hashlib.sha256(bytes.fromhex(first) + bytes([5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0])).hexdigest()
    assert page_hash([1, 2, 3, 4], "") == first  # empty prior = start of sequence


def test_page_keys_only_full_pages_and_chained():
    tokens = list(range(10))
    keys = page_keys(tokens, 4)
    assert len(keys) == 2  # the 2-token tail gets no key
    assert keys[0] == reference_hash(tokens[0:4])
    assert keys[1] == reference_hash(tokens[4:8], keys[0])
    assert page_keys(tokens[:3], 4) == []
    assert page_keys([], 4) == []


def test_page_keys_accept_tensors_and_prior():
    tokens = torch.arange(12, dtype=torch.int64)
    keys = page_keys(tokens, 4)
    assert keys == page_keys(list(range(12)), 4)
    assert page_keys(list(range(4, 12)), 4, prior=keys[0]) == keys[1:]


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"], [True]])
def test_bad_token_ids_rejected(bad):
    with pytest.raises(StorageKeyError):
        page_hash(bad)
    with pytest.raises(StorageKeyError):
        page_keys(bad * 4, 4)


@pytest.mark.parametrize("prior", ["zz", "ab" * 31, 42, "ab" * 32 + "\n"])
def test_bad_prior_rejected(prior):
    with pytest.raises(StorageKeyError):
        page_hash([1], prior)


@pytest.mark.parametrize("page_size", [0, -4, 2.0, True])
def test_bad_page_size_rejected(page_size):
    with pytest.raises(StorageKeyError):
        page_keys([1, 2, 3, 4], page_size)


@settings(max_examples=60, deadline=None)
@given(a=TOKENS, b=TOKENS, page_size=st.integers(1, 5))
def test_keys_are_a_prefix_property(a, b, page_size):
    """Key i depends on exactly the first i+1 pages: equal page prefixes <=> equal key prefixes."""
    ka, kb = page_keys(a, page_size), page_keys(b, page_size)
    assert len(ka) == len(a) // page_size
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[: (i + 1) * page_size] == b[: (i + 1) * page_size]
        assert (ka[i] == kb[i]) == same_prefix
    # extending a sequence never changes the keys already computed
    assert page_keys(a + b, page_size)[: len(a) // page_size] == ka


@settings(max_examples=40, deadline=None)
@given(tokens=TOKENS, page_size=st.integers(1, 4))
def test_keys_match_reference_chaining(tokens, page_size):
    prior = None
    expected = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = reference_hash(tokens[start : start + page_size], prior)
        expected.append(prior)
    assert page_keys(tokens, page_size) == expected


# ---------------------------------------------------------------- namespaces

H = "ab" * 32


def test_namespace_key_layout():
    assert KeyNamespace("llama-3-8b").storage_key(H) == f"llama-3-8b/_/0of1/{H}"
    assert KeyNamespace("m", tp_rank=3, tp_size=8, tenant="acme").storage_key(H) == f"m/acme/3of8/{H}"
    mla = KeyNamespace("dsv3", tp_rank=5, tp_size=8, is_mla=True)
    assert mla.storage_key(H) == f"dsv3/_/mla/{H}"
    assert mla.storage_key(H) == KeyNamespace("dsv3", tp_rank=0, tp_size=8, is_mla=True).storage_key(H)
    assert mla.owns(mla.storage_key(H)) and not KeyNamespace("dsv3").owns(mla.storage_key(H))


@pytest.mark.parametrize(
    "model",
    ["", "a/b", "..", "a..b", ".hidden", "has space", "tab\t", "x" * 129, "star*", "q?", "br[a]", "back\\slash", "é"],
)
def test_bad_model_names_rejected(model):
    with pytest.raises(StorageKeyError):
        KeyNamespace(model)
    with pytest.raises(StorageKeyError):
        KeyNamespace("ok", tenant=model)


def test_reserved_tenant_and_ranks_rejected():
    with pytest.raises(StorageKeyError):
        KeyNamespace("m", tenant="_")
    for rank, size in [(1, 1), (-1, 2), (0, 0), (True, 2)]:
        with pytest.raises(StorageKeyError):
            KeyNamespace("m", tp_rank=rank, tp_size=size)
    with pytest.raises(HiCacheError):
        KeyNamespace(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["", "a/b", "a b", "../x", 7, "k*"])
def test_bad_page_keys_rejected(key):
    with pytest.raises(StorageKeyError):
        KeyNamespace("m").storage_key(key)


NAME = st.text(alphabet="abcXYZ019-_.:", min_size=1, max_size=12).filter(
    lambda s: ".." not in s and not s.startswith(".") and s != "_"
)


@settings(max_examples=80, deadline=None)
@given(m1=NAME, t1=st.none() | NAME, r1=st.integers(0, 3), m2=NAME, t2=st.none() | NAME, r2=st.integers(0, 3),
       mla1=st.booleans(), mla2=st.booleans(), key=st.sampled_from(["k", H]))
def test_distinct_namespaces_never_share_keys(m1, t1, r1, m2, t2, r2, mla1, mla2, key):
    a = KeyNamespace(m1, tp_rank=r1, tp_size=4, tenant=t1, is_mla=mla1)
    b = KeyNamespace(m2, tp_rank=r2, tp_size=4, tenant=t2, is_mla=mla2)
    same = (m1, t1, mla1, None if mla1 else r1) == (m2, t2, mla2, None if mla2 else r2)
    assert (a.storage_key(key) == b.storage_key(key)) == same
    if not same:
        assert not a.prefix.startswith(b.prefix) and not b.prefix.startswith(a.prefix)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), ps=st.sampled_from([1, 2, 4]),
       prior=st.sampled_from([None, "ab" * 32]), chunk=st.integers(1, 5), reads=st.lists(st.integers(-25, 25)))
def test_page_key_chain_reads_equal_page_keys(ids, ps, prior, chunk, reads):
    """Whatever order keys are read in, a PageKeyChain gives page_keys's keys."""
    from hicache_fsm.storage.keys import PageKeyChain

    want = page_keys(ids, ps, prior)
    chain = PageKeyChain(ids, ps, prior, chunk=chunk)
    assert len(chain) == len(want)
    for r in reads:
        if -len(want) <= r < len(want):
            assert chain[r] == want[r]
        else:
            with pytest.raises(IndexError):
                chain[r]
        assert chain[r:] == tuple(want[r:]) and chain[:r] == tuple(want[:r])
    assert list(chain) == want and chain == tuple(want)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 50), min_size=1, max_size=40), ps=st.sampled_from([1, 2, 4]),
       cut=st.integers(0, 40), length=st.integers(0, 40), other=st.lists(st.integers(0, 50), max_size=8))
def test_page_key_chain_keys_following(ids, ps, cut, length, other):
    """keys_following answers page_keys of the pages after a prior it hashed, or None; never other keys."""
    from hicache_fsm.storage.keys import PageKeyChain
    from hicache_fsm.tokens import pack_token_ids

    chain = PageKeyChain(ids, ps, None)
    pages = len(ids) // ps
    cut, length = min(cut, pages), min(length, pages - min(cut, pages))
    keys = page_keys(ids, ps, None)
    prior = keys[cut - 1] if cut else None
    part = ids[cut * ps:(cut + length) * ps]
    want = tuple(page_keys(part, ps, prior)) if part else None
    got = chain.keys_following(prior, pack_token_ids(part))
    assert got is None or got == want  # None: the prior was not hashed yet (the caller hashes itself)
    list(chain)  # every key hashed: the chain now knows every prior
    assert chain.keys_following(prior, pack_token_ids(part)) == want
    if other and len(other) % ps == 0:
        foreign = chain.keys_following(prior, pack_token_ids(other))
        assert foreign is None or foreign == tuple(page_keys(other, ps, prior))


@pytest.mark.parametrize("make", [lambda: validate_page_keys(["abc\n"]), lambda: KeyNamespace("llama\n"),
                                  lambda: KeyNamespace("llama", tenant="a\n")])
def test_a_name_or_key_ending_in_a_newline_is_refused(make):
    """A pattern ending in "$" also matches before a final newline: keys and names are matched whole."""
    with pytest.raises(StorageKeyError):
        make()


# SGLang 0.5.23's storage_namespace_seed (mem_cache/utils.py) of (extra_key, cache_salt):
SGLANG_SEEDS = {
    ("lora1", None): "69df3de801c43e60adaa856ad245421b72609a9c94f2c6cc263c4d6c4497c3c5",
    ("lora1", "salt"): "224af80b6f35754d2982517317bd1b38956b98c3742fb6579c97345b4183fc13",
    (None, "salt"): "43601f36bb365a5bdb202f3b4398e5edcdc529750311c8aa2028ce19293f8d6e",
}


def test_a_lora_id_or_cache_salt_seeds_the_chain_as_sglang_does():
    # The seed was this project's own (a repr under another tag): a LoRA request's pages had other keys.
    from hicache_fsm.storage.tier import namespace_seed

    assert namespace_seed(None) is None
    assert namespace_seed("lora1") == SGLANG_SEEDS[("lora1", None)]  # a str is SGLang's extra_key
    for pair, seed in SGLANG_SEEDS.items():
        assert namespace_seed(pair) == seed
    others = [7, ("lora1",), (None, None), ("a", "b", "c"), ("a", 1)]
    seeds = {namespace_seed(ns) for ns in others} | set(SGLANG_SEEDS.values())
    assert len(seeds) == len(others) + len(SGLANG_SEEDS)  # every namespace its own chain
