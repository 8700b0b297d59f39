"""``match_prefix`` gives one answer whatever form the ids come in, and its hit counters add up.

Tuples and lists go straight to the packer, tensors through numpy and a
``TokenIds`` is used as it is; each call counts every whole-page token once,
as a device hit, a host hit or a miss.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, put
from hicache_fsm.config import CacheConfig
from hicache_fsm.tokens import pack_token_ids

PAGE = 2
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=9 * PAGE + 1)

FORMS = {
    "tuple": tuple,
    "list": list,
    "packed": pack_token_ids,
    "tensor": lambda t: torch.tensor(t, dtype=torch.int64),
    "array": lambda t: np.asarray(t, dtype=np.uint32),
}


def _summary(m) -> tuple:
    return (m.device_indices.tolist(), m.last_device_node.id, m.last_host_node.id, m.host_hit_length)


@settings(max_examples=60, deadline=None)
@given(stored=st.lists(tokens_st, max_size=6), evict_pages=st.integers(0, 6), query=tokens_st,
       policy=st.sampled_from(["write_through", "write_back"]))
def test_every_form_matches_alike_and_counters_add_up(stored, evict_pages, query, policy):
    cache, ex = make_cache(page=PAGE, device_pages=10, host_pages=24, config=CacheConfig(write_policy=policy))
    for t in stored:
        put(cache, t[: len(t) - len(t) % PAGE])
        drain(cache, ex)
    cache.evict(evict_pages * PAGE)
    drain(cache, ex)
    cache.match_prefix(tuple(query))  # splits a node the query matches in part: later calls see the same tree
    answers = {}
    for name, form in FORMS.items():
        before = dict(cache.counters)
        m = cache.match_prefix(form(query))
        delta = {k: cache.counters[k] - before.get(k, 0)
                 for k in ("match_requests", "device_hit_tokens", "host_hit_tokens", "miss_tokens")}
        assert delta["match_requests"] == 1
        assert delta["device_hit_tokens"] == m.device_indices.numel()
        assert delta["host_hit_tokens"] == m.host_hit_length
        assert delta["device_hit_tokens"] + delta["host_hit_tokens"] + delta["miss_tokens"] == (
            len(query) - len(query) % PAGE)
        answers[name] = _summary(m)
    assert len(set(map(repr, answers.values()))) == 1, answers
    cache.check_invariants()
