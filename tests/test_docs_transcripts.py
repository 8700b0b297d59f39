"""Command output in README.md and docs/*.md is what the commands print today.

Every block that could show output is marked (``hicache_fsm.docs_transcripts``):
transcripts are run and compared after masking durations, addresses and paths;
blocks marked not-run are listed here as skipped, each with its reason, so none
is left unverified silently.
"""

from __future__ import annotations

import pytest

from hicache_fsm import docs_transcripts as dt

PAGE = """\
# A page

<!-- not-output: synopsis -->
```text
tool [--flag]
```

```python
import pathlib
pathlib.Path("made.txt").write_text("made by a snippet\\n")
print("printed", 6 * 7)
```

<!-- transcript: python -->
```text
printed 41
```

<!-- transcript: cwd=snippets -->
```text
$ cat made.txt
stale
$ echo took 1.5s at 0xdeadbeef; \\
    echo second line
took 9.9s at 0x12345678
second line
```

<!-- transcript: head=2 -->
```text
$ printf 'a\\nb\\nc\\n'
```

<!-- transcript: select=keep -->
```text
$ printf 'keep 1\\ndrop\\ndrop\\nkeep 2\\ndrop\\n'
```

<!-- not-run: needs a cluster -->
```text
$ deploy
done
```
"""


@pytest.fixture
def page(tmp_path):
    path = tmp_path / "page.md"
    path.write_text(PAGE, encoding="utf-8")
    return path


def test_blocks_are_read_with_their_markers(page):
    blocks = dt.parse_blocks(page)
    assert [(b.info, b.kind) for b in blocks] == [
        ("text", "not-output"), ("python", None), ("text", "transcript"), ("text", "transcript"),
        ("text", "transcript"), ("text", "transcript"), ("text", "not-run")]
    assert blocks[3].options == {"cwd": "snippets"}
    assert dt.commands(blocks[3]) == [("cat made.txt", ["stale"]),
                                      ("echo took 1.5s at 0xdeadbeef; \\\n    echo second line",
                                       ["took 9.9s at 0x12345678", "second line"])]
    assert blocks[-1].note == "needs a cluster"
    assert dt.unmarked([page]) == [] and [b.line for b in dt.not_run([page])] == [40]


def test_an_unmarked_output_block_is_reported(tmp_path):
    path = tmp_path / "p.md"
    path.write_text("```\nsome output\n```\n\n```bash\n$ cmd\n```\n\n```python\nx = 1\n```\n", encoding="utf-8")
    assert [b.line for b in dt.unmarked([path])] == [1, 5]


@pytest.mark.parametrize("marker, error", [
    ("<!-- transcript: colour=red -->", "unknown transcript option"),
    ("<!-- transcript: head=many -->", "head= needs a number"),
    ("<!-- transcript: cwd=/tmp -->", "cwd= takes only"),
])
def test_a_bad_marker_is_one_clear_error(tmp_path, marker, error):
    path = tmp_path / "p.md"
    path.write_text(f"{marker}\n```text\n$ true\n```\n", encoding="utf-8")
    with pytest.raises(dt.TranscriptError, match=error):
        dt.parse_blocks(path)


def test_normalising_masks_only_durations_addresses_and_padding():
    assert dt.normalise("fuzz: 50 runs (seed 1, 8.9s) at 0x7f00aa11") == "fuzz: 50 runs (seed 1, <time>) at <addr>"
    assert dt.normalise("3.2 ms / 12 us / 4 s, 12 states, 0x1f") == "<time> / <time> / <time>, 12 states, 0x1f"
    assert dt.normalise("max depth 6, v1.5s3") == "max depth 6, v1.5s3"
    assert dt.normalise("  name    12   3.0%") == " name 12 3.0%"
    assert dt.normalise("-----  ---------  -") == "--- --- -"


def test_shown_selects_and_cuts():
    out = "a\nb\nc\nd\n"
    assert dt.shown(out, {"head": "2"}) == ["a", "b", "..."]
    assert dt.shown(out, {"head": "4"}) == ["a", "b", "c", "d"]
    assert dt.shown(out, {"select": "[ad]"}) == ["a", "...", "d"]
    assert dt.shown("", {}) == []


def test_merge_keeps_the_old_text_only_when_it_reads_the_same():
    old = ["run 1: 3.0s", "a    b", "---  ---"]
    assert dt.merge(old, ["run 1: 9.1s", "a  b", "-----  ----"]) == old
    assert dt.merge(old, ["run 1: 9.1s", "a  c", "---  ---"]) == ["run 1: 9.1s", "a  c", "---  ---"]


def test_a_page_is_run_compared_and_rewritten(page):
    results = dt.run_all([page], jobs=2)
    by_line = {r.block.line: r for r in results}
    assert by_line[15].expected == ["printed 42"] and by_line[15].drifted
    assert by_line[20].expected == ["$ cat made.txt", "made by a snippet", "$ echo took 1.5s at 0xdeadbeef; \\",
                                    "    echo second line", "took 9.9s at 0x12345678", "second line"]
    assert by_line[30].expected == ["$ printf 'a\\nb\\nc\\n'", "a", "b", "..."]
    assert by_line[35].expected == ["$ printf 'keep 1\\ndrop\\ndrop\\nkeep 2\\ndrop\\n'", "keep 1", "...", "keep 2", "..."]
    assert "printed 41" in by_line[15].diff() and "printed 42" in by_line[15].diff()
    rewritten = dt.write(results)
    assert [b.line for b in rewritten] == [15, 20, 30, 35]
    again = dt.run_all([page], jobs=1)
    assert not any(r.drifted for r in again)
    text = page.read_text(encoding="utf-8")
    assert "took 9.9s at 0x12345678" in text and "stale" not in text and text.endswith("done\n```\n")


def test_commands_see_this_checkout_and_a_fresh_directory(tmp_path):
    path = tmp_path / "p.md"
    path.write_text("<!-- transcript -->\n```text\n$ hicache-fsm --version; pwd; ls\n```\n", encoding="utf-8")
    (result,) = dt.run_all([path])
    import hicache_fsm

    assert result.expected[1:] == [f"hicache-fsm {hicache_fsm.__version__}", "/path/to/cwd", "examples"]


def test_every_block_that_could_show_output_is_marked():
    problems = [f"{b.where}: ```{b.info} block with no marker" for b in dt.unmarked()]
    problems += [f"{b.where}: not-output block holds a `$ ` line" for page in dt.doc_pages()
                 for b in dt.parse_blocks(page) if b.kind == "not-output" and any(x.startswith("$ ") for x in b.body)]
    assert not problems, "\n".join(problems) + "\nmark each as described in hicache_fsm/docs_transcripts.py"


@pytest.mark.parametrize("block", dt.not_run(), ids=lambda b: b.where)
def test_blocks_not_run_are_listed_with_their_reason(block):
    assert block.note, f"{block.where}: a not-run block says why"
    pytest.skip(f"{block.where} not run: {block.note}")


def test_the_docs_show_what_the_commands_print():
    results = dt.run_all(jobs=2)
    assert len(results) >= 12
    drifted = [r for r in results if r.drifted]
    assert not drifted, "\n\n".join(r.diff() for r in drifted) + f"\n\nregenerate with: {dt.REGENERATE}"
