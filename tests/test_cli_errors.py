"""Every command meets bad input or a bad environment with one line on stderr and the documented
exit status (2: usage, 1: runtime), never a traceback; progress uses carriage returns only on a terminal.

Each case runs the real command line in a fresh interpreter, as a user would. The interpreters
start a few at a time (each imports torch), and each test then checks its own case.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # about 20 interpreters, each importing torch

ROOT = Path(__file__).resolve().parents[1]
TINY_SIM = ["--clients", "1", "--rounds", "1", "--request-length", "8", "--output-length", "2",
            "--system-prompt-length", "8", "--page-size", "8", "--device-tokens", "32", "--host-tokens", "64",
            "--device", "cpu", "--no-progress"]


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "hicache_fsm.cli", *argv]


def environment() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(*argv), capture_output=True, text=True, env=environment(), timeout=300)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MISSING_DIR = "/nonexistent-hicache-fsm-dir"
TINY = ROOT / "examples" / "tiny_lru_cache.py"  # its make_adapter is for fuzz, explorer_factory for check
BLOCKS = ROOT / "examples" / "block_offload_manager.py"  # a block store
# name -> (argv, exit status, fragments of the one stderr line)
CASES: dict[str, tuple[list[str], int, tuple[str, ...]]] = {
    "check_negative_pages": (["check", "--device-pages", "-1"], 2, ("--device-pages", "positive")),
    "check_page_size_zero": (["check", "--page-size", "0"], 2, ("--page-size",)),
    "check_missing_adapter": (["check", "--adapter", "nosuch:thing"], 2, ("cannot import nosuch",)),
    "check_bounds_too_big": (["check", "--alphabet", "1000"], 2, ("prompts",)),
    "fuzz_negative_examples": (["fuzz", "--examples", "-1"], 2, ("--examples",)),
    "fuzz_zero_steps": (["fuzz", "--steps", "0"], 2, ("--steps",)),
    "fuzz_adapter_format": (["fuzz", "--adapter", "badformat"], 2, ("MODULE:CALLABLE",)),
    # a factory that cannot make an adapter the way the command calls it is a usage error, not a finding
    "check_given_a_fuzz_factory": (["check", "--adapter", f"{TINY}:make_adapter", "--nodes", "2"], 2,
                                   ("make_adapter raised TypeError", "with the explorer's Bounds")),
    "fuzz_given_an_explorer_factory": (["fuzz", "--adapter", f"{TINY}:explorer_factory", "--examples", "3"], 2,
                                       ("explorer_factory raised TypeError", "keywords of a --variant")),
    "fuzz_given_no_factory": (["fuzz", "--adapter", "os:system"], 2, ("os:system raised TypeError",)),
    # a config option an adapter would not apply: refused, or the run would pass without it
    "check_cache_option_its_adapter_ignores": (["check", "--adapter", f"{TINY}:explorer_factory", "--cache-option",
                                                "eviction_headroom_tokens=1", "--max-depth", "1"], 2,
                                               ("does not report them in its config",)),
    "check_cache_option_for_a_block_store": (["check", "--adapter", f"{BLOCKS}:make_adapter", "--cache-option",
                                              "eviction_headroom_tokens=1"], 2,
                                             ("--cache-option: not for a block store",)),
    # storage flags: without --storage they would be ignored; an adapter without storage steps would pass without them
    "check_storage_option_without_storage": (["check", "--storage-option", "batch_pages=1"], 2,
                                             ("--storage-option: the storage tier's, so it needs --storage",)),
    "check_storage_flags_without_storage": (["check", "--stop-policy", "timeout", "--remote-tenant", "b"], 2,
                                            ("--stop-policy, --remote-tenant", "they need --storage")),
    "check_unknown_storage_option": (["check", "--storage", "--storage-option", "timeout_max=1"], 2,
                                     ("--storage-option: unknown option(s) timeout_max",)),
    "check_bad_remote_tenant": (["check", "--storage", "--remote-tenant", "a/b"], 2, ("--remote-tenant",)),
    "check_storage_its_adapter_ignores": (["check", "--adapter", f"{TINY}:explorer_factory", "--storage",
                                           "--max-depth", "1"], 2, ("--storage:", "takes none of the storage steps")),
    "check_storage_for_a_block_store": (["check", "--adapter", f"{BLOCKS}:make_adapter", "--storage"], 2,
                                        ("--storage: not for a block store",)),
    # each priority is another insert of every prompt in every state: a huge count ran away from --max-seconds
    "check_priorities_too_many": (["check", "--priorities", "100000"], 2, ("--priorities", "1..16")),
    "bench_scale_below_the_evict_row": (["bench", "scale", "--sizes", "16", "--quick", "--peer", "none"], 2,
                                        ("--sizes wants node counts of at least 64",)),
    "bench_events_replay_buffer_too_big": (["bench", "events", "--replay-batches", str(2**63)], 2,
                                           ("--replay-batches", "1..2147483647")),
    "bench_storage_page_too_big": (["bench", "storage", "--page-tokens", str(10**20)], 2,
                                   ("a page of", "--page-tokens x --layers")),
    "bench_copy_sglang_pool_of_one_page": (["bench", "copy", "--engine", "sglang_mha", "--tokens", "64",
                                            "--page-size", "64"], 2, ("keeps page 0 for SGLang",)),
    "replay_a_file_named_like_json": (["replay", '{"event": "header", "version": 1}'], 2,
                                      ("cannot read", "No such file")),
    "bench_copy_negative_tokens": (["bench", "copy", "--tokens", "-1"], 2, ("--tokens",)),
    "bench_copy_part_of_a_page": (["bench", "copy", "--tokens", "65", "--page-size", "64"], 2,
                                  ("--tokens must be a whole number of pages of --page-size 64, got 65",)),
    "bench_copy_too_big": (["bench", "copy", "--tokens", "64", "--layers", "100000", "--heads", "1000",
                            "--head-dim", "1000"], 2, ("--tokens 64 is more than this machine could hold",)),
    "bench_scale_too_big": (["bench", "scale", "--sizes", "1000000000000", "--quick", "--peer", "none"], 2,
                            ("--sizes node count 1000000000000 is more than this machine could hold",)),
    "bench_all_output_is_a_directory": (["bench", "all", "--quick", "--output", str(ROOT / "docs")], 2,
                                        ("bench all: error:", "is a directory; pass --output FILE.md")),
    # pools the machine cannot allocate: the documented runtime error (8 TiB of allocator table alone)
    "simulate_pools_too_big": (["simulate", *TINY_SIM, "--device-tokens", str(2**40), "--host-tokens", str(2**41)],
                               1, ("simulate: not enough memory",)),
    "simulate_host_not_larger": (["simulate", "--device-tokens", "3584", "--host-tokens", "3072"], 2,
                                 ("host_tokens 3072 must be larger than device_tokens 3584",)),
    "simulate_bad_device": (["simulate", "--device", "tpu9"], 2, ("device must be cpu, cuda or cuda:N",)),
    "simulate_cpu_with_an_index": (["simulate", "--device", "cpu:99"], 2, ("device must be cpu, cuda or cuda:N",)),
    "replay_missing_file": (["replay", "/nonexistent.jsonl"], 2, ("No such file or directory",)),
    "diagram_missing_directory": (["diagram", "residency", "-o", f"{MISSING_DIR}/x.mmd"], 1,
                                  ("No such file or directory", f"{MISSING_DIR}/x.mmd")),
    # a mistyped storage URL is a usage error before any configuration runs (was exit 1, seconds in)
    "simulate_unknown_storage_scheme": (["simulate", *TINY_SIM, "--storage-url", "http://x"], 2,
                                        ("--storage-url", "unknown storage scheme 'http'")),
    "simulate_storage_port_zero": (["simulate", *TINY_SIM, "--storage-url", "redis://127.0.0.1:0/0"], 2,
                                   ("--storage-url", "port 0 names no server")),
    "simulate_storage_fragment": (["simulate", *TINY_SIM, "--storage-url", "file:///tmp/x#y"], 2,
                                  ("--storage-url", "no #fragment")),
    "simulate_storage_url_unused": (["simulate", *TINY_SIM, "--storage-url", "memory://", "--no-storage"], 2,
                                    ("--no-storage leaves out",)),
    # an empty path turned its option off without a word
    "diagram_empty_counts": (["diagram", "residency", "--counts", ""], 2, ("--counts: an empty path",)),
    "fuzz_empty_test_out": (["fuzz", "--test-out", ""], 2, ("--test-out: an empty path",)),
    "simulate_empty_record": (["simulate", *TINY_SIM, "--record", ""], 2, ("--record: an empty path",)),
    "fuzz_seed_beyond_64_bits": (["fuzz", "--seed", str(2**64)], 2, ("--seed", "not in range")),
    "bench_insert_blocks_too_many": (["bench", "insert", "--blocks", str(10**11)], 2, ("--blocks", "1..10000")),
}
if importlib.util.find_spec("redis") is not None:  # the [redis] extra; without it the message names the extra
    CASES["simulate_unreachable_redis"] = (
        ["simulate", *TINY_SIM, "--storage-url", f"redis://127.0.0.1:{closed_port()}/0"],
        1, ("attaching storage failed", "unreachable"))
if not torch.cuda.is_available():
    CASES["simulate_cuda_without_cuda"] = (["simulate", "--device", "cuda"], 2, ("CUDA is not available",))


@pytest.fixture(scope="module")
def hostile_specs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    files = {"deep": "x: " + "[" * 400 + "]" * 400 + "\n", "nul": "name: a\x00\n"}
    for name, text in files.items():
        (d / f"{name}.yaml").write_text(text, encoding="utf-8")
    return {name: d / f"{name}.yaml" for name in files}


@pytest.fixture(scope="module")
def results(hostile_specs) -> dict[str, subprocess.CompletedProcess]:
    cases = dict(CASES)
    cases["validate_deep_spec"] = (["validate", str(hostile_specs["deep"])], 1, ("deep.yaml:1", "nested deeper"))
    cases["list_nul_spec"] = (["list", str(hostile_specs["nul"])], 1, ("nul.yaml:1", "not allowed in YAML"))
    cases["diagram_deep_spec"] = (["diagram", str(hostile_specs["deep"])], 1, ("deep.yaml:1", "nested deeper"))
    loop = hostile_specs["deep"].parent / "loop.jsonl"  # a symlink to itself: was exit 1 with a raw errno line
    loop.symlink_to(loop.name)
    cases["diagram_counts_symlink_loop"] = (["diagram", "residency", "--counts", str(loop)], 2,
                                            ("loop.jsonl", "cannot read it"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = {name: pool.submit(cli, *argv) for name, (argv, _, _) in cases.items()}
        return {name: (run.result(), cases[name][1:]) for name, run in runs.items()}


ALL_CASES = sorted([*CASES, "validate_deep_spec", "list_nul_spec", "diagram_deep_spec", "diagram_counts_symlink_loop"])


@pytest.mark.parametrize("case", ALL_CASES)
def test_one_line_the_documented_status_and_no_traceback(results, case):
    proc, (status, fragments) = results[case]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {proc.stderr!r}"
    assert proc.returncode == status, (proc.returncode, lines[0])
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "not JSON" not in lines[0]


def test_fuzz_progress_has_no_carriage_return_off_a_terminal():
    proc = cli("fuzz", "--examples", "3", "--steps", "3")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "\r" not in proc.stderr and "fuzz: " in proc.stderr


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_fuzz_progress_redraws_in_place_on_a_terminal():
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(command("fuzz", "--examples", "3", "--steps", "3"), stderr=slave,
                                stdout=subprocess.DEVNULL, env=environment())
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    assert proc.wait(timeout=300) == 0
    assert b"\rfuzz [" in b"".join(chunks)


@pytest.mark.parametrize("argv", [["--cp", "--adapter", "x:y"], ["--variant", "{}"], ["--adapter", "nosuch:thing"]])
def test_a_refused_fuzz_leaves_the_record_file_as_it_was(tmp_path, argv):
    """The file was opened, and so emptied, before the other arguments were checked."""
    kept = tmp_path / "keep.jsonl"
    kept.write_text("precious\n", encoding="utf-8")
    proc = cli("fuzz", "--record", str(kept), *argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert kept.read_text(encoding="utf-8") == "precious\n"


def test_sigterm_ends_a_simulation_as_ctrl_c_does_its_temporary_store_removed(tmp_path):
    """``timeout`` sends SIGTERM: the default action left the run's file store (megabytes of pages) in /tmp."""
    proc = subprocess.Popen(command("simulate", "--clients", "8", "--rounds", "400", "--device-tokens", "65536",
                                    "--host-tokens", "131072"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(environment(), TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a verdict
        while not list(tmp_path.glob("hicache-sim-*")):  # the store exists: the run is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert not list(tmp_path.glob("hicache-sim-*"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_imports_is_held_until_they_are_done(monkeypatch, capsys, signum):
    """Ctrl-C inside numpy's import (nested in torch's) was swallowed there and left numpy half-initialised (the
    run went on, or failed with a traceback); SIGTERM then killed the process (status -15). Held until the imports
    are done, either ends the command with status 130 and one line."""
    import os

    from hicache_fsm import cli

    imported = []
    real = cli.build_parser

    def build_parser(*args, **kwargs):
        os.kill(os.getpid(), signum)  # arrives in the middle of the imports
        parser = real(*args, **kwargs)
        imported.append(True)  # the imports finished: the signal did not cut them short
        return parser

    def unheld(signum, frame):  # what a regression meets here, instead of the default action killing pytest
        raise AssertionError(f"signal {signum} was not held during the imports")

    monkeypatch.setattr(cli, "build_parser", build_parser)
    previous = signal.signal(signum, unheld)
    try:
        assert cli.main(["list"]) == 130
    finally:
        signal.signal(signum, previous)
    assert imported == [True]
    err = capsys.readouterr().err
    assert err.strip() == "hicache-fsm list: interrupted"


def test_a_usage_error_from_a_value_check_points_to_help_as_argparse_errors_do(capsys):
    """Errors the commands raise after parsing (a value out of range, options that conflict) read as the parser's own:
    one line, ``hicache-fsm CMD: error: message (see hicache-fsm CMD --help)``."""
    from hicache_fsm.cli import main

    assert main(["simulate", "--clients", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-fsm simulate: error: ")
    assert err.rstrip().endswith("(see hicache-fsm simulate --help)")
