"""The package as a user installs it: a wheel that works from any directory, light commands, optional extras.

The wheel test builds the wheel from this checkout, installs it with ``--no-deps``
into a temporary target and runs the command line from a directory outside the
repository, with only that target (and the interpreter's own site-packages, for
the dependencies) on the path.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wheel_util import PIP_ENV, REPO, build_wheel

from hicache_fsm.bench import BENCHMARKS
from hicache_fsm.cli import COMMANDS

SMALL_SIMULATE = [
    "simulate", "--clients", "2", "--rounds", "3", "--request-length", "16", "--output-length", "4",
    "--system-prompt-length", "16", "--page-size", "8", "--device-tokens", "80", "--host-tokens", "96",
    "--device", "cpu", "--no-progress", "--json",
]


def _run(args: list[str], cwd: Path, pythonpath: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, **PIP_ENV, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """A target directory holding the wheel built from this checkout, installed with --no-deps."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    target = tmp / "target"
    installed = _run([sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--target", str(target), str(wheel)],
                     tmp, tmp)
    assert installed.returncode == 0, installed.stderr
    return target


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A working directory outside the repository."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


@pytest.mark.slow
def test_the_wheel_lists_the_specs_from_any_directory(installed_wheel, elsewhere):
    where = _run([sys.executable, "-c", "import hicache_fsm; print(hicache_fsm.__file__)"], elsewhere, installed_wheel)
    assert Path(where.stdout.strip()).is_relative_to(installed_wheel)  # not this checkout, not an editable install
    listed = _run([str(installed_wheel / "bin" / "hicache-fsm"), "list", "--json"], elsewhere, installed_wheel)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(r["name"] for r in rows) == ["layer_write", "prefetch", "residency", "storage_link"]
    assert all(r["file"] == f"hicache_fsm/specs/{r['name']}.yaml" for r in rows)  # package-relative, not site-packages


@pytest.mark.slow
def test_the_wheel_simulates_with_every_page_exact(installed_wheel, elsewhere):
    storage = f"file://{elsewhere.parent / 'l3'}"
    out = _run([str(installed_wheel / "bin" / "hicache-fsm"), *SMALL_SIMULATE, "--storage-url", storage],
               elsewhere, installed_wheel)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["kv_mismatches"] == 0 and result["output_mismatches"] == 0
    assert all(c["kv_checked_pages"] > 0 for c in result["configs"].values())


@pytest.mark.slow
def test_the_wheel_declares_torch_as_a_range_and_hypothesis_as_an_extra(installed_wheel, elsewhere):
    code = "import importlib.metadata as m, json; print(json.dumps(m.requires('hicache_fsm')))"
    requires = json.loads(_run([sys.executable, "-c", code], elsewhere, installed_wheel).stdout)
    unconditional = [r for r in requires if "extra ==" not in r]
    assert not [r for r in unconditional if r.startswith(("hypothesis", "redis", "pytest"))], unconditional
    (torch_req,) = [r for r in unconditional if r.startswith("torch")]
    assert "==" not in torch_req and ">=" in torch_req
    assert any(r.startswith("hypothesis") and 'extra == "testing"' in r for r in requires)


def _imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output (``import time: self | cumulative | name``)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("argv", [["list"], ["validate"], ["diagram", "residency"]], ids=lambda a: a[0])
def test_spec_commands_import_neither_torch_nor_hypothesis(argv, elsewhere):
    out = _run([sys.executable, "-X", "importtime", "-m", "hicache_fsm.cli", *argv], elsewhere, REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    modules = _imported_modules(out.stderr)
    assert "hicache_fsm.spec" in modules  # the parse worked: it saw the imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "hypothesis", "numpy"))
    assert not heavy, heavy[:10]


@pytest.mark.slow
def test_installed_spec_commands_import_no_torch(installed_wheel, elsewhere):
    out = _run([sys.executable, "-X", "importtime", "-m", "hicache_fsm.cli", "list"], elsewhere, installed_wheel)
    assert out.returncode == 0
    assert not [m for m in _imported_modules(out.stderr) if m.split(".")[0] == "torch"]


def _without(module: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``module`` cannot be imported."""
    return _run([sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"], cwd, REPO)


@pytest.mark.parametrize("argv", [["check"], ["fuzz"], ["replay", "trace.jsonl"]], ids=lambda a: a[0])
def test_without_hypothesis_the_testing_commands_say_so_in_one_line(argv, elsewhere):
    out = _without("hypothesis", f"from hicache_fsm.cli import main; sys.exit(main({argv!r}))", elsewhere)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"hicache-fsm {argv[0]}: hicache_fsm.testing needs hypothesis: pip install 'hicache_fsm[testing]'"
    ]


def test_without_hypothesis_the_toolkit_raises_a_typed_error(elsewhere):
    code = (
        "from hicache_fsm.errors import MissingExtra\n"
        "try:\n    import hicache_fsm.testing\n"
        "except MissingExtra as exc:\n    print(exc.name, exc)\n"
        "import hicache_fsm.cache, hicache_fsm.spec  # the library itself needs no hypothesis\n"
    )
    out = _without("hypothesis", code, elsewhere)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hypothesis hicache_fsm.testing needs hypothesis: pip install 'hicache_fsm[testing]'"


def test_without_redis_the_redis_backend_names_its_extra(elsewhere):
    code = (
        "from hicache_fsm.errors import MissingExtra\nfrom hicache_fsm.storage import open_backend\n"
        "try:\n    open_backend('redis://127.0.0.1:1/0')\n"
        "except MissingExtra as exc:\n    print(exc)\n"
    )
    out = _without("redis", code, elsewhere)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the redis:// storage backend needs redis: pip install 'hicache_fsm[redis]'"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_lines_are_the_modules_first_docstring_lines(name):
    path, help_line = COMMANDS[name]
    source = Path(importlib.util.find_spec(path).origin).read_text(encoding="utf-8")
    assert ast.get_docstring(ast.parse(source)).strip().splitlines()[0] == help_line


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_help_lines_are_the_modules_first_docstring_lines(name):
    path, help_line = BENCHMARKS[name]
    source = Path(importlib.util.find_spec(path).origin).read_text(encoding="utf-8")
    assert ast.get_docstring(ast.parse(source)).strip().splitlines()[0] == help_line


@pytest.mark.parametrize("missing", ["zmq", "msgspec"])
def test_without_the_events_extra_bench_copy_runs_and_bench_events_names_it(missing, elsewhere):
    """Building the bench parser imported every benchmark: bench copy failed on a GPU machine without pyzmq."""
    copy = ["bench", "copy", "--tokens", "64", "--page-size", "16", "--layers", "2", "--repeats", "1", "--json"]
    out = _without(missing, f"from hicache_fsm.cli import main; sys.exit(main({copy!r}))", elsewhere)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["benchmark"] == "copy"
    out = _without(missing, "from hicache_fsm.cli import main; sys.exit(main(['bench', 'events']))", elsewhere)
    assert out.returncode == 1
    extra = {"zmq": "pyzmq", "msgspec": "msgspec"}[missing]
    assert out.stderr.strip().splitlines() == [
        f"hicache-fsm bench events: KV events needs {extra}: pip install 'hicache_fsm[events]'"]


def test_specs_live_in_the_package_and_the_top_level_points_there():
    from hicache_fsm.spec import SPEC_DIR

    assert SPEC_DIR == (REPO / "hicache_fsm" / "specs").resolve()
    assert "hicache_fsm/specs/" in (REPO / "specs" / "README.md").read_text(encoding="utf-8")


def test_without_hypothesis_bench_controllers_tp_figures_say_so_before_timing(elsewhere):
    """The rank processes run through the toolkit: the default --tp 1,2,4 timed everything, then failed."""
    argv = ["bench", "controller", "--requests", "5", "--repeats", "1", "--tree-nodes", "10", "--tp", "1"]
    code = ("from hicache_fsm.bench import controller\n"
            "controller.make_cache = lambda *a, **k: sys.exit('timed before the extra was checked')\n"
            f"from hicache_fsm.cli import main; sys.exit(main({argv!r}))")
    out = _without("hypothesis", code, elsewhere)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "hicache-fsm bench controller: hicache_fsm.testing needs hypothesis: pip install 'hicache_fsm[testing]'"
    ]
