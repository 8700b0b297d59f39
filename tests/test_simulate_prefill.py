"""simulate's prefill figures: the model runs only the uncached suffix, and its work falls with reuse.

Work is counted, never timed: tokens the model embeds (a forward hook on the
Llama's embedding) and the FLOPs of ``KVModel.prefill_flops``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_fsm.model import TinyModel, decoder_flops
from hicache_fsm.simulate import DEVICE, FULL, Options, Workload, build_model, reference_run, run_tier
from hicache_fsm.simulate_results import TierResult

WORKLOAD = Workload(clients=3, rounds=3, request_length=32, output_length=8, system_prompt_length=64)
# Counted prefill work of the hierarchy over device only's may exceed the ratio of tokens computed by
# at most this factor: every computed token still attends to the reused past (the linear part, most of
# the work, falls exactly with the tokens).
WORK_TOLERANCE = 1.25


@given(st.integers(1, 300), st.integers(1, 300), st.integers(0, 300))
def test_prefill_flops_add_up_over_a_split_prompt(a, b, past):
    """Prefill of a+b tokens in one piece = the two pieces (less the one extra LM head), for both models."""
    head = 7
    whole = decoder_flops(a + b, past, 100, 3, head)
    assert whole == decoder_flops(a, past, 100, 3, head) + decoder_flops(b, past + a, 100, 3, head) - 2 * head
    model = TinyModel(2, 2, 8, vocab=16)
    assert model.prefill_flops(a, past) < model.prefill_flops(a, past + 1)  # attention to the past counts


def _serve(model: str, tmp_path) -> dict[str, TierResult]:
    options = Options(WORKLOAD, device_tokens=256, host_tokens=512, page_size=8, device="cpu", model=model)
    m = build_model(options, "cpu")
    reference = reference_run(m, WORKLOAD)
    tiers = {t.name: t for t in options.tiers(f"file://{tmp_path}/l3")}
    return {name: run_tier(tiers[name], WORKLOAD, reference, m, options.page_size, device="cpu", settle_storage=True)
            for name in (DEVICE, FULL)}  # settled storage: what is reused does not depend on the threads' speed


def _check_proportion(results: dict[str, TierResult]) -> None:
    dev, full = results[DEVICE], results[FULL]
    for r in (dev, full):
        assert r.reused_tokens + r.computed_tokens == r.prompt_tokens
        assert len(r.ttft_s) == r.requests
        assert r.prefill_s > 0 and r.decode_s > 0
    assert full.computed_tokens < dev.computed_tokens  # the hierarchy does serve more from cache
    tokens = full.computed_tokens / dev.computed_tokens
    work = full.prefill_flops / dev.prefill_flops
    assert tokens <= work <= tokens * WORK_TOLERANCE


def test_tiny_prefill_work_falls_with_tokens_reused(tmp_path):
    torch.set_num_threads(1)
    _check_proportion(_serve("tiny", tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the llama extra")
def test_llama_runs_only_the_uncached_suffix(tmp_path):
    """Every token the Llama embeds is an uncached prompt token or a decode step: no prefill over the past."""
    torch.set_num_threads(1)
    model = build_model(Options(WORKLOAD, device_tokens=256, host_tokens=512, page_size=8, model="llama"), "cpu")
    embedded = [0]
    model.hf.get_input_embeddings().register_forward_hook(
        lambda module, args, out: embedded.__setitem__(0, embedded[0] + args[0].numel()))
    reference = reference_run(model, WORKLOAD)
    options = Options(WORKLOAD, device_tokens=256, host_tokens=512, page_size=8, model="llama")
    tiers = {t.name: t for t in options.tiers(f"file://{tmp_path}/l3")}
    results = {}
    for name in (DEVICE, FULL):
        embedded[0] = 0
        r = results[name] = run_tier(tiers[name], WORKLOAD, reference, model, 8, device="cpu", settle_storage=True)
        decode_steps = r.output_tokens - r.requests  # the last answer token is never run
        assert embedded[0] == r.computed_tokens + decode_steps
    _check_proportion(results)
