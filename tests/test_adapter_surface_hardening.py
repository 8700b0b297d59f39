"""What an outside probe of ``fuzz --adapter`` / ``check --adapter`` found: a refused step that changed the
cache passed ``fuzz``; an adapter whose ``close``, ``describe`` or ``eviction_policy`` raises gave a traceback;
a non-reproducible failure wrote a test of no steps; a variant with NaN wrote a test that could not run; a file
adapter's sibling modules and dataclasses did not import. Each case fails on the old code."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.explorer import Bounds, explore

ROOT = Path(__file__).resolve().parent.parent

SIMPLE = '''
from hicache_fsm.testing import CacheAdapter, MatchInfo, Occupancy, kv_fingerprint


class Simple(CacheAdapter):
    """A correct one-tier prefix cache: one entry a token prefix."""

    name = "simple"

    def __init__(self):
        self.kv = {}

    def insert(self, t):
        t = tuple(t)
        for i in range(len(t)):
            self.kv[t[:i + 1]] = kv_fingerprint(t[:i + 1])
        return True

    def match(self, t):
        t, n = tuple(t), 0
        while n < len(t) and t[:n + 1] in self.kv:
            n += 1
        return MatchInfo(n)

    def read_kv(self, t):
        t, out = tuple(t), []
        for i in range(len(t)):
            if t[:i + 1] not in self.kv:
                break
            out.append((self.kv[t[:i + 1]],))
        return out

    def invariant_violations(self):
        return []

    def evict(self, n):
        freed = 0
        for k in sorted(self.kv, key=len, reverse=True):
            if freed >= n:
                break
            if not any(len(o) == len(k) + 1 and o[:len(k)] == k for o in self.kv):
                del self.kv[k]
                freed += 1
        return freed

    def occupancy(self):
        return Occupancy(len(self.kv))

    def snapshot(self):
        return tuple(sorted(self.kv.items()))

    def state_key(self):
        return self.snapshot()

    def size(self):
        return len(self.kv)
'''


@pytest.fixture
def adapters(tmp_path, monkeypatch):
    """A directory with ``simple.py`` and a file adapter module written from ``body`` beside it (the directory on
    the path here: each test but the last two is about something else than finding it)."""
    (tmp_path / "simple.py").write_text(SIMPLE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "simple", raising=False)

    def write(body: str, name: str = "mine.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(body), encoding="utf-8")
        return str(path)
    return write


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def test_fuzz_fails_a_refused_step_that_changed_the_cache(adapters, capsys):
    path = adapters('''
        from hicache_fsm.testing import Rejected
        from simple import Simple

        class StoresWhileRefusing(Simple):
            def insert(self, tokens):
                super().insert(tokens)
                if len(tokens) >= 2:
                    raise Rejected("no room (but stored anyway)")
                return True

        def make(**kw):
            return StoresWhileRefusing()
    ''')
    code, text = run(capsys, "fuzz", "--adapter", f"{path}:make", "--examples", "50", "--quiet")
    assert code == 1 and "refused (no room (but stored anyway)) but the cache changed" in text


@pytest.mark.parametrize("method", ["close", "describe", "eviction_policy"])
@pytest.mark.parametrize("command", ["fuzz", "check"])
def test_an_adapter_method_that_raises_is_a_usage_error_not_a_traceback(adapters, capsys, method, command):
    path = adapters(f'''
        from simple import Simple

        class Raising(Simple):
            def {method}(self):
                raise RuntimeError("{method} boom")

        def make(*args, **kw):
            return Raising()
    ''')
    extra = ["--examples", "3"] if command == "fuzz" else ["--nodes", "2"]
    code, text = run(capsys, command, "--adapter", f"{path}:make", *extra, "--quiet")
    if command == "fuzz" and method == "describe":  # fuzz never asks for a description
        assert code == 0
        return
    assert code == 2 and f"the adapter's {method} raised RuntimeError: {method} boom" in text
    assert "Traceback" not in text


def test_check_refuses_a_policy_it_cannot_judge_as_a_usage_error(adapters, capsys):
    path = adapters('''
        from simple import Simple

        class Fifo(Simple):
            def eviction_policy(self):
                return "fifo"

        def make(bounds):
            return Fifo()
    ''')
    code, text = run(capsys, "check", "--adapter", f"{path}:make", "--nodes", "2", "--quiet")
    assert code == 2 and "returned 'fifo'" in text


def test_a_failure_that_does_not_reproduce_never_writes_a_test_that_cannot_parse(adapters, capsys, tmp_path):
    """A bug that shows at random: each run either writes a test of the steps it found (that parses) or says the
    failure is not reproducible and writes none (before, a test of no steps: an IndentationError)."""
    path = adapters('''
        import os
        from simple import Simple

        class Flaky(Simple):
            def invariant_violations(self):
                return ["flaky_bug"] if os.urandom(1)[0] < 16 else []

        def make(**kw):
            return Flaky()
    ''')
    for seed in range(6):
        out = tmp_path / f"test_regression_{seed}.py"
        code, text = run(capsys, "fuzz", "--adapter", f"{path}:make", "--examples", "100", "--seed", str(seed),
                         "--test-out", str(out))
        assert code == 1
        if out.exists():
            ast.parse(out.read_text(encoding="utf-8"))
            assert "state.setup(" in out.read_text(encoding="utf-8")
        else:
            assert "not reproducible" in text


@pytest.mark.parametrize("variant", ['{"cap": NaN}', '{"cap": -Infinity}', '{"cap": 1e999}',
                                     '{"cap": 1' + "0" * 5000 + "}"], ids=["nan", "-inf", "1e999", "5001 digits"])
def test_a_variant_a_regression_test_could_not_hold_is_refused(capsys, variant):
    with pytest.raises(SystemExit) as exc:
        main(["fuzz", "--variant", variant, "--adapter", "examples/tiny_lru_cache.py:buggy_adapter"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "not a plain JSON value" in err and len(err) < 400


def test_a_file_adapter_imports_its_siblings_and_its_dataclasses_in_the_generated_test(adapters, capsys, tmp_path):
    path = adapters('''
        from __future__ import annotations

        from dataclasses import dataclass, field

        from hicache_fsm.testing import kv_fingerprint
        from simple import Simple

        @dataclass
        class Store:
            kv: dict = field(default_factory=dict)

        class Stale(Simple):
            def __init__(self):
                super().__init__()
                self.store = Store()

            def insert(self, t):
                t = tuple(t)
                for i in range(len(t)):  # the planted bug: the second token's KV is off by one
                    self.kv[t[:i + 1]] = kv_fingerprint(t[:i + 1]) + (1 if i == 1 else 0)
                return True

        def make(**kw):
            return Stale()
    ''', name="dc_adapter.py")
    out = tmp_path / "regression" / "test_regression.py"
    out.parent.mkdir()
    code, text = run(capsys, "fuzz", "--adapter", f"{path}:make", "--examples", "100", "--test-out", str(out))
    assert code == 1 and "kv_readback" in text
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", out.name],
                         cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 1 and "1 failed" in ran.stdout and "kv_readback" in ran.stdout, ran.stdout


def test_a_module_adapter_is_found_in_the_current_directory(adapters, capsys, tmp_path, monkeypatch):
    adapters('''
        from simple import Simple

        def make(**kw):
            return Simple()
    ''', name="here_adapter.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    code, text = run(capsys, "fuzz", "--adapter", "here_adapter:make", "--examples", "3")
    assert code == 0 and "no failure" in text


def test_explore_names_a_factory_that_makes_no_adapter():
    with pytest.raises(ConfigError, match="returned int, not a CacheAdapter"):
        explore(Bounds(nodes=2), lambda bounds: 5)
    with pytest.raises(ConfigError, match="factory raised ZeroDivisionError"):
        explore(Bounds(nodes=2), lambda bounds: 1 // 0)


@pytest.mark.parametrize("method, named", [
    ("def invariant_violations(self):\n                return 'everything is broken'",
     "invariant_violations() returned str 'everything is broken', not a list of strings"),
    ("def match(self, t):\n                return MatchInfo(-5)", "MatchInfo.device_tokens must be an int >= 0, got -5"),
    ("def match(self, t):\n                return 3", "returned int 3, not a MatchInfo"),
    ("def insert(self, t):\n                super().insert(t)\n                return 'no'", "returned str 'no', not a bool"),
], ids=["violations a str", "negative match", "match an int", "insert a str"])
def test_an_adapter_answer_of_the_wrong_type_is_named_as_such(adapters, capsys, method, named):
    """A string of violations was read a letter each ('invariant catalogue: e'), a negative match and a truthy
    string from insert passed, an int from match was an AttributeError about ``total``."""
    path = adapters(f'''
        from hicache_fsm.testing import MatchInfo
        from simple import Simple

        class Wrong(Simple):
            {method}

        def make(**kw):
            return Wrong()
    ''')
    code, text = run(capsys, "fuzz", "--adapter", f"{path}:make", "--examples", "20", "--quiet")
    assert code == 1 and named in text


@pytest.mark.parametrize("method, named", [
    ("def state_key(self):\n                return [1]", "state_key() returned an unhashable list"),
    ("def describe(self):\n                raise RuntimeError('describe boom')",
     "the adapter's describe raised RuntimeError: describe boom"),
    ("def slots(self):\n                return list(super().slots())",
     "adapter_error: slots() returned list, not a mapping of key to slot"),
    ("def free_slots(self):\n                return str(super().free_slots())",
     "adapter_error: free_slots() returned str, not an int"),
], ids=["unhashable state key", "describe raises", "slots a list", "free slots a str"])
def test_a_block_store_that_breaks_the_explorer_is_named_not_a_traceback(adapters, capsys, monkeypatch, method, named):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    path = adapters(f'''
        from block_offload_manager import OffloadAdapter

        class Broken(OffloadAdapter):
            {method}

        def make(**kw):
            return Broken(**kw)
    ''')
    code, text = run(capsys, "check", "--adapter", f"{path}:make", "--max-depth", "3")
    assert code == 1 and named in text and "Traceback" not in text


@pytest.mark.parametrize("seed", ["x", None, 1.5, True, 2**63])
def test_run_fuzz_refuses_a_seed_the_command_line_would(seed):
    from hicache_fsm.testing.stateful import hicache_machine, run_fuzz

    with pytest.raises(ConfigError, match="seed must be a 64-bit int"):
        run_fuzz(hicache_machine(), examples=1, seed=seed)


def test_a_store_job_takes_its_keys_as_a_list_and_names_a_key_that_cannot_be_one():
    """A job's keys in a list crashed the explorer's symmetry with TypeError (and passed fuzz); a list key is named
    in the adapter's own call, where the explorer reports it as that step's violation."""
    from hicache_fsm.testing.blockstore import StoreJob

    assert StoreJob(1, [(0,), (0, 1)]).keys == ((0,), (0, 1))
    with pytest.raises(ConfigError, match=r"StoreJob.keys: key \[0, 1\] is not hashable"):
        StoreJob(1, [[0, 1]])


def test_an_entry_bound_that_cut_the_search_is_in_the_verdict(monkeypatch):
    """``--max-entries 0`` explored the empty store alone and printed "complete"; the verdict says the bound cut it,
    as it says a depth bound did."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from block_offload_manager import make_adapter

    from hicache_fsm.testing.blockstore import StoreBounds, explore_store

    cut = explore_store(lambda: make_adapter(), StoreBounds(max_entries=0, max_depth=3))
    assert cut.entries_bound == 0 and "within --max-entries 0" in cut.verdict()
    assert cut.to_json()["entries_bound"] == 0
    whole = explore_store(lambda: make_adapter(), StoreBounds(max_depth=3))
    assert whole.entries_bound is None and "max-entries" not in whole.verdict()


def test_a_double_free_is_not_called_a_leak(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from block_offload_manager import OffloadAdapter

    from hicache_fsm.testing.blockstore.world import StoreWorld

    class FreedTwice(OffloadAdapter):
        def free_slots(self):
            return super().free_slots() + 1

    world = StoreWorld(FreedTwice())
    assert any("(a slot freed twice)" in p for p in world.violations())


def test_a_required_block_store_method_left_out_is_named():
    """It was ``lookup: raised NotImplementedError: `` with no text."""
    from hicache_fsm.testing.blockstore import BlockStoreAdapter, StoreBounds, explore_store

    class Partial(BlockStoreAdapter):
        def describe(self):
            return "partial"

    result = explore_store(Partial, StoreBounds(max_depth=2))
    problems = [p for found, _ in result.violations for p in found]
    assert any("Partial does not implement lookup, which every BlockStoreAdapter must" in p for p in problems)
