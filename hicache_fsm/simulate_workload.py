"""The chat workload of ``simulate``: who asks what, in which order, and the cache-free answers.

The shape of SGLang's multi-turn benchmark: ``clients`` conversations of
``rounds`` turns each. A request is the shared system prompt, then the client's
history (every earlier user turn and answer), then a new user turn of
``request_length`` tokens; the answer is ``output_length`` greedy tokens of the
model, appended to the history.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import attrs

from hicache_fsm.config import check_positive_int
from hicache_fsm.errors import ConfigError
from hicache_fsm.model import KVModel

ARRIVALS = ("round-robin", "random")


@attrs.frozen
class Workload:
    """The requests: who asks what, in which order (token ids only)."""

    clients: int = 8
    rounds: int = 4
    request_length: int = 128
    output_length: int = 32
    system_prompt_length: int = 256
    arrival: str = "round-robin"
    seed: int = 0
    vocab: int = 256

    def __attrs_post_init__(self) -> None:
        check_positive_int("clients", self.clients)
        check_positive_int("rounds", self.rounds)
        check_positive_int("request_length", self.request_length)
        check_positive_int("output_length", self.output_length)
        check_positive_int("system_prompt_length", self.system_prompt_length, 0)
        check_positive_int("vocab", self.vocab, 2)
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")

    @property
    def requests(self) -> int:
        return self.clients * self.rounds

    def _tokens(self, n: int, *salt: int) -> list[int]:
        rng = random.Random(":".join(map(str, (self.seed, *salt))))
        return [rng.randrange(self.vocab) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._tokens(self.system_prompt_length, -1)

    def user_turn(self, client: int, round_: int) -> list[int]:
        return self._tokens(self.request_length, client, round_)

    def schedule(self) -> list[tuple[int, int]]:
        """(client, round) in arrival order; a client's rounds always come in order."""
        if self.arrival == "round-robin":
            return [(c, r) for r in range(self.rounds) for c in range(self.clients)]
        rng = random.Random(f"{self.seed}:arrival")
        done = [0] * self.clients
        out = []
        while len(out) < self.requests:
            c = rng.choice([c for c in range(self.clients) if done[c] < self.rounds])
            out.append((c, done[c]))
            done[c] += 1
        return out

    def max_tokens(self) -> int:
        """Tokens of every client's full history (what an infinite cache holds at most)."""
        per_client = self.rounds * (self.request_length + self.output_length)
        return self.system_prompt_length + self.clients * per_client


@attrs.frozen
class Reference:
    """The cache-free run: each request's prompt and greedy answer."""

    prompts: dict[tuple[int, int], tuple[int, ...]]
    outputs: dict[tuple[int, int], tuple[int, ...]]
    prompt_tokens: int
    seconds: float


def reference_run(model: KVModel, workload: Workload, on_request: Callable[[], None] = lambda: None) -> Reference:
    """Run every request from scratch (no cache) and keep prompts and answers."""
    start = time.perf_counter()
    system = workload.system_prompt()
    history = {c: list(system) for c in range(workload.clients)}
    prompts, outputs = {}, {}
    total = 0
    for c, r in workload.schedule():
        prompt = history[c] + workload.user_turn(c, r)
        out = model.generate(prompt, workload.output_length)
        prompts[(c, r)] = tuple(prompt)
        outputs[(c, r)] = tuple(out)
        total += len(prompt)
        history[c] = prompt + out
        on_request()
    return Reference(prompts, outputs, total, time.perf_counter() - start)


def token_stream(workload: Workload, outputs: dict[tuple[int, int], Sequence[int]]) -> Reference:
    """The prompts a given set of answers leads to (no model needed)."""
    system = workload.system_prompt()
    history = {c: list(system) for c in range(workload.clients)}
    prompts = {}
    total = 0
    for c, r in workload.schedule():
        prompt = history[c] + workload.user_turn(c, r)
        prompts[(c, r)] = tuple(prompt)
        total += len(prompt)
        history[c] = prompt + list(outputs[(c, r)])
    return Reference(prompts, dict(outputs), total, 0.0)


__all__ = ["ARRIVALS", "Reference", "Workload", "check_positive_int", "reference_run", "token_stream"]
