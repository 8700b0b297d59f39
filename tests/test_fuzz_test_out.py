"""`fuzz --test-out FILE` writes a regression test that runs from wherever it is written: pytest run in
another directory (no repository root on the path, another working directory) collects it and it fails
the way the fuzzer's run did, not with an import error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hicache_fsm.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_generated_test_runs_from_the_directory_it_is_written_to(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the adapter is named relative to the repository root, as in the docs
    out_test = tmp_path / "test_regression.py"
    rc = main(["fuzz", "--adapter", "examples/tiny_lru_cache.py:buggy_adapter", "--examples", "200", "--quiet",
               "--no-shrink", "--test-out", str(out_test)])
    capsys.readouterr()
    assert rc == 1 and out_test.exists()
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's hicache_fsm; nothing else from the repo
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", out_test.name],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr  # 1: the test ran and failed (2/4: it could not run)
    assert "1 failed" in run.stdout and "AssertionError" in run.stdout, run.stdout
    assert "ModuleNotFoundError" not in run.stdout and "FileNotFoundError" not in run.stdout
