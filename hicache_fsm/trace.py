"""Production KV-cache traces in the Mooncake format: reading them, their tokens, their hit-rate bound.

A trace is a JSON Lines file, one request a line::

    {"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28, 29, ...]}

``timestamp`` is the arrival time in milliseconds, ``input_length`` and
``output_length`` count tokens, and each entry of ``hash_ids`` names one block
of ``block_size`` input tokens *together with its whole prefix*: two requests
share a hash id exactly where they share every token up to the end of that
block. There are ``ceil(input_length / block_size)`` ids; the last block may be
partial, and then holds the first ``input_length % block_size`` tokens of its
id's block. Traces carry no text, so :class:`BlockTokens` derives token ids
from (hash id, position in block): equal ids give equal tokens, and different
ids differ in the first tokens of the block (they spell the id), so a radix
tree over these tokens branches exactly where the hash ids do.

:func:`prefix_bound` computes, from the hash ids alone, what an infinite cache
of whole pages would hit: the bound every replayed configuration is compared
with.
"""

from __future__ import annotations

import json
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Sequence

import attrs
import numpy as np

from hicache_fsm.errors import ConfigError, TraceError
from hicache_fsm.input_limits import (
    MAX_JSON_DEPTH, InputRefused, check_count, check_json_depth, max_items, memory_budget_bytes, open_regular_text,
    undecodable_line,
)
from hicache_fsm.tokens import ID_BYTES, TokenIds

DEFAULT_BLOCK_SIZE = 512
MAX_HASH_ID = 1 << 63  # hash ids are non-negative and below this (64-bit hashes fit)
VOCAB = 1 << 16  # token ids are below this
ID_TOKENS = 4  # a block's first four tokens spell its hash id in base VOCAB
_TAIL_ROWS = 1024  # the rest of a block comes from row (hash id mod this) of a fixed random table
_TAIL_SEED = 20250225
BLOCK_CACHE = 8192  # derived blocks kept per BlockTokens
_LE_UINT32 = np.dtype("<u4")
_HEAD = struct.Struct("<4I")  # a block's first four ids: its hash id in base VOCAB
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_TIMESTAMP_MS = 10**15  # about 31,700 years: a float holds every millisecond below it
# Bounds on untrusted traces, checked before the work they would size.
MAX_BLOCK_SIZE = 4096  # the token table is 1024 rows of a block, and up to BLOCK_CACHE derived blocks are kept
MAX_LINE_CHARS = 1 << 24  # one request's JSON; 4096-token blocks make that over 10**10 tokens of hash ids
TOKEN_BYTES = 32  # what replaying one token may cost: token tuples, radix keys, metadata pools of each tier
TRACE_TEXT_SHARE = 16  # a trace file may be 1/16 of the memory budget: parsed requests are larger than their text


