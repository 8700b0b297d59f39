"""The Hugging Face Llama behind the KVModel interface, and `simulate --model llama` end to end.

Needs the `llama` extra (transformers); each test that builds the model skips
without it. The test of the message printed without transformers runs always.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from hicache_fsm.cli import main
from hicache_fsm.copy import backup_to_host, load_all_layers
from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.simulate import INFINITE, Options, Tier, Workload, build_model, reference_run, run_simulation
from hicache_fsm.simulate_engine import ChatEngine

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs the llama extra (transformers); .ci/run installs it")

SMALL_ARGS = ["--clients", "3", "--rounds", "3", "--request-length", "32", "--output-length", "8",
              "--system-prompt-length", "32", "--page-size", "8", "--device-tokens", "160", "--host-tokens", "256",
              "--device", "cpu", "--no-progress", "--json"]


def prompt(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the llama extra (transformers); .ci/run installs it")
    from hicache_fsm.llama_model import LlamaModel

    torch.set_num_threads(1)
    return LlamaModel(layers=3, heads=4, kv_heads=2, head_dim=8, vocab=64, seed=5, dtype=torch.float64)


def test_grouped_query_attention_and_rotary_are_really_used(llama):
    cfg = llama.hf.config
    assert cfg.num_key_value_heads == 2 < cfg.num_attention_heads == 4
    attn = llama.hf.model.layers[0].self_attn
    assert attn.k_proj.out_features == 2 * 8 < attn.q_proj.out_features == 4 * 8
    assert llama.kv_shape == KVShape(3, 2, 8, torch.float64)
    _, k, v = llama.prefill(prompt(12, vocab=64))
    assert k.shape == v.shape == (3, 12, 2, 8)  # the cache holds the KV heads, not the query heads
    # Rotary: layer 0's key of a token depends on the token and its position only, and moving the
    # token rotates it (same norm per head), while its value does not move at all.
    _, k_a, v_a = llama.prefill([7, 9, 9, 9, 9, 9])
    assert not torch.allclose(k_a[0, 1], k_a[0, 5])
    assert torch.allclose(k_a[0, 1].norm(dim=-1), k_a[0, 5].norm(dim=-1), rtol=1e-6)  # cos/sin in float32
    assert torch.allclose(v_a[0, 1], v_a[0, 5], rtol=1e-12, atol=1e-12)


def test_weights_are_seeded_and_leave_the_global_generator_alone(llama):
    from hicache_fsm.llama_model import LlamaModel

    state = torch.get_rng_state()
    again = LlamaModel(layers=3, heads=4, kv_heads=2, head_dim=8, vocab=64, seed=5, dtype=torch.float64)
    assert torch.equal(torch.get_rng_state(), state)
    other = LlamaModel(layers=3, heads=4, kv_heads=2, head_dim=8, vocab=64, seed=6, dtype=torch.float64)
    toks = prompt(20, vocab=64)
    la, ka, _ = llama.prefill(toks)
    lb, kb, _ = again.prefill(toks)
    assert torch.equal(la, lb) and torch.equal(ka, kb)
    assert not torch.equal(la, other.prefill(toks)[0])
    assert llama.name != other.name


def test_prefill_after_a_past_matches_one_piece(llama):
    toks = prompt(50, seed=1, vocab=64)
    logits, k, v = llama.prefill(toks)
    _, k1, v1 = llama.prefill(toks[:29])
    logits2, k2, v2 = llama.prefill(toks[29:], k1, v1)
    tol = dict(rtol=1e-12, atol=1e-12)
    assert torch.allclose(logits2, logits, **tol)
    assert torch.allclose(torch.cat([k1, k2], 1), k, **tol) and torch.allclose(torch.cat([v1, v2], 1), v, **tol)


def test_generate_agrees_with_transformers_and_with_any_cached_prefix(llama):
    toks = prompt(40, seed=2, vocab=64)
    fresh = llama.generate(toks, 10)
    with torch.inference_mode():
        hf = llama.hf.generate(torch.tensor([toks]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert hf[0, len(toks):].tolist() == fresh  # our decode loop is transformers' greedy search
    _, k, v = llama.prefill(toks)
    for n_past in (1, 16, 39, 40):
        assert llama.generate(toks, 10, past_kv=(k[:, :n_past], v[:, :n_past])) == fresh


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_generate_from_kv_moved_through_the_pools(llama, layout):
    ps = 8
    toks = prompt(32, seed=3, vocab=64)
    fresh = llama.generate(toks, 6)
    _, k, v = llama.prefill(toks)
    dev = DeviceKVPool(llama.kv_shape, 64, ps, device="cpu")
    host = HostKVPool(llama.kv_shape, 64, ps, layout)
    d_idx = dev.allocator.alloc(32)
    dev.write(d_idx, None, k, v)
    h_idx = host.allocator.alloc(32).view(-1, ps).flip(0).reshape(-1)
    backup_to_host(dev, host, d_idx, h_idx)
    dev.allocator.free(d_idx)
    dev.kv.zero_()
    back = dev.allocator.alloc(32)
    load_all_layers(dev, host, h_idx, back)
    ck, cv = dev.read(back)
    assert torch.equal(ck, k) and torch.equal(cv, v)
    assert llama.generate(toks, 6, past_kv=(ck, cv)) == fresh


def test_bad_input(llama):
    from hicache_fsm.llama_model import LlamaModel

    with pytest.raises(ConfigError, match="multiple of kv_heads"):
        LlamaModel(heads=3, kv_heads=2)
    with pytest.raises(ConfigError):
        LlamaModel(head_dim=7)
    with pytest.raises(BadIndices):
        llama.prefill([64])
    with pytest.raises(BadIndices):
        llama.prefill([])
    _, k, v = llama.prefill([1, 2, 3])
    with pytest.raises(BadIndices, match="heads=2"):
        llama.prefill([4], k[:, :, :1], v[:, :, :1])
    with pytest.raises(BadIndices):
        llama.generate([1, 2], 3, past_kv=(k, v))  # the past covers more than the prompt


@needs_transformers
def test_the_kv_check_catches_corruption_with_llama():
    w = Workload(clients=2, rounds=2, request_length=16, output_length=4, system_prompt_length=16)
    model = build_model(Options(w, 256, 512, page_size=8, device="cpu", model="llama"), "cpu")
    ref = reference_run(model, w)
    engine = ChatEngine(Tier("t", 256, 512), w, model, 8, "page_first", "cpu")
    try:
        schedule = w.schedule()
        for key in schedule[:2]:
            engine.serve(ref.prompts[key], ref.outputs[key])
        assert engine.result.kv_mismatches == 0 and engine.result.output_mismatches == 0
        assert engine.pool.kv.dtype == torch.float64
        engine.pool.kv.add_(1.0)
        engine.serve(ref.prompts[schedule[2]], ref.outputs[schedule[2]])
        assert engine.result.kv_mismatches > 0
    finally:
        engine.cache.close()


@needs_transformers
def test_simulate_model_llama_end_to_end(capsys, tmp_path):
    rc = main(["simulate", "--model", "llama", "--storage-url", f"file://{tmp_path}/l3", *SMALL_ARGS])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["model"] == "llama" and out["model_name"].startswith("llama-4L-4q2kv")
    assert out["kv_mismatches"] == 0 and out["output_mismatches"] == 0
    configs = out["configs"]
    assert "device+host+storage" in configs
    for name, c in configs.items():
        assert c["kv_mismatches"] == 0 and c["output_mismatches"] == 0, name
        assert c["kv_checked_pages"] > 0 and c["output_tokens"] == 9 * 8, name
    assert out["hit_rate"] >= 0.95 * configs[INFINITE]["hit_rate"]


def test_llama_without_transformers_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "hicache_fsm.llama_model", raising=False)
    rc = main(["simulate", "--model", "llama", "--storage-url", f"file://{tmp_path}/l3", *SMALL_ARGS])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "transformers" in err[0] and "pip install" in err[0]


@needs_transformers
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_simulate_model_llama_on_cuda(tmp_path):
    """Model and device pool on CUDA: the past goes from the pool to the model without leaving the device."""
    w = Workload(clients=3, rounds=3, request_length=32, output_length=8, system_prompt_length=32)
    sim = run_simulation(Options(w, 160, 256, f"file://{tmp_path}/l3", page_size=8, device="cuda", model="llama"))
    assert sim.device == "cuda" and sim.model == "llama"
    assert sim.kv_mismatches == 0 and sim.output_mismatches == 0
    assert sum(t.kv_checked_pages for t in sim.tiers) > 0
