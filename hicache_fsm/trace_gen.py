"""Generate a synthetic multi-turn trace in the Mooncake format (deterministic for a seed).

Conversations open ``sessions`` at a time; each begins with one of
``system_prompts`` shared system prompts (a Zipf-popular few), then alternates
a new user turn and an answer. Every request's input is the system prompt, the
whole history and the new user turn; a conversation ends after its drawn number
of turns (uniform in 1 .. 2 * turns - 1) and a new one takes its place. Lengths
are uniform in [mean / 2, 3 * mean / 2]; arrivals are Poisson at ``rate``
requests per second.

Hash ids follow the format's rule: a block's id names its tokens and its whole
prefix, so a block is keyed by its parent's id and the pieces of content
(which system prompt, turn or answer, from where to where) it holds, and ids
are handed out as consecutive integers in order of first appearance. A
partial last block that a later turn fills gets a new id then, as in the
public traces.

    python -m hicache_fsm.trace_gen -o trace.jsonl --requests 300 --seed 0
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
from pathlib import Path
from typing import Iterator, TextIO

import attrs

from hicache_fsm.errors import ConfigError
from hicache_fsm.output_files import open_output_text
from hicache_fsm.trace import DEFAULT_BLOCK_SIZE, MAX_TIMESTAMP_MS, check_block_size, check_tokens

MAX_OPEN = 1 << 16  # sessions open at once, and distinct system prompts: all are made before the first request


def _at_least(minimum: int, maximum: int | None = None):
    def check(instance, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{attribute.name} must be at most {maximum}, got {value}")
    return check


def _loadable_tokens(instance, attribute, value) -> None:
    """A length no trace reader could hold (``load_trace`` refuses it) is refused before it is written."""
    check_tokens(value, attribute.name)


def _positive_rate(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} must be a number > 0, got {value!r}")


SPAN_HEADROOM = 1000  # a sum of exponential arrivals never comes near 1000 x its mean


@attrs.frozen
class TraceShape:
    """What the generated trace looks like (means of the drawn lengths, in tokens)."""

    requests: int = attrs.field(default=300, validator=_at_least(1))
    sessions: int = attrs.field(default=24, validator=_at_least(1, MAX_OPEN))
    turns: int = attrs.field(default=5, validator=_at_least(1))
    system_prompts: int = attrs.field(default=4, validator=_at_least(1, MAX_OPEN))
    system_length: int = attrs.field(default=1024, validator=_at_least(0))
    user_length: int = attrs.field(default=384, validator=_at_least(2))
    output_length: int = attrs.field(default=192, validator=[_at_least(2), _loadable_tokens])
    max_input_length: int = attrs.field(default=131072, validator=[_at_least(1), _loadable_tokens])
    rate: float = attrs.field(default=2.0, validator=_positive_rate)
    block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, validator=lambda i, a, v: check_block_size(v))
    seed: int = attrs.field(default=0, validator=_at_least(0))

    def __attrs_post_init__(self) -> None:
        span_ms = self.requests / self.rate * 1e3  # the mean; the drawn arrivals stay far below 1000 x that
        if span_ms * SPAN_HEADROOM > MAX_TIMESTAMP_MS:
            raise ConfigError(f"rate {self.rate:g} per second spreads {self.requests} requests over about "
                              f"{span_ms:.3g} ms, past what a trace's timestamps hold ({MAX_TIMESTAMP_MS:.0e} ms, "
                              f"with {SPAN_HEADROOM}x to spare); raise the rate or lower the requests")
        longest_system = self.system_length + self.system_length // 2  # lengths are drawn up to 1.5 x the mean
        if longest_system >= self.max_input_length:
            raise ConfigError(f"max_input_length {self.max_input_length} cannot hold a system prompt of up to "
                              f"{longest_system} tokens (1.5 x system_length) and a user turn; raise it or lower "
                              "system_length")


class _Conversation:
    """One conversation's content as pieces, and the ids of its blocks that are already full."""

    def __init__(self, name: int, turns: int, system: tuple[str, int] | None) -> None:
        self.name = name
        self.turns_left = turns
        self.turn = 0
        self.pieces: list[tuple[object, int]] = []  # (content key, tokens)
        self.starts: list[int] = []  # first token of each piece
        self.length = 0
        self.full_ids: list[int] = []
        if system is not None and system[1]:
            self.add(system[0], system[1])

    def add(self, key: object, tokens: int) -> None:
        self.pieces.append((key, tokens))
        self.starts.append(self.length)
        self.length += tokens

    def content(self, start: int, end: int) -> tuple:
        """(key, from, to) of every piece overlapping tokens [start, end)."""
        i = bisect.bisect_right(self.starts, start) - 1
        out = []
        while i < len(self.pieces) and self.starts[i] < end:
            key, n = self.pieces[i]
            s = self.starts[i]
            out.append((key, max(start, s) - s, min(end, s + n) - s))
            i += 1
        return tuple(out)


