"""`hicache-fsm bench all --quick` runs every benchmark and writes the performance page."""

from __future__ import annotations

import json

from hicache_fsm.bench import BENCHMARKS
from hicache_fsm.bench.all import STEPS
from hicache_fsm.cli import main


def test_bench_all_quick_writes_the_page(tmp_path, capsys):
    out = tmp_path / "performance.md"
    assert main(["bench", "all", "--quick", "--output", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["results"]) == {key for key, _, _ in STEPS}
    page = out.read_text(encoding="utf-8")
    for heading in ("## Summary", "## Machine", "## Dispatch", "## Copy", "## Controller", "## Storage (file backend)"):
        assert heading in page
    assert "Quick run" in page
    for _, name, argv in STEPS:
        assert name in BENCHMARKS
        assert " ".join(["hicache-fsm bench", name, *argv]) in page
    assert "n/a" not in page.split("## Machine")[0]  # every summary figure was found in its result


def test_bench_all_refuses_a_missing_directory(tmp_path, monkeypatch, capsys):
    """A usage error (exit 2, the usual one line), refused before any benchmark runs."""
    monkeypatch.chdir(tmp_path)  # no docs/ here
    assert main(["bench", "all", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache-fsm bench all: error: docs/ does not exist") and "--output" in err
    assert list(tmp_path.iterdir()) == []
