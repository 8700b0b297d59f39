"""TinyModel: determinism, KV shapes, and cached reuse (also through the pools)."""

from __future__ import annotations

import pytest
import torch

from hicache_fsm.copy import backup_to_host, load_all_layers
from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.model import TinyModel
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape


def prompt(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_deterministic_weights_and_outputs():
    a, b = TinyModel(seed=3), TinyModel(seed=3)
    toks = prompt(40)
    la, ka, va = a.prefill(toks)
    lb, kb, vb = b.prefill(toks)
    assert torch.equal(la, lb) and torch.equal(ka, kb) and torch.equal(va, vb)
    assert a.generate(toks, 8) == b.generate(toks, 8)
    lc, _, _ = TinyModel(seed=4).prefill(toks)
    assert not torch.equal(la, lc)


def test_shapes_and_kv_shape():
    m = TinyModel(layers=3, heads=2, head_dim=8, vocab=64)
    logits, k, v = m.prefill(prompt(10, vocab=64))
    assert logits.shape == (64,)
    assert k.shape == (3, 10, 2, 8) and v.shape == (3, 10, 2, 8)
    assert m.kv_shape == KVShape(3, 2, 8, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_prefill_matches_fresh(dtype):
    m = TinyModel(dtype=dtype)
    toks = prompt(96, seed=1)
    full_logits, full_k, full_v = m.prefill(toks)
    _, k1, v1 = m.prefill(toks[:64])
    logits, k2, v2 = m.prefill(toks[64:], k1, v1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert torch.allclose(logits, full_logits, **tol)
    assert torch.allclose(torch.cat([k1, k2], 1), full_k, **tol)
    assert torch.allclose(torch.cat([v1, v2], 1), full_v, **tol)


def test_cached_generate_equals_fresh():
    m = TinyModel()
    toks = prompt(70, seed=2)
    fresh = m.generate(toks, 12)
    assert len(fresh) == 12
    for n_past in (1, 32, 69, 70):
        _, k, v = m.prefill(toks[:n_past])
        assert m.generate(toks, 12, past_kv=(k, v)) == fresh


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_generate_from_kv_moved_through_the_pools(layout):
    m = TinyModel()
    ps = 8
    toks = prompt(64, seed=3)
    fresh = m.generate(toks, 10)
    _, k, v = m.prefill(toks)
    dev = DeviceKVPool(m.kv_shape, 128, ps, device="cpu")
    host = HostKVPool(m.kv_shape, 256, ps, layout)
    d_idx = dev.allocator.alloc(64)
    dev.write(d_idx, None, k, v)
    h_idx = host.allocator.alloc(64).view(-1, ps).flip(0).reshape(-1)  # host pages in reverse order
    backup_to_host(dev, host, d_idx, h_idx)
    dev.allocator.free(d_idx)
    dev.kv.zero_()
    dev.allocator.alloc(16)  # churn so the load lands on other slots
    back = dev.allocator.alloc(64)
    load_all_layers(dev, host, h_idx, back)
    ck, cv = dev.read(back)
    assert torch.equal(ck, k) and torch.equal(cv, v)
    assert m.generate(toks, 10, past_kv=(ck, cv)) == fresh


def test_errors():
    m = TinyModel(vocab=16)
    with pytest.raises(BadIndices):
        m.prefill([])
    with pytest.raises(BadIndices):
        m.prefill([16])
    with pytest.raises(BadIndices):
        m.prefill([1, 2], torch.zeros(4, 3, 2, 16), None)
    with pytest.raises(BadIndices):
        m.prefill([1, 2], torch.zeros(3, 3, 2, 16), torch.zeros(3, 3, 2, 16))
    with pytest.raises(BadIndices):
        m.generate([1, 2], 3, past_kv=(torch.zeros(4, 3, 2, 16), torch.zeros(4, 3, 2, 16)))
    with pytest.raises(ConfigError):
        TinyModel(head_dim=15)
    with pytest.raises(ConfigError):
        TinyModel(layers=0)



@pytest.mark.parametrize("tokens", [[1.5], [1, 2.0], "abc", [torch.tensor(1.0)], [None]])
def test_token_ids_that_are_not_integers_are_refused_not_truncated(tokens):
    with pytest.raises(BadIndices, match="integers"):
        TinyModel(vocab=16).prefill(tokens)


def test_integer_scalars_of_numpy_and_torch_are_token_ids():
    import numpy as np

    m = TinyModel(vocab=16)
    expected = m.prefill([3, 4])[1]
    assert torch.equal(m.prefill(np.array([3, 4]))[1], expected)
    assert torch.equal(m.prefill(torch.tensor([3, 4]))[1], expected)


def test_a_device_the_model_cannot_run_on_is_refused():
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
        TinyModel(device="tpu")