class _Ids:
    """Consecutive hash ids for (parent id, block content) keys, in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def __call__(self, parent: int, content: tuple) -> int:
        key = (parent, content)
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def generate(shape: TraceShape = TraceShape()) -> Iterator[dict]:
    """The trace's requests as dicts (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``)."""
    rng = random.Random(shape.seed)
    bs = shape.block_size

    def around(mean: int) -> int:
        return rng.randint(mean - mean // 2, mean + mean // 2) if mean else 0

    systems = [(f"system{k}", around(shape.system_length)) for k in range(shape.system_prompts)]
    popularity = [1.0 / (k + 1) for k in range(shape.system_prompts)]
    ids = _Ids()
    opened = 0

    def new_conversation() -> _Conversation:
        nonlocal opened
        opened += 1
        system = rng.choices(systems, popularity)[0]
        return _Conversation(opened, rng.randint(1, 2 * shape.turns - 1), system)

    live = [new_conversation() for _ in range(shape.sessions)]
    clock_ms = 0.0
    for _ in range(shape.requests):
        slot = rng.randrange(len(live))
        conv = live[slot]
        user = around(shape.user_length)
        if conv.length + user > shape.max_input_length and conv.turn:  # context full: start afresh
            conv = live[slot] = new_conversation()
        conv.add(("user", conv.name, conv.turn), max(1, min(user, shape.max_input_length - conv.length)))
        n_in = conv.length
        while (len(conv.full_ids) + 1) * bs <= n_in:  # blocks that became full stay as they are
            k = len(conv.full_ids)
            parent = conv.full_ids[-1] if conv.full_ids else -1
            conv.full_ids.append(ids(parent, conv.content(k * bs, (k + 1) * bs)))
        hash_ids = list(conv.full_ids)
        if n_in % bs:
            parent = hash_ids[-1] if hash_ids else -1
            hash_ids.append(ids(parent, conv.content(len(hash_ids) * bs, n_in)))
        output = around(shape.output_length)
        yield {"timestamp": int(clock_ms), "input_length": n_in, "output_length": output, "hash_ids": hash_ids}
        clock_ms += rng.expovariate(shape.rate) * 1e3
        conv.add(("answer", conv.name, conv.turn), output)
        conv.turn += 1
        conv.turns_left -= 1
        if conv.turns_left == 0:
            live[slot] = new_conversation()


def write(shape: TraceShape, out: TextIO) -> int:
    """Write the trace as JSON lines; returns the number of requests."""
    n = 0
    for request in generate(shape):
        out.write(json.dumps(request, separators=(", ", ": ")) + "\n")
        n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    d = TraceShape()
    p = argparse.ArgumentParser(prog="python -m hicache_fsm.trace_gen", description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", required=True, metavar="FILE.jsonl", help="where to write the trace ('-': stdout)")
    for name, help_ in (
        ("requests", "requests in the trace"),
        ("sessions", f"conversations open at once, at most {MAX_OPEN}"),
        ("turns", "mean turns per conversation"),
        ("system-prompts", f"distinct shared system prompts (Zipf-popular), at most {MAX_OPEN}"),
        ("system-length", "mean tokens of a system prompt"),
        ("user-length", "mean tokens of a user turn"),
        ("output-length", "mean tokens of an answer"),
        ("max-input-length", "longest input; a conversation that would exceed it starts afresh (it must exceed "
                             "1.5 x --system-length)"),
        ("block-size", "tokens per hash id"),
        ("seed", "random seed"),
    ):
        attr = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, default=getattr(d, attr), help=f"{help_} (default {getattr(d, attr)})")
    p.add_argument("--rate", type=float, default=d.rate, help=f"requests per second (default {d.rate})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fields = {f.name for f in attrs.fields(TraceShape)}
    try:
        shape = TraceShape(**{k: v for k, v in vars(args).items() if k in fields})
    except ConfigError as exc:
        print(f"trace_gen: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        write(shape, sys.stdout)
        return 0
    try:
        with open_output_text(Path(args.output)) as f:
            n = write(shape, f)
    except OSError as exc:
        print(f"trace_gen: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {n} requests to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
