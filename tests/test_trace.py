"""Production traces (Mooncake format): reading, token derivation, the analytic bound, the generator."""

from __future__ import annotations

import io
import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.errors import ConfigError, TraceError
from hicache_fsm.tokens import pack_token_ids
from hicache_fsm.trace import (
    VOCAB,
    BlockTokens,
    Trace,
    TraceRequest,
    load_trace,
    parse_lines,
    parse_request,
    prefix_bound,
)
from hicache_fsm.trace_gen import TraceShape, generate, main as gen_main, write

SHIPPED = Path(__file__).resolve().parent.parent / "examples" / "traces" / "synthetic-chat.jsonl"


def line(ts=0, n_in=1000, n_out=10, ids=(1, 2)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


# ====================================================================== parsing


def test_parse_a_good_line():
    r = parse_request(line(3052, 1000, 52, [46, 47]), 512, "t.jsonl", 7)
    assert r == TraceRequest(3052, 1000, 52, (46, 47), 7)
    assert r.line == 7
    extra = json.dumps({"timestamp": 1.5, "input_length": 512, "output_length": 0, "hash_ids": [9], "note": "x"})
    assert parse_request(extra, 512).hash_ids == (9,)  # unknown fields are ignored


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 5}', "missing fields output_length, hash_ids"),
    (line(ts=-1), "timestamp must be"),
    (line(ts=True), "timestamp must be"),
    (line(ts="0"), "timestamp must be"),
    (line(ts=10**400), "timestamp must be"),  # was an OverflowError from math.isfinite
    (line(ts=10**16), "timestamp must be"),
    (line(n_in=0, ids=()), "input_length must be an int >= 1"),
    (line(n_in=1.5), "input_length must be an int >= 1"),
    (line(n_out=-1), "output_length must be an int >= 0"),
    (json.dumps({"timestamp": 0, "input_length": 3, "output_length": 0, "hash_ids": 5}), "hash_ids must be a list"),
    (line(ids=(1, -2)), "hash_ids must be ints in [0, 2**63)"),
    (line(ids=(1, 2.0)), "hash_ids must be ints in [0, 2**63)"),
    (line(ids=(1, 1 << 63)), "hash_ids must be ints in [0, 2**63)"),
    (line(n_in=1000, ids=(1,)), "1 hash_ids, but input_length 1000 makes 2 blocks of 512 tokens"),
    (line(n_in=1000, ids=(1, 2, 3)), "3 hash_ids, but input_length 1000 makes 2 blocks"),
])
def test_bad_lines_name_file_and_line(text, message):
    with pytest.raises(TraceError) as err:
        parse_lines(["", line(), text], 512, "trace.jsonl")
    assert str(err.value).startswith("trace.jsonl:3: ")
    assert message in str(err.value)
    assert err.value.line == 3 and err.value.path == "trace.jsonl"


def test_load_trace_files(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(line(20, ids=(1, 2)) + "\n\n" + line(10, ids=(1, 3)) + "\n" + line(10, ids=(4, 5)) + "\n")
    t = load_trace(p)
    assert [r.timestamp for r in t.requests] == [10, 10, 20]  # by arrival; ties keep file order
    assert [r.hash_ids[-1] for r in t.requests] == [3, 5, 2]
    assert [r.line for r in t.requests] == [3, 4, 1]
    s = t.summary()
    assert s["requests"] == 3 and s["input_tokens"] == 3000 and s["unique_hash_ids"] == 5
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="empty.jsonl: no requests"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match=r"bin.jsonl:1: not UTF-8 text \(byte 0xff"):
        load_trace(tmp_path / "bin.jsonl")
    late = (line(1) + "\n") * 400 + '{"bad": "\udcff"}\n'  # past the chunk text mode decodes first
    (tmp_path / "late.jsonl").write_bytes(late.encode("utf-8", "surrogateescape"))
    assert len(late) > 8192
    with pytest.raises(TraceError, match=r"late.jsonl:401: not UTF-8 text \(byte 0xff"):
        load_trace(tmp_path / "late.jsonl")
    with pytest.raises(ConfigError, match="block size"):
        load_trace(p, block_size=2)


