"""``check`` and ``fuzz`` for a block-store ``--adapter`` (the ``testing.blockstore`` profile).

Each command calls ``check_block_store`` / ``fuzz_block_store`` first when
``--adapter`` is given; they return None for a prefix-cache factory (the
command goes on as before) and an exit status otherwise. Flags that only mean
something for a prefix cache are refused (usage error, exit 2); a ``--variant``
that does not fit the factory is a usage error, never a run of another machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from hicache_fsm.commands.adapter_factory import import_lines, load_factory, make_block_store
from hicache_fsm.commands.args import INTERRUPTED, UsageError

# The search is exhaustive: each state tries every prompt, so the prompts must stay few.
MAX_PROMPTS = 4096


def refuse_many_prompts(alphabet: int, pages: int) -> None:
    """``UsageError`` when prompts of 1..``pages`` pages over ``alphabet`` contents number more than MAX_PROMPTS."""
    prompts, per_length = 0, 1
    for _ in range(pages):  # stops as soon as the count is too big, however long --max-len is
        per_length *= alphabet
        prompts += per_length
        if prompts > MAX_PROMPTS:
            raise UsageError(f"--alphabet {alphabet} with prompts of up to {pages} pages gives more than "
                             f"{MAX_PROMPTS} prompts to try in every state (lower --alphabet or --max-len)")
# check flags a block store has no use for, with the value meaning "not given"
CHECK_ONLY_FOR_PREFIX_CACHES = ("nodes", "device_pages", "host_pages", "layers", "page_size", "locks", "pins",
                                "write_policy", "eviction_policy", "track_hits", "max_seconds", "coverage", "record",
                                "namespaces", "host_layout", "cache_option", "storage", "stop_policy",
                                "max_prefetches", "storage_option", "remote_tenant", "priorities", "max_resets")
FUZZ_ONLY_FOR_PREFIX_CACHES = ("coverage", "record")


def check_block_store(args: argparse.Namespace, defaults: dict) -> int | None:
    """Explore a block store; None when ``--adapter`` makes prefix caches (``--variant`` is then refused).
    ``defaults``: the check parser's defaults, to tell which flags were given."""
    factory = load_factory(args.adapter)
    variant = args.variant or {}
    first = make_block_store(factory, variant, args.adapter)
    if first is None:
        if args.variant is not None:
            raise UsageError(f"--variant is for block-store factories; {args.adapter} makes prefix caches")
        return None
    _refuse_flags(args, CHECK_ONLY_FOR_PREFIX_CACHES, defaults)
    max_jobs = 2 if args.max_jobs is None else args.max_jobs
    if max_jobs < 1:
        raise UsageError(f"--max-jobs {max_jobs} is not a positive integer")
    if args.max_entries is not None and args.max_entries < 0:
        raise UsageError(f"--max-entries {args.max_entries} is not a non-negative integer")
    alphabet, max_len = args.alphabet or 2, args.max_len or 3
    refuse_many_prompts(alphabet, max_len)
    from hicache_fsm.testing.blockstore import StoreBounds, StoreWorld, explore_store

    _check_world(StoreWorld, first, args.adapter)
    depth = getattr(args, "max_depth", None)
    bounds = StoreBounds(alphabet=alphabet, max_len=max_len, max_jobs=max_jobs,
                         max_entries=args.max_entries, max_states=args.max_states,
                         max_depth=StoreBounds().max_depth if depth is None else depth,
                         redeliver=not args.no_redeliver, symmetry=not getattr(args, "no_symmetry", False))
    progress = None if args.quiet or not sys.stderr.isatty() else sys.stderr
    result = explore_store(lambda: factory(**variant), bounds, stop_on_first=args.stop_on_first,
                           max_violations=args.max_violations, progress=progress)  # SIGTERM: as Ctrl-C (cli.main)
    out = sys.stderr if args.json else sys.stdout
    print(result.summary(), file=out)
    if result.symmetry.startswith("off:"):
        print(f"symmetry {result.symmetry}", file=out)
    for i in range(len(result.violations)):
        print(result.format_violation(i), file=out)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    if result.stopped == "interrupted" and not result.violations:
        return INTERRUPTED
    return 0 if result.ok else 1


def fuzz_block_store(args: argparse.Namespace, variants: list[dict],
                     report: Callable[[Any, argparse.Namespace, Any], None]) -> int | None:
    """Fuzz a block store; None when ``--adapter`` makes prefix caches (the first ``--variant`` tells: ``run_fuzz``
    then builds each of them once, so none is built twice). Every ``--variant`` of a block store is tried first;
    ``report`` prints the outcome as the fuzz command does."""
    factory = load_factory(args.adapter)
    first = make_block_store(factory, variants[0], args.adapter, takes_bounds=False)
    if first is None:
        return None
    made = [first] + [make_block_store(factory, v, args.adapter, takes_bounds=False) for v in variants[1:]]
    if any(m is None for m in made):
        raise UsageError(f"--adapter {args.adapter}: some --variant make block stores, others not")
    _refuse_flags(args, FUZZ_ONLY_FOR_PREFIX_CACHES, {})
    from hicache_fsm.testing.blockstore import StoreWorld, run_store_fuzz

    for adapter in made:
        _check_world(StoreWorld, adapter, args.adapter)
    machine_import = (f"from hicache_fsm.testing.blockstore import store_machine\n"
                      f"{import_lines(args.adapter, '_factory')}\n"
                      f"BlockStoreMachine = store_machine(_factory, variants={variants!r})")
    result = run_store_fuzz(factory, variants=variants, examples=args.examples, steps=args.steps, seed=args.seed,
                            progress=None if args.quiet else sys.stderr, shrink=not args.no_shrink,
                            machine_import=machine_import)
    report(result, args, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    return 0 if result.ok else 1


def _refuse_flags(args: argparse.Namespace, names: tuple[str, ...], defaults: dict) -> None:
    given = [n for n in names if hasattr(args, n) and getattr(args, n) != defaults.get(n, _unset(args, n))]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise UsageError(f"{flags}: not for a block store (its bounds: --alphabet, --max-len, --max-jobs, "
                         f"--max-entries, --max-states, --max-depth)")


def _unset(args: argparse.Namespace, name: str) -> Any:
    return False if isinstance(getattr(args, name), bool) else None


def _check_world(world_cls: Callable[..., Any], adapter: Any, ref: str) -> None:
    try:
        world_cls(adapter)
    except ValueError as exc:
        raise UsageError(f"--adapter {ref}: {exc}") from None
