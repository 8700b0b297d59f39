"""Shared timing and reporting helpers for the benchmarks."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from array import array
from typing import Callable

import torch

# How an engine may hold a request's ids, handed to every cache call (``--ids`` of ``bench controller`` and
# ``bench scale``): a builder from the id tuple, built before timing, and how a report names the form.
ID_FORMS: dict[str, tuple[Callable[[tuple[int, ...]], object], str]] = {
    "array": (lambda ids: array("q", ids), "an array('q') per call, as SGLang's scheduler holds ids (checked and "
              "packed in vectorised passes; insert after match_prefix of the same ids reuses the packing; a miss "
              "reads its first page only)"),
    "tuple": (lambda ids: ids, "a tuple per call (a miss reads its first page only; insert after match_prefix "
              "of the same ids in a tuple or list reuses its packing)"),
    "list": (list, "a list per call (a miss reads its first page only; insert after match_prefix of the same ids "
             "in a list or tuple reuses its packing)"),
}


# The clocks a benchmark may time with (``--clock``): process CPU time is steadier on a machine shared with other work.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timing them round-robin in the same run."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def machine_description() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def report(title: str, rows: list[tuple[str, str]], result: dict, as_json: bool) -> None:
    """Print a two-column table; with ``as_json`` the table goes to stderr and stdout holds only the JSON result."""
    out = sys.stderr if as_json else sys.stdout
    print(title, file=out)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}", file=out)
    if as_json:
        print(json.dumps(result, sort_keys=True))