def test_a_leading_byte_order_mark_is_skipped(tmp_path):
    text = line(20, ids=(1, 2)) + "\r\n" + line(10, ids=(1, 3)) + "\r\n"
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")  # as Notepad saves it
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_trace(marked).requests == load_trace(plain).requests
    inner = tmp_path / "inner.jsonl"
    inner.write_bytes(plain.read_bytes().replace(b"\r\n", b"\r\n\xef\xbb\xbf", 1))
    with pytest.raises(TraceError, match=f"{inner}:2: not valid JSON"):
        load_trace(inner)


# ====================================================================== tokens


def test_block_tokens():
    bt = BlockTokens(16)
    a, b = bt.block(7), bt.block(8)
    assert len(a) == 16 and a == BlockTokens(16).block(7)  # deterministic across instances
    assert a[:4] != b[:4]  # different ids differ in the first tokens of the block
    assert all(isinstance(t, int) and 0 <= t < VOCAB < 2**31 for t in a + b)
    assert a[:4] == (7, 0, 0, 0) and bt.block((3 << 48) | 5)[:4] == (5, 0, 0, 3)
    assert bt.tokens([7, 8], 32) == a + b
    assert bt.tokens([7, 8], 21) == a + b[:5]  # a partial last block is a prefix of its block
    assert bt.tokens([7], 9) == a[:9]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.lists(st.integers(0, 5), min_size=1, max_size=6),
       st.integers(1, 8), st.integers(1, 8), st.sampled_from([0, 1 << 20, (1 << 62) + 17]))
def test_tokens_share_exactly_the_shared_blocks(ids_a, ids_b, cut_a, cut_b, offset):
    """Two inputs share every token of the blocks whose id prefixes agree and nothing of the next block."""
    bs = 8
    bt = BlockTokens(bs)
    ids_a, ids_b = [offset + h for h in ids_a], [offset + h for h in ids_b]
    len_a, len_b = (len(ids_a) - 1) * bs + cut_a, (len(ids_b) - 1) * bs + cut_b
    a, b = bt.tokens(ids_a, len_a), bt.tokens(ids_b, len_b)
    assert len(a) == len_a and len(b) == len_b
    k = 0
    while k < min(len(ids_a), len(ids_b)) and ids_a[k] == ids_b[k]:
        k += 1
    common = 0
    while common < min(len_a, len_b) and a[common] == b[common]:
        common += 1
    assert common == min(k * bs, len_a, len_b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=5), st.integers(0, 15),
       st.sampled_from([4, 8, 16]))
def test_packed_blocks_are_the_tokens_packed(ids, cut, bs):
    """``packed`` builds the bytes ``pack_token_ids`` gives for ``tokens``, whole blocks or a partial last one."""
    bt = BlockTokens(bs)
    length = (len(ids) - 1) * bs + 1 + cut % bs
    assert bt.packed(ids, length).raw == pack_token_ids(bt.tokens(ids, length)).raw
    assert bt.packed(ids, len(ids) * bs).raw == pack_token_ids(bt.tokens(ids, len(ids) * bs)).raw


# ====================================================================== the bound


def trace_of(*requests: tuple[int, tuple[int, ...]], block_size: int = 8) -> Trace:
    lines = [line(i, n, 1, ids) for i, (n, ids) in enumerate(requests)]
    return parse_lines(lines, block_size)


