"""`fuzz --test-out FILE` writes a regression test that runs from wherever it is written: pytest run in
another directory (no repository root on the path, another working directory) collects it and it fails
the way the fuzzer's run did, not with an import error, nor by replaying another variant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.stateful import hicache_machine, run_fuzz

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


def test_a_generated_test_checks_its_variant_number_still_builds_its_variant():
    """The test replays ``state.setup(variant=N, ...)``: were the variant list changed, N would build another
    cache and the test replay a different configuration, passing or failing for the wrong reason."""
    # caught only with pages of two tokens: six variants of fifty, each run drawing one about evenly
    with quiet_cache_logs(), mutant("backup_host_start_in_pages"):
        result = run_fuzz(hicache_machine(name="Regression"), examples=400, steps=40, seed=0)
        assert not result.ok
        assert "'page_size': 2" in result.test_code and "state.expect_variant({" in result.test_code
        replay: dict = {}
        exec(compile(result.test_code, "test_regression.py", "exec"), replay)
        with pytest.raises(AssertionError, match="kv_readback"):
            replay["test_fuzz_regression"]()  # the bug, reproduced
        changed = result.test_code.replace(
            "hicache_machine(name=", "hicache_machine(variants=tuple(reversed(HICACHE_VARIANTS)), name=").replace(
            "import hicache_machine", "import HICACHE_VARIANTS, hicache_machine")
        stale: dict = {}
        exec(compile(changed, "test_regression.py", "exec"), stale)
        with pytest.raises(ConfigError, match="generated for variant"):
            stale["test_fuzz_regression"]()