@attrs.frozen(slots=True)
class TraceRequest:
    """One line of a trace; built by hand, a value a trace line could not hold is a ``ConfigError``."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = attrs.field(eq=False)

    def __attrs_post_init__(self) -> None:
        problem = request_problem(self.timestamp, self.input_length, self.output_length, self.hash_ids)
        if problem is None and not (_is_int(self.line) and self.line >= 0):
            problem = f"line must be an int >= 0, got {self.line!r}"
        if problem is not None:
            raise ConfigError(problem)


@attrs.frozen
class Trace:
    """The requests of a trace file, in arrival order (stable for equal timestamps).

    Built by hand, it is checked as a file would be: a ``Trace`` of requests
    out of order, or whose hash ids do not make their blocks, is a ``ConfigError``.
    """

    path: str
    block_size: int
    requests: tuple[TraceRequest, ...]

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ConfigError(f"Trace.path must be a str (where the trace came from), got {type(self.path).__name__}")
        check_block_size(self.block_size)
        if not isinstance(self.requests, tuple) or not all(isinstance(r, TraceRequest) for r in self.requests):
            raise ConfigError("Trace.requests must be a tuple of TraceRequest")
        last = 0.0
        for i, r in enumerate(self.requests):
            problem = blocks_problem(r.input_length, len(r.hash_ids), self.block_size)
            if problem is None and r.timestamp < last:
                problem = (f"timestamp {r.timestamp} is before the previous request's {last} "
                           "(requests go in arrival order)")
            if problem is not None:
                raise ConfigError(f"Trace request {i} (line {r.line}): {problem}")
            last = r.timestamp

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_length for r in self.requests)

    @property
    def max_input_length(self) -> int:
        return max((r.input_length for r in self.requests), default=0)

    def summary(self) -> dict:
        n = len(self.requests)
        return {
            "path": self.path,
            "block_size": self.block_size,
            "requests": n,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "mean_input_length": round(self.input_tokens / n, 1) if n else 0.0,
            "max_input_length": self.max_input_length,
            "unique_hash_ids": len({h for r in self.requests for h in r.hash_ids}),
            "duration_s": round((self.requests[-1].timestamp - self.requests[0].timestamp) / 1e3, 3) if n else 0.0,
        }


def check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < ID_TOKENS:
        raise ConfigError(f"block size must be an int >= {ID_TOKENS} (a block's first {ID_TOKENS} tokens "
                          f"spell its hash id), got {block_size!r}")
    if block_size > MAX_BLOCK_SIZE:
        raise ConfigError(f"block size {block_size} is over the limit of {MAX_BLOCK_SIZE} tokens")
    return block_size


def check_page_size(page_size: object, block_size: int) -> int:
    """A page size a trace replays with: it divides the block size, and is at least ``ID_TOKENS``.

    A block's first ``ID_TOKENS`` tokens spell its hash id one 16-bit digit a
    token, so ids that differ in a higher digit only (1 and 65537) share the
    first token: a smaller page would be shared by blocks the hash ids say
    share nothing, and the cache would beat the bound computed from them.
    """
    if (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < ID_TOKENS
            or block_size % page_size):
        raise ConfigError(f"page size must divide the trace's block size {block_size} and be at least "
                          f"{ID_TOKENS} (a block's first {ID_TOKENS} tokens spell its hash id), got {page_size!r}")
    return page_size


def check_tokens(count: int, what: str) -> int:
    """``count`` tokens to replay, or ConfigError when this machine could not hold them (the limit named)."""
    try:
        return check_count(count, TOKEN_BYTES, what)
    except InputRefused as exc:
        raise ConfigError(str(exc)) from None


# ====================================================================== reading


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _within_tokens(count: int, what: str, limit: int | None) -> None:
    """``check_tokens``, skipped while ``count`` is within ``limit`` (the memory bound read once per file)."""
    if limit is None or count > limit:
        check_tokens(count, what)


def parse_request(text: str, block_size: int, where: str = "<trace>", line: int = 1, *,
                  token_limit: int | None = None) -> TraceRequest:
    """One trace line as a request; a ``TraceError`` saying ``where:line`` and what is wrong otherwise.

    ``token_limit``: what ``check_tokens`` allowed when the caller asked (a count
    within it is not checked again; one over it is, against the memory of now).
    """

    def bad(message: str) -> TraceError:
        return TraceError(where, line, message)

    if len(text) > MAX_LINE_CHARS and len(text.rstrip("\r\n")) > MAX_LINE_CHARS:
        raise bad(f"line longer than {MAX_LINE_CHARS} characters")
    try:
        if text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # fewer openers cannot nest deeper
            check_json_depth(text)
        obj = json.loads(text)
    except InputRefused as exc:
        raise bad(str(exc)) from None
    except ValueError as exc:
        raise bad(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise bad(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    n_in, n_out, ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not isinstance(ids, list):
        raise bad(f"hash_ids must be a list of ints, got {type(ids).__name__}")
    try:
        request = TraceRequest(obj["timestamp"], n_in, n_out, tuple(ids), line)
    except ConfigError as exc:
        raise bad(str(exc)) from None
    try:
        _within_tokens(n_in + n_out, "input_length + output_length", token_limit)
    except ConfigError as exc:
        raise bad(str(exc)) from None
    problem = blocks_problem(n_in, len(ids), block_size)
    if problem is not None:
        raise bad(problem)
    return request


def request_problem(ts: object, n_in: object, n_out: object, ids: object) -> str | None:
    """What makes these fields no trace line's (None when they are one's): types and ranges."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_TIMESTAMP_MS:  # NaN fails too
        return f"timestamp must be a number of milliseconds from 0 to {MAX_TIMESTAMP_MS:.0e}, got {_shown(ts)}"
    if not _is_int(n_in) or n_in < 1:
        return f"input_length must be an int >= 1, got {_shown(n_in)}"
    if not _is_int(n_out) or n_out < 0:
        return f"output_length must be an int >= 0, got {_shown(n_out)}"
    if not isinstance(ids, tuple):
        return f"hash_ids must be a tuple of ints, got {type(ids).__name__}"
    if ids and not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < MAX_HASH_ID):
        for h in ids:  # name the first bad one
            if not _is_int(h) or not 0 <= h < MAX_HASH_ID:
                return f"hash_ids must be ints in [0, 2**63), got {_shown(h)}"
    return None