def test_prefix_bound_by_hand():
    t = trace_of(
        (20, (1, 2, 3)),  # caches 20 // 4 * 4 = 20 tokens (blocks 1, 2 and half of 3)
        (24, (1, 2, 3)),  # hits 20, caches 24
        (24, (1, 2, 4)),  # hits blocks 1 and 2: 16
        (13, (1, 5)),     # hits block 1: 8
        (6, (1,)),        # hits 6 // 4 * 4 = 4 (a partial first block)
        (9, (9, 9)),      # nothing
    )
    b = prefix_bound(t, 4)
    assert b.input_tokens == 20 + 24 + 24 + 13 + 6 + 9
    assert b.hit_tokens == 20 + 16 + 8 + 4
    assert b.unique_tokens == 24 + 8 + 4 + 8  # blocks 1, 2, 3; 4; the 4 of block 5 cut to a page; 9 and 9
    assert prefix_bound(t, 8).hit_tokens == 16 + 16 + 8 + 0
    with pytest.raises(ConfigError, match="divide the trace's block size 8 and be at least 4"):
        prefix_bound(t, 3)
    with pytest.raises(ConfigError, match="at least 4"):  # ids differing above 16 bits share a page this small
        prefix_bound(t, 2)


# ====================================================================== the generator and the shipped trace


def test_generator_is_deterministic_and_follows_the_format():
    shape = TraceShape(requests=120, sessions=6, turns=3, system_prompts=2, system_length=200, user_length=100,
                       output_length=50, block_size=64, seed=3)
    first, second = list(generate(shape)), list(generate(shape))
    assert first == second
    assert first != list(generate(attrs.evolve(shape, seed=4)))
    parent: dict[int, int] = {}
    seen = -1
    for r in first:
        ids = r["hash_ids"]
        assert len(ids) == -(-r["input_length"] // 64)
        for k, h in enumerate(ids):
            assert parent.setdefault(h, ids[k - 1] if k else -1) == (ids[k - 1] if k else -1)  # one prefix per id
            if h > seen:
                assert h == seen + 1  # consecutive, in order of first appearance
                seen = h
    assert [r["timestamp"] for r in first] == sorted(r["timestamp"] for r in first)
    buf = io.StringIO()
    assert write(shape, buf) == 120
    assert parse_lines(buf.getvalue().splitlines(), 64).requests[0].input_length == first[0]["input_length"]


def test_shipped_trace_is_the_generators_default_output():
    buf = io.StringIO()
    write(TraceShape(), buf)
    assert SHIPPED.read_text(encoding="utf-8") == buf.getvalue()


def test_generator_command(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert gen_main(["-o", str(out), "--requests", "5", "--block-size", "16", "--seed", "2"]) == 0
    assert len(load_trace(out, 16).requests) == 5
    assert gen_main(["-o", str(out), "--requests", "0"]) == 2
    assert "requests must be an int >= 1" in capsys.readouterr().err
    assert gen_main(["-o", str(tmp_path / "no" / "dir.jsonl")]) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(1, 8)),
                min_size=1, max_size=8),
       st.sampled_from([4, 8]))
def test_prefix_bound_equals_the_longest_cached_prefix(requests, page):
    """From the hash ids alone, the bound equals a brute-force search over the tokens of every earlier input."""
    bs = 8
    t = trace_of(*[((len(ids) - 1) * bs + cut, tuple(ids)) for ids, cut in requests], block_size=bs)
    bt = BlockTokens(bs)
    cached: list[tuple[int, ...]] = []
    hit = 0
    for r in t.requests:
        tokens = bt.tokens(r.hash_ids, r.input_length)
        best = 0
        for c in cached:
            n = 0
            while n < min(len(c), len(tokens)) and c[n] == tokens[n]:
                n += 1
            best = max(best, n)
        hit += best // page * page
        cached.append(tokens[: len(tokens) // page * page])
    b = prefix_bound(t, page)
    assert b.hit_tokens == hit
    assert b.unique_tokens == len({c[:n] for c in cached for n in range(page, len(c) + 1, page)}) * page


def test_a_whole_trace_text_is_read_line_by_line_not_letter_by_letter():
    lines = [json.dumps({"timestamp": i, "input_length": 600, "output_length": 5, "hash_ids": [i, i + 1]})
             for i in range(3)]
    assert parse_lines("\n".join(lines), 512) == parse_lines(lines, 512)  # a str was iterated char by char
