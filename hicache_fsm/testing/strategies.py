"""Hypothesis strategies for prefix caches: prompts, workloads and fault schedules.

Prompts are drawn as lists of *page ids* over a small alphabet, so that
independently drawn prompts share prefixes (and split each other's radix
nodes) often; ``pages_to_tokens`` turns page ids into token ids for any page
size (page ``p`` becomes ``page_size`` copies of token ``p + 1``).

- ``prompt_pages`` / ``token_sequences``: one prompt, or a family sharing a prefix;
- ``multi_turn_workloads``: sessions whose every turn extends the previous
  turn's prompt, interleaved across sessions like a serving engine sees them;
- ``fault_schedules``: which jobs fail (by submission order), in which order
  acknowledgements arrive, and which storage calls raise or time out, when.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from hicache_fsm.testing.adapter import StorageFault

__all__ = [
    "FaultSchedule",
    "Request",
    "Workload",
    "fault_schedules",
    "multi_turn_workloads",
    "pages_to_tokens",
    "prefix_families",
    "prompt_pages",
    "storage_faults",
    "token_sequences",
]


def pages_to_tokens(pages: Sequence[int], page_size: int = 1) -> tuple[int, ...]:
    """Token ids of a prompt given as page ids (page ``p`` -> ``page_size`` copies of ``p + 1``)."""
    return tuple(t for p in pages for t in (p + 1,) * page_size)


def prompt_pages(alphabet: int = 3, min_pages: int = 1, max_pages: int = 4) -> st.SearchStrategy[list[int]]:
    """Page ids of one prompt; a small alphabet makes prompts share prefixes."""
    return st.lists(st.integers(0, alphabet - 1), min_size=min_pages, max_size=max_pages)


def token_sequences(page_size: int = 1, alphabet: int = 3, min_pages: int = 1,
                    max_pages: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    return prompt_pages(alphabet, min_pages, max_pages).map(lambda p: pages_to_tokens(p, page_size))


@st.composite
def prefix_families(draw, page_size: int = 1, alphabet: int = 3, max_prefix: int = 3, max_suffix: int = 3,
                    max_members: int = 4) -> list[tuple[int, ...]]:
    """A few prompts that all start with one drawn prefix (a system prompt, a few-shot header)."""
    prefix = draw(prompt_pages(alphabet, 0, max_prefix))
    tails = draw(st.lists(prompt_pages(alphabet, 1, max_suffix), min_size=1, max_size=max_members))
    return [pages_to_tokens(prefix + t, page_size) for t in tails]


@attrs.frozen
class Request:
    """One scheduled request: its session and the whole prompt (history included)."""

    session: int
    tokens: tuple[int, ...]
    turn: int = 0


@attrs.frozen
class Workload:
    requests: tuple[Request, ...]

    @property
    def prompts(self) -> list[tuple[int, ...]]:
        return list(dict.fromkeys(r.tokens for r in self.requests))


@st.composite
def multi_turn_workloads(draw, page_size: int = 1, alphabet: int = 3, max_sessions: int = 3, max_turns: int = 4,
                         max_turn_pages: int = 2, shared_system_prompt: bool | None = None) -> Workload:
    """Sessions of growing prompts, interleaved: turn ``t`` of a session extends turn ``t - 1``."""
    sessions = draw(st.integers(1, max_sessions))
    shared = draw(st.booleans()) if shared_system_prompt is None else shared_system_prompt
    system = draw(prompt_pages(alphabet, 0, 2)) if shared else []
    turns = []
    for s in range(sessions):
        history = list(system) if shared else draw(prompt_pages(alphabet, 0, 2))
        mine = []
        for t in range(draw(st.integers(1, max_turns))):
            history = history + draw(prompt_pages(alphabet, 1, max_turn_pages))
            mine.append(Request(s, pages_to_tokens(history, page_size), t))
        turns.append(mine)
    order = draw(st.permutations([s for s, mine in enumerate(turns) for _ in mine]))
    cursor = [0] * sessions
    requests = []
    for s in order:
        requests.append(turns[s][cursor[s]])
        cursor[s] += 1
    return Workload(tuple(requests))


@attrs.frozen
class FaultSchedule:
    """When things go wrong.

    ``fail_jobs``: ordinals (0-based, in submission order) of jobs that fail;
    ``ack_order``: ``fifo``, ``lifo`` or ``shuffle`` (with ``shuffle_seed``)
    for the order in which pending jobs are acknowledged; ``ack_every``: how
    many requests run between acknowledgement rounds; ``storage``: storage
    faults in the order they are armed.
    """

    fail_jobs: frozenset[int] = frozenset()
    ack_order: str = "fifo"
    shuffle_seed: int = 0
    ack_every: int = 1
    storage: tuple[StorageFault, ...] = ()


def storage_faults(max_after: int = 8) -> st.SearchStrategy[StorageFault]:
    return st.builds(
        StorageFault,
        kind=st.sampled_from(["raise", "timeout", "short", "corrupt"]),
        call=st.sampled_from(["get", "set", "exists", "any"]),
        after=st.integers(0, max_after),
        count=st.integers(1, 3),
    )


def fault_schedules(max_jobs: int = 40, max_storage_faults: int = 2) -> st.SearchStrategy[FaultSchedule]:
    return st.builds(
        FaultSchedule,
        fail_jobs=st.frozensets(st.integers(0, max_jobs - 1), max_size=max_jobs // 4),
        ack_order=st.sampled_from(["fifo", "lifo", "shuffle"]),
        shuffle_seed=st.integers(0, 2**16),
        ack_every=st.integers(1, 3),
        storage=st.lists(storage_faults(), max_size=max_storage_faults).map(tuple),
    )