def blocks_problem(input_length: int, hash_ids: int, block_size: int) -> str | None:
    """Why ``hash_ids`` ids cannot name the blocks of ``input_length`` tokens (None when they can)."""
    blocks = -(-input_length // block_size)
    if hash_ids != blocks:
        return (f"{hash_ids} hash_ids, but input_length {_shown(input_length)} makes {_shown(blocks)} blocks of "
                f"{block_size} tokens (is the block size right?)")
    return None


def _shown(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a 5000-digit int is not a message)."""
    text = repr(value) if not (_is_int(value) and value.bit_length() > 128) else f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:40] + "..."


def parse_lines(lines: Iterable[str], block_size: int = DEFAULT_BLOCK_SIZE, where: str = "<trace>") -> Trace:
    """Requests from JSON lines (blank lines skipped), sorted by timestamp; at least one required.

    ``lines`` is any iterable of lines, or the whole text in one str (read line by line, not letter by letter).
    """
    check_block_size(block_size)
    if not isinstance(where, str):
        raise ConfigError(f"where must be a str (named in errors), got {type(where).__name__}")
    if isinstance(lines, str):
        lines = lines.splitlines()
    elif isinstance(lines, (bytes, bytearray)) or not isinstance(lines, Iterable):
        raise ConfigError(f"parse_lines takes the trace's text or an iterable of its lines, got {type(lines).__name__}")
    requests, tokens = [], 0
    limit = max_items(TOKEN_BYTES)  # check_tokens's bound, read once: counts past it are checked afresh
    for i, text in enumerate(lines, 1):
        if not isinstance(text, str):
            raise TraceError(where, i, f"a line must be a str, got {type(text).__name__}")
        if text.strip():
            requests.append(parse_request(text, block_size, where, i, token_limit=limit))
            tokens += requests[-1].input_length + requests[-1].output_length
            try:
                _within_tokens(tokens, "the trace's tokens so far", limit)
            except ConfigError as exc:
                raise TraceError(where, i, str(exc)) from None
    if not requests:
        raise TraceError(where, None, "no requests in the trace")
    requests.sort(key=lambda r: r.timestamp)  # stable: equal timestamps keep file order
    return Trace(where, block_size, tuple(requests))


def load_trace(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Read a trace file; a ``TraceError`` (file:line) when it is missing, malformed or over a bound.

    Only regular files are read (a FIFO is never opened), at most a share of
    the memory budget, and no line past ``MAX_LINE_CHARS``.
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise ConfigError(f"load_trace takes a path as str or pathlib.Path, got {type(path).__name__}")
    where = str(path)
    check_block_size(block_size)
    try:
        with open_regular_text(path, memory_budget_bytes() // TRACE_TEXT_SHARE) as f:
            return parse_lines(iter(lambda: f.readline(MAX_LINE_CHARS + 2), ""), block_size, where)
    except InputRefused as exc:
        raise TraceError(where, None, str(exc)) from None
    except FileNotFoundError:
        raise TraceError(where, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(where, None, "is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        bad = undecodable_line(path)
        if bad is None:
            raise TraceError(where, None, f"not UTF-8 text: {exc.reason}") from None
        raise TraceError(where, bad[0], f"not UTF-8 text (byte 0x{bad[1]:02x}; a binary file?)") from None
    except OSError as exc:
        raise TraceError(where, None, exc.strerror or str(exc)) from None


# ====================================================================== tokens


class BlockTokens:
    """Token ids of hash-id blocks: equal ids give equal tokens, different ids differ in the first four.

    Token ``i`` of the block of ``hash_id`` is, for ``i < 4``, the ``i``-th
    base-65536 digit of ``hash_id`` (least significant first), and otherwise
    entry ``i - 4`` of row ``hash_id % 1024`` of a fixed pseudo-random table.
    Every token is below ``VOCAB`` (2**16). ``packed`` (what the replay uses)
    joins each block's packed bytes: the four head ids packed in one call and
    the row's tail packed once per instance, so no token id is looked at one
    by one (they are in range by construction: nothing to check). ``block``
    and ``tokens`` give the same ids as ints (tuples of shared int objects,
    built on first use).
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = check_block_size(block_size)
        self._table = np.random.default_rng(_TAIL_SEED).integers(0, VOCAB, size=(_TAIL_ROWS, block_size - ID_TOKENS))
        self._tail_raw = [row.tobytes() for row in self._table.astype(_LE_UINT32)]
        self._tails: list[tuple[int, ...]] | None = None
        # Consecutive requests reuse most of their blocks: remember the recent ones (4 KiB each).
        self._cached: Callable[[int], tuple[int, ...]] = lru_cache(maxsize=BLOCK_CACHE)(self._derive)

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The ``block_size`` tokens of ``hash_id``'s block."""
        return self._cached(hash_id)

    def _derive(self, hash_id: int) -> tuple[int, ...]:
        if self._tails is None:
            ints = tuple(range(VOCAB))  # every token refers to one of these objects
            self._tails = [tuple(ints[t] for t in row) for row in self._table.tolist()]
        mask = VOCAB - 1
        head = (hash_id & mask, (hash_id >> 16) & mask, (hash_id >> 32) & mask, (hash_id >> 48) & mask)
        return head + self._tails[hash_id % _TAIL_ROWS]

    def _blocks(self, hash_ids: Sequence[int], length: int) -> tuple[int, int]:
        """Whole blocks and the tokens of a partial last one in ``length``; ``ConfigError`` when ``hash_ids`` are
        too few to name them (``length`` past the ids' blocks would be cut short without a word)."""
        full, rest = divmod(length, self.block_size)
        if length < 0 or len(hash_ids) < full + (rest > 0):
            raise ConfigError(f"{len(hash_ids)} hash ids name {len(hash_ids) * self.block_size} tokens of "
                              f"{self.block_size}-token blocks, not {length}")
        return full, rest

    def packed(self, hash_ids: Sequence[int], length: int) -> TokenIds:
        """``tokens(hash_ids, length)`` packed as the cache keys them (``pack_token_ids`` of them, byte for byte)."""
        full, rest = self._blocks(hash_ids, length)
        head, tails, mask = _HEAD.pack, self._tail_raw, VOCAB - 1
        parts = []
        for h in hash_ids[: full + (rest > 0)]:
            parts.append(head(h & mask, (h >> 16) & mask, (h >> 32) & mask, (h >> 48) & mask))
            parts.append(tails[h % _TAIL_ROWS])
        raw = b"".join(parts)
        return TokenIds(raw[: length * ID_BYTES] if rest else raw)

    def tokens(self, hash_ids: Sequence[int], length: int) -> tuple[int, ...]:
        """The first ``length`` tokens of the blocks ``hash_ids`` (a partial last block is a prefix of its block)."""
        full, rest = self._blocks(hash_ids, length)
        block = self._cached
        out: list[int] = []
        for h in hash_ids[:full]:
            out += block(h)  # a list extended by tuples: a few ns a token
        if rest:
            out += block(hash_ids[full])[:rest]
        return tuple(out)


# ====================================================================== the bound


@attrs.frozen
class PrefixBound:
    """What an infinite cache of whole pages holds and hits on a trace, from the hash ids alone."""

    input_tokens: int
    hit_tokens: int
    unique_tokens: int  # tokens such a cache holds at the end (whole pages)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def prefix_bound(trace: Trace, page_size: int) -> PrefixBound:
    """Hit tokens of an infinite cache that holds every request's input cut to whole pages.

    A request hits the longest prefix it shares with an earlier request's
    cached input (cut to whole pages). Two inputs share every token of the
    blocks whose hash-id prefixes agree and none of the first block where they
    differ, so a trie of hash-id sequences that remembers, per block, the most
    tokens any cached input reached into it gives that prefix directly.
    """
    bs = trace.block_size
    check_page_size(page_size, bs)
    children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node; node 0 is the root
    reach = [0]  # node -> most tokens of its block any cached input covered
    hit = unique = total = 0
    for r in trace.requests:
        total += r.input_length
        node, matched = 0, 0
        for k, h in enumerate(r.hash_ids):
            child = children.get((node, h))
            if child is None:
                break
            mine = min(bs, r.input_length - k * bs)
            got = min(reach[child], mine)
            matched += got
            if got < bs:
                break
            node = child
        hit += matched // page_size * page_size
        cached = r.input_length // page_size * page_size
        node = 0
        for k, h in enumerate(r.hash_ids):
            covered = min(bs, cached - k * bs)
            if covered <= 0:
                break
            key = (node, h)
            child = children.get(key)
            if child is None:
                child = children[key] = len(reach)
                reach.append(0)
            if covered > reach[child]:
                unique += covered - reach[child]
                reach[child] = covered
            node = child
    return PrefixBound(total, hit, unique)


__all__ = [
    "DEFAULT_BLOCK_SIZE", "MAX_BLOCK_SIZE", "MAX_LINE_CHARS", "TOKEN_BYTES", "BlockTokens", "PrefixBound", "Trace",
    "TraceRequest", "VOCAB", "check_block_size", "check_tokens",
    "load_trace", "parse_lines", "parse_request", "prefix_bound",
]
