"""End to end with the real TinyModel and the TorchExecutor, for every host layout.

``Engine`` is a minimal serving loop over ``HiCache``: match, load back the
host hit, lock, wait for each layer before reading it, compute the suffix,
insert, unlock. ``Ledger`` follows what each tier should hold: the device copy
of a page is what the engine wrote (or what a load brought back from the
host), the host copy is what the device held when the backup started. Every
check is bit for bit (``torch.equal``); reusing cached KV must give the same
greedy tokens as a cache-free run, with logits within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.bindings.residency import LOADING
from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.model import TinyModel
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool

PAGE = 4
MODEL = TinyModel(layers=3, heads=2, head_dim=8, vocab=64, seed=7)


class Ledger:
    """Expected KV per page (keyed by the tokens up to the page's end), per tier."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.device: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.host: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        cache.add_observer(self._on_event)

    def keys(self, node) -> list[tuple]:
        prefix = self.cache.tree.prefix_tokens(node)
        start = len(prefix) - node.num_tokens
        return [(node.namespace, prefix[: end + PAGE]) for end in range(start, len(prefix), PAGE)]

    def _on_event(self, e: dict) -> None:
        if e["event"] != "transition":
            return
        node = self.cache.tree.get(e["node"])
        if node is None:
            return
        if e["trigger"] == "backup":
            for key in self.keys(node):
                self.host[key] = self.device[key]
        elif e["trigger"] == "load":
            for key in self.keys(node):
                self.device[key] = self.host[key]

    def wrote(self, tokens, namespace, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The engine wrote KV for tokens[start:start + k.shape[1]] (page aligned)."""
        for i in range(0, k.shape[1], PAGE):
            end = start + i + PAGE
            self.device[(namespace, tuple(tokens[:end]))] = (k[:, i : i + PAGE].clone(), v[:, i : i + PAGE].clone())

    def expected(self, tier: dict, tokens, namespace, n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected KV of tokens[start:n] in one tier."""
        parts = [tier[(namespace, tuple(tokens[: end + PAGE]))] for end in range(start, n, PAGE)]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


class Engine:
    def __init__(self, layout: str, policy: str = "write_through", device_pages: int = 12, host_pages: int = 24,
                 model: TinyModel = MODEL) -> None:
        self.model = model
        shape = model.kv_shape
        self.dev = DeviceKVPool(shape, device_pages * PAGE, PAGE, "cpu")
        self.host = HostKVPool(shape, host_pages * PAGE, PAGE, layout, pin_memory=False)
        self.cache = HiCache(self.dev, self.host, CacheConfig(write_policy=policy),
                             TorchExecutor(self.dev, self.host))
        self.ledger = Ledger(self.cache)

    def prefix_kv(self, tokens, namespace=None):
        """Match + load back + lock; read the cached prefix layer by layer after each layer's wait."""
        cache = self.cache
        m = cache.match_prefix(tokens, namespace)
        lb = cache.load_back(m.last_host_node)
        node = lb.last_node if lb is not None else m.last_device_node
        cache.lock(node)
        idx = torch.cat([m.device_indices, lb.device_indices]) if lb is not None else m.device_indices
        ks, vs = [], []
        for layer in range(self.model.layers):
            m.wait(layer)
            if lb is not None:
                lb.wait(layer)
            ks.append(self.dev.k[layer, idx])
            vs.append(self.dev.v[layer, idx])
        return node, idx, torch.stack(ks), torch.stack(vs)

    def serve(self, tokens, namespace=None):
        """One request: returns the logits of its last token computed with the cached prefix."""
        tokens = tuple(tokens)
        cache = self.cache
        node, idx, pk, pv = self.prefix_kv(tokens, namespace)
        try:
            n_pre = idx.numel()
            n_use = min(n_pre, len(tokens) - 1)  # at least one token is computed, for its logits
            logits, k, v = self.model.prefill(tokens[n_use:], pk[:, :n_use], pv[:, :n_use])
            aligned = len(tokens) - len(tokens) % PAGE
            if aligned > n_pre:
                new_k, new_v = k[:, n_pre - n_use : aligned - n_use], v[:, n_pre - n_use : aligned - n_use]
                fresh = cache.alloc_device(aligned - n_pre)
                if fresh is not None:
                    self.dev.write(fresh, None, new_k, new_v)
                    self.ledger.wrote(tokens, namespace, n_pre, new_k, new_v)
                    cache.insert(tokens[:aligned], torch.cat([idx, fresh]), namespace)
            return logits
        finally:
            cache.unlock(node)
            cache.poll()

    def settle(self) -> None:
        for _ in range(2):
            self.cache.poll()
        assert not self.cache.pending_job_ids()

    def check(self, tokens, namespace=None) -> int:
        """Every tier's copy of the cached prefix of ``tokens`` equals what the ledger says; returns its length."""
        self.settle()
        cache, ledger = self.cache, self.ledger
        m = cache.match_prefix(tokens, namespace)
        self.settle()  # the match may have started a backup (write_through_selective)
        node = m.last_host_node
        if node.is_root:
            return 0
        path = list(reversed(list(cache.tree.path_to_root(node))))
        pos = 0
        for n in path:
            size = n.num_tokens
            assert n.state not in LOADING
            if n.device_indices is not None:
                k, v = self.dev.read(n.device_indices)
                ek, ev = ledger.expected(ledger.device, tokens, namespace, pos + size, pos)
                assert torch.equal(k, ek) and torch.equal(v, ev), f"device copy of node {n.id}"
            if n.host_indices is not None:
                k, v = self.host.read(n.host_indices)
                ek, ev = ledger.expected(ledger.host, tokens, namespace, pos + size, pos)
                assert torch.equal(k, ek) and torch.equal(v, ev), f"host copy of node {n.id}"
            pos += size
        cache.check_invariants()
        return pos


def reference_logits(tokens) -> torch.Tensor:
    return MODEL.prefill(tuple(tokens))[0]


def prompts(seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    heads = [tuple(torch.randint(1, 64, (n,), generator=g).tolist()) for n in (8, 12)]
    out = []
    for i in range(6):
        tail = tuple(torch.randint(1, 64, (4 + 3 * i,), generator=g).tolist())
        out.append(heads[i % 2] + tail)
    return out


PROMPTS = prompts()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_host_is_bit_exact(layout):
    eng = Engine(layout)
    tokens = PROMPTS[2][:16]
    eng.serve(tokens)
    eng.settle()
    written = eng.ledger.expected(eng.ledger.device, tokens, None, 16)
    assert eng.cache.evict(100) == 16
    node, idx, pk, pv = eng.prefix_kv(tokens)  # loaded back from the host
    eng.cache.unlock(node)
    assert torch.equal(pk, written[0]) and torch.equal(pv, written[1])
    assert eng.check(tokens) == 16


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_generation_with_cached_prefix_matches_a_cache_free_run(layout, policy):
    eng = Engine(layout, policy)
    for tokens in PROMPTS:
        eng.serve(tokens)
    eng.cache.evict(24)  # part of the tree goes to the host
    eng.settle()
    for tokens in PROMPTS:
        logits = eng.serve(tokens)
        assert torch.allclose(logits, reference_logits(tokens), atol=1e-5, rtol=0)
        eng.check(tokens)
        node, idx, pk, pv = eng.prefix_kv(tokens)
        try:
            assert idx.numel() > 0
            cached = MODEL.generate(tokens, 6, past_kv=(pk, pv))
        finally:
            eng.cache.unlock(node)
        assert cached == MODEL.generate(tokens, 6)


op_st = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, len(PROMPTS) - 1), st.integers(8, 40)),
    st.tuples(st.just("evict"), st.integers(1, 12)),
    st.tuples(st.just("evict_host"), st.integers(1, 12)),
    st.tuples(st.just("backup"), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("poll")),
)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=14),
       policy=st.sampled_from(["write_through", "write_through_selective", "write_back", "write_behind"]))
def test_any_sequence_of_operations_keeps_kv_bit_exact(layout, ops, policy):
    eng = Engine(layout, policy, device_pages=10, host_pages=14)
    cache = eng.cache
    for op in ops:
        if op[0] == "serve":
            tokens = PROMPTS[op[1]][: op[2]]
            logits = eng.serve(tokens)
            assert torch.allclose(logits, reference_logits(tokens), atol=1e-5, rtol=0)
        elif op[0] == "evict":
            cache.evict(op[1] * PAGE)
        elif op[0] == "evict_host":
            cache.evict_host(op[1] * PAGE)
        elif op[0] == "backup":
            path = cache.tree.walk(PROMPTS[op[1]])[0]
            for node in path:
                if node.state == "device":
                    cache.write_backup(node)
        else:
            cache.poll()
        cache.check_invariants()
    for tokens in PROMPTS:
        eng.check(tokens)


def test_namespaces_keep_separate_kv():
    eng = Engine("page_first")
    tokens = PROMPTS[3][:16]
    eng.serve(tokens, namespace="a")
    assert eng.cache.match_prefix(tokens, "b").device_hit_length == 0
    eng.serve(tokens, namespace="b")
    assert eng.check(tokens, "a") == 16 and eng.check(tokens, "b") == 16
