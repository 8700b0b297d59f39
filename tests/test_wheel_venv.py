"""The wheel in a fresh virtual environment: every command line job runs, and its hints name the wheel's extras.

The wheel is built once from this checkout (``pip wheel --no-deps``) and
installed with ``--no-deps`` into a venv created with ``--system-site-packages``
(the dependencies and extras come from this interpreter's environment; nothing
is downloaded). Every command then runs from a directory outside the checkout
through the venv's own ``hicache-fsm`` script, on small inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wheel_util import PIP_ENV, build_wheel

SMALL_WORKLOAD = ["--clients", "2", "--rounds", "2", "--request-length", "16", "--output-length", "4",
                  "--system-prompt-length", "16", "--page-size", "8", "--device-tokens", "80", "--host-tokens", "96",
                  "--device", "cpu", "--no-progress"]

pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(args, cwd=cwd, env={**env, **PIP_ENV}, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"{args[1:]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv (system site-packages visible) holding only the wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("venv")
    wheel = build_wheel(tmp)
    env_dir = tmp / "env"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], tmp)
    _run([str(env_dir / "bin" / "python"), "-m", "pip", "-q", "install", "--no-deps", str(wheel)], tmp)
    return env_dir


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cwd")


def test_the_venv_imports_the_wheel_not_the_checkout(venv, elsewhere):
    where = _run([str(venv / "bin" / "python"), "-c", "import hicache_fsm; print(hicache_fsm.__file__)"], elsewhere)
    assert Path(where.stdout.strip()).is_relative_to(venv)


def test_every_command_runs_from_the_wheel(venv, elsewhere):
    cli = str(venv / "bin" / "hicache-fsm")
    assert _run([cli, "--version"], elsewhere).stdout.startswith("hicache-fsm ")
    assert "hicache_fsm/specs/residency.yaml" in _run([cli, "list"], elsewhere).stdout
    assert _run([cli, "validate"], elsewhere).stdout.count("ok hicache_fsm/specs/") == 4
    assert "stateDiagram" in _run([cli, "diagram", "residency"], elsewhere).stdout
    trace = elsewhere / "run.jsonl"
    report = json.loads(_run([cli, "simulate", *SMALL_WORKLOAD, "--json", "--record", str(trace)], elsewhere).stdout)
    assert report["kv_mismatches"] == 0 and report["output_mismatches"] == 0
    assert "digraph" in _run([cli, "diagram", "residency", "--counts", str(trace), "--format", "dot"], elsewhere).stdout
    _run([cli, "replay", str(trace)], elsewhere)
    _run([cli, "check", "--nodes", "2", "--device-pages", "1", "--host-pages", "1", "--quiet", "--json"], elsewhere)
    _run([cli, "fuzz", "--examples", "2", "--steps", "6", "--quiet", "--json"], elsewhere)
    requests = elsewhere / "trace.jsonl"
    _run([str(venv / "bin" / "python"), "-m", "hicache_fsm.trace_gen", "-o", str(requests), "--requests", "20"],
         elsewhere)
    replayed = json.loads(_run([cli, "simulate", "--trace", str(requests), "--json", "--no-storage"], elsewhere).stdout)
    assert replayed["requests"] == 20
    bench = json.loads(_run([cli, "bench", "dispatch", "--json", "--objects", "200", "--repeats", "1", "--chunk", "50"],
                            elsewhere).stdout)
    assert bench


def test_hints_name_the_wheels_extras(venv, elsewhere):
    """A missing extra is named as ``pip install 'hicache_fsm[...]'``; no installed file says ``pip install -e``."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['hicache_fsm.llama_model'] = None; "
            "from hicache_fsm.cli import main; "
            "sys.exit(main(['simulate', '--no-progress', '--plot', 'x.png']) * 10 "
            "+ main(['simulate', '--no-progress', '--clients', '1', '--rounds', '1', '--model', 'llama']))")
    proc = _run([str(venv / "bin" / "python"), "-c", code], elsewhere, check=False)
    assert proc.returncode == 11, proc.stderr
    assert "pip install 'hicache_fsm[plot]'" in proc.stderr and "pip install 'hicache_fsm[llama]'" in proc.stderr
    package = Path(_run([str(venv / "bin" / "python"), "-c", "import hicache_fsm; print(hicache_fsm.__file__)"],
                        elsewhere).stdout.strip()).parent
    editable_hints = [p.name for p in package.rglob("*.py") if "pip install -e" in p.read_text(encoding="utf-8")]
    assert not editable_hints
